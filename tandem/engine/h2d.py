"""Host-to-device copies that never wait for the GPU.

`torch.tensor(values, device="cuda")` and `cpu_tensor.to("cuda")` end in a stream
synchronize (PyTorch's blocking copy): the host waits until every queued kernel has run. In a
speculative round that serialises all host work (metadata, planning) with the GPU -- each
draft step's `build_metadata` made eight such copies. Here a host tensor goes to pinned
memory and crosses with one `non_blocking` copy; PyTorch's pinned allocator keeps the
block until the copy ran, so the host tensor may be dropped at once. On CPU devices
these are plain tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from tandem.engine.attention.metadata import BatchLayout, SeqSlice, build_metadata


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device's queue."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, host: torch.Tensor) -> None:
    """`dst.copy_(host)` (dst on any device, e.g. a CUDA graph's buffer) without waiting for
    the device's queue."""
    if dst.device.type != "cuda":
        dst.copy_(host)
    else:
        dst.copy_(host.pin_memory(), non_blocking=True)


def tensor(values: object, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` without a stream sync."""
    return to_device(torch.tensor(values, dtype=dtype), device)


_INT32 = ("qo_indptr", "kv_page_indptr", "kv_page_ids", "kv_lens", "kv_last_page_len")


def layout_to_device(host: BatchLayout, device: torch.device | str,
                     pack: bool | None = None) -> BatchLayout:
    """A host-built layout (`build_metadata(..., "cpu")`) with its device fields moved by two
    copies (the int32 CSR arrays packed, then slots and positions), never syncing. The `_cpu`
    mirrors stay the host tensors planning reads. A custom mask already on the device stays.
    pack=None packs on CUDA only (elsewhere the host layout is returned as is); tests force it."""
    device = torch.device(device)
    if not (device.type == "cuda" if pack is None else pack):
        return host
    a = host.attn
    ints = [getattr(a, f) for f in _INT32]
    packed = to_device(torch.cat(ints), device)  # [sum] int32
    longs = to_device(torch.cat([a.slot_ids, host.positions]), device)  # [2T] int64
    views, off = {}, 0
    for f, t in zip(_INT32, ints):
        views[f] = packed[off : off + t.numel()]
        off += t.numel()
    t = a.slot_ids.numel()
    mask = a.custom_mask
    if mask is not None and mask.device != device:
        mask = to_device(mask, device)
    attn = dataclasses.replace(a, slot_ids=longs[:t], custom_mask=mask, **views)
    return BatchLayout(attn=attn, positions=longs[t:])


def build_layout(seqs: Sequence[SeqSlice], page_size: int,
                 device: torch.device | str) -> BatchLayout:
    """`build_metadata(seqs, page_size, device)` -- the same values -- built on the host and
    moved without a stream sync (see the module docstring)."""
    return layout_to_device(build_metadata(seqs, page_size, "cpu"), device)
