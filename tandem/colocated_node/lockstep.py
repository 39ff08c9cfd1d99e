"""A colocated engine over `tp` ranks: rank 0's `LockstepEngine` and the other ranks' `follow`.

A colocated server runs one engine behind its router (`EngineLoop` drives it). With TP the
engine is `tp` engines, one per rank, each holding its share of the heads and columns, that must
run the same steps on the same requests, SPMD as a TP worker's ranks do (worker/group_loop.py).
The `EngineLoop` on rank 0 stays as it is; what it drives is a `LockstepEngine`, which

  - applies each call that changes the engine (`add_request`, `abort`) to rank 0's engine at
    once -- so a refusal raises to the caller as it would on one rank -- and records it;
  - in `step()`, broadcasts the calls recorded since the last step (a `Tick`), then steps rank
    0's engine; each other rank (`follow`) applies the same calls, in order, and steps too.

Every rank thus applies the same calls between the same two steps and issues the same
collectives in the same order. The engines' own generators make their unseeded draws agree
(engine/sampling.py). When the server is idle the loop does not step; rank 0 then sends an empty
tick every `heartbeat_s`, so that the others' wait in the broadcast never reaches the process
group's timeout. Only rank 0's outputs are read: the others compute the same ones.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from tandem.messages import SamplingParams
from tandem.worker.ranks import RankSync

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AddRequest:
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    req_id: str


@dataclass(frozen=True, slots=True)
class Abort:
    req_id: str


@dataclass(frozen=True, slots=True)
class Tick:
    """What rank 0 broadcasts: the calls since the last tick, in order, then a step or not."""

    calls: tuple[AddRequest | Abort, ...]
    step: bool  # False: a heartbeat (idle) or the stop
    stop: bool = False


def _apply(engine, call: AddRequest | Abort) -> None:
    if isinstance(call, AddRequest):
        engine.add_request(list(call.prompt_ids), call.params, call.req_id)
    else:
        engine.abort(call.req_id)


class LockstepEngine:
    """Rank 0's face of a TP engine, for one `EngineLoop` (which owns it). Reads (`stats`,
    `spec`, `allocator`, ...) go to rank 0's engine; the calls that change it are mirrored."""

    def __init__(self, engine, sync: RankSync, heartbeat_s: float = 1.0) -> None:
        if sync.rank != 0:
            raise ValueError("sync: a LockstepEngine runs on rank 0; the others `follow`")
        self.engine, self._sync = engine, sync
        self._lock = threading.Lock()  # guards _calls, _closed and the broadcast order
        self._calls: list[AddRequest | Abort] = []
        self._closed = False
        self.broken = False  # a tick failed: a rank died, the group cannot be torn down
        self._last = time.monotonic()  # when the last tick went out
        self._heartbeat_s = heartbeat_s
        self._stop_beat = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="lockstep-heartbeat",
                                      daemon=True)
        self._beat.start()

    def __getattr__(self, name: str) -> Any:  # reads: rank 0's engine
        return getattr(self.engine, name)

    def add_request(self, prompt_ids, params, req_id: str | None = None) -> str:
        if req_id is None:
            raise ValueError("req_id: a TP colocated engine needs the caller's request id")
        with self._lock:
            out = self.engine.add_request(prompt_ids, params, req_id)  # raises: not recorded
            self._calls.append(AddRequest(tuple(prompt_ids), params, req_id))
            return out

    def abort(self, req_id: str) -> None:
        with self._lock:
            self.engine.abort(req_id)
            self._calls.append(Abort(req_id))

    def step(self):
        with self._lock:
            if self._closed:  # the others left: a step would wait for them forever
                raise RuntimeError("lockstep engine: closed (the other ranks have stopped)")
            self._send(step=True)
            return self.engine.step()

    def close(self) -> None:
        """Stop the other ranks' `follow` (after the loop stopped stepping)."""
        self._stop_beat.set()
        self._beat.join(timeout=5.0)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._send(step=False, stop=True)
            except Exception as exc:  # noqa: BLE001 -- a rank died: nobody left to stop
                log.warning("lockstep engine: the other ranks are gone (%s)", exc)

    def _send(self, step: bool, stop: bool = False) -> None:
        # under _lock
        calls, self._calls = tuple(self._calls), []
        try:
            self._sync.broadcast(Tick(calls, step, stop))
        except BaseException:
            self.broken = True
            raise
        self._last = time.monotonic()

    def _heartbeat(self) -> None:
        while not self._stop_beat.wait(self._heartbeat_s / 4):
            if time.monotonic() - self._last < self._heartbeat_s:
                continue
            with self._lock:
                if self._closed:
                    return
                try:
                    self._send(step=False)
                except Exception:  # a dead peer: the next step fails and reports it
                    log.exception("lockstep heartbeat failed")
                    return


def follow(engine, sync: RankSync) -> None:
    """Ranks 1..tp-1: apply rank 0's calls and step with it until it stops (blocks)."""
    import torch

    with torch.inference_mode():
        while True:
            tick: Tick = sync.broadcast(None)
            for call in tick.calls:
                try:
                    _apply(engine, call)
                except Exception:  # rank 0 applied it: the engines no longer agree
                    log.exception("rank %d: %r failed after rank 0 applied it", sync.rank, call)
                    raise
            if tick.stop:
                return
            if tick.step:
                engine.step()
