"""Are the machine's GPUs equally fast? A bf16 matmul loop (compute-bound) and a device copy
(HBM-bound) timed on each visible GPU, so that a comparison between runs on different cards of
one host (e.g. colocated on GPU 0 vs a prefill worker on GPU 1) can rule the card out.

    python3 benchmarks/gpu_speed.py
"""

from __future__ import annotations

import time

import torch


def timed(fn, device, reps: int) -> float:
    fn()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    for i in range(torch.cuda.device_count()):
        dev = torch.device(f"cuda:{i}")
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        for _ in range(3):  # warm the clocks up
            timed(lambda: a @ b, dev, 20)
        mm = min(timed(lambda: a @ b, dev, 50) for _ in range(3))
        cp = min(timed(lambda: dst.copy_(src), dev, 20) for _ in range(3))
        print(f"cuda:{i} {torch.cuda.get_device_name(dev)}: matmul 8k bf16 {mm * 1e3:.3f} ms "
              f"({2 * 8192 ** 3 / mm / 1e12:.0f} TFLOP/s), copy 1 GiB {cp * 1e3:.3f} ms "
              f"({2 * (1 << 30) / cp / 1e9:.0f} GB/s r+w)", flush=True)
        del a, b, src, dst
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
