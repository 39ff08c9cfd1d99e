"""A listening TCP socket that only accepts connections addressed to given IPs, for libraries
that bind the wildcard address and offer no knob to bind one address (Mooncake: see bind.py).

A classic BPF socket filter (SO_ATTACH_FILTER) on a listening socket runs on every packet that
reaches it, the SYNs included (Linux `tcp_v4_rcv`/`tcp_v6_rcv` call `tcp_filter` before the
LISTEN branch); a dropped SYN means no connection, and the accepted sockets inherit the filter.
The program compares the packet's DESTINATION address with the allowed ones: a packet sent to
any other local address (another interface, or a NATed one) is dropped, which is what binding
the socket to the allowed address would have done - except that the kernel still shows the
socket as `0.0.0.0:port` / `*:port`, and a peer's SYN is dropped (it times out) instead of
answered with a reset.

The program, for IPv4 allowed addresses a1..an and IPv6 ones b1..bm:

    A = skb->protocol
    if A == ETH_P_IP:   A = ipv4.daddr; accept if A in (a1..an); drop
    if A == ETH_P_IPV6: accept if the four words of ipv6.daddr equal those of some bj; drop
    drop

An IPv4 packet on a dual-stack IPv6 socket still carries an IPv4 header, so "127.0.0.1" covers
it too. Linux only (Mooncake and NIXL are Linux-only).
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct
from collections.abc import Sequence

# <linux/filter.h>, <asm-generic/socket.h>
SO_ATTACH_FILTER = 26
SO_LOCK_FILTER = 44
_LD_H_ABS = 0x00 | 0x08 | 0x20  # BPF_LD | BPF_H | BPF_ABS
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
_RET_K = 0x06 | 0x00  # BPF_RET | BPF_K
_SKF_AD_PROTOCOL = -0x1000 + 0  # SKF_AD_OFF + SKF_AD_PROTOCOL: skb->protocol, host order
_SKF_NET_OFF = -0x100000  # loads relative to the network (IP) header
_ETH_P_IP, _ETH_P_IPV6 = 0x0800, 0x86DD
_IPV4_DADDR = 16  # byte offset of the destination address in an IPv4 header
_IPV6_DADDR = 24
_ACCEPT = 0xFFFFFFFF  # keep the whole packet (a smaller value would truncate TCP payloads)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Insn = tuple[int, int, int, int]  # (code, jt, jf, k): jt/jf relative jumps


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def destination_filter(allowed: Sequence[IPAddress]) -> list[Insn]:
    """The cBPF program accepting exactly the packets addressed to one of `allowed`."""
    if not allowed:
        raise ValueError("destination_filter: no allowed address")
    # Instructions with symbolic jump targets, resolved once every label's position is known.
    prog: list[tuple[int, int | str, int | str, int]] = [
        (_LD_H_ABS, 0, 0, _SKF_AD_PROTOCOL & 0xFFFFFFFF),
        (_JEQ_K, 0, "not_v4", _ETH_P_IP),
        (_LD_W_ABS, 0, 0, (_SKF_NET_OFF + _IPV4_DADDR) & 0xFFFFFFFF),
    ]
    for a in allowed:
        if a.version == 4:
            prog.append((_JEQ_K, "accept", 0, int(a)))
    prog.append((_RET_K, 0, 0, 0))
    labels = {"not_v4": len(prog)}
    prog.append((_JEQ_K, 0, "drop", _ETH_P_IPV6))  # A still holds the protocol here
    for i, a in enumerate(x for x in allowed if x.version == 6):
        words = struct.unpack(">4I", a.packed)
        for w, word in enumerate(words):
            prog.append((_LD_W_ABS, 0, 0, (_SKF_NET_OFF + _IPV6_DADDR + 4 * w) & 0xFFFFFFFF))
            prog.append((_JEQ_K, "accept" if w == 3 else 0, f"next{i}", word))
        labels[f"next{i}"] = len(prog)
    labels["drop"] = len(prog)
    prog.append((_RET_K, 0, 0, 0))
    labels["accept"] = len(prog)
    prog.append((_RET_K, 0, 0, _ACCEPT))

    def rel(target: int | str, pc: int) -> int:
        off = labels[target] - pc - 1 if isinstance(target, str) else target
        if not 0 <= off <= 255:  # cBPF conditional jumps are 8-bit: too many addresses
            raise ValueError(f"destination_filter: {len(allowed)} addresses do not fit")
        return off

    return [(code, rel(jt, pc), rel(jf, pc), k) for pc, (code, jt, jf, k) in enumerate(prog)]


def attach_destination_filter(fd: int, allowed: Sequence[IPAddress]) -> None:
    """Filter the socket behind `fd` (not ours: the caller's library owns it) to `allowed`
    destinations, and lock the filter so that it cannot be detached or replaced. Raises
    OSError if the kernel refuses."""
    prog = destination_filter(allowed)
    insns = (_SockFilter * len(prog))(*(_SockFilter(c, jt, jf, k) for c, jt, jf, k in prog))
    fprog = _SockFprog(len(prog), insns)
    sock = socket.socket(fileno=fd)  # wraps the descriptor without duplicating it
    try:
        # The struct holds a pointer to `insns`, which stays alive until this call returns.
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER,
                        ctypes.string_at(ctypes.addressof(fprog), ctypes.sizeof(fprog)))
        sock.setsockopt(socket.SOL_SOCKET, SO_LOCK_FILTER, 1)
    finally:
        sock.detach()  # the library keeps its descriptor open
