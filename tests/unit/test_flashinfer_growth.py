"""Growable FlashInfer decode buffers grow a dimension only when it is exceeded. Regression: the
page-id buffer doubled whenever the batch grew, so a batch growing a row at a time (draft-extend
rows at 256 concurrent requests) asked for 51 GiB and the decode worker died (2 x H100)."""

from tandem.engine.attention.flashinfer_backend import grown_capacity


def test_batch_growth_leaves_the_page_capacity_alone():
    bs, pages = 64, 4096
    for rows in range(65, 400):  # the batch creeps up one row at a time
        bs, pages = grown_capacity(rows, 1000, bs, pages)
    assert pages == 4096
    assert bs >= 399 and bs < 2 * 399


def test_each_dimension_at_least_doubles_when_exceeded():
    assert grown_capacity(65, 10, 64, 4096) == (128, 4096)
    assert grown_capacity(10, 4097, 64, 4096) == (64, 8192)
    assert grown_capacity(300, 20000, 64, 4096) == (300, 20000)
    assert grown_capacity(64, 4096, 64, 4096) == (64, 4096)
