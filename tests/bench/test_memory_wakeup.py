"""The whole-path bench of ``memory_wakeup``: what it relays is a whole, well-formed chat stream."""

from __future__ import annotations

import json

import uvloop

from sluice.bench import memory_wakeup
from sluice.bench.broker_cycles import settings
from sluice.broker.memory import MemoryBroker
from sluice.dispatcher import Dispatcher


async def _relayed(per_read: int) -> list[bytes]:
    broker = MemoryBroker(settings())
    await broker.start()
    dispatcher = Dispatcher(broker, [memory_wakeup.FakeEngine(per_read)])
    await dispatcher.start()
    sent: list[bytes] = []
    try:
        await memory_wakeup.relay_one(broker, memory_wakeup.streamed_job(0), sent)
    finally:
        await dispatcher.stop()
        await broker.close()
    return sent


def test_the_relayed_stream_is_every_token_then_the_usage_and_done() -> None:
    for per_read in (1, 3):
        text = b"".join(uvloop.run(_relayed(per_read))).decode()
        frames = [f.removeprefix("data: ") for f in text.split("\n\n") if f]
        assert frames[-1] == "[DONE]"
        chunks = [json.loads(f) for f in frames[:-1]]
        tokens, usage = chunks[:-1], chunks[-1]
        assert len(tokens) == memory_wakeup.JOB_TOKENS
        assert {c["id"] for c in chunks} == {"chatcmpl-bench000000"}
        content = "".join(c["choices"][0]["delta"]["content"] for c in tokens)
        assert content.startswith("Hello w1 w2 w3")
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == memory_wakeup.JOB_TOKENS


def test_the_engine_stream_groups_its_chunks_by_read() -> None:
    pieces = memory_wakeup.engine_stream(10, 4)
    assert len(pieces) == 3  # 10 tokens, the usage chunk and [DONE]: 12 lines, 4 a read
    assert b"".join(pieces).count(b"data: ") == 12
