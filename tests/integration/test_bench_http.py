"""`tandem bench --target http://...` against tandem's real OpenAI-compatible HTTP front, in
process on 127.0.0.1: `HttpServer` (bearer token) and the gRPC server on one `Router` over a
colocated tiny random llama (float32) with a word-level tokenizer of its whole vocabulary, so
every token streams as text of its own (one token per chunk).

Checks: the JSON report of an HTTP run (completed count, output tokens from the usage, the
prompt sent as the workload's token ids, tau n/a, status counts); a wrong token fails every
request as UNAUTHENTICATED over both APIs, and a deadline as DEADLINE_EXCEEDED, every KV page
coming back; and the same workload over HTTP and over gRPC against
the same server agrees -- the same completed count, prompt and output tokens, statuses, and
TTFT/TPOT medians within a factor of 2 (a check that both drivers measure the same thing, not a
benchmark of the two fronts), for random prompts (/v1/completions) and chat questions
(/v1/chat/completions)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

import pytest
import torch
from hf_tiny import TINY_COMMON
from http_helpers import CHAT_TEMPLATE
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from tandem.bench.results import validate
from tandem.bench.workload import LengthRange, WorkloadConfig, build_requests
from tandem.colocated_node import build_colocated_router
from tandem.engine import EngineConfig, LLMEngine
from tandem.http_api import HttpConfig, HttpServer
from tandem.router import Router
from tandem.router.app import BackgroundServer
from tandem.router.server import ServerConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TOKEN = "bench-http-secret"
WORKER = "colocated-0"
# Random prompt ids are drawn from [256, VOCAB) (workload.FIRST_TOKEN_ID): the tiny model gets a
# vocabulary past that, and the tokenizer a word for every id.
VOCAB = 512
# Wider and deeper than hf_tiny's shape, so that the model's time (TTFT ~40 ms, TPOT ~15 ms on a
# 2-core CPU) outweighs what a front adds per request and per chunk (~1-3 ms) and the noise of a
# shared machine: the agreement test compares the drivers, not the fronts.
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=4)
AGREE = 2.0  # HTTP and gRPC medians within this factor of each other


def save_model(root: Path) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**{**TINY_COMMON, **SHAPE, "vocab_size": VOCAB}, rope_theta=10000.0)
    out = root / "llama512"
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(out)
    hf = HFTokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (out / "tokenizer.json").write_text(hf.to_str())
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return out


@dataclass(frozen=True)
class Fronts:
    grpc: str  # host:port
    http: str  # http://host:port
    engine: LLMEngine
    router: Router

    def wait_pages_free(self, timeout_s: float = 10.0) -> None:
        """Asserts the engine goes idle within `timeout_s` with every KV page back."""
        assert self.router.dispatcher.loop(WORKER).wait_idle(timeout_s), "generation went on"
        assert self.engine.allocator.num_free == self.engine.allocator.num_usable, "pages leaked"


@pytest.fixture(scope="module")
def fronts(tmp_path_factory):
    """Both fronts of one server."""
    model_dir = save_model(tmp_path_factory.mktemp("bench-http"))
    # One torch thread: an intra-op pool as wide as this 2-core machine stalls whenever any
    # other process takes a core, which made the model's own times swing by 2x between runs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="float32",
                                                page_size=4, num_pages=256))
    router = build_colocated_router(engine, model="tiny", worker=WORKER)
    http = HttpServer(router, HttpConfig(port=0, auth_token=TOKEN))
    server = BackgroundServer(router, ServerConfig(port=0, auth_token=TOKEN),
                              fronts=[http]).start()
    yield Fronts(grpc=f"127.0.0.1:{server.port}", http=f"http://127.0.0.1:{http.port}",
                 engine=engine, router=router)
    server.stop()
    torch.set_num_threads(threads)


def bench(tmp_path: Path, name: str, targets: list[str], *flags: str,
          token: str = TOKEN) -> tuple[int, dict, str]:
    """(exit code, the JSON document, what it printed) of one `tandem bench` run."""
    import contextlib
    import io

    from tandem.cli import main

    out = tmp_path / f"{name}.json"
    argv = ["bench", *[a for t in targets for a in ("--target", t)], "--auth-token", token,
            "--out", str(out), "--no-plot", "--no-progress", *flags]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(argv)
    doc = json.loads(out.read_text())
    validate(doc)
    return rc, doc, printed.getvalue()


RANDOM = ["--input-len", "8:16", "--vocab-size", str(VOCAB)]


def test_http_run_reports_what_the_server_did(fronts, tmp_path):
    url = fronts.http
    rc, doc, printed = bench(tmp_path, "http", [url], *RANDOM, "--output-len", "8",
                             "--concurrency", "1,2", "--num-requests", "4", "--num-warmup", "1")
    assert rc == 0, printed
    (run,) = doc["runs"]
    assert (run["api"], run["target"], run["error"]) == ("http", url, None)
    workload = WorkloadConfig(kind="random", input_len=LengthRange(lo=8, hi=16),
                              output_len=LengthRange(lo=8, hi=8), vocab_size=VOCAB)
    for i, lv in enumerate(run["levels"]):
        assert (lv["num_completed"], lv["num_failed"]) == (4, 0), lv["errors"]
        assert lv["status_counts"] == {"OK": 4}
        assert lv["mean_output_tokens"] == 8  # the usage's count; ignore_eos forced it
        # The server counted exactly the workload's prompts: they went as token ids.
        sent = build_requests(workload, 4, stream=i + 1)
        assert lv["mean_prompt_tokens"] == fmean(len(r.prompt_token_ids) for r in sent)
        assert 0 < lv["ttft_s"]["p50"] <= lv["latency_s"]["p50"]
        assert lv["tpot_s"]["p50"] > 0 and lv["itl_s"]["mean"] == pytest.approx(
            lv["tpot_s"]["mean"], rel=0.5)
        assert lv["acceptance"] is None  # n/a over the OpenAI API
    assert "tau n/a" in printed and "OpenAI-compatible HTTP front" in printed


def test_a_wrong_token_fails_every_request_over_both_apis(fronts, tmp_path):
    grpc_target, url = fronts.grpc, fronts.http
    rc, doc, printed = bench(tmp_path, "badtoken", [grpc_target, url], *RANDOM,
                             "--output-len", "2", "--concurrency", "2", "--num-requests", "3",
                             "--num-warmup", "0", token="not-the-token")
    assert rc == 1 and "UNAUTHENTICATED 3" in printed
    for run in doc["runs"]:
        assert run["error"] is None  # the runs went; their requests were refused
        (lv,) = run["levels"]
        assert (lv["num_completed"], lv["num_failed"]) == (0, 3)
        assert lv["status_counts"] == {"UNAUTHENTICATED": 3}
    assert "HTTP 401" in doc["runs"][1]["levels"][0]["errors"][0]


def test_a_deadline_ends_requests_over_both_apis_and_frees_their_pages(fronts, tmp_path):
    # Answers of 300 tokens take seconds here; the deadline ends each after a few chunks. Over
    # HTTP the client closes the connection at its deadline, and the front aborts the request.
    rc, doc, printed = bench(tmp_path, "deadline", [fronts.grpc, fronts.http], *RANDOM,
                             "--output-len", "300", "--concurrency", "2", "--num-requests", "2",
                             "--num-warmup", "0", "--request-timeout", "0.5")
    assert rc == 1, printed
    for run in doc["runs"]:
        (lv,) = run["levels"]
        assert lv["status_counts"] == {"DEADLINE_EXCEEDED": 2}, (run["api"], lv["errors"])
    fronts.wait_pages_free()


def agree(grpc_lv: dict, http_lv: dict) -> list[str]:
    """What differs between a level measured over gRPC and over HTTP (empty: they agree)."""
    bad = [f"{key}: gRPC {grpc_lv[key]} vs HTTP {http_lv[key]}"
           for key in ("num_completed", "num_failed", "mean_prompt_tokens",
                       "mean_output_tokens", "status_counts") if grpc_lv[key] != http_lv[key]]
    for key in ("ttft_s", "tpot_s"):
        g, h = grpc_lv[key]["p50"], http_lv[key]["p50"]
        if not (g > 0 and h > 0 and 1 / AGREE <= h / g <= AGREE):
            bad.append(f"{key} p50: gRPC {g * 1e3:.2f} ms vs HTTP {h * 1e3:.2f} ms")
    return bad


def medians(lv: dict) -> str:
    return (f"TTFT p50 {lv['ttft_s']['p50'] * 1e3:.2f} ms, TPOT p50 "
            f"{lv['tpot_s']['p50'] * 1e3:.2f} ms, {lv['mean_output_tokens']:g} out tok")


@pytest.mark.parametrize("workload", [
    ["--input-len", "32:64", "--vocab-size", str(VOCAB), "--output-len", "16",
     "--concurrency", "1,2", "--num-requests", "8"],
    ["--dataset", "chat", "--output-len", "12", "--concurrency", "1", "--num-requests", "4"],
], ids=["random-ids", "chat"])
def test_http_and_grpc_measure_the_same_workload_alike(fronts, tmp_path, workload):
    grpc_target, url = fronts.grpc, fronts.http
    # The same workload twice against the same server, one API after the other.
    rc, doc, printed = bench(tmp_path, "agree", [grpc_target, url], *workload,
                             "--num-warmup", "2")
    assert rc == 0, printed
    grpc_run, http_run = doc["runs"]
    assert (grpc_run["api"], http_run["api"]) == ("grpc", "http")
    for g, h in zip(grpc_run["levels"], http_run["levels"], strict=True):
        print(f"{' '.join(workload[:2])} c={g['load']['concurrency']}: gRPC {medians(g)} | HTTP "
              f"{medians(h)}")
        assert g["num_completed"] == g["num_requests"]
        assert agree(g, h) == [], printed
