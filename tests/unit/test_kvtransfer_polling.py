"""The wait loops' sleep schedule (endpoint.poll_pause_s / PollBackoff) and the per-role NIXL
progress thread default. Latency guard without timing anything: a fixed >= 1 ms sleep quantum on
the grant/completion path cost every transfer ~1.1 ms on 2xH200 (2026-11-26b); these tests fail
if a schedule like that comes back, on a simulated clock, so load cannot make them flaky."""

from __future__ import annotations

import ctypes

import pytest

from tandem.kvtransfer import (AuxRegion, BackendOptions, CompatInfo, DecodeReceiver,
                               EndpointConfig, ErrorKind, KVLayout, KVRegion, PollBackoff,
                               PrefillSender, TransferError, poll_pause_s)
from tandem.kvtransfer import endpoint as endpoint_mod
from tandem.kvtransfer.backends.fake import FakeFabric
from tandem.kvtransfer.endpoint import BACKOFF_FRACTION, options_for_role

DEFAULT = EndpointConfig()
SLACK_S = 60e-6  # what Linux adds to every non-zero sleep (timer slack ~50 us) + a poll


class SimClock:
    """perf_counter + sleep on simulated time: a poll costs `poll_s`, a sleep its length plus
    the kernel's slack. Records every sleep asked for."""

    def __init__(self, poll_s: float = 5e-6):
        self.t, self.poll_s, self.sleeps = 0.0, poll_s, []

    def perf_counter(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += self.poll_s + (s + SLACK_S if s > 0 else 0.0)


def _seen_at(event_s: float, config: EndpointConfig = DEFAULT) -> tuple[float, int]:
    """(simulated time a PollBackoff loop notices an event at `event_s`, polls made)."""
    clock = SimClock()
    backoff = PollBackoff(config, clock=clock.perf_counter, sleep=clock.sleep)
    polls = 0
    while True:
        polls += 1
        if clock.t >= event_s:
            return clock.t, polls
        backoff.pause()


def test_schedule_spins_then_backs_off_below_one_ms():
    waited = [i * 10e-6 for i in range(5000)]  # the first 50 ms of a wait, 10 us apart
    pauses = [poll_pause_s(w, DEFAULT) for w in waited]
    assert all(p == 0.0 for w, p in zip(waited, pauses) if w < DEFAULT.spin_s)
    assert max(pauses) < 1e-3, "a wait loop must never sleep a 1 ms quantum"
    assert pauses == sorted(pauses), "the schedule only backs off"
    # After the spin: a fixed fraction of the time waited, within [min, cap].
    for w, p in zip(waited, pauses):
        if w >= DEFAULT.spin_s:
            assert DEFAULT.poll_min_sleep_s <= p <= DEFAULT.poll_sleep_s
            assert p <= max(DEFAULT.poll_min_sleep_s, w * BACKOFF_FRACTION) + 1e-12


@pytest.mark.parametrize("event_ms", [0.02, 0.3, 0.9, 1.2, 2.0, 3.5, 8.0])
def test_an_event_is_noticed_promptly(event_ms):
    """Transfers of 16 MiB-1 GiB over NVLink take 0.05-3.5 ms: each must be seen within a small
    fraction of that, never a fixed ~1 ms later."""
    event_s = event_ms * 1e-3
    seen, _ = _seen_at(event_s)
    late = seen - event_s
    assert late < 1e-3
    assert late <= event_s * BACKOFF_FRACTION + DEFAULT.poll_min_sleep_s + SLACK_S + 10e-6


def test_a_long_wait_does_not_burn_a_core():
    seen, polls = _seen_at(1.0)  # a grant that takes a second (prefill queue)
    spin_polls = DEFAULT.spin_s / 5e-6
    assert polls < spin_polls + 1.0 / DEFAULT.poll_sleep_s * 1.1  # capped sleeps, no spinning
    assert seen - 1.0 < DEFAULT.poll_sleep_s + SLACK_S + 10e-6


def test_reset_goes_back_to_spinning():
    clock = SimClock()
    backoff = PollBackoff(DEFAULT, clock=clock.perf_counter, sleep=clock.sleep)
    clock.t = 0.1
    assert backoff.pause() == DEFAULT.poll_sleep_s
    backoff.reset()
    assert backoff.pause() == 0.0


def test_config_rejects_a_minimum_above_the_cap():
    with pytest.raises(ValueError, match="poll_min_sleep_s"):
        EndpointConfig(poll_min_sleep_s=0.002, poll_sleep_s=0.001)


def _layout():
    kv = ctypes.create_string_buffer(2 * 8 * 64)
    aux = ctypes.create_string_buffer(2 * 128)
    layout = KVLayout(regions=(KVRegion(name="target", base_ptr=ctypes.addressof(kv),
                                        num_layers=2, num_pages=8, page_bytes=64),),
                      aux=AuxRegion(base_ptr=ctypes.addressof(aux), num_slots=2, slot_bytes=128))
    return layout, (kv, aux)


def test_endpoint_waits_follow_the_schedule(monkeypatch):
    """The endpoints' own wait loop (here: a handshake nobody answers) sleeps per the schedule."""
    clock = SimClock()
    monkeypatch.setattr(endpoint_mod, "time", clock)
    compat = CompatInfo(model="m", dtype="bf16", page_size=16, kv_layout="NHD", tp_size=1,
                        tp_rank=0, draft_model="d", draft_hidden_size=64, topk=1,
                        feature_layers=(3,))
    opts = BackendOptions(fabric=FakeFabric())
    (rl, _rkeep), (sl, _skeep) = _layout(), _layout()  # _keep: buffers stay alive
    rx = DecodeReceiver("fake", rl, compat, release=lambda r: None, config=DEFAULT, options=opts,
                        clock=clock.monotonic)
    tx = PrefillSender("fake", sl, compat, config=DEFAULT, options=opts, clock=clock.monotonic)
    with pytest.raises(TransferError) as e:
        tx.connect(rx.info(), timeout_s=0.05)  # rx is never polled: no WELCOME
    assert e.value.kind is ErrorKind.TIMEOUT
    assert clock.sleeps and max(clock.sleeps) < 1e-3
    assert clock.sleeps[0] == 0.0  # spins first
    assert len(clock.sleeps) < DEFAULT.spin_s / clock.poll_s + 0.05 / DEFAULT.poll_min_sleep_s
    monkeypatch.undo()
    tx.close()
    rx.close()


def test_nixl_progress_thread_defaults_by_role():
    assert options_for_role(None, "decode").nixl_progress_thread is True
    assert options_for_role(None, "prefill").nixl_progress_thread is False
    forced = BackendOptions(nixl_progress_thread=False)
    assert options_for_role(forced, "decode").nixl_progress_thread is False
    assert options_for_role(BackendOptions(nixl_progress_thread=True),
                            "prefill").nixl_progress_thread is True
