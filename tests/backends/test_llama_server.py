"""The backend conformance suite against a real llama-server (SmolLM2-135M on the CPU).

One engine serves the whole module, on the module's event loop: loading the model costs more than
most of the tests.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from sluice.backends.openai import OpenAIBackend
from sluice.local_engine.server import LocalEngine, find_llama_server, find_model
from tests.backends.conformance import BackendConformance, Target, open_backend

pytestmark = [
    pytest.mark.llm,
    pytest.mark.skipif(
        find_llama_server() is None or find_model() is None,
        reason="llama-server or the model is absent: run `sluice engine build` (about 4 minutes)",
    ),
    pytest.mark.asyncio(loop_scope="module"),
]

# One slot: the suite runs one request at a time, and each test waits until the engine is idle.
CTX = 4096


# Every /metrics read wakes all of llama-server's waiting HTTP handlers, and each wake-up restarts
# the 1 s wait after which a non-streaming request checks whether its client is still there:
# reading more often than that keeps such a request from ever noticing that its client left.
METRICS_INTERVAL_S = 1.5


class LlamaTarget(Target):
    """A llama-server, read through its ``/metrics``. A 4,000-token answer takes 20 s or more."""

    long_tokens = CTX - 96  # room for the prompt and the chat template
    # Up to two metrics intervals, plus the engine's own 1 s check, plus a busy machine.
    abort_notice_s = 10.0

    def __init__(self, engine: LocalEngine, http: httpx.AsyncClient) -> None:
        self.url = engine.url
        self.model = engine.model
        self._http = http
        self._last_read = -math.inf

    async def in_flight(self) -> int:
        await asyncio.sleep(self._last_read + METRICS_INTERVAL_S - time.monotonic())
        self._last_read = time.monotonic()
        text = (await self._http.get(self.url + "/metrics")).text
        processing = re.search(r"^llamacpp:requests_processing\s+(\S+)", text, re.MULTILINE)
        deferred = re.search(r"^llamacpp:requests_deferred\s+(\S+)", text, re.MULTILINE)
        assert processing and deferred, "llama-server exposes requests_processing and requests_deferred"
        return int(float(processing.group(1))) + int(float(deferred.group(1)))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LlamaTarget]:
    log = Path(tmp_path_factory.mktemp("engine")) / "engine.log"
    async with (
        LocalEngine(slots=1, ctx_per_slot=CTX, log_path=log) as engine,
        httpx.AsyncClient(trust_env=False, timeout=10) as http,
    ):
        yield LlamaTarget(engine, http)


@pytest_asyncio.fixture(loop_scope="module")
async def backend(target: LlamaTarget) -> AsyncIterator[OpenAIBackend]:
    async with open_backend(target) as b:
        yield b


class TestLlamaServer(BackendConformance):
    pass
