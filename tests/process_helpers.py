"""What the tests that start `tandem serve` in a process of its own share: reading its output
until the line that names its port."""

from __future__ import annotations

import re
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
