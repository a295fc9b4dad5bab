"""Connection caps (``max_connections``): counted per key, in the broker (one count for every gateway
that shares it), and given back as soon as the client is gone, however it goes.

The clients here are raw sockets, so that a test can hang up the way a client really does: an RST
(``SO_LINGER`` 0) in the middle of a long poll, a stream or a WebSocket. Whether a key's slot is
held is asked the way any client would: a ``?wait=`` poll takes a slot for a moment and answers 429
``too_many_connections`` while the cap is reached.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import struct
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from sluice.api.auth import hash_key
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.broker.brokers import empty_redis
from tests.failures.procs import Proc
from tests.helpers import free_port, wait_until
from tests.redis_server import RedisServer
from tests.servers import Gateway, run_gateway

MSG = [{"role": "user", "content": "hi"}]
ONE, OTHER, WIDE = "sk-one", "sk-other", "sk-wide"
#: ONE and OTHER belong to one tenant, each key with a cap of one connection; WIDE has the default.
KEYS = [
    {"key_sha256": hash_key(ONE), "tenant": "acme", "max_connections": 1},
    {"key_sha256": hash_key(OTHER), "tenant": "acme", "max_connections": 1},
    {"key_sha256": hash_key(WIDE), "tenant": "wide"},
]
#: How long a slot may stay taken after its client is gone (the tests wait on it, never sleep).
FREED_WITHIN_S = 5.0


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def stalled_sim() -> AsyncIterator[str]:
    """An engine that starts every job and then sends nothing: a job stays running, silent."""
    async with serve_in_background(preset("fast", model="sim", stall_after=0)) as url:
        yield url


@pytest.fixture
async def gw(stalled_sim: str) -> AsyncIterator[Gateway]:
    async with run_gateway([stalled_sim], keys=KEYS) as g:
        yield g


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
async def redis_url(redis_server: RedisServer) -> str:
    return await empty_redis(redis_server)


async def running_job(http: httpx.AsyncClient, url: str, key: str = ONE) -> str:
    """A job that runs and never ends (the engine stalls); its id."""
    body = {"model": "sim", "messages": MSG, "max_tokens": 50, "timeout": 120}
    r = await http.post(url + "/v1/jobs", json=body, headers=auth(key))
    assert r.status_code == 202, r.text
    job_id: str = r.json()["id"]

    async def started() -> bool:
        return bool(
            (await http.get(f"{url}/v1/jobs/{job_id}", headers=auth(key))).json()["status"] == "running"
        )

    await wait_until(started)
    return job_id


async def probe(http: httpx.AsyncClient, url: str, job_id: str, key: str = ONE) -> int:
    """The status of a short long poll: 429 while the key's connections are all taken, else 200."""
    r = await http.get(f"{url}/v1/jobs/{job_id}", params={"wait": 0.01}, headers=auth(key))
    if r.status_code == 429:
        assert r.json()["error"]["code"] == "too_many_connections"
    return r.status_code


async def capped(http: httpx.AsyncClient, url: str, job_id: str, key: str = ONE) -> bool:
    return await probe(http, url, job_id, key) == 429


async def free(http: httpx.AsyncClient, url: str, job_id: str, key: str = ONE) -> bool:
    return await probe(http, url, job_id, key) == 200


class RawClient:
    """One HTTP/1.1 request on a raw socket, left open until :meth:`reset` hangs up with an RST."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def send(
        cls, url: str, method: str, path: str, key: str, extra: dict[str, str] | None = None
    ) -> RawClient:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        headers = {"Host": f"{host}:{port}", **auth(key), **(extra or {})}
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write((head + "\r\n").encode())
        await writer.drain()
        return cls(reader, writer)

    @classmethod
    async def websocket(cls, url: str, path: str, key: str) -> RawClient:
        """A WebSocket whose handshake completed (101), and nothing more."""
        nonce = base64.b64encode(os.urandom(16)).decode()
        upgrade = {
            "Upgrade": "websocket",
            "Connection": "Upgrade",
            "Sec-WebSocket-Key": nonce,
            "Sec-WebSocket-Version": "13",
        }
        client = await cls.send(url, "GET", path, key, upgrade)
        head = await asyncio.wait_for(client.reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 101"), head
        return client

    async def head(self) -> bytes:
        """The response's status line and headers."""
        return await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)

    def reset(self) -> None:
        sock: Any = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


# --- one gateway -----------------------------------------------------------------------------------


async def test_cap_is_per_key_not_per_tenant(gw: Gateway, http: httpx.AsyncClient) -> None:
    job_id = await running_job(http, gw.url)
    stream = await RawClient.send(gw.url, "GET", f"/v1/jobs/{job_id}/events", ONE)
    assert b" 200 " in (await stream.head())
    assert await capped(http, gw.url, job_id, ONE)
    # The tenant's other key has its own cap: one key never locks out the others.
    assert await free(http, gw.url, job_id, OTHER)
    stream.reset()
    await wait_until(lambda: free(http, gw.url, job_id, ONE), timeout=FREED_WITHIN_S)


