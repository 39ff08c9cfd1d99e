"""ListWorkers' num_pages is the pages requests can use: the configured pool less page 0, the
scratch page the padding rows of CUDA-graph batches write to (kv_cache.py). So a pool of 600
reports 599, in colocated mode (through the gRPC API) and on disaggregated workers alike, an
idle worker has all of them free, and the API says why (router.proto, WorkerStatus)."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
from spec_helpers import engine_cfg, one_thread, tiny_target  # noqa: F401 (autouse fixture)

from tandem.engine import LLMEngine, PageAllocator

CONFIGURED = 600
USABLE = CONFIGURED - PageAllocator(CONFIGURED).reserved  # 599
PROTO = Path(__file__).resolve().parents[2] / "proto" / "tandem" / "v1" / "router.proto"


def test_one_page_is_the_scratch_page():
    assert USABLE == 599


@pytest.mark.timeout(60)
def test_colocated_list_workers_reports_the_usable_pages():
    from tandem.colocated_node import build_colocated_router
    from tandem.proto import router_pb2 as pb
    from tandem.proto import router_pb2_grpc as pb_grpc
    from tandem.router.app import BackgroundServer
    from tandem.router.server import ServerConfig

    engine = LLMEngine(engine_cfg(num_pages=CONFIGURED), tiny_target("llama", live=None))
    server = BackgroundServer(build_colocated_router(engine),
                              ServerConfig(host="127.0.0.1", port=0)).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            (w,) = pb_grpc.RouterStub(channel).ListWorkers(pb.ListWorkersRequest(),
                                                           timeout=10).workers
        assert (w.num_pages, w.num_free_pages) == (USABLE, USABLE)
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_disaggregated_workers_report_the_usable_pages(tmp_path):
    from disagg_helpers import tiny_model_and_head, worker_config
    from tandem.decode_node.worker import DecodeWorker
    from tandem.prefill_node.worker import PrefillWorker

    model_dir, head_dir = tiny_model_and_head(tmp_path)
    prefill = PrefillWorker(worker_config("p", model_dir, head_dir, "fake",
                                          num_pages=CONFIGURED))
    decode = DecodeWorker(worker_config("d", model_dir, head_dir, "fake", num_pages=CONFIGURED))
    try:
        assert prefill.num_pages() == prefill.num_free_pages() == USABLE
        load = decode.pool_load()  # what its health answer reports
        assert decode.num_pages() == load.num_pages == load.num_free_pages == USABLE
    finally:
        prefill.close()
        decode.close()


def test_the_api_says_why():
    text = PROTO.read_text()
    status = text[text.index("message WorkerStatus {"):]
    comment = re.search(r"((?:\s*//[^\n]*\n)+)\s*int32 num_pages = 10;", status).group(1)
    assert "scratch page" in comment and "599" in comment
