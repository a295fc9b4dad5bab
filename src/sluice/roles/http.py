"""What the two roles that serve HTTP (``serve`` and ``gateway``) share: who may be exposed where,
the listening socket (bound before anything slow starts), and the server loop."""

from __future__ import annotations

import gc
import ipaddress
import logging
import socket
from collections.abc import Callable

import uvicorn

from sluice.config import ConfigError, Settings
from sluice.roles.http_limits import ConnectionLimits, bounded_protocol

log = logging.getLogger("sluice.serve")

# What the kernel queues of connections not yet accepted: a burst of clients must not be reset.
BACKLOG = 2048


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


def quiet_gc() -> None:
    """Keep collector pauses off the admission path.

    Everything allocated at start-up lives for the whole run: freezing it keeps full collections
    from walking it again and again while requests wait.
    """
    gc.collect()
    gc.freeze()


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
    )


async def serve_http(
    app: object,
    sock: socket.socket,
    settings: Settings,
    role: str,
    on_server: Callable[[uvicorn.Server], None] | None = None,
) -> None:
    """Serve ``app`` on the bound ``sock`` until SIGINT or SIGTERM (or until ``should_exit`` is set
    on the server that ``on_server`` receives)."""
    server = uvicorn.Server(server_config(app, settings))
    if on_server is not None:
        on_server(server)
    quiet_gc()
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    log.info(
        f"sluice {role} serving",
        extra={"fields": {"url": f"http://{url_host}:{port}", "broker": settings.broker}},
    )
    await server.serve(sockets=[sock])
