"""The pure metadata builder: slots, positions, page tables and masks for every phase."""

from __future__ import annotations

import pytest
import torch

from tandem.engine import SeqSlice, build_metadata, causal_mask, tree_mask


def test_prefill_chunk_and_decode_layout():
    seqs = [
        SeqSlice(page_ids=[5, 9, 2], num_cached=3, num_new=4),  # chunk at tokens 3..6
        SeqSlice(page_ids=[7], num_cached=0, num_new=1),  # first token
        SeqSlice(page_ids=[3, 4], num_cached=4, num_new=1),  # decode at token 4
    ]
    lay = build_metadata(seqs, page_size=4)
    a = lay.attn
    assert a.qo_indptr.tolist() == [0, 4, 5, 6]
    assert a.kv_lens.tolist() == [7, 1, 5]
    assert a.kv_page_indptr.tolist() == [0, 2, 3, 5]  # only pages covering kv_len
    assert a.kv_page_ids.tolist() == [5, 9, 7, 3, 4]
    assert a.kv_last_page_len.tolist() == [3, 1, 1]
    assert a.slot_ids.tolist() == [5 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1, 9 * 4 + 2, 7 * 4, 4 * 4]
    assert lay.positions.tolist() == [3, 4, 5, 6, 0, 4]
    assert a.custom_mask is None and not a.is_decode
    assert build_metadata(seqs[1:], 4).attn.is_decode


def test_page_table_too_short_is_rejected():
    with pytest.raises(ValueError, match=r"seqs\[0\]: 1 pages cannot hold 5 tokens"):
        build_metadata([SeqSlice(page_ids=[1], num_cached=4, num_new=1)], 4)
    with pytest.raises(ValueError, match="at least one sequence"):
        build_metadata([], 4)


def test_tree_mask_sees_prefix_and_ancestors_only():
    # Tree over 2 cached tokens: 0 -> (1, 2), 1 -> 3
    m = tree_mask(2, [-1, 0, 0, 1])
    assert m.tolist() == [
        [True, True, True, False, False, False],
        [True, True, True, True, False, False],
        [True, True, True, False, True, False],
        [True, True, True, True, False, True],
    ]
    lay = build_metadata([SeqSlice(page_ids=[1, 2], num_cached=2, num_new=4, mask=m,
                                   positions=[2, 3, 3, 4])], 4)
    assert lay.attn.custom_mask.tolist() == m.reshape(-1).tolist()
    assert lay.positions.tolist() == [2, 3, 3, 4]


def test_causal_mask_offsets_queries_by_cached_tokens():
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]


def test_wrong_mask_shape_is_rejected():
    with pytest.raises(ValueError, match=r"seqs\[0\].mask"):
        build_metadata([SeqSlice(page_ids=[1], num_cached=1, num_new=2,
                                 mask=torch.ones(2, 2, dtype=torch.bool))], 4)
