"""The attacks on input, against real processes on Redis (a gateway and a worker, as deployed): no
answer is a 5xx, both processes live on and serve, and every line either writes is one JSON object
without the prompts it was sent."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.failures.procs import served, start_gateway, start_worker
from tests.helpers import wait_until
from tests.redis_server import RedisServer

MARKER = "MARKER-5d1e-prompt-text"
CHAT = {"model": "sim", "max_tokens": 2, "messages": [{"role": "user", "content": f"hi {MARKER}"}]}
LOGS = {"SLUICE_LOG_LEVEL": "info", "SLUICE_LOG_FORMAT": "json"}


def nested(depth: int) -> str:
    return '{"a":' * depth + '"x"' + "}" * depth


async def raw_exchange(host: str, port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; everything the server answers until it closes."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        with contextlib.suppress(ConnectionError):
            writer.write(data)
            await writer.drain()
        received = b""
        async with asyncio.timeout(15):
            with contextlib.suppress(ConnectionError):
                while chunk := await reader.read(65536):
                    received += chunk
        return received
    finally:
        writer.close()


async def test_input_attacks_on_real_processes(redis: RedisServer, http: httpx.AsyncClient) -> None:
    async with serve_in_background(preset("fast", model="sim")) as sim:
        gateway, url = await start_gateway(redis.url, LOGS)
        worker = start_worker(redis.url, sim, env=LOGS)
        try:
            await wait_until(lambda: served(url), timeout=30)
            head = {"content-type": "application/json"}
            prefix = json.dumps(CHAT)[:-1]
            answers = {
                "deep unknown field": await http.post(
                    url + "/v1/chat/completions", content=prefix + ', "x": ' + nested(900) + "}", headers=head
                ),
                "deep response_format": await http.post(
                    url + "/v1/chat/completions",
                    content=prefix
                    + ', "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": '
                    + nested(300)
                    + "}}}",
                    headers=head,
                ),
                "lone surrogate": await http.post(
                    url + "/v1/chat/completions",
                    content=json.dumps(CHAT).replace(MARKER, MARKER + " \\ud800"),
                    headers=head,
                ),
                "retry count": await http.post(
                    url + "/v1/chat/completions", json=CHAT, headers={"x-stainless-retry-count": "9" * 5000}
                ),
            }
            statuses = {name: r.status_code for name, r in answers.items()}
            assert statuses == {
                "deep unknown field": 400,
                "deep response_format": 400,
                "lone surrogate": 400,
                "retry count": 200,
            }, {name: r.text[:200] for name, r in answers.items()}

            job_id = (await http.post(url + "/v1/jobs", json=CHAT)).json()["id"]
            assert (await http.get(f"{url}/v1/jobs/{job_id}", params={"wait": 10})).json()[
                "status"
            ] == "succeeded"
            r = await http.get(f"{url}/v1/jobs/{job_id}/events", headers={"Last-Event-ID": str(2**64)})
            assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"
            r = await http.get(f"{url}/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "1"})
            assert r.status_code == 200 and "event: done" in r.text  # the stream is whole

            ws_url = url.replace("http://", "ws://") + f"/v1/jobs/{job_id}/ws?after=%C2%B2"
            try:
                async with websockets.connect(ws_url, open_timeout=10) as ws:
                    with pytest.raises(ConnectionClosed) as closed:
                        await ws.recv()
                    assert closed.value.rcvd is not None and closed.value.rcvd.reason
            except InvalidStatus as refused:
                assert refused.response.status_code == 400

            host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
            garbage = await raw_exchange(host, port, b"\x16\x03\x01 not http at all\r\n\r\n")
            assert garbage.startswith(b"HTTP/1.1 400")
            huge = await raw_exchange(
                host, port, b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * (16 * 1024 * 1024)
            )
            assert huge.startswith(b"HTTP/1.1 431")

            # Both processes live on and serve.
            assert (await http.post(url + "/v1/chat/completions", json=CHAT)).status_code == 200
            assert gateway.alive and worker.alive
        finally:
            gateway_output, worker_output = gateway.output(), worker.output()
            gateway.stop()
            worker.stop()
    for name, output in (("gateway", gateway_output), ("worker", worker_output)):
        lines = [line for line in output.splitlines() if line.strip()]
        for line in lines:
            parsed = json.loads(line)  # one JSON object per line, uvicorn's own lines included
            assert isinstance(parsed, dict) and "msg" in parsed, f"{name}: {line}"
        assert MARKER not in output, f"{name} logged a prompt"
    assert any(
        json.loads(line)["logger"].startswith("uvicorn") for line in gateway_output.splitlines() if line
    )
