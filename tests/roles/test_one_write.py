"""The answer's transport (sluice.roles.http_limits.OneWrite): what reaches the connection, in what
writes and when, over a transport that records its writes, in a real event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from sluice.roles.http_limits import OneWrite


class Recorded:
    """A transport that keeps each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else None


async def next_turn() -> None:
    """Let the loop finish the current turn (callbacks scheduled with call_soon run)."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def one_write(transport: Recorded) -> OneWrite:
    return OneWrite(transport, asyncio.get_running_loop())  # type: ignore[arg-type]


async def head_sent() -> tuple[Recorded, OneWrite]:
    """A stream's answer whose head has gone out at the end of its turn, as its tokens find it."""
    transport = Recorded()
    out = one_write(transport)
    out.write(b"HEAD")
    await next_turn()
    assert transport.writes == [b"HEAD"]
    return transport, out


async def test_a_whole_answer_goes_out_in_one_write_at_once() -> None:
    transport = Recorded()
    out = one_write(transport)
    out.write(b"HEAD")
    assert transport.writes == []  # held for its body
    out.write(b"BODY")
    assert transport.writes == [b"HEADBODY"]  # not waiting for the turn's end
    await next_turn()
    assert transport.writes == [b"HEADBODY"]


async def test_a_streams_head_goes_out_at_the_end_of_its_turn_and_a_lone_token_at_once() -> None:
    transport, out = await head_sent()
    assert transport.writes == [b"HEAD"]
    out.write(b"token 1")
    assert transport.writes == [b"HEAD", b"token 1"]  # the first of its turn: not delayed
    await next_turn()
    out.write(b"token 2")
    assert transport.writes == [b"HEAD", b"token 1", b"token 2"]


async def test_tokens_that_come_together_go_out_first_at_once_then_the_rest_in_one_write() -> None:
    transport, out = await head_sent()
    out.write(b"a")
    out.write(b"b")
    out.write(b"c")
    assert transport.writes == [b"HEAD", b"a"]
    await next_turn()
    assert transport.writes == [b"HEAD", b"a", b"bc"]
    assert b"".join(transport.writes) == b"HEADabc"  # in order, nothing lost


async def test_a_close_writes_what_was_gathered_first_and_nothing_is_written_after() -> None:
    transport, out = await head_sent()
    out.write(b"last token")
    out.write(b"end")
    out.close()
    assert transport.closed and transport.writes == [b"HEAD", b"last token", b"end"]
    await next_turn()  # the turn's flush finds nothing left, and a closed transport
    assert transport.writes == [b"HEAD", b"last token", b"end"]


async def test_a_head_alone_then_closed_is_written_before_the_close() -> None:
    transport = Recorded()
    out = one_write(transport)
    out.write(b"HEAD")
    out.close()
    assert transport.writes == [b"HEAD"] and transport.closed


async def test_anything_else_is_the_transports_own() -> None:
    out = one_write(Recorded())
    assert out.get_extra_info("peername") == ("127.0.0.1", 1)
    assert not out.is_closing()
