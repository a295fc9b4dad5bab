"""Real servers on loopback for the tests: a Sluice gateway in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from sluice.config import Settings, load_settings
from sluice.runtime import build_app
from tests.helpers import wait_until


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # leave the test runner's signal handlers alone


@contextlib.asynccontextmanager
async def run_app(app: FastAPI) -> AsyncIterator[str]:
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only then, else small answers wait ~40 ms.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("the server stopped during start-up")
                await asyncio.sleep(0.005)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        try:
            async with asyncio.timeout(10):
                await task
        except TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        sock.close()


class Gateway:
    """A running gateway: its URL and the app (for the broker behind it)."""

    def __init__(self, url: str, app: FastAPI) -> None:
        self.url = url
        self.app = app

    @property
    def broker(self) -> Any:
        return self.app.state.gateway.broker


@contextlib.asynccontextmanager
async def run_gateway(backends: list[str], **overrides: Any) -> AsyncIterator[Gateway]:
    # The Batch API's files go to a directory of the test's own, never the user's.
    files = tempfile.TemporaryDirectory(prefix="sluice-files-")
    overrides.setdefault("files_dir", files.name)
    settings: Settings = load_settings(
        overrides={"backends": [{"url": u} for u in backends], "log_level": "warning", **overrides},
        environ={},
    )
    app = build_app(settings, dispatch=True)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(files.cleanup)
        url = await stack.enter_async_context(run_app(app))
        # The dispatcher registers its models at start; wait until the gateway sees them.
        await wait_until(app.state.gateway.broker.served_models)
        yield Gateway(url, app)
