"""The HTTP connection to one engine: an aiohttp session, opened in the running event loop when
first used, closed by :meth:`EngineHTTP.aclose`.

aiohttp rather than httpx: measured on the gateway's request path, httpx's connection pool walks
every pooled connection on each request and answer, and cost 4.3-6.0 ms of CPU per request at 32
in flight against aiohttp's 0.3 ms (docs/benchmarks/overhead.md).

What the engine sees is what httpx sent it: keep-alive connections without a pool limit (the
dispatcher bounds what is in flight), no redirects followed, the proxy the environment names for
the engine's URL (``HTTP_PROXY``/``HTTPS_PROXY``/``NO_PROXY``, read once when the session opens,
as httpx read it once), and a connect timeout and a read timeout between two reads. Every transport
failure (refused, reset, a timeout, a body cut short) raises :class:`EngineUnreachable`, so callers
catch one type.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from yarl import URL

__all__ = ["NOT_SENT_ERRORS", "TRANSPORT_ERRORS", "EngineHTTP", "EngineUnreachable", "unreachable"]

#: What aiohttp raises when an engine cannot be reached or breaks a connection. TimeoutError covers
#: aiohttp's own connect and read timeouts (its ``ServerTimeoutError`` is one): they must not escape
#: as the bare TimeoutError that the dispatcher reads as the job's deadline.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError, OSError)

# Engines close idle connections after 5 s (vLLM's uvicorn, llama-server's cpp-httplib); a
# connection kept a little less is never reused just as the engine closes it.
KEEPALIVE_S = 4.0


#: Failures to open a connection at all (refused, no route, DNS, TLS, the connect timeout): the
#: engine cannot have seen the request. A connection that broke later may have carried it.
NOT_SENT_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientConnectorError,
    aiohttp.ConnectionTimeoutError,
)


class EngineUnreachable(Exception):
    """The engine could not be reached, or broke the connection; ``detail`` is for the operator's
    log only (aiohttp's text may name the engine's address). ``reached`` is False when no
    connection could be opened, so the engine never saw the request."""

    def __init__(self, kind: str, detail: str, *, reached: bool = True) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.reached = reached


def unreachable(exc: BaseException) -> EngineUnreachable:
    """The one error a transport failure becomes."""
    kind = type(exc).__name__
    reached = not isinstance(exc, NOT_SENT_ERRORS)
    return EngineUnreachable(kind, f"{kind}: {exc}".rstrip(": "), reached=reached)


class EngineHTTP:
    """The keep-alive connections to one engine at ``base`` (scheme, host, port, and any path
    prefix, no trailing slash).

    Args:
        base: the engine's URL; request paths are appended to it, so a path prefix is kept.
        headers: sent with every request (the API key's ``Authorization``).
        connect_timeout_s: to open a connection (DNS and TCP, TLS).
        read_timeout_s: the longest wait for the next bytes of an answer.
    """

    def __init__(
        self,
        base: str,
        *,
        headers: dict[str, str] | None = None,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 120.0,
    ) -> None:
        self.base = base
        self._headers = dict(headers or {})
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proxy: URL | None = None
        self._proxy_auth: aiohttp.BasicAuth | None = None
        # Parsed once per path: yarl's parse is a visible share of a short request.
        self._urls: dict[str, URL] = {}

    def url(self, path: str) -> URL:
        found = self._urls.get(path)
        if found is None:
            found = self._urls[path] = URL(self.base + path)
        return found

    def session(self) -> aiohttp.ClientSession:
        """The session, opened in the running loop on first use (and again after :meth:`aclose`,
        or if the loop it was opened in is not the running one: a session is bound to its loop)."""
        loop = asyncio.get_running_loop()
        session = self._session
        if session is not None and not session.closed and self._loop is loop:
            return session
        if session is not None and not session.closed:
            # Its loop is gone or not running: its connections cannot be closed from here. Detach
            # them so that the abandoned session is not reported as unclosed.
            session.detach()
        self._proxy, self._proxy_auth = None, None
        with contextlib.suppress(LookupError):
            self._proxy, self._proxy_auth = aiohttp.helpers.get_env_proxy_for_url(URL(self.base))
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            headers=self._headers,
            timeout=self._timeout,
            # trust_env would look the proxy up in a thread and read ~/.netrc in another, per request.
            trust_env=False,
        )
        self._loop = loop
        return self._session

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """Send ``body``; the response's headers have come, its body is left to read. The caller
        releases the response (its connection goes back to the pool once the body was read whole)
        or closes it (the connection closes: the engine stops generating)."""
        try:
            return await self.session().post(
                self.url(path),
                data=body,
                headers=headers,
                allow_redirects=False,
                proxy=self._proxy,
                proxy_auth=self._proxy_auth,
            )
        except TRANSPORT_ERRORS as exc:
            raise unreachable(exc) from exc

    async def get(self, path: str, timeout_s: float) -> tuple[int, bytes]:
        """A small GET (the model list, ``/metrics``, ``/slots``, ``/props``): its status and body,
        all within ``timeout_s``."""
        try:
            async with self.session().get(
                self.url(path),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                allow_redirects=False,
                proxy=self._proxy,
                proxy_auth=self._proxy_auth,
            ) as response:
                return response.status, await response.read()
        except TRANSPORT_ERRORS as exc:
            raise unreachable(exc) from exc

    async def aclose(self) -> None:
        """Close every connection, those of answers still being read included (their readers get
        :class:`EngineUnreachable`, and the engine stops generating them)."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            if self._loop is asyncio.get_running_loop():
                await session.close()
            else:
                session.detach()
