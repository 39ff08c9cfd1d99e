"""What a deployment asks of the cluster, checked before anything is placed
(tandem/deploy/resources.py): refused at once, with the resource, the numbers and the config
field to change, whenever it cannot fit - in total, a worker's ranks on one node, or all of them
together; and it fits whenever a placement exists."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.deploy.config import DeployConfig, GroupConfig, PlacementConfig, parse_deploy
from tandem.deploy.resources import (Need, PlacementError, check_fits, deployment_needs,
                                     group_bundle)
from tandem.engine.config import ConfigError


def cfg(prefill: dict | None = None, decode: dict | None = None) -> DeployConfig:
    return DeployConfig(prefill=GroupConfig(**(prefill or {})),
                        decode=GroupConfig(**(decode or {})))


def test_needs_name_every_worker_with_its_ranks():
    needs = deployment_needs(cfg(prefill={"replicas": 2}, decode={"tp": 2, "num_gpus": 1,
                                                                  "resources": {"big": 1}}))
    assert [(n.who, n.ranks) for n in needs] == [("prefill-0", 1), ("prefill-1", 1),
                                                 ("decode-0", 2)]
    assert needs[2].bundle == {"CPU": 1.0, "GPU": 1, "big": 1}
    assert needs[2].gang() == {"CPU": 2.0, "GPU": 2, "big": 2}
    assert group_bundle(GroupConfig(num_cpus=0.5)) == {"CPU": 0.5}  # no GPU key without GPUs


def test_the_2_cpu_head_holds_the_disaggregated_cpu_bench():
    """The case that hung: 1 + 1 CPU workers on a 2-CPU node (the router actor asks none)."""
    check_fits(deployment_needs(cfg()), [{"CPU": 2.0, "memory": 1e9}])


def test_too_few_cpus_in_all_names_the_fields_and_the_numbers():
    with pytest.raises(PlacementError) as err:
        check_fits(deployment_needs(cfg(decode={"num_cpus": 2})), [{"CPU": 2.0}])
    msg = str(err.value)
    assert "needs 3 CPU in all (prefill-0 1, decode-0 2)" in msg
    assert "the cluster has 2 (2 on 1 node(s))" in msg
    assert msg.startswith("prefill.num_cpus / decode.num_cpus")


def test_a_missing_gpu_or_custom_resource_is_named():
    with pytest.raises(PlacementError, match=r"decode.num_gpus: .*needs 1 GPU in all .*has 0"):
        check_fits(deployment_needs(cfg(decode={"num_gpus": 1})), [{"CPU": 8.0}])
    with pytest.raises(PlacementError, match=r"prefill.resources.pinned: .*1 pinned"):
        check_fits(deployment_needs(cfg(prefill={"resources": {"pinned": 1}})), [{"CPU": 8.0}])


def test_a_worker_s_ranks_must_share_one_node():
    two_nodes = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 2.0}]
    with pytest.raises(PlacementError) as err:  # 4 GPUs in all, but 2 per node
        check_fits(deployment_needs(cfg(prefill={"num_gpus": 0, "num_cpus": 0.5},
                                        decode={"tp": 4, "num_gpus": 1})), two_nodes)
    msg = str(err.value)
    assert msg.startswith("decode.num_gpus: decode-0 needs 4 GPU on one node (4 rank(s) x 1")
    assert "largest node has 2" in msg and "decode.tp/dp" in msg


def test_workers_that_fit_the_totals_but_not_the_nodes_together():
    # 3 workers of 2 GPUs on two 3-GPU nodes: 6 <= 6, each fits a node, no packing exists.
    needs = deployment_needs(cfg(prefill={"replicas": 1, "tp": 2, "num_gpus": 1},
                                 decode={"replicas": 2, "tp": 2, "num_gpus": 1}))
    with pytest.raises(PlacementError, match="fit the cluster's totals but not its nodes"):
        check_fits(needs, [{"CPU": 8.0, "GPU": 3.0}, {"CPU": 8.0, "GPU": 3.0}])
    check_fits(needs, [{"CPU": 8.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 2.0}])  # packs


def test_prefill_and_decode_pinned_to_different_nodes():
    needs = deployment_needs(cfg(prefill={"resources": {"p": 1}}, decode={"resources": {"d": 1}}))
    check_fits(needs, [{"CPU": 1.0, "p": 1.0}, {"CPU": 1.0, "d": 1.0}])
    with pytest.raises(PlacementError):
        check_fits(needs, [{"CPU": 1.0, "p": 1.0, "d": 1.0}, {"CPU": 1.0}])


def test_no_alive_node():
    with pytest.raises(PlacementError, match="no alive node"):
        check_fits([Need(who="x", role="decode", bundle={"CPU": 1.0})], [])


def test_placement_is_a_config_section_and_its_errors_are_config_errors():
    parsed = parse_deploy({"placement": {"check": False, "timeout_s": 120}})
    assert parsed.placement == PlacementConfig(check=False, timeout_s=120)
    assert parse_deploy({}).placement.timeout_s == 30.0
    with pytest.raises(ConfigError, match="placement.timeout_s"):
        parse_deploy({"placement": {"timeout_s": 0}})
    with pytest.raises(ConfigError, match="placement.wait"):
        parse_deploy({"placement": {"wait": 1}})
    assert issubclass(PlacementError, ConfigError)
    assert dataclasses.replace(parsed, placement=PlacementConfig()).placement.check
