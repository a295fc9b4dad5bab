"""Webhooks: POST a job's result to its ``callback_url`` when it ends, signed, retried, logged.

What a receiver gets::

    POST <callback_url>
    Content-Type: application/json
    User-Agent: sluice-webhooks/<version>
    Sluice-Event: job.succeeded | job.failed | job.cancelled | job.expired
    Sluice-Delivery: dlv_…   (one id per delivery, the same on every retry: use it to drop duplicates)
    Sluice-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of f"{t}." + body>   (only with a secret)

    {"type": "job.succeeded", "created": 1767225600, "data": {<the job, as GET /v1/jobs/{id} shows it>}}

Without a secret the request goes out unsigned (no ``Sluice-Signature``), and the receiver cannot tell it
from a forgery. Any 2xx is success; connection errors, timeouts, 429 and 5xx are retried with backoff;
other statuses fail at once, redirects included (never followed: one could point inside our network).

Anyone who can submit a job chooses where the gateway sends a POST (server-side request forgery), so
:func:`check_callback_url` refuses hosts that resolve to any non-public address, and each delivery attempt
resolves and checks again and connects to the checked address: DNS rebinding gets a refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import random
import re
import secrets
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from typing import Any, Self

import httpx

from sluice import __version__

log = logging.getLogger("sluice.webhooks")

IPAddress = IPv4Address | IPv6Address
#: ``(host, port) -> addresses as strings``; injectable so tests need no real DNS.
Resolver = Callable[[str, int], Awaitable[list[str]]]

USER_AGENT = f"sluice-webhooks/{__version__}"
EVENTS = {status: f"job.{status}" for status in ("succeeded", "failed", "cancelled", "expired")}
MAX_URL_LENGTH = 2048

_CGNAT = ip_network("100.64.0.0/10")
_NAT64 = ip_network("64:ff9b::/96")
_NAT64_LOCAL = ip_network("64:ff9b:1::/48")
_METADATA = ip_address("169.254.169.254")
_LOOPBACKS: list[IPAddress] = [ip_address("127.0.0.1"), ip_address("::1")]
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")
_NUMBER = re.compile(r"0x[0-9a-f]*|[0-9]+")


class CallbackRefused(ValueError):
    """The callback URL is malformed or points somewhere Sluice must not send requests."""


class CallbackUnresolvable(CallbackRefused):
    """The host did not resolve: refused at submission, but retried at delivery (DNS has bad moments)."""


async def default_resolver(host: str, port: int) -> list[str]:
    """The system resolver (IPv4 and IPv6), as the event loop runs it."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def blocked_reason(ip: IPAddress) -> str | None:
    """Why a webhook must not be sent to ``ip``, or None when it is a public address."""
    if isinstance(ip, IPv6Address):
        # These forms carry an IPv4 address that the network may route to directly: judge that one.
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            reason = blocked_reason(embedded)
            return f"{reason} (embedded in {ip})" if reason else None
        if ip in _NAT64_LOCAL:
            return "a local-use NAT64 address"
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "the cloud metadata address" if ip == _METADATA else "a link-local address"
    if ip.is_unspecified:
        return "the unspecified address"
    if ip.is_multicast:
        return "a multicast address"
    if isinstance(ip, IPv4Address) and ip in _CGNAT:
        return "a carrier-grade NAT (shared) address"
    if ip.is_reserved:
        return "a reserved address"
    if ip.is_private:
        return "a private address"
    if not ip.is_global:
        return "a non-routable address"
    return None


def _ipv4_loose(host: str) -> IPv4Address | None:
    """Numeric hosts as inet_aton and browsers read them (``2130706433``, ``0x7f.1``): parsed here, they
    are judged the same whatever the resolver would make of them, and never become DNS queries."""
    parts = host.removesuffix(".").split(".")
    if not _NUMBER.fullmatch(parts[-1]):
        return None
    if len(parts) > 4 or not all(_NUMBER.fullmatch(p) for p in parts):
        raise CallbackRefused(f"{host!r} is not a valid IPv4 address")
    try:
        nums = [
            int(p, 16) if p.startswith("0x") else int(p, 8) if p.startswith("0") else int(p) for p in parts
        ]
    except ValueError:  # "0x" alone, or 8s and 9s in an octal part
        raise CallbackRefused(f"{host!r} is not a valid IPv4 address") from None
    *head, last = nums
    if any(n > 255 for n in head) or last >= 256 ** (4 - len(head)):
        raise CallbackRefused(f"{host!r} is not a valid IPv4 address")
    return IPv4Address(last + sum(n << (8 * (3 - i)) for i, n in enumerate(head)))


