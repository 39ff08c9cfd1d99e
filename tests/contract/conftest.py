"""Fixtures of the kvtransfer contract suite: every test runs over each backend (`fake`,
`mooncake`, `nixl`). Real backends talk between this process and a spawned worker on 127.0.0.1;
the fake one between this thread and a worker thread over one FakeFabric."""

from __future__ import annotations

import importlib.util
import os

import pytest
from kvt_harness import TEST_ENV
from kvt_runners import LocalDriver, RemoteDriver, ThreadDriver

for _k, _v in TEST_ENV.items():  # before this process creates any Mooncake/NIXL instance
    os.environ.setdefault(_k, _v)

_LIBS = {"fake": None, "mooncake": "mooncake.engine", "nixl": "nixl._api"}


def _available(backend: str) -> bool:
    mod = _LIBS[backend]
    if mod is None:
        return True
    try:
        return importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture(params=list(_LIBS), scope="module")
def backend(request) -> str:
    if not _available(request.param):
        pytest.skip(f"{request.param} is not installed")
    return request.param


class Pair:
    """Creates drivers for one backend: `local()` in this process, `remote()` in a worker."""

    def __init__(self, backend: str, fabric=None):
        from tandem.kvtransfer.backends.fake import FakeFabric

        self.backend = backend
        self.fabric = fabric or (FakeFabric() if backend == "fake" else None)
        self._owned: list = []

    def local(self) -> LocalDriver:
        d = LocalDriver(self.backend, self.fabric)
        self._owned.append(d)
        return d

    def remote(self):
        d = (ThreadDriver(self.backend, self.fabric) if self.backend == "fake"
             else RemoteDriver(self.backend))
        self._owned.append(d)
        return d

    def close(self) -> None:
        for d in reversed(self._owned):
            try:
                d.close()
            except Exception:  # noqa: BLE001 - best-effort teardown of killed/frozen workers
                pass
        self._owned.clear()


@pytest.fixture(scope="module")
def shared(backend):
    """A Pair plus one long-lived remote worker per backend (spawn + NIXL init are the slow
    part); tests that kill or freeze their peer make their own with `pair.remote()`."""
    pair = Pair(backend)
    pair.worker = pair.remote()
    yield pair
    pair.close()


@pytest.fixture
def pair(backend, shared):
    """Per-test drivers (closed at test end), on the shared worker's fabric for `fake`."""
    p = Pair(backend, shared.fabric)
    p.worker = shared.worker
    yield p
    p.close()