async def test_websocket_reset_frees_its_slot_at_once(gw: Gateway, http: httpx.AsyncClient) -> None:
    job_id = await running_job(http, gw.url)
    # after=2: past QUEUED and STARTED, so the stalled job has nothing more to send.
    ws = await RawClient.websocket(gw.url, f"/v1/jobs/{job_id}/ws?after=2", ONE)
    assert await capped(http, gw.url, job_id)
    ws.reset()
    await wait_until(lambda: free(http, gw.url, job_id), timeout=FREED_WITHIN_S)
    assert (await http.get(f"{gw.url}/v1/jobs/{job_id}", headers=auth(ONE))).json()["status"] == "running"


async def test_long_poll_disconnect_frees_its_slot(gw: Gateway, http: httpx.AsyncClient) -> None:
    job_id = await running_job(http, gw.url)
    poll = await RawClient.send(gw.url, "GET", f"/v1/jobs/{job_id}?wait=60", ONE)
    await wait_until(lambda: capped(http, gw.url, job_id), timeout=FREED_WITHIN_S)
    poll.reset()
    await wait_until(lambda: free(http, gw.url, job_id), timeout=FREED_WITHIN_S)


async def test_sse_disconnect_frees_its_slot(gw: Gateway, http: httpx.AsyncClient) -> None:
    job_id = await running_job(http, gw.url)
    stream = await RawClient.send(gw.url, "GET", f"/v1/jobs/{job_id}/events?after=2", ONE)
    assert b" 200 " in (await stream.head())
    assert await capped(http, gw.url, job_id)
    stream.reset()
    await wait_until(lambda: free(http, gw.url, job_id), timeout=FREED_WITHIN_S)


async def test_every_slot_comes_back(gw: Gateway, http: httpx.AsyncClient) -> None:
    """Many connections of every kind, ended every way: the broker's count goes back to zero."""
    job_id = await running_job(http, gw.url, WIDE)
    clients = [
        await RawClient.send(gw.url, "GET", f"/v1/jobs/{job_id}?wait=60", WIDE),
        await RawClient.send(gw.url, "GET", f"/v1/jobs/{job_id}/events", WIDE),
        await RawClient.websocket(gw.url, f"/v1/jobs/{job_id}/ws?after=2", WIDE),
    ]

    async def open_now(expected: int) -> bool:
        return bool(await gw.broker.open_connections(hash_key(WIDE)) == expected)

    await wait_until(lambda: open_now(3), timeout=FREED_WITHIN_S)
    for client in clients:
        client.reset()
    await wait_until(lambda: open_now(0), timeout=FREED_WITHIN_S)
    assert gw.app.state.gateway.connections == {}  # nothing left for this gateway to renew


# --- several gateways on one Redis -------------------------------------------------------------------


async def test_cap_holds_across_gateways(redis_url: str, stalled_sim: str, http: httpx.AsyncClient) -> None:
    async with (
        run_gateway([stalled_sim], broker=redis_url, keys=KEYS) as one,
        run_gateway([], broker=redis_url, keys=KEYS) as two,
    ):
        job_id = await running_job(http, one.url)
        stream = await RawClient.send(one.url, "GET", f"/v1/jobs/{job_id}/events", ONE)
        assert b" 200 " in (await stream.head())
        # The slot taken through one gateway is taken on the other: a cap means the same on each.
        assert await capped(http, two.url, job_id)
        assert await free(http, two.url, job_id, OTHER)
        stream.reset()
        await wait_until(lambda: free(http, two.url, job_id), timeout=FREED_WITHIN_S)
        assert await one.broker.open_connections(hash_key(ONE)) == 0


async def test_killed_gateways_slots_come_back(
    redis_url: str, stalled_sim: str, http: httpx.AsyncClient, tmp_path: Any
) -> None:
    # The doomed gateway's lease; it renews every third of it, so a stall of up to two thirds of it
    # (a loaded test machine) loses nothing.
    lease_s = 3.0
    config = tmp_path / "sluice.toml"
    config.write_text(
        "".join(
            f'[[keys]]\nkey_sha256 = "{k["key_sha256"]}"\ntenant = "{k["tenant"]}"\n'
            + (f"max_connections = {k['max_connections']}\n" if "max_connections" in k else "")
            for k in KEYS
        )
    )
    async with run_gateway([stalled_sim], broker=redis_url, keys=KEYS) as survivor:
        port = free_port()
        doomed = Proc(
            ["gateway", "--broker", redis_url, "--port", str(port), "--config", str(config)],
            {"SLUICE_LEASE_S": str(lease_s)},
        )
        doomed_url = f"http://127.0.0.1:{port}"
        try:

            async def up() -> bool:
                assert doomed.alive, doomed.output()
                try:
                    return (await http.get(doomed_url + "/healthz", timeout=1)).status_code == 200
                except httpx.HTTPError:
                    return False

            await wait_until(up, timeout=30)
            job_id = await running_job(http, survivor.url)
            stream = await RawClient.send(doomed_url, "GET", f"/v1/jobs/{job_id}/events", ONE)
            assert b" 200 " in (await stream.head())
            await wait_until(lambda: capped(http, survivor.url, job_id), timeout=FREED_WITHIN_S)
            # Held for longer than a lease: the doomed gateway renews it.
            renewed_until = asyncio.get_running_loop().time() + 2 * lease_s
            while asyncio.get_running_loop().time() < renewed_until:
                assert await capped(http, survivor.url, job_id)
            doomed.kill()
            # Nobody renews its slot now: it lapses within a lease of its last renewal.
            await wait_until(lambda: free(http, survivor.url, job_id), timeout=2 * lease_s)
            stream.reset()
        finally:
            doomed.stop()
