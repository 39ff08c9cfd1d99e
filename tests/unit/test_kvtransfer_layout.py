"""kvtransfer layout + planner: addressing, coalescing on both sides, batch splitting at the
Mooncake limit, validation, and the aux-slot format."""

from __future__ import annotations

import pytest

from tandem.kvtransfer import (HEADER_BYTES, MAX_BATCH_ENTRIES, AuxRegion, ErrorKind, KVLayout,
                               KVRegion, TransferError, check_aux, decode_aux, encode_aux,
                               page_runs, plan_layers)
from tandem.kvtransfer.layout import layout_mismatches, parse_device, validate_pages


def _region(name="target", base=0x10000, layers=3, pages=8, page_bytes=64, device="cpu"):
    return KVRegion(name=name, base_ptr=base, num_layers=layers, num_pages=pages,
                    page_bytes=page_bytes, device=device)


def _layout(*regions, slot_bytes=128):
    return KVLayout(regions=regions, aux=AuxRegion(base_ptr=0x90000, num_slots=4,
                                                   slot_bytes=slot_bytes))


def test_page_addr_is_layer_major():
    r = _region(base=1000, pages=8, page_bytes=64)
    assert r.page_addr(0, 0) == 1000
    assert r.page_addr(0, 3) == 1000 + 3 * 64
    assert r.page_addr(2, 5) == 1000 + (2 * 8 + 5) * 64
    assert r.nbytes == 3 * 8 * 64


def test_page_runs_coalesce_only_when_both_sides_are_consecutive():
    assert page_runs([1, 2, 3, 9], [5, 6, 7, 8]) == [(1, 5, 3), (9, 8, 1)]
    assert page_runs([1, 2, 3], [5, 7, 8]) == [(1, 5, 1), (2, 7, 2)]
    assert page_runs([4, 3], [1, 2]) == [(4, 1, 1), (3, 2, 1)]  # descending source: no run
    assert page_runs([0, 1], [0, 1, 2, 3]) == [(0, 0, 2)]  # decode reserved more: prefix only


def test_plan_addresses_match_pages_of_every_layer():
    src, dst = _region(base=0x1000), _region(base=0x8000)
    (batch,) = plan_layers(src, dst, page_runs([1, 4], [6, 2]), range(3))
    expect = [(src.page_addr(layer, s), dst.page_addr(layer, d), 64) for layer in range(3)
              for s, d in ((1, 6), (4, 2))]
    assert list(zip(batch.src_addrs, batch.dst_addrs, batch.lengths)) == expect


def test_whole_layers_merge_across_layers():
    """All pages of layer l followed by layer l+1 are contiguous on both sides: one entry."""
    src, dst = _region(base=0x1000, pages=4), _region(base=0x8000, pages=4)
    (batch,) = plan_layers(src, dst, page_runs(range(4), range(4)), range(3))
    assert batch.lengths == (3 * 4 * 64,) and batch.src_addrs == (0x1000,)


def test_batches_split_at_the_entry_limit_without_losing_bytes():
    src, dst = _region(pages=3000, layers=2), _region(base=0x900000, pages=3000, layers=2)
    runs = page_runs(range(0, 2400, 2), range(1, 2401, 2))  # 1200 single-page runs
    batches = plan_layers(src, dst, runs, range(2))
    assert [len(b.lengths) for b in batches] == [MAX_BATCH_ENTRIES, MAX_BATCH_ENTRIES, 352]
    assert sum(b.nbytes for b in batches) == 2 * 1200 * 64
    small = plan_layers(src, dst, runs, range(2), max_entries=100)
    assert max(len(b.lengths) for b in small) == 100 and len(small) == 24


def test_plan_rejects_layers_outside_the_region():
    with pytest.raises(TransferError) as e:
        plan_layers(_region(), _region(), [(0, 0, 1)], range(2, 5))
    assert e.value.kind is ErrorKind.INVALID


