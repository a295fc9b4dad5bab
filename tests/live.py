"""A gateway on a simulator, served from a thread with its own event loop, for callers that block:
schemathesis (whose calls are synchronous) and processes outside the tests (the Node SDK's)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.servers import run_gateway

START_S = 30.0


@contextlib.contextmanager
def gateway_thread(model: str = "sim", **overrides: Any) -> Iterator[str]:
    """The URL of a running gateway (settings ``overrides``) in front of a fast simulator serving
    ``model``. Everything of the gateway lives in the thread's loop: callers use it by HTTP only."""
    url: list[str] = []
    failed: list[BaseException] = []
    started = threading.Event()
    control: dict[str, Any] = {}

    async def main() -> None:
        stop = asyncio.Event()
        control["loop"], control["stop"] = asyncio.get_running_loop(), stop
        async with (
            serve_in_background(preset("fast", model=model)) as sim,
            run_gateway([sim], **overrides) as gw,
        ):
            url.append(gw.url)
            started.set()
            await stop.wait()

    def run() -> None:
        try:
            asyncio.run(main())  # which also ends what the gateway left running
        except BaseException as exc:
            failed.append(exc)
        finally:
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert started.wait(START_S), "the gateway did not start"
        if failed:
            raise failed[0]
        yield url[0]
    finally:
        if "loop" in control and thread.is_alive():
            control["loop"].call_soon_threadsafe(control["stop"].set)
        thread.join(START_S)
