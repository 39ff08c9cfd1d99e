"""Where a transfer endpoint listens: only on the address it advertises.

The advertised host (`BackendOptions.host`, `default_host()` unless given) is `$TANDEM_KV_HOST`
if set - `init_ray` sets 127.0.0.1 for the workers of a local Ray instance it starts - else,
inside a Ray actor, the Ray node's IP, else 127.0.0.1. The libraries are then held to it:

- Mooncake (0.3.x, P2PHANDSHAKE + tcp) binds its handshake listener to INADDR_ANY (`0.0.0.0`)
  and its TCP data listener to the dual-stack wildcard (`*`), whatever `initialize(host, ...)`
  was told; no environment variable changes that (MC_TCP_BIND_ADDRESS only picks the address
  published in metadata-server mode). Two layers hold it to the advertised address:
  1. in worker processes, which Ray starts with the bind() shim preloaded (bindshim.c,
     bindshim.py), `listeners_on(host)` switches the shim on while `initialize` runs: its
     listeners bind `host` itself (`127.0.0.1:port`, `[::ffff:127.0.0.1]:port`);
  2. `confine_new_listeners` then finds the listeners that appeared during `initialize`, and
     any still on the wildcard (no shim in this process: tests, a driver, a node without a
     compiler) gets a socket filter that drops packets not addressed to `host` (sockfilter.py).
- NIXL's UCX plugin: the `tcp` transport listens on the address of every network device UCX
  uses (`UCX_NET_DEVICES`, default all), so with the default devices it is reachable on every
  interface. `ucx_devices_for(host)` restricts the devices to the interface that carries the
  advertised address (plus the RDMA devices, whose access needs keys only the metadata carries;
  none for a loopback host) while the agent is created. NIXL's own metadata listener is off
  unless `enable_listen_thread` is set, which tandem never does.

`TANDEM_KV_LISTEN_ANY=1` turns both restrictions off (e.g. when peers reach this node through a
NAT at an address no local interface carries). A `UCX_NET_DEVICES` already in the environment
is left as the user set it.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tandem.kvtransfer.sockfilter import IPAddress, attach_destination_filter

log = logging.getLogger(__name__)

KV_HOST_ENV = "TANDEM_KV_HOST"
LISTEN_ANY_ENV = "TANDEM_KV_LISTEN_ANY"
BIND_HOST_ENV = "TANDEM_BIND_HOST"  # read by the bind() shim (bindshim.c)
_TCP_LISTEN = "0A"  # state column of /proc/net/tcp*
_SIOCGIFADDR = 0x8915
_SIOCGIFFLAGS = 0x8913
_IFF_LOOPBACK = 0x8
_ENV_LOCK = threading.Lock()


def default_host() -> str:
    """The address this process's transfer endpoints advertise (see the module doc)."""
    env = os.environ.get(KV_HOST_ENV, "").strip()
    if env:
        return env
    ray = sys.modules.get("ray")  # only if Ray is already loaded: kvtransfer never imports it
    if ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def listen_any() -> bool:
    return os.environ.get(LISTEN_ANY_ENV, "").strip().lower() in ("1", "true", "yes")


def resolve(host: str) -> list[IPAddress]:
    """Every IP `host` (an address or a name) stands for."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        return sorted({ipaddress.ip_address(info[4][0]) for info in infos}, key=str)


@contextlib.contextmanager
def listeners_on(host: str) -> Iterator[str | None]:
    """Within the block, a TCP listener this process binds to the wildcard address binds `host`
    (its first IPv4 address, else its first address) instead - where the bind() shim is
    preloaded (bindshim.c); elsewhere this does nothing and `confine_new_listeners` filters.
    Yields the address the shim was given (None: turned off by TANDEM_KV_LISTEN_ANY)."""
    if listen_any():
        yield None
        return
    ips = resolve(host)
    ip = str(next((ip for ip in ips if ip.version == 4), ips[0]))
    with _ENV_LOCK:
        previous = os.environ.get(BIND_HOST_ENV)
        os.environ[BIND_HOST_ENV] = ip  # putenv: the shim's getenv() sees it
        try:
            yield ip
        finally:
            if previous is None:
                os.environ.pop(BIND_HOST_ENV, None)
            else:
                os.environ[BIND_HOST_ENV] = previous


# -- listening sockets of this process -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Listener:
    fd: int
    ip: IPAddress
    port: int

    @property
    def wildcard(self) -> bool:
        return self.ip.is_unspecified


def _proc_addr(hex_addr: str) -> tuple[IPAddress, int]:
    """/proc/net/tcp{,6} "ADDR:PORT": the address as 32-bit words in host byte order."""
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw), int(port, 16)


def tcp_listeners() -> dict[int, Listener]:
    """This process's listening TCP sockets by file descriptor (from /proc)."""
    inode_fd: dict[str, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inode_fd[target[8:-1]] = int(name)
    out: dict[int, Listener] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):  # no IPv6 in this kernel
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == _TCP_LISTEN and cols[9] in inode_fd:
                    ip, port = _proc_addr(cols[1])
                    fd = inode_fd[cols[9]]
                    out[fd] = Listener(fd=fd, ip=ip, port=port)
    return out


