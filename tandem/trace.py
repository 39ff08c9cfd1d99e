"""Request timelines for latency work: where a request's time to first token goes.

Off unless the environment names a file: with `TANDEM_TRACE=/path/trace.jsonl` every process of a
deployment (router, prefill and decode actors, which get the variable through their Ray
runtime_env: deploy/launcher.actor_runtime_env) appends one JSON line per mark,
`{"room": int, "stage": str, "t": wall-clock seconds}`. Lines are short single `write`s to a
file opened with O_APPEND, so processes on one host do not interleave. Wall clocks of different
hosts differ: read a multi-node trace per host.

`stage_report(path)` turns a trace into the median time of each stage after the room's first
mark (the router's `router.submit`), in order: `tandem bench --trace` prints it per deployment.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

log = logging.getLogger(__name__)
ENV = "TANDEM_TRACE"
_file = None  # this process's open trace file (None: not opened yet or tracing off)
_path: str | None = None


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def env_vars() -> dict[str, str]:
    """The environment a process started from this one needs to trace too."""
    path = os.environ.get(ENV)
    return {ENV: path} if path else {}


def mark(room: int, stage: str) -> None:
    """Record that `room` reached `stage` now (a no-op unless TANDEM_TRACE is set)."""
    path = os.environ.get(ENV)
    if not path:
        return
    global _file, _path
    try:
        if _file is None or _path != path:
            _path = path
            _file = open(path, "a", buffering=1)  # line-buffered: one write per mark
        _file.write(json.dumps({"room": int(room), "stage": stage, "t": time.time()}) + "\n")
    except OSError as exc:  # tracing must never fail a request: stop tracing in this process
        log.warning("request trace off in this process: cannot write %s (%s)", path, exc)
        os.environ.pop(ENV, None)


def read(path: str | Path) -> dict[int, dict[str, float]]:
    """room -> stage -> first time it was marked."""
    rooms: dict[int, dict[str, float]] = defaultdict(dict)
    for line in Path(path).read_text().splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a killed process
            continue
        rooms[m["room"]].setdefault(m["stage"], m["t"])
    return dict(rooms)


def stage_report(path: str | Path, start: str = "router.submit", skip: int = 0,
                 window: tuple[float, float] | None = None) -> list[tuple[str, float, int]]:
    """(stage, median ms after `start`, rooms that reached it), ordered by the median. Rooms
    without `start` are left out, so are those that started outside `window` (wall-clock
    seconds) and the first `skip` rooms by start time (warm-up)."""
    rooms = sorted((r for r in read(path).values() if start in r
                    and (window is None or window[0] <= r[start] <= window[1])),
                   key=lambda r: r[start])
    after: dict[str, list[float]] = defaultdict(list)
    for r in rooms[skip:]:
        for stage, t in r.items():
            after[stage].append((t - r[start]) * 1e3)
    rows = [(stage, statistics.median(v), len(v)) for stage, v in after.items()]
    return sorted(rows, key=lambda row: row[1])


def format_report(rows: list[tuple[str, float, int]]) -> str:
    lines, prev = [], 0.0
    for stage, ms, n in rows:
        lines.append(f"  {stage:<22} {ms:9.2f} ms  (+{ms - prev:7.2f})  n={n}")
        prev = ms
    return "\n".join(lines)
