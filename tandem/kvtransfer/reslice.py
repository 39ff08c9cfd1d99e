"""KV head re-slicing between different prefill and decode TP sizes: which prefill rank sends
which KV heads to which decode rank, and the (src, dst, len) entries that move them.

Pure functions (numpy, no backend, no torch); tests/unit/test_kvtransfer_reslice.py checks them
against a byte-level reference for P, D in {1, 2, 4}.

Heads per rank follow the engine's `HeadLayout.for_rank`: with tp <= Hkv rank r holds the
contiguous heads [r * Hkv / tp, (r + 1) * Hkv / tp); with tp > Hkv (tp a multiple of Hkv) rank r
holds the single head r * Hkv // tp, replicated over tp / Hkv ranks. A decode rank takes each of
its heads from the LOWEST prefill rank that holds it, so every head byte lands exactly once.

A page of one layer on one rank is [2, page_size, H_local, head_dim] (KVPool), so a head
sub-range of one token is one contiguous chunk of `n * head_bytes`: a page moves as 2 * page_size
chunks per layer unless the slice is every head on both sides (then whole pages, and runs of pages
coalesce as in coalesce.plan_entries). Regions without a head split (`num_heads == 0`: the EAGLE
draft's KV, replicated on every rank) move whole pages, from the decode rank's primary sender only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.kvtransfer import coalesce


def kv_head_range(rank: int, tp: int, num_kv_heads: int) -> tuple[int, int]:
    """(first head, count) of the model's KV heads that TP rank `rank` of `tp` holds."""
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads {num_kv_heads} does not split over tp {tp}")
        per = num_kv_heads // tp
        return rank * per, per
    if tp % num_kv_heads:
        raise ValueError(f"tp size {tp} must be a multiple of num_key_value_heads {num_kv_heads}")
    return rank * num_kv_heads // tp, 1


