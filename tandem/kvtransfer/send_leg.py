"""The records of one prefill-side send: the decode peer it goes to (`DecodePeer`), a write built
ahead of its grant (`BuiltWrite`), a leg's whole state (`SendLeg`), and a room's (`SendRoom`: its
legs and outcome). `PrefillSender` owns them (its table of rooms); `LegWriter` posts a leg's
writes."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tandem.kvtransfer.compat import CompatInfo
from tandem.kvtransfer.contract import Destination, TransferError, TransferState
from tandem.kvtransfer.faults import FaultKind
from tandem.kvtransfer.layout import CopyBatch, KVLayout
from tandem.kvtransfer.reslice import HeadSlice


@dataclass(slots=True)
class DecodePeer:
    """A connected decode endpoint (one per receiver session)."""

    peer_id: str
    session: int
    layout: KVLayout  # the receiver's (base pointers included)
    compat: CompatInfo  # the receiver's (its TP size and rank pick the head slice)
    alive: bool = True


@dataclass(slots=True)
class BuiltWrite:
    """A write built ahead (`backend.prepare_write`) while the room waited for GO."""

    prepared: object  # the backend's unposted write: post_prepared or drop_prepared it, once
    nbytes: int


@dataclass(slots=True)
class SendLeg:
    """One room going to one decode endpoint: one leg per decode rank the room feeds (one
    unless the TP sizes differ). Lives in `PrefillSender` until it retires."""

    room: int
    dest: Destination
    peer: DecodePeer
    runs: np.ndarray  # [R, 3] int64 coalesced (src page, dst page, count), coalesce.page_runs
    num_pages: int  # source pages; they land in dest.page_ids[:num_pages]
    deadline: float  # monotonic s: terminal by then (Destination.timeout_s after start)
    started_at: float  # monotonic s
    fault: FaultKind | None  # injected misbehaviour of this transfer (tests only)
    piece: HeadSlice | None  # heads this leg moves (different TP sizes); None: every head
    state: TransferState = TransferState.RESERVED
    pushed: dict[str, set[int]] = field(default_factory=dict)  # group -> layers queued
    queued: deque[CopyBatch | BuiltWrite] = field(default_factory=deque)  # waiting for GO / DELAY
    # group -> the writes of all its layers, built ahead (LegWriter._build_ahead)
    ready: dict[str, list[BuiltWrite]] = field(default_factory=dict)
    ready_final: tuple[BuiltWrite, int, str] | None = None  # (aux write, staging slot, its FINAL)
    inflight: list[tuple[object, int]] = field(default_factory=list)  # (write handle, bytes)
    post_after: float = 0.0  # monotonic s: writes wait until then (DELAY fault)
    aux_payload: bytes | None = None
    staging_slot: int | None = None
    final_handle: object | None = None  # the aux write carrying FINAL(done)
    final_bytes: int = 0
    final_landed: bool = False  # the aux write completed; DONE once the page writes did too
    kv_bytes: int = 0  # bytes of page writes that completed
    posted_bytes: int = 0  # bytes of page writes posted
    num_data: int = 0  # page writes posted with a DATA notification
    error: TransferError | None = None
    drain_deadline: float = float("inf")  # monotonic s: stop waiting for posted writes
    final_said: bool = False  # decode got (or can no longer get) our final word
    # Terminal, its final word said, nothing of it in flight: it only waits for its siblings
    retired: bool = False


@dataclass(slots=True)
class SendRoom:
    """One room at the sender, from its first leg's start until its last leg retires."""

    legs: list[SendLeg] = field(default_factory=list)  # one per decode endpoint, in start order
    error: TransferError | None = None  # its first leg failure: the room's outcome
    reported: bool = False  # its outcome went out (once every leg was terminal)

