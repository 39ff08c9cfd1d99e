"""Memory descriptors (`KVRegion`, `AuxRegion`, `KVLayout`) and the copy planner that turns a
request's page lists into bounded batches of (src address, dst address, length) entries
(vectorized in coalesce.py).

Addressing: a region holds one layer group as [num_layers, num_pages, page_bytes] bytes, so the
bytes of (layer l, page p) start at `base_ptr + (l * num_pages + p) * page_bytes`. All groups share
page ids. The planner coalesces entries that are contiguous on BOTH sides (runs of consecutive
pages, and whole-layer runs that continue into the next layer) and splits the result so that no
batch exceeds `max_entries` (Mooncake fails above 1024 entries per batch).

kvtransfer never imports torch here: `*.from_tensor` only reads attributes of the tensor given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.kvtransfer import coalesce
from tandem.kvtransfer.contract import ErrorKind, TransferError

MAX_BATCH_ENTRIES = 1024  # Mooncake's per-batch limit (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER)


def parse_device(device: str) -> tuple[str, int]:
    """"cpu" -> ("DRAM", 0); "cuda" / "cuda:N" -> ("VRAM", N). NIXL and Mooncake both need this."""
    if device == "cpu":
        return "DRAM", 0
    if device == "cuda":
        return "VRAM", 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return "VRAM", int(device[5:])
    raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class KVRegion:
    """One layer group's KV buffer on one TP rank: [num_layers, num_pages, page_bytes] bytes."""

    name: str  # layer group, e.g. "target", "draft"
    base_ptr: int  # address of byte 0 (host or device pointer)
    num_layers: int
    num_pages: int
    page_bytes: int  # bytes of one (layer, page) block on this rank (its heads only)
    device: str = "cpu"  # "cpu" | "cuda:N": selects DRAM/VRAM registration
    # KV heads held by this rank: [head_start, head_start + num_heads) of the model's KV heads.
    # Equal-TP transfers ignore it; head re-slicing between TP sizes will read it.
    head_start: int = 0
    num_heads: int = 0

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_pages", "page_bytes"):
            if getattr(self, f) <= 0:
                raise ValueError(f"KVRegion {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        parse_device(self.device)

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_pages * self.page_bytes

    @property
    def block_bytes(self) -> int:  # the unit a backend may prepare descriptors for
        return self.page_bytes

    @property
    def num_blocks(self) -> int:
        return self.num_layers * self.num_pages

    def page_addr(self, layer: int, page: int) -> int:
        return self.base_ptr + (layer * self.num_pages + page) * self.page_bytes

    @classmethod
    def from_tensor(cls, name: str, tensor, *, head_start: int = 0, num_heads: int = 0) -> KVRegion:
        """`tensor`: contiguous [num_layers, num_pages, ...] (any dtype, CPU or CUDA)."""
        if not tensor.is_contiguous():
            raise ValueError(f"KVRegion {name!r}: tensor must be contiguous")
        num_layers, num_pages = int(tensor.shape[0]), int(tensor.shape[1])
        page_bytes = tensor.numel() * tensor.element_size() // (num_layers * num_pages)
        return cls(
            name=name, base_ptr=int(tensor.data_ptr()), num_layers=num_layers, num_pages=num_pages,
            page_bytes=page_bytes, device=str(tensor.device), head_start=head_start,
            num_heads=num_heads,
        )

    def to_wire(self) -> dict:
        return {
            "name": self.name, "base_ptr": self.base_ptr, "num_layers": self.num_layers,
            "num_pages": self.num_pages, "page_bytes": self.page_bytes, "device": self.device,
            "head_start": self.head_start, "num_heads": self.num_heads,
        }

    @classmethod
    def from_wire(cls, d: dict) -> KVRegion:
        return cls(**d)


@dataclass(frozen=True, slots=True, kw_only=True)
class AuxRegion:
    """Slots for EAGLE seeds: [num_slots, slot_bytes] bytes of HOST memory (the seed is small; the
    decode worker copies it to the GPU itself, so the receiver can verify it without CUDA)."""

    base_ptr: int
    num_slots: int
    slot_bytes: int  # header (aux.HEADER_BYTES) + the largest payload
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.num_slots <= 0 or self.slot_bytes <= 0:
            raise ValueError(f"AuxRegion: num_slots/slot_bytes must be > 0, got {self}")
        if self.device != "cpu":
            raise ValueError("AuxRegion.device: aux slots live in host memory, "
                             f"got {self.device!r}")

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def block_bytes(self) -> int:  # a whole slot: the aux write always writes one
        return self.slot_bytes

    @property
    def num_blocks(self) -> int:
        return self.num_slots

    def slot_addr(self, slot: int) -> int:
        return self.base_ptr + slot * self.slot_bytes

    @classmethod
    def from_tensor(cls, tensor) -> AuxRegion:
        """`tensor`: contiguous uint8 [num_slots, slot_bytes] on the CPU (pinned on GPU nodes)."""
        if not tensor.is_contiguous() or tensor.element_size() != 1 or tensor.dim() != 2:
            raise ValueError("AuxRegion: tensor must be a contiguous uint8 [num_slots, slot_bytes]")
        return cls(base_ptr=int(tensor.data_ptr()), num_slots=int(tensor.shape[0]),
                   slot_bytes=int(tensor.shape[1]), device=str(tensor.device))

    def to_wire(self) -> dict:
        return {"base_ptr": self.base_ptr, "num_slots": self.num_slots,
                "slot_bytes": self.slot_bytes, "device": self.device}

    @classmethod
    def from_wire(cls, d: dict) -> AuxRegion:
        return cls(**d)


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayout:
    """All memory one endpoint exposes: its KV regions (by group) and its aux slots."""

    regions: tuple[KVRegion, ...]
    aux: AuxRegion

    def __post_init__(self) -> None:
        names = [r.name for r in self.regions]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"KVLayout: need >= 1 region with unique names, got {names}")
        pages = {r.num_pages for r in self.regions}
        if len(pages) != 1:  # one page id must index every group
            raise ValueError(f"KVLayout: every region needs the same num_pages, got {pages}")

    @property
    def num_pages(self) -> int:
        return self.regions[0].num_pages

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page id moves: every layer of every group."""
        return sum(r.num_layers * r.page_bytes for r in self.regions)

    def region(self, name: str) -> KVRegion:
        for r in self.regions:
            if r.name == name:
                return r
        raise TransferError(ErrorKind.INVALID, f"unknown layer group {name!r}; have "
                            f"{[r.name for r in self.regions]}")

    def to_wire(self) -> dict:
        return {"regions": [r.to_wire() for r in self.regions], "aux": self.aux.to_wire()}

    @classmethod
    def from_wire(cls, d: dict) -> KVLayout:
        return cls(regions=tuple(KVRegion.from_wire(r) for r in d["regions"]),
                   aux=AuxRegion.from_wire(d["aux"]))


def layout_mismatches(src: KVLayout, dst: KVLayout) -> list[str]:
    """Shape differences that make src→dst page copies meaningless (empty list: compatible).
    Equal TP only: per-region page_bytes must match exactly."""
    out: list[str] = []
    src_names, dst_names = [r.name for r in src.regions], [r.name for r in dst.regions]
    if sorted(src_names) != sorted(dst_names):
        out.append(f"layer groups: prefill={src_names} decode={dst_names}")
        return out
    for s in src.regions:
        d = dst.region(s.name)
        fs = ["num_layers"]
        if s.num_heads and d.num_heads and s.num_heads != d.num_heads:
            # Different TP sizes: pages hold different head counts; a head's bytes must agree.
            if s.page_bytes * d.num_heads != d.page_bytes * s.num_heads:
                out.append(f"{s.name}.page_bytes per head: prefill={s.page_bytes}/{s.num_heads} "
                           f"decode={d.page_bytes}/{d.num_heads}")
        else:
            fs.append("page_bytes")
        for f in fs:
            if getattr(s, f) != getattr(d, f):
                out.append(f"{s.name}.{f}: prefill={getattr(s, f)} decode={getattr(d, f)}")
    if src.aux.slot_bytes != dst.aux.slot_bytes:
        out.append(f"aux.slot_bytes: prefill={src.aux.slot_bytes} decode={dst.aux.slot_bytes}")
    return out


# ---------------------------------------------------------------------------------------------
# Planning


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyBatch:
    """At most `max_entries` contiguous copies from one local device to one remote device."""

    src_device: str
    dst_device: str
    src_addrs: tuple[int, ...]  # [n] local addresses
    dst_addrs: tuple[int, ...]  # [n] remote addresses
    lengths: tuple[int, ...]  # [n] bytes

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)


def page_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Coalesce (src[i], dst[i]) pairs into (src_start, dst_start, count) runs that are
    consecutive on both sides. `dst_pages` may be longer (decode reserves for generation too).
    (The sender uses coalesce.page_runs, its numpy twin, directly.)"""
    return [tuple(int(x) for x in row) for row in coalesce.page_runs(src_pages, dst_pages)]


