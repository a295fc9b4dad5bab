"""The floor of a Python proxy: a raw ASGI pass-through to one engine, for ``sluice.bench.overhead``.

Every request is sent on to ``--upstream`` as it came (method, path, query, body, content type)
through one shared aiohttp session, and the engine's answer is relayed piece by piece as it
arrives, so a stream stays a stream. No validation, no queue, no routing: whatever a gateway
costs above this is what its features cost. Served by uvicorn on uvloop and httptools.

Usage: python -m sluice.bench.passthrough --upstream http://127.0.0.1:8100 [--port 8200]
"""

from __future__ import annotations

import argparse

import aiohttp
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send


def make_app(upstream: str) -> ASGIApp:
    """The ASGI app relaying to ``upstream`` (a base URL without ``/v1``)."""
    session: aiohttp.ClientSession | None = None

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            await receive()  # lifespan.startup
            # No limit on connections to the engine: the gateway in front of it queues nothing.
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            await session.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        assert session is not None and scope["type"] == "http"
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        query = scope["query_string"].decode()
        url = upstream + scope["path"] + ("?" + query if query else "")
        headers = {"content-type": "application/json"}
        async with session.request(scope["method"], url, data=body, headers=headers) as answer:
            kind = answer.headers.get("content-type", "application/json").encode()
            headers_out = [(b"content-type", kind)]
            await send({"type": "http.response.start", "status": answer.status, "headers": headers_out})
            async for piece in answer.content.iter_any():
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.passthrough", description=__doc__)
    parser.add_argument("--upstream", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8100")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    args = parser.parse_args()
    app = make_app(args.upstream.rstrip("/"))
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
