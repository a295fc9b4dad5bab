"""What the two roles that serve HTTP (``serve`` and ``gateway``) share: who may be exposed where,
the listening socket (bound before anything slow starts), and the server loop with its drain.

On SIGTERM (or SIGINT) the server drains (:mod:`sluice.drain`) before it stops: ``/readyz`` answers
503 at once, so that load balancers take the process out of rotation; new requests are still taken
for ``SLUICE_DRAIN_ACCEPT_S`` seconds (0 by default: for a load balancer that has not yet seen the
readiness change) and refused after it with 503, ``Retry-After`` and ``Connection: close`` (a client
retries on another gateway); the requests that are open (streams, synchronous completions, long
polls, WebSockets) finish within the grace period (``SLUICE_DRAIN_GRACE_S``, 30 s); then the server
stops and the process exits 0. A second signal stops it at once. Probes, ``/metrics`` and the
dashboard are answered throughout and not waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn

from sluice import drain
from sluice.api.request_id import new_request_id
from sluice.config import ConfigError, Settings
from sluice.roles.http_limits import ConnectionLimits, bounded_protocol

log = logging.getLogger("sluice.serve")

# What the kernel queues of connections not yet accepted: a burst of clients must not be reset.
BACKLOG = 2048

#: how long new requests are still taken after SIGTERM unless configured (seconds), and its variable
DEFAULT_ACCEPT_S = drain.DEFAULT_ACCEPT_S
ACCEPT_ENV = drain.ACCEPT_ENV
#: what a request refused while draining is told to wait before it retries (elsewhere)
REFUSED_RETRY_AFTER_S = 1
#: once the grace period is over, how long (whole seconds, as uvicorn takes it) the server gives
#: what is still open before it cuts it off
CUT_OFF_S = 1
#: answered while draining and never waited for: probes, scrapes and the operator's live views,
#: which stay open for as long as someone watches
UNCOUNTED_PATHS = ("/healthz", "/readyz", "/metrics")
UNCOUNTED_PREFIXES = ("/dashboard",)

#: what a role does during a drain besides waiting for its open requests (``sluice serve``: its
#: dispatcher's jobs), given the app and the drain; it returns by the end of the grace period
Settle = Callable[[Any, drain.Drain], Awaitable[None]]


class PortUnavailable(ConfigError):
    """The address to listen on cannot be bound (taken, or not this machine's)."""


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach ``host``. The empty host is not: the socket layer binds
    it to every interface, as it does 0.0.0.0."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(settings: Settings) -> None:
    """Open mode (no keys) is for local use: refuse it on a reachable address unless forced."""
    if settings.keys or settings.key_store or is_loopback(settings.host):
        return
    if not settings.insecure_open:
        raise ConfigError(
            f"no API keys are configured, so Sluice would serve anyone who can reach {settings.host}; "
            "add [[keys]] to the config (see `sluice keys new`), bind to 127.0.0.1, or pass --insecure-open"
        )
    log.warning("serving WITHOUT API KEYS on %s: anyone who can reach it can use it", settings.host)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now, so that a taken port fails at once and not after minutes of
    start-up."""
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only then, else small answers wait ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bare, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise PortUnavailable(
            f"cannot listen on {host}:{port}: {reason}. Is another server using it? "
            "Choose another port with --port (or SLUICE_PORT)."
        ) from None
    sock.set_inheritable(True)
    return sock


YOUNG_GC_THRESHOLD = 10_000
"""Allocations between two collections of the youngest generation (Python's default is 700).

At saturation some 32 requests' objects (about 10,000) are alive at any moment: with 700, every
young pass walks and promotes them, and their promotions set off full passes over the whole heap.
Measured with ``gc.callbacks`` in a saturated gateway (32 connections, short requests), the
collector took 10-12 % of the gateway's CPU at 700 and 4-5 % at 10,000 (no full pass in the run);
50,000 took 3-4 % but paused ~20 ms a pass, worse for the p99 than 10,000's few ms."""


def quiet_gc() -> None:
    """Keep collector pauses off the admission path.

    Everything allocated at start-up lives for the whole run: freezing it keeps full collections
    from walking it again and again while requests wait. A larger young generation
    (:data:`YOUNG_GC_THRESHOLD`) keeps the requests in flight from being promoted and re-walked.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, older, oldest)


def accept_of(settings: Settings) -> float:
    """How long new requests are still taken after SIGTERM (``drain_accept_s``)."""
    return settings.drain_accept_s


def _counted(scope: dict[str, Any]) -> bool:
    path: str = scope.get("path", "")
    return path not in UNCOUNTED_PATHS and not path.startswith(UNCOUNTED_PREFIXES)


class OpenRequests:
    """ASGI middleware: counts the requests and WebSockets that are open, so that a drain knows
    when they are done, and refuses new ones once the drain's accept window is over.

    Attributes:
        app: the application it wraps.
        drain: the process's drain.
        accept_s: how long after the first signal new requests are still taken.
        open: how many counted requests are open now.
    """

    def __init__(self, app: Any, shutdown: drain.Drain, accept_s: float = DEFAULT_ACCEPT_S) -> None:
        self.app = app
        self.drain = shutdown
        self.accept_s = accept_s
        self.open = 0
        self._changed = asyncio.Event()

    def accepting(self) -> bool:
        return not self.drain.draining or self.drain.elapsed() < self.accept_s

    async def changed(self) -> None:
        """Return once a counted request has ended since the last return (at once if one did).
        Cleared after the wait, not before it: a request that ended between the caller's look at
        ``open`` and this wait's start (one turn of the loop, as the drain's waker task starts)
        would otherwise be cleared away unseen, and the drain would sit out its grace period."""
        await self._changed.wait()
        self._changed.clear()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or not _counted(scope):
            await self.app(scope, receive, send)
            return
        if not self.accepting():
            await self._refuse(scope, send)
            return
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1
            self._changed.set()

    async def _refuse(self, scope: dict[str, Any], send: Any) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1013, "reason": "shutting down; retry"})
            return
        body = json.dumps(
            {
                "error": {
                    "message": "This gateway is shutting down; retry, another one will answer.",
                    "type": "server_error",
                    "param": None,
                    "code": "shutting_down",
                }
            }
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(REFUSED_RETRY_AFTER_S).encode()),
            (b"connection", b"close"),
            (b"x-request-id", new_request_id().encode()),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose signals drain the process instead of stopping it at once (and
    which, unlike uvicorn's own, does not raise the signal again after it stops: it exits 0)."""

    def __init__(self, config: uvicorn.Config, shutdown: drain.Drain) -> None:
        super().__init__(config)
        self.drain = shutdown
        self._signals = 0

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        self.drain.signal(sig)
        if self._signals >= 2:
            self.should_exit = True  # hurried: stop now, the grace period is over
        if self._signals >= 3:
            self.force_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in drain.SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in drain.SIGNALS:
                loop.remove_signal_handler(sig)


async def stop_when_drained(
    server: uvicorn.Server, app: Any, requests: OpenRequests, shutdown: drain.Drain, settle: Settle | None
) -> None:
    """At the first signal: wait out the accept window, then until no counted request is open (and
    ``settle`` is done), within the grace period; then stop the server."""
    await shutdown.started.wait()
    try:
        settling = asyncio.ensure_future(settle(app, shutdown)) if settle is not None else None
        window = min(requests.accept_s, shutdown.grace_s)
        await shutdown.until(lambda: shutdown.elapsed() >= window, lambda: asyncio.sleep(0.05))
        idle = await shutdown.until(lambda: requests.open == 0, requests.changed)
        if settling is not None:
            await settling
        if not idle:
            log.warning(
                "drain grace period over: open requests are cut off",
                extra={"fields": {"open": requests.open, "grace_s": shutdown.grace_s}},
            )
        waited = round(shutdown.elapsed(), 3)
        log.info("drained", extra={"fields": {"waited_s": waited, "open": requests.open}})
    except Exception as exc:
        # The process must still stop: a drain that failed half-way ends as a hurried one.
        log.error("drain failed; stopping now", exc_info=exc)
    finally:
        server.should_exit = True


def server_config(app: object, settings: Settings) -> uvicorn.Config:
    """How uvicorn serves ``app``: with the connection bounds of the settings (sluice.roles.http_limits)
    and no logging setup of its own, so that its few lines go through Sluice's handler, one JSON
    object per line (sluice.logs)."""
    limits = ConnectionLimits(
        max_header_bytes=settings.max_header_bytes,
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        keep_alive_s=settings.keep_alive_s,
    )
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        http=bounded_protocol(limits),
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="on",
        # The drain has waited for the open requests already (stop_when_drained).
        timeout_graceful_shutdown=CUT_OFF_S,
    )