def validate_pages(layout_src: KVLayout, layout_dst: KVLayout, src_pages: Sequence[int],
                   dst_pages: Sequence[int], *, room: int) -> None:
    def bad(msg: str) -> TransferError:
        return TransferError(ErrorKind.INVALID, msg, room=room)

    if len(src_pages) > len(dst_pages):
        raise bad(f"{len(src_pages)} source pages but decode reserved only {len(dst_pages)}")
    for name, pages, n in (("source", src_pages, layout_src.num_pages),
                           ("destination", dst_pages, layout_dst.num_pages)):
        for p in pages:
            if not 0 <= p < n:
                raise bad(f"{name} page id {p} outside [0, {n})")
    if len(set(dst_pages)) != len(dst_pages):
        raise bad("destination page ids repeat: two source pages would land in one page")


# Up to this many (run, layer) pairs a plan is made in plain Python: the usual push (a few runs,
# one or a few layers) costs less than the dozen numpy calls of the vectorized planner.
_SMALL_PLAN = 64


def plan_layers(src: KVRegion, dst: KVRegion, runs, layers: range, *,
                max_entries: int | None = MAX_BATCH_ENTRIES) -> list[CopyBatch]:
    """Batches copying `runs` of pages (page_runs output, list or [R, 3] array) for `layers` of
    one group, src region -> dst region; at most `max_entries` entries a batch (None: one)."""
    rows = runs.tolist() if isinstance(runs, np.ndarray) else runs
    if len(rows) * len(layers) > _SMALL_PLAN:
        return split_batches(plan_entries(src, dst, runs, layers), src.device, dst.device,
                             max_entries=max_entries)
    _check_layers(src, layers)
    pb, entries = src.page_bytes, []  # (src addr, dst addr, bytes), merged as plan_entries does
    for layer in layers:
        for s_page, d_page, count in rows:
            sa = src.base_ptr + (layer * src.num_pages + int(s_page)) * pb
            da = dst.base_ptr + (layer * dst.num_pages + int(d_page)) * pb
            n = int(count) * pb
            if entries:
                ps, pd, pn = entries[-1]
                if ps + pn == sa and pd + pn == da:  # contiguous on both sides: one entry
                    entries[-1] = (ps, pd, pn + n)
                    continue
            entries.append((sa, da, n))
    return split_batches(entries, src.device, dst.device, max_entries=max_entries)


