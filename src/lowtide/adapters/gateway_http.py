"""The gateway's server-side HTTP protocol: uvicorn's httptools protocol, minus two per-request costs.

`GatewayServer` runs uvicorn with this class as `uvicorn.Config(http=...)` when httptools is
installed (uvicorn 0.54, `uvicorn/protocols/http/httptools_impl.py`; httptools 0.9). It is
uvicorn's `HttpToolsProtocol` unchanged (parsing, keep-alive, pipelining, flow control, 100-continue,
shutdown) except:

- the response head is written together with the first body piece. uvicorn writes the status
  line and headers on `http.response.start` and each body piece on its own `http.response.body`,
  each one a `transport.write`, i.e. a `send(2)` on uvloop, and a small JSON answer thus leaves in
  two TCP segments the client reads separately. Here the first write of each response (the head;
  after a new request's headers were parsed) is held and joined to the next write; if no write
  follows within the same event-loop iteration (a stream whose first chunk is not there yet, or
  a 100-continue), it goes out alone on the next iteration (`loop.call_soon`), so nothing waits
  longer than that. `close`/`abort`/`write_eof` flush what is held first (abort drops it, as it
  drops the transport's own buffer). Ordering is kept: a held write is always sent before any later one.
- uvicorn's access log is off on the gateway's connections. uvicorn turns it on whenever the
  `uvicorn.access` logger has handlers (the gateway process's root logger has one) and then, per
  request, formats the client address and the quoted path before `Logger.info` drops the record
  (`gateway_process` sets that logger to WARNING). The gateway's requests are counted in its
  own metrics (`gateway_router.GatewayMetrics`); `Config(access_log=False)` is not used because it
  rewrites the process-wide `uvicorn.access` logger.

Must not: change what the client receives (bytes and their order), hold a write past the current
event-loop iteration, or touch anything but the gateway's own connections.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _HeadJoiningTransport:
    """A transport that holds one write, when told to, until the next write or the loop's next turn."""

    __slots__ = ("_held", "_hold_next", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._hold_next = False

    def hold_next_write(self) -> None:
        """The next write (a response head) waits for the one after it, or for the loop's next turn."""
        self._hold_next = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + bytes(data))
        elif self._hold_next and data:
            self._hold_next = False
            self._held = bytes(data)
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def get_write_buffer_size(self) -> int:
        held = self._held
        return self._transport.get_write_buffer_size() + (len(held) if held is not None else 0)

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # get_extra_info, is_closing, pause_reading, ...
        return getattr(self._transport, name)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the response head joined to the body and no access log."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.access_log = False
        self._joining: _HeadJoiningTransport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._joining = _HeadJoiningTransport(transport, self.loop)
        super().connection_made(self._joining)  # type: ignore[arg-type]

    def on_headers_complete(self) -> None:
        if self._joining is not None:
            self._joining.hold_next_write()
        super().on_headers_complete()
