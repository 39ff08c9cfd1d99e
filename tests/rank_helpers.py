"""What the tests that run one engine per torch.distributed rank (gloo, on CPU) share: spawning
the ranks, each with the port of their process group, and collecting what each reports; and
the logits of one prefill forward, which the expert-parallel tests compare across ranks."""

from __future__ import annotations

import socket
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from tandem.engine import LLMEngine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Callable, num_ranks: int, *args: object,
              timeout_s: float) -> tuple[list, list[int | None]]:
    """Run `target(rank, port, *args, queue)` in `num_ranks` spawned processes (one free port
    for their process group). What the ranks put on the queue (one item each, in the order
    they came) and the processes' exit codes. A rank that puts nothing within `timeout_s` (a
    deadlock) fails the test with queue.Empty; a rank still alive 20 s after is killed."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, queue)) for r in range(num_ranks)]
    for p in procs:
        p.start()
    try:
        items = [queue.get(timeout=timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(20)
        for p in procs:
            if p.is_alive():
                p.kill()
    return items, [p.exitcode for p in procs]


def prompt_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), V] float32 logits of one prefill forward over `prompt`."""
    from tandem.engine.attention.metadata import SeqSlice, build_metadata
    from tandem.engine.runner import ForwardBatch

    pages = engine.allocator.alloc(engine.scheduler.pages_needed(len(prompt)))
    layout = build_metadata([SeqSlice(page_ids=pages, num_cached=0, num_new=len(prompt))],
                            engine.cfg.page_size, engine.device)
    out = engine.runner.forward(ForwardBatch(
        input_ids=torch.tensor(prompt), positions=layout.positions, attn=layout.attn,
        logits_indices=torch.arange(len(prompt))))
    engine.allocator.free(pages)
    return out.logits
