"""Paged decode attention: the torch twin equals dense softmax attention over the gathered
keys, and the Triton split + merge kernels equal the twin (on the CPU, TRITON_INTERPRET=1).

The page table is scrambled, lengths straddle page and block edges (1, 5, 16, 17, 40 keys
at page_size 16, 32-key blocks), and 7 splits leave some sequences' last chunks empty: the
merge must give those splits no weight. Skipped (the Triton half) when triton is missing."""

from __future__ import annotations

import pytest
import torch
from triton_interp import require_triton_interpreter

require_triton_interpreter()  # before triton is first imported

from tandem.engine.kernels import ops, torch_ops, triton_decode

PAGE_SIZE, D = 16, 64


@pytest.fixture(autouse=True)
def given_splits(monkeypatch):
    """The kernels run the split count each test names (a launch of few programs would
    otherwise split finer: `decode_split_count`, tested on its own below)."""
    monkeypatch.setattr(triton_decode, "PAGED_DECODE_PROGRAMS", 1)
# (B, kv_lens): one sequence longer than a 32-key block; three mixing the other edges.
BATCHES = [(1, [40]), (3, [1, 17, 5]), (3, [16, 40, 1])]
HEADS = [(4, 1), (8, 2), (2, 2)]  # (Hq, Hkv): G = 4, 4, 1


def _case(seed: int, kv_lens: list[int], hq: int, hkv: int, dtype: torch.dtype):
    """q [B, Hq, D] (a non-contiguous view), cache [num_pages, 2, PAGE_SIZE, Hkv, D],
    page_table [B, P] int32 scrambled over the pool, kv_lens [B] int32."""
    g = torch.Generator().manual_seed(seed)
    batch = len(kv_lens)
    pages_per_seq = max(-(-n // PAGE_SIZE) for n in kv_lens) + 1  # a spare, unused column
    num_pages = batch * pages_per_seq + 2
    cache = torch.randn(num_pages, 2, PAGE_SIZE, hkv, D, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g)[: batch * pages_per_seq]
    page_table = perm.view(batch, pages_per_seq).to(torch.int32)
    q = torch.randn(batch, 2 * hq, D, generator=g).to(dtype)[:, ::2]  # head stride 2 D
    return q, cache, page_table, torch.tensor(kv_lens, dtype=torch.int32)


def _dense_reference(q, cache, page_table, kv_lens, scale):  # -> [B, Hq, D] float32
    """Gather each key one by one into dense [B, L, Hkv, D], mask keys >= kv_len, softmax."""
    batch, hq, _ = q.shape
    hkv = cache.shape[3]
    max_len = int(kv_lens.max())
    k = torch.zeros(batch, max_len, hkv, D)
    v = torch.zeros(batch, max_len, hkv, D)
    for b in range(batch):
        for t in range(int(kv_lens[b])):
            page = int(page_table[b, t // PAGE_SIZE])
            k[b, t] = cache[page, 0, t % PAGE_SIZE].float()
            v[b, t] = cache[page, 1, t % PAGE_SIZE].float()
    kv_head = torch.arange(hq) // (hq // hkv)  # [Hq] the KV head each query head reads
    scores = torch.einsum("bhd,blhd->bhl", q.float(), k[:, :, kv_head]) * scale
    valid = torch.arange(max_len)[None, :] < kv_lens[:, None].long()  # [B, L]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhl,blhd->bhd", scores.softmax(-1), v[:, :, kv_head])


@pytest.mark.parametrize(("hq", "hkv"), HEADS)
@pytest.mark.parametrize(("seed", "kv_lens"), [(i, lens) for i, (_, lens) in
                                               enumerate(BATCHES)])
def test_twin_equals_dense_attention(seed, kv_lens, hq, hkv):
    q, cache, table, lens = _case(seed, kv_lens, hq, hkv, torch.float32)
    want = _dense_reference(q, cache, table, lens, D**-0.5)
    for num_splits in (1, 7):  # the twin ignores the split count
        got = torch_ops.paged_decode(q, cache, table, lens, D**-0.5, num_splits)
        assert got.shape == q.shape and got.dtype == q.dtype
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 4, 7])
@pytest.mark.parametrize(("hq", "hkv"), HEADS)
@pytest.mark.parametrize(("seed", "kv_lens"), [(i, lens) for i, (_, lens) in
                                               enumerate(BATCHES)])
def test_triton_equals_twin_float32(seed, kv_lens, hq, hkv, num_splits):
    q, cache, table, lens = _case(seed, kv_lens, hq, hkv, torch.float32)
    got = triton_decode.paged_decode(q, cache, table, lens, D**-0.5, num_splits)
    want = torch_ops.paged_decode(q, cache, table, lens, D**-0.5, num_splits)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 7])
