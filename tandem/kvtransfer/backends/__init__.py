"""Backend adapters (`fake`, `mooncake`, `nixl`). Import them only through
`tandem.kvtransfer.create_backend`, which loads the library lazily."""