def _parse_url(url: str) -> tuple[httpx.URL, str, int]:
    """The URL, its host as ASCII (IDNA) and its port, or CallbackRefused."""
    if len(url) > MAX_URL_LENGTH:
        raise CallbackRefused(f"the callback URL is longer than {MAX_URL_LENGTH} characters")
    try:
        parsed = httpx.URL(url)
        host = parsed.raw_host.decode("ascii").lower()
    except (httpx.InvalidURL, UnicodeError) as exc:
        raise CallbackRefused(f"the callback URL is not a valid URL: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise CallbackRefused("the callback URL must be an http:// or https:// URL")
    if not host:
        raise CallbackRefused("the callback URL has no host")
    if parsed.userinfo:
        raise CallbackRefused("the callback URL must not contain credentials (user:password@)")
    port = parsed.port if parsed.port is not None else (443 if parsed.scheme == "https" else 80)
    if not 1 <= port <= 65535:
        raise CallbackRefused(f"the callback URL's port {port} is not between 1 and 65535")
    return parsed, host, port


def _literal(host: str) -> IPAddress | None:
    """The address a numeric host spells, or None for a name."""
    with contextlib.suppress(ValueError):
        return ip_address(host)
    return _ipv4_loose(host)


async def _resolve(host: str, port: int, resolver: Resolver) -> list[IPAddress]:
    if (literal := _literal(host)) is not None:
        return [literal]
    name = host.removesuffix(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise CallbackRefused(f"{host!r} is not a valid host name")
    if name == "localhost" or name.endswith(".localhost"):
        # RFC 6761: always loopback, and never to be asked of DNS ("localhost." would otherwise be).
        return list(_LOOPBACKS)
    try:
        answers = await resolver(host, port)
    except (OSError, UnicodeError) as exc:
        raise CallbackUnresolvable(f"the callback host {host!r} does not resolve: {exc}") from None
    try:
        addresses = [ip_address(a) for a in answers]
    except ValueError:
        raise CallbackUnresolvable(f"the callback host {host!r} resolved to a non-address") from None
    if not addresses:
        raise CallbackUnresolvable(f"the callback host {host!r} does not resolve")
    return addresses


async def _check(
    url: str, allow_private: bool, resolver: Resolver | None
) -> tuple[httpx.URL, list[IPAddress]]:
    parsed, host, port = _parse_url(url)
    addresses = await _resolve(host, port, resolver or default_resolver)
    if not allow_private:
        for ip in addresses:
            reason = blocked_reason(ip)
            if reason is None:
                continue
            if _literal(host) is not None:  # the client wrote the address: naming it tells nothing
                raise CallbackRefused(f"the callback host {host!r} is {reason}")
            # A name's addresses are never named, nor the form they came in: the answer would be a
            # DNS oracle into the networks Sluice can see.
            kind = reason.split(" (embedded in ")[0]
            raise CallbackRefused(f"the callback host {host!r} resolves to {kind}")
    return parsed, addresses


async def check_callback_url(
    url: str, *, allow_private: bool = False, resolver: Resolver | None = None
) -> list[IPAddress]:
    """Check that ``url`` may receive webhooks; return the addresses its host resolves to.

    Refused (``CallbackRefused``): schemes other than http/https, no host, credentials in the URL, a port
    outside 1-65535, a host that does not resolve, and, unless ``allow_private`` (local development), a
    host of which ANY address is loopback, private, link-local (cloud metadata), CGNAT, multicast,
    unspecified, reserved, or one of those inside an IPv4-mapped, 6to4 or NAT64 IPv6 address.
    """
    return (await _check(url, allow_private, resolver))[1]


def _digest(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The ``Sluice-Signature`` header value: ``t=<timestamp>,v1=<hex HMAC-SHA256 of f"{t}." + body>``."""
    return f"t={timestamp},v1={_digest(secret, timestamp, body)}"


def verify(
    secret: str, header: str, body: bytes, *, tolerance_s: float = 300, now: float | None = None
) -> bool:
    """Whether ``header`` (``Sluice-Signature``) signs ``body`` with ``secret``, made within ``tolerance_s``.

    Verify the raw request body, before parsing it: re-serialised JSON would not match. The timestamp
    is signed too, so an old request replayed later fails the tolerance check; drop repeats of a
    ``Sluice-Delivery`` id you have already processed to be safe within the window. For example::

        import json
        from fastapi import FastAPI, HTTPException, Request
        from sluice.webhooks import verify

        app = FastAPI()

        @app.post("/hooks/sluice")
        async def on_job(request: Request) -> dict[str, bool]:
            body = await request.body()
            if not verify(SECRET, request.headers.get("Sluice-Signature", ""), body):
                raise HTTPException(401, "bad signature")
            job = json.loads(body)["data"]  # then: handle job["status"], job["result"]
            return {"ok": True}

    Elsewhere: split the header on ``,`` into ``t`` and ``v1``, compute the hex HMAC-SHA256 of
    ``t + "." + body`` keyed with the secret, compare in constant time, and reject an old ``t``.
    """
    if len(header) > 4096:
        return False
    timestamp: int | None = None
    candidates: list[bytes] = []
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t":
            if timestamp is not None or not (value.isascii() and value.isdigit() and len(value) <= 12):
                return False
            timestamp = int(value)
        elif key == "v1":
            candidates.append(value.encode())
    if timestamp is None or not candidates:
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    expected = _digest(secret, timestamp, body).encode()
    matched = False
    for candidate in candidates:
        matched |= hmac.compare_digest(expected, candidate)
    return matched


def new_delivery_id() -> str:
    return "dlv_" + secrets.token_urlsafe(16)


@dataclass
class DeliveryAttempt:
    """One POST (or one refusal before it) in a delivery's log."""

    attempt: int
    #: when the attempt started, seconds since the epoch
    at: float
    #: the HTTP status, or None when no response came back
    status: int | None
    #: why it failed; None on success
    error: str | None
    duration_ms: float

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Outcome:
    status: int | None
    error: str | None
    retry: bool
    retry_after: float | None = None


def _printable(data: bytes, limit: int = 200) -> str:
    return " ".join(data.decode("utf-8", "replace").split())[:limit]


class WebhookSender:
    """Delivers webhooks over one HTTP client; use as ``async with WebhookSender() as sender``.

    Backoff before attempt n+1 is uniform in [0, min(backoff_cap, backoff_base * backoff_factor**(n-1))]
    ("full jitter", so that receivers coming back from an outage are not hit by synchronized waves),
    raised to a 429/503 ``Retry-After`` in seconds, but never above ``backoff_cap``.
    """

    def __init__(
        self,
        *,
        allow_private: bool = False,
        resolver: Resolver | None = None,
        max_attempts: int = 6,
        backoff_base: float = 1.0,
        backoff_factor: float = 2.0,
        backoff_cap: float = 60.0,
        connect_timeout: float = 3.0,
        timeout: float = 10.0,
        max_response_bytes: int = 4096,
        ssl_context: ssl.SSLContext | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.allow_private, self.resolver, self.max_attempts = allow_private, resolver, max_attempts
        self.backoff_base, self.backoff_factor, self.backoff_cap = backoff_base, backoff_factor, backoff_cap
        self.timeout, self.max_response_bytes = timeout, max_response_bytes
        self._clock, self._sleep, self._rng = clock, sleep, rng or random.Random()
        self._client_args: dict[str, Any] = {
            "timeout": httpx.Timeout(timeout, connect=connect_timeout),
            "follow_redirects": False,
            # Proxy variables would send the request somewhere other than the address just checked.
            "trust_env": False,
            # A pooled TLS connection, verified for one host name, could be reused for another name on
            # the same address without verifying it: one connection per request.
            "limits": httpx.Limits(max_keepalive_connections=0),
            "verify": ssl_context if ssl_context is not None else True,
            "transport": transport,
        }
        self._client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Self:
        self._client = httpx.AsyncClient(**self._client_args)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """The wait after failed attempt number ``attempt`` (1-based)."""
        ceiling = min(self.backoff_cap, self.backoff_base * self.backoff_factor ** (attempt - 1))
        delay = self._rng.uniform(0, ceiling)
        if retry_after is not None:
            delay = max(delay, retry_after)
        return min(delay, self.backoff_cap)

    async def deliver(
        self,
        job_view: dict[str, Any],
        url: str,
        secret: str | None,
        *,
        delivery_id: str | None = None,
        on_attempt: Callable[[DeliveryAttempt], Awaitable[None]] | None = None,
    ) -> list[DeliveryAttempt]:
        """POST the job's terminal event to ``url`` until a 2xx or a final failure; return the attempts.

        ``job_view`` is :func:`sluice.views.job_view` of a finished job. ``on_attempt`` is awaited
        after each attempt (to append it to the job's delivery log as it happens); if it raises, the
        error is logged and the delivery carries on, since the receiver matters more than the log.
        """
        if self._client is None:
            raise RuntimeError("WebhookSender is not open: use it as an async context manager")
        event = EVENTS.get(str(job_view.get("status")))
        if event is None:
            raise ValueError(f"job status {job_view.get('status')!r} is not a terminal state")
        delivery_id = delivery_id or new_delivery_id()
        payload = {"type": event, "created": int(self._clock()), "data": job_view}
        body = json.dumps(payload, separators=(",", ":")).encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            "Accept-Encoding": "identity",
            "Sluice-Event": event,
            "Sluice-Delivery": delivery_id,
        }
        attempts: list[DeliveryAttempt] = []
        for n in range(1, self.max_attempts + 1):
            at = self._clock()
            started = time.perf_counter()
            if secret:
                # Signed per attempt: a retry after a long backoff must not carry a stale timestamp.
                headers["Sluice-Signature"] = sign(secret, int(at), body)
            outcome = await self._attempt(self._client, url, headers, body)
            duration_ms = round((time.perf_counter() - started) * 1000, 1)
            attempt = DeliveryAttempt(n, at, outcome.status, outcome.error, duration_ms)
            attempts.append(attempt)
            fields = {"delivery": delivery_id, "job": job_view.get("id"), **attempt.to_dict()}
            log.info("webhook attempt", extra={"fields": fields})
            if on_attempt is not None:
                try:
                    await on_attempt(attempt)
                except Exception:
                    log.exception("webhook on_attempt callback failed", extra={"fields": fields})
            if not outcome.retry or n == self.max_attempts:
                break
            await self._sleep(self.backoff(n, outcome.retry_after))
        return attempts

    async def _attempt(
        self, client: httpx.AsyncClient, url: str, headers: dict[str, str], body: bytes
    ) -> _Outcome:
        try:
            async with asyncio.timeout(self.timeout):
                # Resolved again on every attempt, and the request goes to the address checked here.
                parsed, addresses = await _check(url, self.allow_private, self.resolver)
                return await self._send(client, parsed, addresses, headers, body)
        except CallbackUnresolvable as exc:
            return _Outcome(None, str(exc), retry=True)
        except CallbackRefused as exc:
            return _Outcome(None, f"refused: {exc}", retry=False)
        except (TimeoutError, httpx.TimeoutException):
            return _Outcome(None, f"timed out after {self.timeout:g} s", retry=True)
        except httpx.TransportError as exc:
            return _Outcome(None, f"{type(exc).__name__}: {exc}".rstrip(": "), retry=True)

    async def _send(
        self,
        client: httpx.AsyncClient,
        url: httpx.URL,
        addresses: list[IPAddress],
        headers: dict[str, str],
        body: bytes,
    ) -> _Outcome:
        # The name, not the address, goes in Host and in TLS (SNI and certificate verification).
        headers = {**headers, "Host": url.netloc.decode("ascii")}
        extensions = {"sni_hostname": url.raw_host.decode("ascii")} if url.scheme == "https" else {}
        error: httpx.ConnectError | None = None
        for ip in addresses:
            request = client.build_request(
                "POST", url.copy_with(host=str(ip)), headers=headers, content=body, extensions=extensions
            )
            try:
                response = await client.send(request, stream=True)
            except httpx.ConnectError as exc:
                error = exc  # nothing was sent: the next address may work (IPv6 without a route, say)
                continue
            try:
                received = bytearray()
                # Raw bytes, not decoded ones: a compressed answer must not inflate past the limit.
                async for chunk in response.aiter_raw():
                    received += chunk
                    if len(received) >= self.max_response_bytes:
                        break
            finally:
                await response.aclose()
            return self._judge(response, bytes(received[: self.max_response_bytes]))
        assert error is not None  # addresses is never empty
        raise error

    @staticmethod
    def _judge(response: httpx.Response, body: bytes) -> _Outcome:
        status = response.status_code
        if 200 <= status < 300:
            return _Outcome(status, None, retry=False)
        if 300 <= status < 400:
            location = _printable(response.headers.get("location", "").encode())
            return _Outcome(status, f"HTTP {status}: redirect to {location!r} not followed", retry=False)
        error = f"HTTP {status}" + (f": {_printable(body)}" if body.strip() else "")
        retry_after: float | None = None
        value = response.headers.get("retry-after", "").strip()
        if value.isascii() and value.isdigit():
            retry_after = float(value)
        return _Outcome(status, error, retry=status == 429 or status >= 500, retry_after=retry_after)
