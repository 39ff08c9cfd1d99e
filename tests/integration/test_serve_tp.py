"""`tandem serve --tensor-parallel-size 2` (colocated, no Ray): this process is rank 0 and serves;
rank 1 is a spawned process following it step by step (colocated_node/tp_processes.py). Greedy
float32 output through the gRPC API equals one engine's, plain and speculative; SIGTERM stops
both ranks and the command exits 0. `--tp` with `--config` is refused, naming the flag."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager

import grpc
import pytest
from disagg_helpers import tiny_model_and_head
from process_helpers import reap, stop_cleanly, wait_for_line

from tandem.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[5, 9, 14, 3], [7, 7, 21, 40, 2, 8], [100, 3]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_model_and_head(tmp_path_factory.mktemp("m"))


def _tokens(port: int, prompt: list[int]) -> list[int]:
    from tandem.proto import router_pb2 as pb
    from tandem.proto import router_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        req = pb.GenerateRequest(model="tiny", prompt_token_ids=prompt,
                                 sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True))
        return [t for msg in pb_grpc.RouterStub(ch).Generate(req, timeout=60)
                for t in msg.token_ids]


@contextmanager
def serving_tp2(model_dir, *extra: str):
    """`tandem serve --tp 2` on the tiny model: yields (its gRPC port, the process) once it
    listens; stopped with SIGTERM on the way out, which must end it with 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "--model", str(model_dir), "--dtype",
         "float32", "--page-size", "4", "--num-pages", "256", "--served-model-name", "tiny",
         "--port", "0", "--tp", "2", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    try:
        m, lines = wait_for_line(proc, r"TP=2\) loaded .* listening on 127\.0\.0\.1:(\d+)",
                                 timeout_s=120)
        yield int(m.group(1)), proc
        stop_cleanly(proc, lines, 60)
    finally:
        reap(proc)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "spec"])
def test_serve_tp2_equals_one_engine(dirs, speculative):
    model_dir, head_dir = dirs
    extra = ["--speculative", "--draft-model", str(head_dir)] if speculative else []
    with serving_tp2(model_dir, *extra) as (port, _):
        got = [_tokens(port, p) for p in PROMPTS]
    one = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="float32", page_size=4,
                                             num_pages=256))
    want = [list(c.output_ids) for c in one.generate(
        PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))]
    assert got == want


def test_a_dead_rank_fails_requests_at_once_and_the_command_still_stops(dirs):
    """kill -9 of rank 1: the next request ends UNAVAILABLE at once (gloo sees the peer's
    connection close; no wait for the group's timeout), later ones find the worker down, and
    SIGTERM still ends the command with 0 (nobody left to release)."""
    with serving_tp2(dirs[0]) as (port, proc):
        assert len(_tokens(port, PROMPTS[0])) == 8
        kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                              text=True).stdout.split()
        assert kids
        for pid in kids:  # rank 1 (and multiprocessing's resource tracker)
            os.kill(int(pid), signal.SIGKILL)
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as err:
                _tokens(port, PROMPTS[1])
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tp_flag_with_a_config_is_refused(tmp_path, capsys):
    from tandem.cli import main

    assert main(["serve", "--config", "local", "--tp", "2"]) == 2
    assert "--tensor-parallel-size" in capsys.readouterr().err
