"""Routing a request between prefill and decode workers of different TP sizes
(`ranks.route_to_decode`, `launcher.check_kv_reslice`): each prefill rank gets the decode ranks
whose KV heads it holds (the lowest holder sends a replicated head), equal TP keeps rank r ->
rank r, and uneven head splits are refused naming the field."""

from __future__ import annotations

import json

import pytest

from tandem.deploy.config import DeployConfig, GroupConfig
from tandem.deploy.launcher import check_kv_reslice
from tandem.engine.config import ConfigError
from tandem.kvtransfer import CompatInfo, EndpointInfo
from tandem.worker import encode_dp_destination, encode_per_rank, route_to_decode


def _endpoints(role: str, tp: int, num_kv_heads: int) -> bytes:
    infos = [EndpointInfo(backend="fake", address=f"{role}{r}", session=100 + r, role=role,
                          compat=CompatInfo(model="m", dtype="float32", page_size=4,
                                            kv_layout="NHD", tp_size=tp, tp_rank=r,
                                            draft_model="", draft_hidden_size=0, topk=1,
                                            feature_layers=(), num_kv_heads=num_kv_heads))
             for r in range(tp)]
    return encode_per_rank([i.encode() for i in infos])


def _dests(n: int) -> bytes:
    return encode_per_rank([json.dumps({"d": r}).encode() for r in range(n)])


def _ranks(routes) -> list[list[int]]:
    """Decode ranks each prefill rank feeds (read back from the destinations)."""
    out = []
    for r in routes:
        assert len(r.endpoints) == len(r.destinations)
        ds = [json.loads(d)["d"] for d in r.destinations]
        es = [EndpointInfo.decode(e).compat.tp_rank for e in r.endpoints]
        assert ds == es  # endpoint and destination of the same decode rank
        out.append(ds)
    return out


@pytest.mark.parametrize("prefill_tp,decode_tp,hkv,want", [
    (2, 2, 2, [[0], [1]]),  # equal: rank to rank
    (1, 2, 2, [[0, 1]]),  # one prefill rank feeds both decode ranks
    (2, 1, 2, [[0], [0]]),  # both prefill ranks feed the one decode rank
    (4, 2, 2, [[0], [], [1], []]),  # replicas: the lowest holder sends, the others nothing
    (2, 4, 2, [[0, 1], [2, 3]]),
    (1, 4, 8, [[0, 1, 2, 3]]),
])
def test_route_per_prefill_rank(prefill_tp, decode_tp, hkv, want):
    routes = route_to_decode(_endpoints("decode", decode_tp, hkv), _dests(decode_tp), prefill_tp)
    assert _ranks(routes) == want


def test_uneven_split_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"decode\.tp: .*num_key_value_heads 3"):
        route_to_decode(_endpoints("decode", 2, 3), _dests(2), 1)
    with pytest.raises(ValueError, match=r"num_kv_heads"):
        route_to_decode(_endpoints("decode", 2, 0), _dests(2), 1)
    with pytest.raises(ConfigError, match=r"prefill\.tp: .*num_key_value_heads 3"):
        check_kv_reslice(_endpoints("prefill", 2, 3), _endpoints("decode", 1, 3))
    check_kv_reslice(_endpoints("prefill", 2, 2), _endpoints("decode", 1, 2))
    check_kv_reslice(_endpoints("prefill", 1, 2), _endpoints("decode", 2, 2))
    check_kv_reslice(_endpoints("prefill", 3, 3), _endpoints("decode", 3, 3))  # equal: no check


def test_dp_routes_to_the_taking_rank():
    endpoints = _endpoints("decode", 1, 2)  # a DP rank's compat says tp 1
    blob = encode_per_rank([json.loads(endpoints)[0].encode()] * 2)
    (route,) = route_to_decode(blob, encode_dp_destination(1, [b'{"d": 1}']), 1)
    assert route.destinations == (b'{"d": 1}',)
    with pytest.raises(ValueError, match="DP rank 2"):
        route_to_decode(blob, encode_dp_destination(2, [b'{"d": 1}']), 1)


def test_config_allows_unequal_tp_also_with_decode_dp():
    cfg = DeployConfig(prefill=GroupConfig(tp=2), decode=GroupConfig(tp=1))
    assert (cfg.prefill.tp, cfg.decode.tp) == (2, 1)
    DeployConfig(prefill=GroupConfig(tp=1), decode=GroupConfig(tp=2))
    # Each DP rank re-slices like a worker of its tp (integration/test_ray_dp_tp.py).
    DeployConfig(prefill=GroupConfig(tp=2), decode=GroupConfig(dp=2))
    DeployConfig(prefill=GroupConfig(tp=1), decode=GroupConfig(dp=2, tp=2))
