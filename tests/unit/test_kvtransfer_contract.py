"""kvtransfer contract values: state machine, CompatInfo checks, serializable descriptors, wire
messages, error pickling, fault dice, metrics, and the lazy-import rule."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from tandem.kvtransfer import (CompatInfo, Destination, EndpointInfo, ErrorKind,
                               FailureInjection, FaultKind, IllegalTransition, TransferError,
                               TransferState, advance, check_compat, create_backend)
from tandem.kvtransfer.faults import FaultDice
from tandem.kvtransfer.metrics import MetricsRecorder
from tandem.kvtransfer.wire import Message, MsgKind, decode_message

S = TransferState


def _compat(**kw) -> CompatInfo:
    d = dict(model="m", dtype="bfloat16", page_size=16, kv_layout="NHD", tp_size=2, tp_rank=0,
             draft_model="d", draft_hidden_size=576, topk=1, feature_layers=(29,))
    d.update(kw)
    return CompatInfo(**d)


LEGAL = {(S.RESERVED, S.TRANSFERRING), (S.RESERVED, S.FAILED), (S.RESERVED, S.ABORTED),
         (S.TRANSFERRING, S.DONE), (S.TRANSFERRING, S.FAILED), (S.TRANSFERRING, S.ABORTED)}


@pytest.mark.parametrize("a", list(S))
@pytest.mark.parametrize("b", list(S))
def test_state_machine_allows_exactly_the_documented_edges(a, b):
    if (a, b) in LEGAL:
        assert advance(a, b, room=1) is b
    else:
        with pytest.raises(IllegalTransition, match=f"{a.value} -> {b.value}"):
            advance(a, b, room=1)


def test_terminal_states():
    assert {s for s in S if s.terminal} == {S.DONE, S.FAILED, S.ABORTED}


def test_compat_digest_and_field_named_refusal():
    a = _compat()
    assert a.digest() == _compat().digest() and len(a.digest()) == 16
    b = _compat(dtype="float16", topk=4, feature_layers=[2, 15])
    assert a.digest() != b.digest()
    check_compat(a, _compat(), local_role="prefill", remote_role="decode")  # no raise
    with pytest.raises(TransferError) as e:
        check_compat(a, b, local_role="prefill", remote_role="decode")
    assert e.value.kind is ErrorKind.HANDSHAKE
    msg = str(e.value)
    for part in ("dtype: prefill='bfloat16' decode='float16'", "topk: prefill=1 decode=4",
                 "feature_layers: prefill=(29,) decode=(2, 15)"):
        assert part in msg
    assert "model" not in msg.split("request: ")[1]  # only differing fields


def test_draft_kv_layouts_pair_where_they_re_slice():
    """A head sharded over TP on one side and replicated over several ranks on the other has
    no pairing (TANDEM_SHARD_DRAFT set differently): refused naming draft_kv. A side of TP 1
    holds the whole head either way and pairs with both; older peers ("") are not judged."""
    sliced = dict(draft_kv="sliced", num_kv_heads=4)
    with pytest.raises(TransferError, match="draft_kv: prefill='sliced' .*decode='all'"):
        check_compat(_compat(**sliced), _compat(draft_kv="all", num_kv_heads=4),
                     local_role="prefill", remote_role="decode")
    with pytest.raises(TransferError, match="draft_kv: prefill='sliced' .*decode='all'"):
        check_compat(_compat(draft_kv="all", tp_size=4, tp_rank=1, num_kv_heads=4),
                     _compat(**sliced), local_role="decode", remote_role="prefill")
    for other in (_compat(draft_kv="all", tp_size=1, num_kv_heads=4),  # TP 1: whole head
                  _compat(tp_size=4, tp_rank=1, **sliced),  # both sharded: re-sliced
                  _compat(num_kv_heads=4)):  # an older peer
        check_compat(_compat(**sliced), other, local_role="prefill", remote_role="decode")
    check_compat(_compat(draft_kv="all", num_kv_heads=4), _compat(draft_kv="all", num_kv_heads=4,
                                                                   tp_size=1),
                 local_role="prefill", remote_role="decode")


def test_tp_layout_checks():
    with pytest.raises(TransferError, match="tp_rank: prefill=0 decode=1"):
        check_compat(_compat(), _compat(tp_rank=1), local_role="prefill", remote_role="decode")
    # Different TP sizes: allowed exactly when both state num_kv_heads and the heads re-slice.
    with pytest.raises(TransferError, match="tp_size: prefill=2 decode=4.*num_kv_heads"):
        check_compat(_compat(), _compat(tp_size=4, tp_rank=3), local_role="prefill",
                     remote_role="decode")
    check_compat(_compat(num_kv_heads=4), _compat(tp_size=4, tp_rank=3, num_kv_heads=4),
                 local_role="prefill", remote_role="decode")
    with pytest.raises(TransferError, match="tp_size: prefill=2 decode=3.*decode.tp"):
        check_compat(_compat(num_kv_heads=4), _compat(tp_size=3, tp_rank=2, num_kv_heads=4),
                     local_role="prefill", remote_role="decode")
    with pytest.raises(TransferError, match="num_kv_heads: prefill=4 decode=8"):
        check_compat(_compat(num_kv_heads=4), _compat(tp_size=2, num_kv_heads=8),
                     local_role="prefill", remote_role="decode")
    with pytest.raises(TransferError, match="dtype"):  # a real mismatch wins over TP re-slicing
        check_compat(_compat(), _compat(tp_size=4, dtype="fp8"), local_role="prefill",
                     remote_role="decode")
    with pytest.raises(ValueError, match="tp_rank"):
        _compat(tp_rank=2)


def test_descriptors_are_plain_serializable_values():
    d = Destination(receiver_session=2**62, room=2**64 - 1, page_ids=(5, 9, 2), aux_slot=3,
                    timeout_s=2.5)
    assert isinstance(d.encode(), bytes) and Destination.decode(d.encode()) == d
    assert pickle.loads(pickle.dumps(d)) == d
    info = EndpointInfo(backend="nixl", address="QUJD", session=7, role="decode", compat=_compat())
    assert EndpointInfo.decode(info.encode()) == info


def test_transfer_error_survives_pickling():
    e = pickle.loads(pickle.dumps(TransferError(ErrorKind.PEER_DEAD, "gone", room=9)))
    assert (e.kind, e.message, e.room) == (ErrorKind.PEER_DEAD, "gone", 9)
    assert str(e) == "[peer_dead] (room 9) gone"


def test_wire_messages_round_trip_and_reject_garbage():
    m = Message(kind=MsgKind.FINAL, room=2**64 - 1, outcome="done", num_pages=3, nbytes=99)
    assert decode_message(m.encode()) == m
    assert decode_message(m.encode().encode()) == m  # NIXL hands bytes
    assert m.encode().isascii()  # Mooncake notifications must be valid UTF-8 strings
    for bad in ("nope", '{"v": 99, "t": "go"}', '{"v": 1, "t": "warp"}'):
        with pytest.raises(TransferError) as e:
            decode_message(bad)
        assert e.value.kind is ErrorKind.HANDSHAKE


def test_fault_dice_is_deterministic_and_bounded():
    inj = FailureInjection(probability=0.3, kind=FaultKind.CORRUPT_AUX, seed=4)
    a, b = FaultDice(inj), FaultDice(inj)
    draws = [a.draw() for _ in range(200)]
    assert draws == [b.draw() for _ in range(200)]
    assert 30 < sum(d is FaultKind.CORRUPT_AUX for d in draws) < 90
    assert FaultDice(None).draw() is None
    assert all(FaultDice(FailureInjection(probability=1.0, kind=FaultKind.WRONG_ROOM)).draw()
               is FaultKind.WRONG_ROOM for _ in range(5))
    with pytest.raises(ValueError):
        FailureInjection(probability=1.5, kind=FaultKind.DELAY)
    with pytest.raises(ValueError, match="delay_s"):
        FailureInjection(probability=0.5, kind=FaultKind.DELAY)


def test_metrics_snapshot():
    m = MetricsRecorder()
    for i in range(1, 101):
        m.record_done(1_000_000, i / 1000)
    m.record_failure(ErrorKind.TIMEOUT)
    m.record_failure(ErrorKind.TIMEOUT)
    m.record_failure(ErrorKind.CORRUPT)
    snap = m.snapshot()
    assert snap.num_done == 100 and snap.bytes_moved == 100_000_000 and snap.num_failed == 3
    assert snap.latency_p50_s == pytest.approx(0.050, abs=0.002)
    assert snap.latency_p99_s == pytest.approx(0.099, abs=0.002)
    assert snap.gbps == pytest.approx(100e6 / sum(i / 1000 for i in range(1, 101)) / 1e9)
    assert snap.failures_of(ErrorKind.TIMEOUT) == 2 and snap.failures_of(ErrorKind.ABORTED) == 0
    with pytest.raises(AttributeError):
        snap.num_done = 0  # frozen


def test_importing_kvtransfer_loads_no_transfer_library():
    code = ("import sys, tandem.kvtransfer as k; k.create_backend('fake'); "
            "bad = [m for m in ('mooncake', 'nixl', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown 'rdma-magic'"):
        create_backend("rdma-magic")