def confine_new_listeners(before: dict[int, Listener], host: str, must_include: int
                          ) -> list[Listener]:
    """Filter every wildcard listener that appeared since `before` (a `tcp_listeners()` taken
    just before the library created its sockets) to `host`. `must_include` is a port the
    library reported: if no new listener has it, the sockets were not found and nothing can
    be promised - raises RuntimeError rather than run open. Returns the filtered listeners.
    A wildcard listener another thread of this process opened meanwhile would be filtered too;
    in a worker nothing else opens listeners while its endpoint starts (the process group of a
    multi-rank worker is up before its endpoint is built)."""
    new = [lst for fd, lst in tcp_listeners().items() if before.get(fd) != lst]
    if not any(lst.port == must_include for lst in new):
        raise RuntimeError(f"no new listener on port {must_include} among {new}")
    allowed = resolve(host)
    confined = [lst for lst in new if lst.wildcard]
    for lst in confined:
        attach_destination_filter(lst.fd, allowed)
    log.debug("listeners %s accept connections to %s only", confined, host)
    return confined


# -- UCX network devices ---------------------------------------------------------------------------
def _ifreq(sock: socket.socket, request: int, name: str) -> bytes:
    return fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))


def interface_of(ip: IPAddress) -> str | None:
    """The network interface carrying `ip` (loopback addresses: the loopback interface)."""
    names = [name for _, name in socket.if_nameindex()]
    if ip.version == 6:
        if ip.is_loopback:
            ip = ipaddress.ip_address("127.0.0.1")
        else:  # /proc/net/if_inet6: "<32 hex address> <index> <plen> <scope> <flags> <name>"
            with contextlib.suppress(FileNotFoundError):
                for line in Path("/proc/net/if_inet6").read_text().splitlines():
                    cols = line.split()
                    if ipaddress.ip_address(bytes.fromhex(cols[0])) == ip:
                        return cols[5]
            return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                if ip.is_loopback:
                    flags = struct.unpack_from("H", _ifreq(s, _SIOCGIFFLAGS, name), 16)[0]
                    if flags & _IFF_LOOPBACK:
                        return name
                elif ipaddress.ip_address(_ifreq(s, _SIOCGIFADDR, name)[20:24]) == ip:
                    return name
            except OSError:  # no IPv4 address on this interface
                continue
    return None


def rdma_devices() -> list[str]:
    """UCX names ("mlx5_0:1") of this machine's RDMA ports."""
    root = Path("/sys/class/infiniband")
    if not root.is_dir():
        return []
    return [f"{dev.name}:{port.name}" for dev in sorted(root.iterdir())
            for port in sorted((dev / "ports").iterdir()) if port.name.isdigit()]


def ucx_net_devices(host: str) -> str | None:
    """The UCX_NET_DEVICES value that keeps UCX's TCP listeners on `host`'s interface, or None
    if no local interface carries `host` (then UCX keeps its default)."""
    ips = resolve(host)
    names = [n for n in (interface_of(ip) for ip in ips) if n]
    if not names:
        return None
    if all(ip.is_loopback for ip in ips):
        return ",".join(dict.fromkeys(names))
    return ",".join(dict.fromkeys([*names, *rdma_devices()]))


@contextlib.contextmanager
def ucx_devices_for(host: str) -> Iterator[str | None]:
    """Within the block (which creates the UCX context: UCX reads its environment then),
    UCX_NET_DEVICES is the interface of `host`; restored afterwards. Yields the value used."""
    if listen_any() or "UCX_NET_DEVICES" in os.environ:
        yield os.environ.get("UCX_NET_DEVICES")
        return
    devices = ucx_net_devices(host)
    if devices is None:
        log.warning("no local interface carries %s: UCX listens on every interface (set "
                    "UCX_NET_DEVICES to choose)", host)
        yield None
        return
    with _ENV_LOCK:  # two agents created at once in one process must not mix their devices
        os.environ["UCX_NET_DEVICES"] = devices
        try:
            yield devices
        finally:
            os.environ.pop("UCX_NET_DEVICES", None)
