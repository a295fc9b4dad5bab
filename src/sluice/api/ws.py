"""``GET /v1/jobs/{id}/ws``: a job's events over a WebSocket, with the same authorization as SSE."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from sluice.api.errors import APIError
from sluice.api.gateway import Gateway
from sluice.api.jobs import MAX_EVENT_ID, event_id
from sluice.api.relay import KeyRevoked, bounded, key_check, revocable
from sluice.broker.base import Event

router = APIRouter(tags=["jobs"])


async def _deny(websocket: WebSocket, error: APIError) -> None:
    # Answer the handshake with a real HTTP status (404, 401…) where the server allows it.
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(error.response())
    else:
        await websocket.close(code=4000 + error.status, reason=error.code or "")


@router.websocket("/v1/jobs/{job_id}/ws")
async def job_socket(websocket: WebSocket, job_id: str) -> None:
    gw: Gateway = websocket.app.state.gateway
    try:
        who = await websocket.app.state.keyring.authenticate(websocket)
        gw.job_for(who, await gw.broker.get(job_id), job_id)
        raw = websocket.headers.get("last-event-id") or websocket.query_params.get("after") or "0"
        # ASCII digits: str.isdigit() also takes '²', which int() refuses (after the handshake).
        after = event_id(raw) if raw.isascii() and raw.isdigit() else None
        if after is None:
            message = f"'after' must be an event id (an integer from 0 to {MAX_EVENT_ID})."
            raise APIError(400, message, "invalid_value", param="after")
        held = await gw.hold(who)
    except APIError as error:
        await _deny(websocket, error)
        return
    try:
        await websocket.accept()
        events = bounded(
            revocable(gw.broker.events(job_id, after=after), key_check(websocket, who)),
            gw.settings.max_stream_s,
        )
        # The client may go while the job is silent (queued, or between events): the relay would
        # only notice at its next send, so a watcher listens for the goodbye meanwhile.
        relay = asyncio.create_task(_relay(websocket, events))
        gone = asyncio.create_task(_until_gone(websocket))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relay, gone):
                task.cancel()
            await asyncio.gather(relay, gone, return_exceptions=True)
        if not relay.cancelled():
            relay.result()  # the relay's own failure (the broker's) is the handler's
    finally:
        await held.aclose()


async def _relay(websocket: WebSocket, events: AsyncIterator[Event]) -> None:
    """Send the events, then close; a client gone meanwhile ends it quietly. A revoked key's socket
    is closed with 4401 (4000 + the HTTP status, as a refused handshake), reason invalid_api_key."""
    with contextlib.suppress(WebSocketDisconnect):
        try:
            async for event in events:
                await websocket.send_json({"id": event.id, "event": event.type.value, "data": event.data})
        except KeyRevoked:
            await websocket.close(code=4401, reason="invalid_api_key")
            return
        await websocket.close(code=1000)


async def _until_gone(websocket: WebSocket) -> None:
    """Return when the client disconnects (a close frame, or the connection lost); what it sends
    before that is ignored."""
    while (await websocket.receive())["type"] != "websocket.disconnect":
        pass
