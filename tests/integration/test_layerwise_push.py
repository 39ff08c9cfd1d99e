"""Layer-wise push (WorkerConfig.layerwise_push): disaggregated == colocated when target layer
l's pages leave inside the forward that completes the prompt, chunked prompts included, and
every page and slot is free afterwards."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from disagg_helpers import tiny_model_and_head, worker_config
from test_disagg_inprocess import run_disaggregated
from tandem.decode_node.worker import DecodeWorker
from tandem.engine import SamplingParams
from tandem.prefill_node.worker import PrefillWorker
from tandem.spec import SpecConfig, SpecEngine

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_model_and_head(tmp_path_factory.mktemp("m"))


def slow_layers(engine, seconds: float) -> None:
    """Make each target layer take `seconds` more, so the decode side's grant (GO) arrives while
    the completing forward still runs -- as it does for a long prompt -- and pushes happen
    inside it (the tiny model's forward alone is over before one loopback round trip)."""
    for layer in engine.model.layers:
        inner = layer.forward

        def forward(*args, _inner=inner):
            time.sleep(seconds)
            return _inner(*args)

        layer.forward = forward


@pytest.mark.parametrize("backend", ["fake", "mooncake"])
def test_layerwise_disaggregated_equals_colocated(dirs, backend):
    model_dir, head_dir = dirs
    rng = random.Random(3)
    # 45 and 37 tokens with a 16-token budget: three chunks each, the last one pushes layer-wise.
    lens = [45, 5, 37, 12, 3]
    prompts = [[rng.randrange(256) for _ in range(n)] for n in lens]
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True),
              SamplingParams(max_new_tokens=6, ignore_eos=True),
              SamplingParams(max_new_tokens=8, ignore_eos=True),
              SamplingParams(max_new_tokens=1, ignore_eos=True),  # finished at prefill
              SamplingParams(max_new_tokens=12, ignore_eos=True)]
    spec = SpecConfig(num_steps=3)
    pcfg = worker_config("prefill-0", model_dir, head_dir, backend, spec, layerwise_push=True)
    pcfg = dataclasses.replace(pcfg, engine=dataclasses.replace(pcfg.engine,
                                                                max_num_batched_tokens=16))
    dcfg = worker_config("decode-0", model_dir, head_dir, backend, spec)
    colocated = SpecEngine.from_config(pcfg.engine, pcfg.spec).generate(prompts, params)
    prefill, decode = PrefillWorker(pcfg), DecodeWorker(dcfg)
    slow_layers(prefill.engine, 0.05)
    try:
        got = run_disaggregated(prefill, decode, prompts, params)
        assert got == [c.output_ids for c in colocated]
        assert prefill.pusher is not None and prefill.pusher.num_layers_early > 0
        assert prefill.num_free_pages() == prefill.num_pages()
        assert decode.num_free_pages() == decode.num_pages()
    finally:
        prefill.close()
        decode.close()


def test_layerwise_push_config_is_validated():
    with pytest.raises(ValueError, match="layerwise_push"):
        dataclasses.replace(worker_config("p", "m", "h", "fake"), layerwise_push="yes")
