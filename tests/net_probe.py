"""Probing listeners from this machine: a non-loopback address of it (what another host would
connect to) and whether a TCP connection to an address and port opens."""

from __future__ import annotations

import ipaddress
import socket


def other_local_ipv4() -> str | None:
    """A non-loopback IPv4 address of this machine (the one its default route uses)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a source address
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ipaddress.ip_address(ip).is_loopback else ip


def reaches(ip: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether a TCP connection to (ip, port) opens (a filtered SYN times out: False)."""
    try:
        with socket.create_connection((ip, port), timeout=timeout_s):
            return True
    except OSError:
        return False