async def serve_http(
    app: object,
    sock: socket.socket,
    settings: Settings,
    role: str,
    on_server: Callable[[uvicorn.Server], None] | None = None,
    *,
    grace_s: float = drain.DEFAULT_GRACE_S,
    accept_s: float = DEFAULT_ACCEPT_S,
    settle: Settle | None = None,
) -> None:
    """Serve ``app`` on the bound ``sock`` until SIGINT or SIGTERM and the drain after it (or
    until ``should_exit`` is set on the server that ``on_server`` receives)."""
    shutdown = drain.Drain(grace_s=grace_s)
    state = getattr(app, "state", None)
    if state is not None:
        state.drain = shutdown  # /readyz reads it
    requests = OpenRequests(app, shutdown, accept_s)
    server = DrainingServer(server_config(requests, settings), shutdown)
    if on_server is not None:
        on_server(server)
    quiet_gc()
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    log.info(
        f"sluice {role} serving",
        extra={"fields": {"url": f"http://{url_host}:{port}", "broker": settings.broker}},
    )
    stopper = asyncio.create_task(stop_when_drained(server, app, requests, shutdown, settle), name="drain")
    try:
        await server.serve(sockets=[sock])
    finally:
        stopper.cancel()
        await asyncio.gather(stopper, return_exceptions=True)
