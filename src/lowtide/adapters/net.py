"""Listening sockets for lowtide's HTTP servers (the API and the gateways).

A socket is bound before its server starts so that a taken port fails at once with a clear error.
It is created with proto IPPROTO_TCP on purpose: asyncio turns Nagle's algorithm off
(TCP_NODELAY) on accepted connections only for sockets that say TCP; with Nagle on, every small
response waits for a delayed ACK (~40 ms per request). Must not: start servers.
"""

from __future__ import annotations

import os
import socket


def bind_tcp(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A bound (not yet listening) TCP socket; raises OSError if the address is taken.
    `reuse_port`: SO_REUSEPORT (Linux ≥ 3.9, socket(7)): another socket of the same user that
    also sets it may bind the same address, and the kernel spreads new connections over both
    (the gateway's hand-over to its successor, `gateway_supervisor`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def free_port_block(
    n: int, *, start: int | None = None, avoid: frozenset[int] | set[int] = frozenset()
) -> int:
    """The first port of `n` consecutive loopback ports that are free now (none in `avoid`), for
    the replicas of a service (`base_port` + slot) in tests, benchmarks and the demo. The search
    starts at `start`, by default at a place of this process's own (two runs side by side would
    otherwise both find the same block before either binds it), and wraps around. The ports are
    free when checked, not reserved. Raises RuntimeError when no block is free."""
    first = start if start is not None else 24000 + (os.getpid() % 300) * 97
    for base in [*range(first, 60000, 97), *range(24000, first, 97)]:
        if avoid & set(range(base, base + n)):
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return int(base)
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free loopback ports")
