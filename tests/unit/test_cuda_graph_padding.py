"""The pure parts of CUDA-graph decode (batch-size buckets and padding rows) on the CPU."""

from __future__ import annotations

import pytest

from tandem.engine import SeqSlice, build_metadata
from tandem.engine.cuda_graphs import (
    SCRATCH_PAGE,
    graph_batch_sizes,
    pad_decode_slices,
    padded_batch_size,
)


def test_batch_size_buckets_end_at_max_num_seqs():
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert graph_batch_sizes(5) == (1, 2, 4, 5)
    assert padded_batch_size(3, (1, 2, 4, 8)) == 4
    assert padded_batch_size(8, (1, 2, 4, 8)) == 8
    assert padded_batch_size(9, (1, 2, 4, 8)) is None


def test_padding_rows_write_and_read_only_the_scratch_page():
    real = [SeqSlice(page_ids=[3, 4], num_cached=20, num_new=1),
            SeqSlice(page_ids=[7], num_cached=0, num_new=1)]
    padded = pad_decode_slices(real, 4)
    assert padded[:2] == real and len(padded) == 4
    lay = build_metadata(padded, page_size=16)
    a = lay.attn
    assert a.is_decode and a.num_seqs == 4
    assert a.slot_ids.tolist()[2:] == [SCRATCH_PAGE * 16] * 2
    assert a.kv_page_ids.tolist() == [3, 4, 7, SCRATCH_PAGE, SCRATCH_PAGE]
    assert a.kv_lens.tolist() == [21, 1, 1, 1]
    assert lay.positions.tolist() == [20, 0, 0, 0]
    with pytest.raises(ValueError, match="batch_size"):
        pad_decode_slices(real, 1)
