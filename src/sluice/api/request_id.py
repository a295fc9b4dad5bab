"""Every HTTP answer carries ``x-request-id``, as OpenAI's do: the SDKs read it (``request_id`` of a
response or an error), and a client quoting it names what it asked.

It is the job's id where the request made one (the answer's ``x-sluice-job-id``), so that the id a
client logs finds the job in Sluice's own log lines; else a fresh id.
"""

from __future__ import annotations

import secrets

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
JOB_HEADER = "x-sluice-job-id"


def new_request_id() -> str:
    """An id for an answer that belongs to no job."""
    return "req_" + secrets.token_hex(16)


class RequestId:
    """Adds ``x-request-id`` to every HTTP answer that has none."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if HEADER not in headers:
                    headers[HEADER] = headers.get(JOB_HEADER) or new_request_id()
            await send(message)

        await self.app(scope, receive, send_with_id)
