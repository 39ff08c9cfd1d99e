"""What the tests that start `tandem serve` in a process of its own share: reading its output
until the line that names its port, stopping it with SIGTERM (it must exit 0), and killing one
a failed test left running."""

from __future__ import annotations

import re
import signal
import subprocess
import time


def wait_for_line(proc: subprocess.Popen, pattern: str,
                  timeout_s: float) -> tuple[re.Match, list[str]]:
    """Read `proc`'s text stdout line by line until one matches `pattern`; that match and every
    line read (the last one matched). Fails, with the output so far, when the process exits
    first or no line matched within `timeout_s` (checked after each line: a silent process
    blocks the read)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "tandem serve exited:\n" + "".join(lines)
        assert time.monotonic() < deadline, "tandem serve did not come up:\n" + "".join(lines)
        lines.append(line)
        m = re.search(pattern, line)
        if m:
            return m, lines


def stop_cleanly(proc: subprocess.Popen, lines: list[str], timeout_s: float = 30.0) -> None:
    """SIGTERM `proc`; it must exit with status 0 within `timeout_s` (the failure shows `lines`,
    the output read so far, and the rest of it)."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout_s) == 0, "".join(lines) + proc.stdout.read()


def reap(proc: subprocess.Popen) -> None:
    """For a `finally`: kill `proc` if it still runs (a test failed before stopping it)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
