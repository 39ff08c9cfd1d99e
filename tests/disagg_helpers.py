"""A tiny target checkpoint plus a dummy EAGLE head saved as a head directory, and the worker
configs tests build the disaggregated system from."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hf_tiny import save_tiny
from tandem.engine import EngineConfig, ParallelContext, build_model, resolve_model
from tandem.kvtransfer import EndpointConfig
from tandem.spec import DraftHeadConfig, SpecConfig, dummy_head
from tandem.worker import WorkerConfig

FAST_ENDPOINT = EndpointConfig(handshake_timeout_s=5.0, timeout_s=10.0, drain_timeout_s=6.0,
                               lease_margin_s=8.0)


def tiny_model_and_head(root: Path, kind: str = "eagle") -> tuple[Path, Path]:
    model_dir, _ = save_tiny("llama", root)
    ecfg = EngineConfig(model=str(model_dir), dtype="float32")
    mcfg, path = resolve_model(ecfg)
    model = build_model(mcfg, path, ecfg, ParallelContext(), 512)
    head = dummy_head(DraftHeadConfig.like_target(mcfg, kind), model, torch.float32,
                      torch.device("cpu"), 512, seed=5)
    head_dir = root / f"head-{kind}"
    head_dir.mkdir()
    from safetensors.torch import save_file

    save_file(head.state_for_saving(), str(head_dir / "model.safetensors"))
    (head_dir / "config.json").write_text(json.dumps(head.cfg.to_json()))
    return model_dir, head_dir


def worker_config(name: str, model_dir: Path, head_dir: Path, backend: str,
                  spec: SpecConfig | None = None, num_pages: int = 256, **kw) -> WorkerConfig:
    spec = spec or SpecConfig(num_steps=3)
    spec = SpecConfig(draft_model=str(head_dir), num_steps=spec.num_steps, topk=spec.topk,
                      num_draft_tokens=spec.num_draft_tokens)
    return WorkerConfig(
        name=name, engine=EngineConfig(model=str(model_dir), dtype="float32", page_size=4,
                                       num_pages=num_pages),
        spec=spec, transfer_backend=backend, endpoint=FAST_ENDPOINT, transfer_timeout_s=10.0,
        **kw)


def random_requests(n: int, seed: int, new_tokens: tuple[int, int] = (4, 12)):
    """n random prompts over the tiny vocabulary (2-24 tokens) with greedy params of a random
    length in `new_tokens` (inclusive)."""
    import random

    from tandem.engine import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 24))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(*new_tokens), ignore_eos=True)
              for _ in range(n)]
    return prompts, params


async def collect(dispatcher, i: int, prompt, params, room_base: int):
    """Submit request i (room room_base + i, placed on prefill-0 / decode-0) and gather its
    stream: (token ids, error messages)."""
    import time

    from tandem.router.dispatch import Placement, RoutedRequest

    req = RoutedRequest(request_id=f"r{i}", room=room_base + i, model="default",
                        prompt_ids=tuple(prompt), params=params,
                        placement=Placement(prefill_worker="prefill-0", decode_worker="decode-0"),
                        deadline=time.time() + 60)
    toks, errors = [], []
    async for chunk in dispatcher.submit(req):
        toks.extend(chunk.token_ids)
        if getattr(chunk, "error", ""):
            errors.append(chunk.error)
    return tuple(toks), errors


def tiny_dispatcher(dep, num_steps: int = 3):
    """The router's disaggregated dispatcher over a launched deployment of the tiny model."""
    from tandem.router.disagg import DisaggregatedDispatcher
    from tandem.router.dispatch import ModelInfo

    return DisaggregatedDispatcher(
        dep.prefill, dep.decode, dep.endpoints,
        ModelInfo(name="default", vocab_size=256, max_model_len=512, max_request_tokens=400),
        num_steps=num_steps)


def run_all(dispatcher, prompts, params, room_base: int):
    """Every request at once through `dispatcher`: per request (token ids, error messages)."""
    import asyncio

    async def gather():
        return await asyncio.gather(*(collect(dispatcher, i, p, sp, room_base)
                                      for i, (p, sp) in enumerate(zip(prompts, params))))

    return asyncio.run(gather())


def health_once_all_free(dep, *, slots: bool = False, timeout_s: float = 15.0) -> list:
    """Every rank's health report (leaders, then followers) once every rank has all of its
    pages back (and, with `slots`, every decode seed slot), or at `timeout_s`."""
    import time

    import ray

    handles = [*dep.prefill.values(), *dep.decode.values(), *dep.followers]
    end = time.monotonic() + timeout_s
    while True:
        hs = ray.get([h.health.remote() for h in handles])
        back = all(h.num_free_pages == h.num_pages
                   and (not slots or h.num_free_slots == h.num_slots) for h in hs)
        if back or time.monotonic() > end:
            return hs
        time.sleep(0.2)
