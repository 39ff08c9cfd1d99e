"""Deployment YAML: the bundled configs parse; bad keys and values are refused with a message
naming the key."""

from __future__ import annotations

import pytest

from tandem.deploy.config import BUNDLED, load_deploy, parse_deploy
from tandem.engine.config import ConfigError


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_configs_parse(name):
    cfg = load_deploy(name)
    assert cfg.prefill.replicas >= 1 and cfg.decode.replicas >= 1
    assert cfg.transfer_backend in ("mooncake", "nixl")


@pytest.mark.parametrize("raw,needle", [
    ({"transfer_backend": "carrier-pigeon"}, "transfer_backend"),
    ({"prefil": {"replicas": 1}}, "prefil: unknown key"),
    ({"prefill": {"replicas": 0}}, "replicas"),
    ({"decode": {"gpus": 1}}, "decode.gpus: unknown key"),
    ({"engine": {"dtype": "int4"}}, "engine.dtype"),
    ({"engine": {"page_size": 0}}, "page_size"),
    ({"spec": {"num_steps": 0}}, "spec.num_steps"),
    ({"spec": {"topk": 2, "num_draft_tokens": 99}}, "num_draft_tokens"),
    ({"engine": "bf16"}, "engine: expected a mapping"),
    ({"prefill": {"layerwise_push": "yes"}}, "prefill.*layerwise_push: must be true or false"),
    ({"decode": {"layerwise_push": True}}, "decode.layerwise_push: a prefill-side option"),
])
def test_bad_config_names_the_key(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_deploy(raw)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_deploy(tmp_path / "nope.yaml")


def test_layerwise_push_reaches_the_prefill_worker_config():
    cfg = parse_deploy({"prefill": {"layerwise_push": True}})
    assert cfg.prefill.layerwise_push and not cfg.decode.layerwise_push