@pytest.mark.parametrize(("hq", "hkv"), [(8, 2), (2, 2)])
def test_triton_equals_twin_bf16_int64_lens(hq, hkv, num_splits):
    q, cache, table, lens = _case(5, [1, 17, 40], hq, hkv, torch.bfloat16)
    got = triton_decode.paged_decode(q, cache, table, lens.long(), D**-0.5, num_splits)
    want = torch_ops.paged_decode(q, cache, table, lens, D**-0.5, num_splits)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_split_count_does_not_change_the_result():
    """Splits only reorder the float32 sums: 1, 4 and 7 agree to rounding, with empty
    chunks (7 splits of 5 keys: chunks of 1, two empty)."""
    q, cache, table, lens = _case(6, [5, 40, 17], 8, 2, torch.float32)
    outs = [triton_decode.paged_decode(q, cache, table, lens, 0.3, s) for s in (1, 4, 7)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=1e-6)


def test_zero_length_gives_a_zero_row():
    """A graph-padding row with no keys gets zeros (no NaN) from both kernels."""
    q, cache, table, lens = _case(7, [0, 5], 4, 1, torch.float32)
    for impl in (triton_decode, torch_ops):
        out = impl.paged_decode(q, cache, table, lens, D**-0.5, 4)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].abs().sum() > 0


def test_dispatch_takes_triton_on_a_triton_device_and_the_twin_elsewhere(monkeypatch):
    q, cache, table, lens = _case(8, [17, 1], 4, 1, torch.float32)
    calls: list[str] = []
    real = triton_decode.paged_decode
    monkeypatch.setattr(triton_decode, "paged_decode",
                        lambda *a: calls.append("triton") or real(*a))
    want = torch_ops.paged_decode(q, cache, table, lens, D**-0.5, 4)
    with torch.inference_mode():
        torch.testing.assert_close(ops.paged_decode(q, cache, table, lens, D**-0.5, 4), want)
        assert calls == []  # CPU tensors: the twin
        monkeypatch.setattr(ops, "_on_triton_device", lambda x: True)
        got = ops.paged_decode(q, cache, table, lens, D**-0.5, 4)
    assert calls == ["triton"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_small_launch_splits_finer_up_to_32():
    """512 programs wanted: batch 1 x 4 KV heads -> 32 splits (capped), 8 x 4 -> 16, 8 x 8 at
    an engine count of 7 -> 8; never fewer than the engine's count."""
    count = triton_decode.decode_split_count
    assert triton_decode.PAGED_DECODE_PROGRAMS == 1  # (the fixture)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_decode, "PAGED_DECODE_PROGRAMS", 512)
        assert [count(7, 1, 4), count(7, 8, 4), count(7, 8, 8), count(7, 64, 8)] == [32, 16, 8, 7]
        assert count(40, 1, 1) == 40
        q, cache, table, lens = _case(10, [5, 40, 17], 8, 2, torch.float32)
        got = triton_decode.paged_decode(q, cache, table, lens, D**-0.5, 1)  # 3 x 2: 32 splits
    want = torch_ops.paged_decode(q, cache, table, lens, D**-0.5, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows_per_seq", [1, 5])
def test_rows_plan_kernel_equals_its_twin(rows_per_seq):
    """The decode rows' plan in one launch (positions base[b] + j, key counts, K/V slots, each
    row's page-table row) == the torch twin, across page edges (page_size 16, bases 0, 14, 31
    and 47 with 5 rows), a 3-page table over a scrambled pool, and j past a page boundary."""
    g = torch.Generator().manual_seed(rows_per_seq)
    table = torch.randperm(40, generator=g)[:12].view(4, 3).to(torch.int32)  # [B, P]
    base = torch.tensor([0, 14, 31, 27], dtype=torch.int64)
    got = triton_decode.decode_rows_plan(table, base, rows_per_seq, PAGE_SIZE)
    want = torch_ops.decode_rows_plan(table, base, rows_per_seq, PAGE_SIZE)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    positions, lens, slots, rows = want
    assert positions.tolist()[: rows_per_seq] == list(range(rows_per_seq))
    assert torch.equal(lens, positions + 1) and rows.shape == (4 * rows_per_seq, 3)
    b, j = 1, rows_per_seq - 1  # row j of sequence 1: position 14 + j
    pos = 14 + j
    assert slots[b * rows_per_seq + j] == int(table[1, pos // PAGE_SIZE]) * PAGE_SIZE + pos % 16
    if rows_per_seq == 1:
        assert got[3] is table  # no copy: each row is its sequence's


@pytest.mark.parametrize("opt_in", [False, True])
def test_rows_plan_dispatch_takes_triton_unless_opted_out(opt_in, monkeypatch):
    """On a Triton device the one-launch plan runs unless TANDEM_PLAN_KERNELS=0
    (`ops.PLAN_KERNELS`); either way the result is the twin's."""
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    base = torch.tensor([0, 17, 40], dtype=torch.int64)
    calls: list[str] = []
    real = triton_decode.decode_rows_plan
    monkeypatch.setattr(triton_decode, "decode_rows_plan",
                        lambda *a: calls.append("triton") or real(*a))
    monkeypatch.setattr(ops, "_on_triton_device", lambda x: True)
    monkeypatch.setattr(ops, "PLAN_KERNELS", opt_in)
    with torch.inference_mode():
        got = ops.decode_rows_plan(table, base, 5, PAGE_SIZE)
    assert calls == (["triton"] if opt_in else [])
    for a, b in zip(got, torch_ops.decode_rows_plan(table, base, 5, PAGE_SIZE)):
        assert torch.equal(a, b)
