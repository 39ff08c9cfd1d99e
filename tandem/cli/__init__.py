"""The `tandem` command line (console script `tandem = tandem.cli:main`, or
`python -m tandem.cli`). One module per command, each with `add_parser(subparsers)` and
`run(args) -> int`: it parses and validates its flags into typed configs and delegates; the logic
lives in the packages. `common` holds the flag groups several commands share."""

from tandem.cli.app import build_parser, main
from tandem.cli.common import (
    add_engine_args,
    add_sampling_args,
    engine_config_from_args,
    sampling_params_from_args,
)

__all__ = [
    "add_engine_args",
    "add_sampling_args",
    "build_parser",
    "engine_config_from_args",
    "main",
    "sampling_params_from_args",
]