def reslice_problem(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> str:
    """"" when KV can move from prefill TP `prefill_tp` to decode TP `decode_tp`, else why not
    (each side's KV heads must split evenly over its ranks, or be replicated evenly)."""
    for side, tp in (("prefill.tp", prefill_tp), ("decode.tp", decode_tp)):
        try:
            kv_head_range(0, tp, num_kv_heads)
        except ValueError as e:
            return f"{side}: {e}"
    return ""


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadSlice:
    """KV heads [head_start, head_start + num_heads) (model numbering) that prefill rank
    `prefill_rank` sends to decode rank `decode_rank`; `primary`: this prefill rank also sends the
    aux slot (EAGLE seed) and the replicated groups to that decode rank (one such per decode
    rank)."""

    prefill_rank: int
    decode_rank: int
    head_start: int
    num_heads: int
    primary: bool


def slices_to_decode(decode_rank: int, decode_tp: int, prefill_tp: int,
                     num_kv_heads: int) -> tuple[HeadSlice, ...]:
    """Every slice decode rank `decode_rank` receives, by prefill rank (each rank at most once:
    the heads it takes from one prefill rank are contiguous)."""
    d0, dn = kv_head_range(decode_rank, decode_tp, num_kv_heads)
    by_rank: dict[int, list[int]] = {}
    for h in range(d0, d0 + dn):
        # lowest prefill rank holding head h
        p = next(r for r in range(prefill_tp)
                 if _holds(kv_head_range(r, prefill_tp, num_kv_heads), h))
        by_rank.setdefault(p, []).append(h)
    ranks = sorted(by_rank)
    return tuple(HeadSlice(prefill_rank=p, decode_rank=decode_rank, head_start=by_rank[p][0],
                           num_heads=len(by_rank[p]), primary=p == ranks[0]) for p in ranks)


def slices_from_prefill(prefill_rank: int, prefill_tp: int, decode_tp: int,
                        num_kv_heads: int) -> tuple[HeadSlice, ...]:
    """Every slice prefill rank `prefill_rank` sends, by decode rank (possibly none: a replica
    whose heads a lower rank already sends)."""
    return tuple(s for d in range(decode_tp)
                 for s in slices_to_decode(d, decode_tp, prefill_tp, num_kv_heads)
                 if s.prefill_rank == prefill_rank)


def _holds(rng: tuple[int, int], head: int) -> bool:
    return rng[0] <= head < rng[0] + rng[1]


# ---------------------------------------------------------------------------------------------
# Entries


@dataclass(frozen=True, slots=True, kw_only=True)
class RegionGeometry:
    """One layer group on one rank, as the planner needs it ([L, num_pages, page_bytes] bytes,
    each page [2, page_size, num_heads, head_dim]). `num_heads == 0`: not head-split."""

    base_ptr: int
    num_pages: int
    page_bytes: int
    head_start: int
    num_heads: int


def slice_bytes_per_page(dst: RegionGeometry, piece: HeadSlice) -> int:
    """Bytes one (layer, page) of `dst` receives from the slice's prefill rank."""
    if dst.num_heads == 0:
        return dst.page_bytes if piece.primary else 0
    return dst.page_bytes // dst.num_heads * piece.num_heads


def plan_slice_entries(src: RegionGeometry, dst: RegionGeometry, runs: np.ndarray,
                       layers: range, page_size: int, piece: HeadSlice) -> coalesce.Entries:
    """Entries moving `piece`'s heads of `runs` ([R, 3] coalesce.page_runs) for `layers`, from
    the prefill region `src` to the decode region `dst`; layer-major, merged where contiguous on
    both sides."""
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    whole = (src.num_heads == dst.num_heads == piece.num_heads
             and src.head_start == dst.head_start == piece.head_start)
    if src.num_heads == 0 or dst.num_heads == 0 or whole:
        if src.page_bytes != dst.page_bytes:
            raise ValueError(f"whole-page copy between page_bytes {src.page_bytes} and "
                             f"{dst.page_bytes}")
        if (src.num_heads == 0 or dst.num_heads == 0) and not piece.primary:
            runs = runs[:0]  # replicated groups come from the primary sender only
        return coalesce.plan_entries(src.base_ptr, src.num_pages, dst.base_ptr, dst.num_pages,
                                     src.page_bytes, runs, layers)
    head_bytes = src.page_bytes // (2 * page_size * src.num_heads)
    if (head_bytes * 2 * page_size * src.num_heads != src.page_bytes
            or head_bytes * 2 * page_size * dst.num_heads != dst.page_bytes):
        raise ValueError(f"page_bytes {src.page_bytes}/{dst.page_bytes} do not hold "
                         f"2 x {page_size} tokens x {src.num_heads}/{dst.num_heads} heads alike")
    for side, g in (("prefill", src), ("decode", dst)):
        if not (g.head_start <= piece.head_start
                and piece.head_start + piece.num_heads <= g.head_start + g.num_heads):
            raise ValueError(f"{side} rank holds heads [{g.head_start}, +{g.num_heads}), not "
                             f"the slice [{piece.head_start}, +{piece.num_heads})")
    # Expand runs to page pairs: [N] source and destination page ids.
    counts = runs[:, 2]
    offs = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts,
                                                                      counts)
    src_pages = np.repeat(runs[:, 0], counts) + offs
    dst_pages = np.repeat(runs[:, 1], counts) + offs
    lay = np.arange(layers.start, layers.stop, dtype=np.int64)
    # Chunk (layer, page, k/v, token): [L, N, 2, T] byte offsets on each side.
    kv = np.arange(2, dtype=np.int64)[None, None, :, None]
    tok = np.arange(page_size, dtype=np.int64)[None, None, None, :]

    def addrs(g: RegionGeometry, pages: np.ndarray) -> np.ndarray:
        tok_bytes = g.num_heads * head_bytes  # one token's heads on this rank
        blk = lay[:, None] * g.num_pages + pages[None, :]  # [L, N]
        return (g.base_ptr + blk[:, :, None, None] * g.page_bytes
                + kv * page_size * tok_bytes + tok * tok_bytes
                + (piece.head_start - g.head_start) * head_bytes).reshape(-1)

    src_a, dst_a = addrs(src, src_pages), addrs(dst, dst_pages)
    lengths = np.full(src_a.shape[0], piece.num_heads * head_bytes, dtype=np.int64)
    return merge_contiguous(src_a, dst_a, lengths)


