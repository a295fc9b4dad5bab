"""The app served as ``sluice serve`` and ``sluice gateway`` serve it (``roles.http.server_config``:
the connection bounds, uvicorn's logging left to Sluice's handler), in the test's event loop; and
Sluice's logging set up as those roles set it up, put back afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI

from sluice.config import Settings, load_settings
from sluice.logs import setup_logging
from sluice.roles.http import bind, server_config
from sluice.runtime import build_app
from tests.helpers import wait_until


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # leave the test runner's signal handlers alone


@dataclass
class Served:
    """A running server: where it listens, the app, and uvicorn's server (its live connections)."""

    url: str
    host: str
    port: int
    app: FastAPI
    server: uvicorn.Server

    @property
    def connections(self) -> int:
        """Connections the server holds open right now."""
        return len(self.server.server_state.connections)


@contextlib.asynccontextmanager
async def serve_as_sluice(backends: list[str], **overrides: Any) -> AsyncIterator[Served]:
    """A gateway (with a dispatcher for ``backends``) on a loopback port, served by
    ``server_config``; ``overrides`` are settings."""
    settings: Settings = load_settings(
        overrides={"backends": [{"url": u} for u in backends], **overrides}, environ={}
    )
    app = build_app(settings, dispatch=True)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = _Server(server_config(app, settings))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("the server stopped during start-up")
                await asyncio.sleep(0.005)
        await wait_until(app.state.gateway.broker.served_models)
        yield Served(f"http://127.0.0.1:{port}", "127.0.0.1", port, app, server)
    finally:
        server.should_exit = True
        try:
            async with asyncio.timeout(10):
                await task
        except TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        sock.close()


@contextlib.contextmanager
def logging_as_sluice(fmt: str = "json") -> Iterator[None]:
    """``setup_logging`` as the roles call it (a handler on the current ``sys.stderr``), and the
    loggers it changes put back as they were afterwards."""
    names = ("sluice", "uvicorn", "uvicorn.error", "uvicorn.access", "asyncio")
    saved = {}
    for name in names:
        logger = logging.getLogger(name)
        saved[name] = (list(logger.handlers), logger.level, logger.propagate)
    setup_logging("info", fmt)
    try:
        yield
    finally:
        for name, (handlers, level, propagate) in saved.items():
            logger = logging.getLogger(name)
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate
