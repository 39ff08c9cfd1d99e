"""The bind() shim (bindshim.c): built once per machine, preloaded into tandem's worker processes,
switched on by `TANDEM_BIND_HOST` (bind.BIND_HOST_ENV) while a transfer library opens its
listeners (bind.listeners_on).

Built into `$TANDEM_CACHE/bindshim/` (default `~/.cache/tandem/bindshim/`, the cache root the
engine uses too) under a name carrying the source's hash, with the machine's C compiler (`$CC`,
else `cc`). `init_ray` builds it and puts it in LD_PRELOAD of the job's workers; on a cluster
the other nodes need the same file at the same path: the `ray up` YAMLs build it on every node
with `python -m tandem.kvtransfer.bindshim`. A worker where it is missing (ld.so ignores a
missing preload with a warning) or where no compiler was found falls back to the socket filter
(sockfilter.py), so a missing shim weakens nothing but the address the kernel shows.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bindshim.c")
_PREFIX = "tandem-bindshim-"


def cache_dir() -> Path:
    """`$TANDEM_CACHE/bindshim`, else `~/.cache/tandem/bindshim` (kvtransfer does not import
    the engine, whose cache_root.py says the same)."""
    env = os.environ.get("TANDEM_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "tandem"
    return root / "bindshim"


def shim_path() -> Path:
    """Where this source's build lives (whether built or not)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return cache_dir() / f"{_PREFIX}{digest}.so"


def build() -> Path | None:
    """The built shim, compiling it first if needed; None (with a warning) when this machine
    cannot build it."""
    out = shim_path()
    if out.is_file():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler (cc, gcc or $CC): transfer listeners bind the wildcard "
                    "address and are held to their host by a socket filter instead")
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: workers on this machine may be reading it already.
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
        pass
    try:
        try:
            proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp.name, str(SOURCE),
                                   "-ldl"], capture_output=True, text=True, timeout=120)
            failure = proc.stderr[-2000:] if proc.returncode != 0 else None
        except (OSError, subprocess.TimeoutExpired) as e:
            failure = str(e)
        if failure is not None:
            log.warning("building %s with %s failed: transfer listeners fall back to a socket "
                        "filter\n%s", SOURCE.name, cc, failure)
            return None
        os.replace(tmp.name, out)
    finally:
        if os.path.exists(tmp.name):
            os.unlink(tmp.name)
    log.info("built the bind shim: %s", out)
    return out


def preload_value(path: Path) -> str:
    """LD_PRELOAD for a Ray runtime_env: the shim, then whatever the worker's environment
    preloads already (Ray expands `${LD_PRELOAD}` when it starts the worker)."""
    return f"{path} ${{LD_PRELOAD}}"


def preloaded() -> bool:
    """Whether this process runs with the shim loaded."""
    try:
        with open("/proc/self/maps") as maps:
            return any(_PREFIX in line for line in maps)
    except OSError:
        return False


def main() -> int:
    """`python -m tandem.kvtransfer.bindshim`: build the shim (e.g. on every node of a cluster)
    and print its path."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = build()
    if path is None:
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
