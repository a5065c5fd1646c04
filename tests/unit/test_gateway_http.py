"""The gateway's server protocol joins a response head to the next write (adapters/gateway_http.py).

A fake transport records each `write` (each would be one send(2)); a real asyncio loop runs the
deferred flush. Checked: the held head goes out with the next write, alone on the loop's next turn
when nothing follows, before a close, never after an abort, and nothing else is held.
"""

from __future__ import annotations

import asyncio
from typing import cast

from lowtide.adapters.gateway_http import _HeadJoiningTransport


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def joining() -> tuple[_HeadJoiningTransport, FakeTransport, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    fake = FakeTransport()
    return _HeadJoiningTransport(cast(asyncio.Transport, fake), loop), fake, loop


def turn(loop: asyncio.AbstractEventLoop) -> None:
    loop.run_until_complete(asyncio.sleep(0))


def test_the_head_goes_out_with_the_first_body_piece_in_one_write() -> None:
    transport, fake, loop = joining()
    try:
        transport.hold_next_write()
        transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        assert fake.writes == []
        assert transport.get_write_buffer_size() > 0
        transport.write(b"{}")
        assert fake.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
        transport.write(b"")  # uvicorn's last, empty body message
        turn(loop)
        assert fake.writes[0].endswith(b"{}") and b"".join(fake.writes[1:]) == b""
    finally:
        loop.close()


def test_a_head_with_nothing_after_it_goes_out_alone_on_the_next_turn() -> None:
    transport, fake, loop = joining()
    try:
        transport.hold_next_write()
        transport.write(b"HEAD")
        turn(loop)
        assert fake.writes == [b"HEAD"]
        transport.write(b"chunk 1")  # later writes are not held
        transport.write(b"chunk 2")
        assert fake.writes == [b"HEAD", b"chunk 1", b"chunk 2"]
    finally:
        loop.close()


def test_only_the_write_after_a_new_request_is_held() -> None:
    transport, fake, loop = joining()
    try:
        transport.write(b"a")
        transport.write(b"b")
        assert fake.writes == [b"a", b"b"]
        transport.hold_next_write()
        transport.write(b"")  # an empty write is not a head: nothing to hold
        transport.write(b"head")
        transport.write(b"body")
        assert fake.writes == [b"a", b"b", b"", b"headbody"]
    finally:
        loop.close()


def test_close_sends_what_is_held_first_and_abort_drops_it() -> None:
    transport, fake, loop = joining()
    try:
        transport.hold_next_write()
        transport.write(b"head")
        transport.close()
        assert fake.writes == [b"head"] and fake.closed
        turn(loop)
        assert fake.writes == [b"head"]  # the deferred flush finds nothing left
    finally:
        loop.close()
    transport, fake, loop = joining()
    try:
        transport.hold_next_write()
        transport.write(b"head")
        transport.abort()
        turn(loop)
        assert fake.writes == [] and fake.aborted
    finally:
        loop.close()


def test_everything_else_reaches_the_real_transport() -> None:
    transport, _, loop = joining()
    try:
        assert transport.get_extra_info("peername") == "info:peername"
        assert not transport.is_closing()
    finally:
        loop.close()