@pytest.mark.parametrize("src,dst,needle", [([0, 1, 2], [5, 6], "reserved only 2"),
                                            ([0, 8], [1, 2], "source page id 8"),
                                            ([0], [9], "destination page id 9"),
                                            ([0, 1], [3, 3], "repeat")])
def test_validate_pages(src, dst, needle):
    lay = _layout(_region())
    with pytest.raises(TransferError, match=needle) as e:
        validate_pages(lay, lay, src, dst, room=5)
    assert e.value.kind is ErrorKind.INVALID and e.value.room == 5


def test_layout_invariants_and_mismatch_messages():
    with pytest.raises(ValueError, match="same num_pages"):
        _layout(_region(pages=8), _region(name="draft", pages=9))
    with pytest.raises(ValueError, match="unique"):
        _layout(_region(), _region())
    with pytest.raises(ValueError, match="host memory"):
        AuxRegion(base_ptr=1, num_slots=1, slot_bytes=64, device="cuda:0")
    a = _layout(_region(), _region(name="draft", layers=1, page_bytes=32))
    b = _layout(_region(page_bytes=128), _region(name="draft", layers=2, page_bytes=32),
                slot_bytes=256)
    assert layout_mismatches(a, b) == ["target.page_bytes: prefill=64 decode=128",
                                       "draft.num_layers: prefill=1 decode=2",
                                       "aux.slot_bytes: prefill=128 decode=256"]
    assert a.bytes_per_page == 3 * 64 + 32
    assert KVLayout.from_wire(a.to_wire()) == a


def test_device_selects_memory_kind():
    assert parse_device("cpu") == ("DRAM", 0)
    assert parse_device("cuda") == ("VRAM", 0)
    assert parse_device("cuda:3") == ("VRAM", 3)
    with pytest.raises(ValueError):
        parse_device("mps")


def test_regions_from_tensors():
    torch = pytest.importorskip("torch")
    kv = torch.zeros(4, 10, 2, 16, 3, 8, dtype=torch.bfloat16)  # [L, pages, K/V, tokens, H, D]
    r = KVRegion.from_tensor("target", kv, head_start=3, num_heads=3)
    assert (r.num_layers, r.num_pages, r.page_bytes) == (4, 10, 2 * 16 * 3 * 8 * 2)
    assert r.device == "cpu" and r.base_ptr == kv.data_ptr() and r.head_start == 3
    assert r.page_addr(1, 2) == kv[1, 2].data_ptr()
    aux = AuxRegion.from_tensor(torch.zeros(5, 256, dtype=torch.uint8))
    assert (aux.num_slots, aux.slot_bytes) == (5, 256)


# -- aux slot --------------------------------------------------------------------------------


def test_aux_round_trip_and_checks():
    blob = encode_aux(2**64 - 1, b"seed")
    assert len(blob) == HEADER_BYTES + 4
    assert decode_aux(blob + b"\0" * 50) == (2**64 - 1, b"seed")
    assert check_aux(blob, 2**64 - 1) == b"seed"
    assert check_aux(encode_aux(7, b""), 7) == b""


@pytest.mark.parametrize("mutate,needle", [
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum"),
    (lambda b: b"\0" * len(b), "no seed"),
    (lambda b: b[:10], "shorter than its header"),
    (lambda b: b[:HEADER_BYTES] + b"x", "exceeds the slot"),
])
def test_aux_corruption_is_detected(mutate, needle):
    with pytest.raises(TransferError, match=needle) as e:
        decode_aux(mutate(encode_aux(42, b"payload-bytes")))
    assert e.value.kind is ErrorKind.CORRUPT


def test_aux_for_another_room_is_caught():
    with pytest.raises(TransferError, match="holds room 41, expected room 42") as e:
        check_aux(encode_aux(41, b"seed"), 42)
    assert e.value.kind is ErrorKind.CORRUPT
