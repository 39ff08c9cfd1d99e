"""Ways to run a kvt_harness.Driver - in this process (`LocalDriver`), in a spawned OS process
(`RemoteDriver`: real kill -9 / SIGSTOP) or on a thread over a FakeFabric (`ThreadDriver`) - and
`Link`, a connected sender/receiver pair whichever side is local."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time

from kvt_harness import TEST_ENV, Driver, LayoutSpec, compat_wire, config_wire


# ---------------------------------------------------------------------------------------------
# Ways to run a Driver


def call_pumping(remote, method: str, *args, pump, timeout: float = 60.0):
    """Call `remote` while stepping the local driver `pump` (which may have to answer it)."""
    remote.submit(method, *args)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pump.step()
        ok, value = remote.try_result(0.0005)
        if ok:
            return value
    raise TimeoutError(f"{method} gave no answer in {timeout}s")


class LocalDriver:
    """In the test process; the test steps it while waiting."""

    def __init__(self, backend: str, fabric=None):
        self.d = Driver(backend, fabric)

    def call(self, method: str, *args, timeout: float = 60.0):
        return getattr(self.d, method)(*args)

    def step(self) -> None:
        self.d.step()

    def close(self) -> None:
        self.d.close()


def _serve(d: Driver, recv, send, stop: threading.Event | None = None,
           paused: threading.Event | None = None) -> None:
    while stop is None or not stop.is_set():
        if paused is not None and paused.is_set():
            time.sleep(0.005)
            continue
        msg = recv()
        if msg is not None:
            method, args = msg
            if method == "exit":
                d.close()
                send(("ok", None))
                return
            try:
                send(("ok", getattr(d, method)(*args)))
            except Exception as e:  # noqa: BLE001 - shipped back to the test
                send(("err", e))
        d.step()


def worker_main(conn, backend: str, env: dict) -> None:
    os.environ.update(env)
    d = Driver(backend)
    conn.send(("ready", os.getpid()))
    _serve(d, lambda: conn.recv() if conn.poll(0.0005) else None, conn.send)


class RemoteDriver:
    """A Driver in a spawned process (real kill -9 / SIGSTOP)."""

    def __init__(self, backend: str, env: dict | None = None, start_timeout: float = 60.0):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        env = {**TEST_ENV, **(env or {})}
        self.proc = ctx.Process(target=worker_main, args=(child, backend, env), daemon=True)
        self.proc.start()
        if not self.conn.poll(start_timeout):
            self.kill()
            raise TimeoutError("worker did not start")
        _, self.pid = self.conn.recv()

    def submit(self, method: str, *args) -> None:
        self.conn.send((method, args))

    def try_result(self, timeout: float = 0.0):
        """(True, value) once the submitted call answered, else (False, None)."""
        if not self.conn.poll(timeout):
            return False, None
        status, value = self.conn.recv()
        if status == "err":
            raise value
        return True, value

    def call(self, method: str, *args, timeout: float = 60.0):
        self.submit(method, *args)
        ok, value = self.try_result(timeout)
        if not ok:
            raise TimeoutError(f"worker {self.pid}: {method} gave no answer in {timeout}s")
        return value

    def step(self) -> None:  # the worker steps itself
        pass

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except Exception:  # noqa: BLE001
                pass
        self.kill()


class ThreadDriver:
    """A Driver on a thread of this process (fake backend): kill/freeze act on the FakeFabric."""

    def __init__(self, backend: str, fabric):
        self.d = Driver(backend, fabric)
        self.fabric = fabric
        self.inq: queue.Queue = queue.Queue()
        self.outq: queue.Queue = queue.Queue()
        self.stop, self.paused = threading.Event(), threading.Event()

        def recv():
            try:
                return self.inq.get(timeout=0.0005)
            except queue.Empty:
                return None

        self.thread = threading.Thread(target=_serve, args=(self.d, recv, self.outq.put, self.stop,
                                                            self.paused), daemon=True)
        self.thread.start()

    def submit(self, method: str, *args) -> None:
        self.inq.put((method, args))

    def try_result(self, timeout: float = 0.0):
        try:
            status, value = self.outq.get(timeout=timeout) if timeout else self.outq.get_nowait()
        except queue.Empty:
            return False, None
        if status == "err":
            raise value
        return True, value

    def call(self, method: str, *args, timeout: float = 60.0):
        self.submit(method, *args)
        ok, value = self.try_result(timeout)
        if not ok:
            raise TimeoutError(f"thread driver: {method} gave no answer in {timeout}s")
        return value

    def step(self) -> None:
        pass

    def _local_id(self) -> str:
        return self.d.ep.backend.local_id

    def kill(self) -> None:
        self.fabric.kill(self._local_id())
        self.stop.set()
        self.thread.join(5)

    def freeze(self) -> None:
        self.fabric.freeze(self._local_id())
        self.paused.set()

    def thaw(self) -> None:
        self.fabric.thaw(self._local_id())
        self.paused.clear()

    def close(self) -> None:
        if self.thread.is_alive():
            try:
                self.call("exit", timeout=10)
            except Exception:  # noqa: BLE001
                pass
        self.stop.set()
        self.thread.join(5)


# ---------------------------------------------------------------------------------------------
# A connected sender/receiver pair, whichever side is local


class Link:
    def __init__(self, sender, receiver):
        self.s, self.r = sender, receiver
        self.locals = [d for d in (sender, receiver) if isinstance(d, LocalDriver)]
        self.log: dict[int, list[tuple]] = {id(sender): [], id(receiver): []}

    def pump(self) -> None:
        for d in self.locals:
            d.step()

    def events(self, drv) -> list[tuple]:
        self.log[id(drv)].extend(drv.call("take_events"))
        return self.log[id(drv)]

    def wait_for(self, drv, pred, timeout: float) -> list[tuple]:
        """Step until some event of `drv` satisfies `pred`; returns the matching events."""
        end = time.monotonic() + timeout
        while True:
            self.pump()
            hits = [e for e in self.events(drv) if pred(e)]
            if hits:
                return hits
            if time.monotonic() > end:
                raise TimeoutError(f"no matching event in {timeout}s; got {self.log[id(drv)]}")
            time.sleep(0.001)

    def wait_state(self, drv, room: int, states: tuple[str, ...], timeout: float) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.pump()
            st = drv.call("state", room)
            if st in states:
                return st
            time.sleep(0.001)
        raise TimeoutError(f"room {room} never reached {states}")

    def call_sender(self, method: str, *args):
        if not isinstance(self.s, LocalDriver) and isinstance(self.r, LocalDriver):
            return call_pumping(self.s, method, *args, pump=self.r)  # the receiver must answer
        return self.s.call(method, *args)


def make_link(sender, receiver, spec: LayoutSpec, *, seed: int = 1, config: dict | None = None,
              sender_compat: dict | None = None, receiver_compat: dict | None = None,
              sender_spec: LayoutSpec | None = None, faults: tuple | None = None,
              ) -> tuple[Link, tuple]:
    """Build both endpoints and connect them. Returns (link, connect result)."""
    cfg = config or config_wire()
    info = receiver.call("make_receiver", spec, receiver_compat or compat_wire(), cfg)
    sender.call("make_sender", sender_spec or spec, sender_compat or compat_wire(), cfg, seed,
                faults)
    link = Link(sender, receiver)
    return link, link.call_sender("connect", info, 30.0)
