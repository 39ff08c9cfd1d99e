"""Transfer listeners held to the advertised address (tandem/kvtransfer/bind.py, sockfilter.py),
on plain sockets: a wildcard listener filtered to one address accepts connections to it only
(IPv4 and dual-stack IPv6 sockets), passes whole payloads, and the UCX device choice follows the
host. The real libraries: tests/integration/test_bound_addresses.py."""

from __future__ import annotations

import ipaddress
import os
import socket
import threading

import pytest

from net_probe import other_local_ipv4, reaches
from tandem.kvtransfer import bind
from tandem.kvtransfer.sockfilter import attach_destination_filter, destination_filter

OTHER = other_local_ipv4()
needs_other = pytest.mark.skipif(OTHER is None, reason="no non-loopback IPv4 address here")


def listener(family: int, addr: str) -> socket.socket:
    s = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual-stack, as Mooncake's
    s.bind((addr, 0))
    s.listen(16)
    return s


@needs_other
@pytest.mark.parametrize("family,wild", [(socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")])
def test_a_filtered_wildcard_listener_accepts_its_address_only(family, wild):
    s = listener(family, wild)
    port = s.getsockname()[1]
    try:
        assert reaches("127.0.0.1", port) and reaches(OTHER, port)  # open before
        attach_destination_filter(s.fileno(), [ipaddress.ip_address("127.0.0.1")])
        assert reaches("127.0.0.1", port)
        assert not reaches(OTHER, port)
        if family == socket.AF_INET6:
            assert not reaches("::1", port)  # an IPv6 destination that is not allowed
    finally:
        s.close()


@needs_other
def test_a_filter_to_the_node_address_shuts_loopback_out():
    s = listener(socket.AF_INET, "0.0.0.0")
    port = s.getsockname()[1]
    try:
        attach_destination_filter(s.fileno(), [ipaddress.ip_address(OTHER)])
        assert reaches(OTHER, port) and not reaches("127.0.0.1", port)
    finally:
        s.close()


def test_ipv6_destinations_are_compared_whole():
    s = listener(socket.AF_INET6, "::")
    port = s.getsockname()[1]
    try:
        attach_destination_filter(s.fileno(), [ipaddress.ip_address("::1")])
        assert reaches("::1", port) and not reaches("127.0.0.1", port)
    finally:
        s.close()


def test_accepted_connections_carry_whole_payloads():
    """The filter keeps every byte of a packet (a small accept value would truncate TCP data)."""
    s = listener(socket.AF_INET, "0.0.0.0")
    attach_destination_filter(s.fileno(), [ipaddress.ip_address("127.0.0.1")])
    payload = os.urandom(1 << 20)
    got = bytearray()

    def serve():
        conn, _ = s.accept()
        with conn:
            while chunk := conn.recv(1 << 16):
                got.extend(chunk)

    t = threading.Thread(target=serve)
    t.start()
    with socket.create_connection(("127.0.0.1", s.getsockname()[1]), timeout=5) as c:
        c.sendall(payload)
    t.join(10)
    s.close()
    assert bytes(got) == payload


def test_the_filter_is_locked():
    s = listener(socket.AF_INET, "0.0.0.0")
    try:
        attach_destination_filter(s.fileno(), [ipaddress.ip_address("127.0.0.1")])
        with pytest.raises(PermissionError):  # no replacing it (nor detaching) once locked
            attach_destination_filter(s.fileno(), [ipaddress.ip_address("0.0.0.0")])
    finally:
        s.close()


def test_the_program_checks_the_protocol_then_the_destination():
    prog = destination_filter([ipaddress.ip_address("127.0.0.1")])
    assert prog[-1] == (0x06, 0, 0, 0xFFFFFFFF) and prog[-2] == (0x06, 0, 0, 0)
    assert any(k == 0x7F000001 for _, _, _, k in prog)
    with pytest.raises(ValueError):
        destination_filter([])


def test_listeners_are_found_with_their_descriptor_and_address():
    s = listener(socket.AF_INET, "127.0.0.1")
    w = listener(socket.AF_INET6, "::")
    try:
        found = bind.tcp_listeners()
        assert found[s.fileno()].ip == ipaddress.ip_address("127.0.0.1")
        assert found[s.fileno()].port == s.getsockname()[1] and not found[s.fileno()].wildcard
        assert found[w.fileno()].wildcard and found[w.fileno()].port == w.getsockname()[1]
    finally:
        s.close()
        w.close()


def test_confining_new_listeners_filters_the_wildcard_ones_only():
    before = bind.tcp_listeners()
    wild, lo = listener(socket.AF_INET, "0.0.0.0"), listener(socket.AF_INET, "127.0.0.1")
    try:
        confined = bind.confine_new_listeners(before, "127.0.0.1", wild.getsockname()[1])
        assert [c.fd for c in confined] == [wild.fileno()]
        with pytest.raises(RuntimeError, match="no new listener"):  # sockets not found: fail
            bind.confine_new_listeners(bind.tcp_listeners(), "127.0.0.1", 1)
    finally:
        wild.close()
        lo.close()


def test_the_advertised_host(monkeypatch):
    monkeypatch.delenv(bind.KV_HOST_ENV, raising=False)
    assert bind.default_host() == "127.0.0.1"  # outside a Ray actor
    monkeypatch.setenv(bind.KV_HOST_ENV, "10.1.2.3")
    assert bind.default_host() == "10.1.2.3"


def test_ucx_devices_follow_the_host(monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.delenv(bind.LISTEN_ANY_ENV, raising=False)
    lo = bind.ucx_net_devices("127.0.0.1")
    assert lo and "," not in lo  # the loopback interface only: no NIC, no RDMA device
    assert bind.ucx_net_devices("198.51.100.77") is None  # no local interface carries it
    if OTHER:
        assert bind.ucx_net_devices(OTHER).split(",")[0] != lo
    with bind.ucx_devices_for("127.0.0.1") as used:
        assert used == lo == os.environ["UCX_NET_DEVICES"]
    assert "UCX_NET_DEVICES" not in os.environ  # only while the agent is created
    monkeypatch.setenv("UCX_NET_DEVICES", "eth7")
    with bind.ucx_devices_for("127.0.0.1") as used:  # the user's choice stands
        assert used == "eth7"
    monkeypatch.delenv("UCX_NET_DEVICES")
    monkeypatch.setenv(bind.LISTEN_ANY_ENV, "1")
    with bind.ucx_devices_for("127.0.0.1") as used:
        assert used is None and "UCX_NET_DEVICES" not in os.environ
