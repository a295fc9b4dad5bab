"""The peers' routing, as a small HTTP proxy in front of the engines, for ``sluice bench fleet``.

LiteLLM's router picks a deployment of the model by its routing strategy and, when the deployment
has ``max_parallel_requests``, waits on a semaphore of that size before calling it: a fixed cap per
engine, and a queue in the proxy behind each cap. A failed call is retried on a new pick
(``num_retries``, 2 by default) and the deployment that failed is left out of picks for a cooldown
(5 s by default). This proxy does the same with two strategies:

- ``round-robin``: the next engine in turn;
- ``least-busy``: the engine with the fewest requests assigned to it (waiting for its cap or running).

Neither looks at an engine's speed, its own queue or the client's deadline: that is the comparison.
One generous difference: a client that gives up (closes its connection) cancels its request here,
waiting or running, so the engine stops generating for it.

    python -m sluice.bench.peer_router --engine s4=http://127.0.0.1:8101:4 --strategy least-busy

prints ``peer router: listening on URL`` once it serves; ``GET /metrics`` has its own counts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

__all__ = [
    "COOLDOWN_S",
    "NUM_RETRIES",
    "EngineSlot",
    "PeerRouter",
    "Strategy",
    "main",
    "parse_engine",
    "serve_in_background",
]

# LiteLLM's defaults: two retries after a failed call, and a failed deployment out of picks for 5 s.
NUM_RETRIES = 2
COOLDOWN_S = 5.0
# Headers of the engine's answer that are the connection's, not the answer's.
_HOP_HEADERS = frozenset(
    {"connection", "content-length", "transfer-encoding", "keep-alive", "content-encoding", "date", "server"}
)


class Strategy(StrEnum):
    """How the proxy picks an engine for a request."""

    ROUND_ROBIN = "round-robin"
    LEAST_BUSY = "least-busy"


@dataclass(slots=True)
class EngineSlot:
    """One engine behind the proxy and what the proxy knows of it.

    ``cap`` is its fixed in-flight cap (LiteLLM's ``max_parallel_requests``); ``assigned`` the requests
    picked for it that have not ended (waiting for the cap or running); ``running`` those past the cap;
    ``cooldown_until`` the monotonic time before which it is left out of picks after a failure;
    ``answered`` and ``failed`` count its calls that ended with an engine answer or a failed connection.
    """

    name: str
    url: str
    cap: int
    assigned: int = 0
    running: int = 0
    cooldown_until: float = 0.0
    answered: int = 0
    failed: int = 0
    semaphore: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        if self.cap < 1:
            raise ValueError(f"engine {self.name}: the cap must be at least 1")
        self.url = self.url.rstrip("/").removesuffix("/v1")
        self.semaphore = asyncio.Semaphore(self.cap)


def parse_engine(text: str) -> tuple[str, str, int]:
    """``NAME=URL:CAP`` (the CAP after the URL's last colon) → (name, url, cap)."""
    name, sep, rest = text.partition("=")
    url, _, cap = rest.rpartition(":")
    # The URL keeps its own port: NAME=http://HOST:PORT:CAP.
    has_port = ":" in url.partition("://")[2]
    if (
        not sep
        or not name
        or not url.startswith(("http://", "https://"))
        or not has_port
        or not cap.isdigit()
    ):
        raise ValueError(f"an engine is NAME=URL:CAP, e.g. s4=http://127.0.0.1:8101:4 (got {text!r})")
    return name, url, int(cap)


class PeerRouter:
    """The proxy's state: its engines, the strategy, and the round-robin turn."""

    def __init__(
        self,
        engines: Sequence[EngineSlot],
        strategy: Strategy,
        *,
        num_retries: int = NUM_RETRIES,
        cooldown_s: float = COOLDOWN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not engines:
            raise ValueError("the router needs at least one engine")
        self.engines = list(engines)
        self.strategy = strategy
        self.num_retries = num_retries
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._turn = 0
        self.no_engine = 0  # requests answered 503 because every engine was cooling down

    def pick(self, tried: set[str]) -> EngineSlot | None:
        """The engine for the next attempt: not cooling down, and not tried by this request unless
        every engine has been; None when all are cooling down."""
        now = self.clock()
        live = [e for e in self.engines if e.cooldown_until <= now]
        fresh = [e for e in live if e.name not in tried] or live
        if not fresh:
            return None
        if self.strategy is Strategy.LEAST_BUSY:
            # Ties go round the list, so that an idle fleet is not all sent to the first engine.
            start = self._turn % len(self.engines)
            self._turn += 1
            order = {e.name: (i - start) % len(self.engines) for i, e in enumerate(self.engines)}
            return min(fresh, key=lambda e: (e.assigned, order[e.name]))
        for _ in range(len(self.engines)):
            engine = self.engines[self._turn % len(self.engines)]
            self._turn += 1
            if engine in fresh:
                return engine
        return fresh[0]

    def metrics(self) -> str:
        """Prometheus text: per engine, requests assigned, running, answered and failed."""
        lines: list[str] = []
        for name, kind, attr in (
            ("peer_router_assigned", "gauge", "assigned"),
            ("peer_router_running", "gauge", "running"),
            ("peer_router_answered_total", "counter", "answered"),
            ("peer_router_failed_total", "counter", "failed"),
        ):
            lines.append(f"# TYPE {name} {kind}")
            lines += [f'{name}{{engine="{e.name}"}} {getattr(e, attr)}' for e in self.engines]
        lines.append("# TYPE peer_router_waiting gauge")
        lines.append(f"peer_router_waiting {sum(e.assigned - e.running for e in self.engines)}")
        lines.append("# TYPE peer_router_no_engine_total counter")
        lines.append(f"peer_router_no_engine_total {self.no_engine}")
        return "\n".join(lines) + "\n"


def _error(status: int, code: str, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return web.json_response(body, status=status)


def _headers(upstream: Any) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}


class _Proxy:
    """The aiohttp handlers around one :class:`PeerRouter`, with one client session to the engines."""

    def __init__(self, router: PeerRouter) -> None:
        self.router = router
        self.http: ClientSession | None = None

    async def start(self, _app: web.Application) -> None:
        # No client-side timeout: the client's own deadline (its closed connection) ends a request.
        self.http = ClientSession(timeout=ClientTimeout(total=None), connector=TCPConnector(limit=0))

    async def stop(self, _app: web.Application) -> None:
        if self.http is not None:
            await self.http.close()

    async def models(self, _request: web.Request) -> web.Response:
        assert self.http is not None
        for engine in self.router.engines:
            with contextlib.suppress(ClientError, TimeoutError):
                async with self.http.get(f"{engine.url}/v1/models", timeout=ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return web.json_response(await r.json())
        return _error(503, "no_engine", "no engine answered /v1/models")

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text=self.router.metrics(), content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        assert self.http is not None
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "invalid_json", "the body is not JSON")
        stream = isinstance(body, dict) and bool(body.get("stream"))
        tried: set[str] = set()
        last = "no engine was tried"
        router = self.router
        for _attempt in range(router.num_retries + 1):
            engine = router.pick(tried)
            if engine is None:
                router.no_engine += 1
                return _error(503, "no_engine", "every engine is cooling down after failures")
            tried.add(engine.name)
            engine.assigned += 1
            try:
                async with engine.semaphore:
                    engine.running += 1
                    try:
                        return await self._forward(request, engine, raw, stream)
                    finally:
                        engine.running -= 1
            except (ClientError, ConnectionError) as exc:
                # A refused or broken connection: the engine is gone or dying. Cool it down and retry.
                engine.failed += 1
                engine.cooldown_until = router.clock() + router.cooldown_s
                last = f"{engine.name}: {type(exc).__name__}"
            except _Retryable as exc:
                engine.failed += 1
                engine.cooldown_until = router.clock() + router.cooldown_s
                last = f"{engine.name}: HTTP {exc.status}"
            finally:
                engine.assigned -= 1
        return _error(502, "upstream_error", f"every attempt failed (last: {last})")

    async def _forward(
        self, request: web.Request, engine: EngineSlot, raw: bytes, stream: bool
    ) -> web.StreamResponse:
        assert self.http is not None
        url = f"{engine.url}{request.path}"
        headers = {"content-type": "application/json"}
        async with self.http.post(url, data=raw, headers=headers) as upstream:
            if upstream.status >= 500:
                await upstream.read()
                raise _Retryable(upstream.status)
            if not stream or upstream.status != 200:
                content = await upstream.read()
                engine.answered += 1
                return web.Response(body=content, status=upstream.status, headers=_headers(upstream))
            out = web.StreamResponse(status=200, headers=_headers(upstream))
            await out.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await out.write(chunk)
            except (ClientError, ConnectionError):
                # The answer has begun: it cannot move to another engine. The client sees it cut.
                engine.failed += 1
                engine.cooldown_until = self.router.clock() + self.router.cooldown_s
                return out
            await out.write_eof()
            engine.answered += 1
            return out


class _Retryable(Exception):
    """An engine's 5xx answer: retried on another pick, as LiteLLM retries a server error."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


def build_app(router: PeerRouter) -> web.Application:
    """The proxy's aiohttp application around ``router``."""
    proxy = _Proxy(router)
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/chat/completions", proxy.completions)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/metrics", proxy.metrics)
    app.router.add_get("/health", _health)
    return app


async def _health(_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@contextlib.asynccontextmanager
async def serve_in_background(
    router: PeerRouter, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[str]:
    """Serve ``router`` in this event loop until the block ends; yields its base URL.

    ``handler_cancellation``: a client that closes its connection cancels its handler, so the call to
    the engine is closed too (the engine aborts the request) rather than generating for nobody.
    """
    runner = web.AppRunner(build_app(router), handler_cancellation=True, access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()
        sock.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.peer_router",
        description="round-robin or least-busy routing with a fixed cap per engine, as LiteLLM's router",
    )
    parser.add_argument("--engine", action="append", required=True, metavar="NAME=URL:CAP")
    parser.add_argument("--strategy", choices=[s.value for s in Strategy], default=Strategy.LEAST_BUSY.value)
    parser.add_argument("--num-retries", type=int, default=NUM_RETRIES, help=f"({NUM_RETRIES})")
    parser.add_argument("--cooldown", type=float, default=COOLDOWN_S, help=f"seconds ({COOLDOWN_S:g})")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free one (0)")
    return parser


async def _serve(args: argparse.Namespace) -> None:
    engines = [EngineSlot(*parse_engine(text)) for text in args.engine]
    strategy = Strategy(args.strategy)
    router = PeerRouter(engines, strategy, num_retries=args.num_retries, cooldown_s=args.cooldown)
    async with serve_in_background(router, args.host, args.port) as url:
        print(f"peer router: listening on {url} ({args.strategy})", flush=True)
        await asyncio.Event().wait()  # until SIGTERM / SIGINT


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        asyncio.run(_serve(args))
    except ValueError as exc:
        print(f"peer router: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