def merge_contiguous(src_addrs: np.ndarray, dst_addrs: np.ndarray,
                     lengths: np.ndarray) -> coalesce.Entries:
    """Merge entry i into i-1 wherever i-1 ends exactly where i starts on both sides."""
    src_a = np.asarray(src_addrs, dtype=np.int64)
    dst_a = np.asarray(dst_addrs, dtype=np.int64)
    ln = np.asarray(lengths, dtype=np.int64)
    if ln.shape[0] == 0:
        empty = np.zeros(0, dtype=np.uint64)
        return coalesce.Entries(src_addrs=empty, dst_addrs=empty.copy(), lengths=empty.copy())
    cont = (src_a[:-1] + ln[:-1] == src_a[1:]) & (dst_a[:-1] + ln[:-1] == dst_a[1:])
    heads = np.flatnonzero(np.concatenate(([True], ~cont)))
    return coalesce.Entries(src_addrs=src_a[heads].astype(np.uint64),
                            dst_addrs=dst_a[heads].astype(np.uint64),
                            lengths=np.add.reduceat(ln, heads).astype(np.uint64))


# ---------------------------------------------------------------------------------------------
# Endpoints: what one prefill rank sends one decode rank


def geometry(region) -> RegionGeometry:
    """The planner's view of a `layout.KVRegion`."""
    return RegionGeometry(base_ptr=region.base_ptr, num_pages=region.num_pages,
                          page_bytes=region.page_bytes, head_start=region.head_start,
                          num_heads=region.num_heads)


def slice_between(prefill, decode) -> HeadSlice | None:
    """The heads prefill rank `prefill` (a CompatInfo) sends decode rank `decode`: None with equal
    TP sizes (rank r sends rank r every head: whole pages, as before re-slicing); raises
    ValueError when the pair exchanges nothing."""
    if prefill.tp_size == decode.tp_size:
        return None
    hkv = prefill.num_kv_heads
    for piece in slices_to_decode(decode.tp_rank, decode.tp_size, prefill.tp_size, hkv):
        if piece.prefill_rank == prefill.tp_rank:
            return piece
    raise ValueError(f"tp_rank: prefill rank {prefill.tp_rank} of {prefill.tp_size} holds none "
                     f"of the KV heads decode rank {decode.tp_rank} of {decode.tp_size} takes "
                     "from it (no transfer between them)")


def slice_for_peer(local, local_layout, remote, remote_layout, *,
                   local_is_prefill: bool = True) -> HeadSlice | None:
    """`slice_between` for an endpoint pair, after checking that every head-split region of
    both layouts holds the heads the engine's HeadLayout gives its rank (ValueError if not)."""
    prefill, decode = (local, remote) if local_is_prefill else (remote, local)
    piece = slice_between(prefill, decode)
    if piece is None:
        return None
    for compat, layout in ((local, local_layout), (remote, remote_layout)):
        want = kv_head_range(compat.tp_rank, compat.tp_size, compat.num_kv_heads)
        for r in layout.regions:
            if r.num_heads and (r.head_start, r.num_heads) != want:
                raise ValueError(f"{r.name}: rank {compat.tp_rank} of {compat.tp_size} holds KV "
                                 f"heads [{r.head_start}, +{r.num_heads}), expected "
                                 f"[{want[0]}, +{want[1]}) of {compat.num_kv_heads}")
    return piece
