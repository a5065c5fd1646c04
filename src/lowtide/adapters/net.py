"""Listening sockets for lowtide's HTTP servers (the API and the gateways).

A socket is bound before its server starts so that a taken port fails at once with a clear error.
It is created with proto IPPROTO_TCP on purpose: asyncio turns Nagle's algorithm off
(TCP_NODELAY) on accepted connections only for sockets that say TCP; with Nagle on, every small
response waits for a delayed ACK (~40 ms per request). Must not: start servers.
"""

from __future__ import annotations

import socket


def bind_tcp(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket; raises OSError if the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
