"""Layer-wise KV push vs push-after-prefill, with the real prefill forward (issue 5).

One PrefillWorker (this thread) and one DecodeWorker (a WorkerLoop thread, as in its Ray actor)
in one process, KV moving over Mooncake or NIXL on loopback. Per request (one long prompt at a
time, max_new_tokens 2, chain spec):

    prefill_s  = prefill start (first step of the request) -> hand-off (target + draft prefill)
    received_s = prefill start -> decode's receiver reports the request Received (TTFT-relevant)
    exposed_s  = received_s - prefill_s: transfer time not hidden behind the prefill

    python benchmarks/layerwise_push.py --backend mooncake --prompt-len 1536 --reps 3
    python benchmarks/layerwise_push.py --backend nixl --device cuda ...   # a later GPU run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

from tandem.decode_node.worker import DecodeWorker
from tandem.engine import EngineConfig, SamplingParams
from tandem.kvtransfer import EndpointConfig, Received
from tandem.prefill_node.worker import PrefillWorker
from tandem.spec import SpecConfig
from tandem.worker import WorkerConfig, WorkerLoop


def worker_cfg(name: str, args: argparse.Namespace, layerwise: bool) -> WorkerConfig:
    engine = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                          page_size=args.page_size, max_model_len=args.prompt_len + 64,
                          max_num_batched_tokens=args.chunk, num_pages=args.num_pages)
    return WorkerConfig(name=name, engine=engine, spec=SpecConfig(num_steps=3),
                        transfer_backend=args.backend, transfer_timeout_s=120.0,
                        endpoint=EndpointConfig(timeout_s=120.0), torch_threads=args.threads,
                        layerwise_push=layerwise)


def measure(args: argparse.Namespace, layerwise: bool) -> list[dict]:
    prefill = PrefillWorker(worker_cfg("prefill-0", args, layerwise))
    decode = DecodeWorker(worker_cfg("decode-0", args, False))
    received: dict[int, float] = {}
    lock = threading.Lock()
    poll = decode.receiver.poll

    def timed_poll(*a, **k):  # on the decode loop thread: stamp each Received as it surfaces
        events = poll(*a, **k)
        now = time.perf_counter()
        with lock:
            for ev in events:
                if isinstance(ev, Received):
                    received.setdefault(ev.room, now)
        return events

    decode.receiver.poll = timed_poll
    handed: dict[int, float] = {}
    take = prefill.engine.take_handoffs

    def timed_take():  # right after engine.step(): target + draft prefill of the room done
        out = take()
        for h in out:
            handed[int(h.req_id)] = time.perf_counter()
        return out

    prefill.engine.take_handoffs = timed_take
    dloop = WorkerLoop(decode, lambda outs: None)
    rows = []
    try:
        prefill.connect(dloop.call(decode.endpoint))
        rng = random.Random(0)
        for rep in range(args.warmup + args.reps):
            room = 100 + rep
            prompt = [rng.randrange(1000, 20000) for _ in range(args.prompt_len)]
            sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
            prefill.submit(room, prompt, sp, dloop.call(decode.reserve, room, prompt, sp))
            t0 = time.perf_counter()
            results = []
            while not results:
                results = prefill.step()
            assert results[0].ok, results[0].error
            while room not in received:
                time.sleep(0.0005)
            while dloop.call(decode.busy):
                time.sleep(0.005)
            if rep >= args.warmup:
                rows.append({"prefill_s": handed[room] - t0, "received_s": received[room] - t0,
                             "exposed_s": received[room] - handed[room]})
        early = prefill.pusher.num_layers_early
        for r in rows:
            r["layers_pushed_in_forward_total"] = early
    finally:
        dloop.close()
        prefill.close()
        decode.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="mooncake", choices=["mooncake", "nixl", "fake"])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-len", type=int, default=1536)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    out = {}
    for layerwise in (False, True):
        rows = measure(args, layerwise)
        mode = "layerwise" if layerwise else "after_prefill"
        out[mode] = {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
        out[mode]["runs"] = rows
        print(mode, {k: v for k, v in out[mode].items() if k != "runs"}, flush=True)
    print(json.dumps({"args": vars(args), **out}))


if __name__ == "__main__":
    main()
