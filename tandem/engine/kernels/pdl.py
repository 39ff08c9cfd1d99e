"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step: opt-in.

On Hopper a kernel launched with PDL may be launched while the kernel before it on the stream
is still finishing; its programs first wait (`griddepcontrol.wait`: Triton's `gdc_wait`) until
that kernel has completed and its writes are visible, so results are unchanged, while the
launch latency between back-to-back kernels (about 1 us each; an 8B TP=2 decode step runs ~260
of them) overlaps the previous kernel's tail. No kernel here triggers its dependents early, so
a dependent is launched only once every program of the kernel before it has exited: no
program ever waits on one that is not yet running. FlashInfer (0.7) already launches its
attention kernels this way on Hopper (`enable_pdl` defaults to the device's support), so with
this on, the whole decode layer but cuBLAS and NCCL launches as dependents.

`TANDEM_PDL=1` turns it on (read once, at import) for the one-row and multi-row GEMVs, the
rope + KV store and the flag all-reduce. Off by default until it is measured on a GPU
(`TANDEM_PDL=1 python3 benchmarks/gpu_tp.py ...` next to the default). A CUDA graph keeps what
it captured. The interpreter (CPU tests) never sees it: the kernels' PDL branch is a constant
False there.
"""

from __future__ import annotations

import os

# Never under the interpreter (it has no griddepcontrol).
ENABLED = (os.environ.get("TANDEM_PDL", "0") == "1"
           and os.environ.get("TRITON_INTERPRET") != "1")


_ON: dict[str, bool] = {"launch_pdl": True}
_OFF: dict[str, bool] = {}


def launch_options() -> dict[str, bool]:
    """Extra launch keywords for a kernel that takes a `PDL` constexpr: {} when off (shared
    dicts, read-only: every Triton launch of the decode step unpacks one)."""
    return _ON if ENABLED else _OFF