def _check_layers(src: KVRegion, layers: range) -> None:
    if layers.start < 0 or layers.stop > src.num_layers or layers.step != 1:
        raise TransferError(ErrorKind.INVALID, f"{src.name}: layers {layers} outside "
                            f"range(0, {src.num_layers}) or not step 1")


def plan_entries(src: KVRegion, dst: KVRegion, runs, layers: range) -> coalesce.Entries:
    """The coalesced entries of `plan_layers`, as numpy arrays (vectorized: no per-page Python)."""
    _check_layers(src, layers)
    return coalesce.plan_entries(src.base_ptr, src.num_pages, dst.base_ptr, dst.num_pages,
                                 src.page_bytes, np.asarray(runs, dtype=np.int64).reshape(-1, 3),
                                 layers)


def split_batches(entries, src_device: str, dst_device: str, *,
                  max_entries: int | None = MAX_BATCH_ENTRIES) -> list[CopyBatch]:
    """`entries`: coalesce.Entries, or a sequence of (src, dst, len) rows."""
    if isinstance(entries, coalesce.Entries):
        src_l, dst_l, len_l = (entries.src_addrs.tolist(), entries.dst_addrs.tolist(),
                               entries.lengths.tolist())
    else:
        src_l = [int(e[0]) for e in entries]
        dst_l = [int(e[1]) for e in entries]
        len_l = [int(e[2]) for e in entries]
    step = max_entries or max(1, len(len_l))
    out = []
    for i in range(0, len(len_l), step):
        out.append(CopyBatch(src_device=src_device, dst_device=dst_device,
                             src_addrs=tuple(src_l[i : i + step]),
                             dst_addrs=tuple(dst_l[i : i + step]),
                             lengths=tuple(len_l[i : i + step])))
    return out
