"""The lean routes' own answers (sluice.api.lean) are byte for byte the framework's."""

from __future__ import annotations

import gc
from typing import Any

import httpx
import pytest
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from sluice.api import lean, relay
from sluice.api.errors import APIError
from sluice.api.lean import send_error
from sluice.api.relay import WholeAnswer
from tests.api.sluice_server import serve_as_sluice


def _errors() -> list[APIError]:
    refused = APIError(
        429, "Queue full for 'm'; retry later.", "queue_full", retry_after_s=2.5, should_retry=True
    )
    refused.extra_headers = {"x-ratelimit-remaining-requests": "0"}
    failed = APIError(502, "The engine failed: ü", "engine_error", should_retry=False)
    failed.job_id = "job_abc"
    return [
        APIError(401, "Incorrect API key provided.", "invalid_api_key", type="invalid_request_error"),
        APIError(400, "Invalid value for 'n'.", "invalid_value", param="n"),
        refused,
        failed,
    ]


_ANSWER = {
    "id": "chatcmpl-abc",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "é☃😀 \u2028", "refusal": None}}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18},
}
_RATE = {
    "x-ratelimit-limit-requests": "60",
    "x-ratelimit-remaining-requests": "59",
    "x-ratelimit-reset-requests": "1s",
    "X-Mixed-Case": "ü",
}


@pytest.mark.parametrize(
    "headers",
    [None, {}, {"x-sluice-job-id": "job_abc", "x-request-id": "job_abc"}, {"x-request-id": "job_a", **_RATE}],
    ids=["none", "empty", "ids", "rate"],
)
async def test_a_whole_answer_is_starlettes_json_response(headers: dict[str, str] | None) -> None:
    # The same status, body and raw headers in the same order, twice (the second with the names
    # made already), and sent as Response.__call__ sends it.
    expected = JSONResponse(_ANSWER, headers=headers)
    for _ in range(2):
        made = WholeAnswer(_ANSWER, headers)
        assert isinstance(made, JSONResponse)
        assert (made.status_code, made.body, made.raw_headers) == (
            expected.status_code,
            expected.body,
            expected.raw_headers,
        )
        assert made.headers.get("content-type") == "application/json"
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await WholeAnswer(_ANSWER, headers)({"type": "http"}, None, send)  # type: ignore[arg-type]
    expected_sent: list[dict[str, Any]] = []

    async def expected_send(message: dict[str, Any]) -> None:
        expected_sent.append(message)

    await expected({"type": "http"}, None, expected_send)  # type: ignore[arg-type]
    assert sent == expected_sent


@pytest.mark.parametrize("error", _errors(), ids=lambda e: str(e.code))
async def test_an_error_is_answered_as_its_response_would_be(error: APIError) -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await send_error(send, error)
    await send_error(send, error)  # the second with its body kept from the first
    expected = error.response()
    start, body, *again = sent
    assert [again[0]["headers"][:-1], again[1]] == [start["headers"][:-1], body]
    assert start["status"] == expected.status_code
    *headers, (name, request_id) = start["headers"]
    assert headers == expected.raw_headers
    assert name == b"x-request-id"
    assert request_id == (error.job_id.encode() if error.job_id else request_id)
    assert request_id.startswith(b"job_" if error.job_id else b"req_")
    assert body["body"] == expected.body


async def test_a_request_leaves_no_cycle_for_the_collector(sim_url: str, http: httpx.AsyncClient) -> None:
    """The server's client watch and the request's cycle refer to each other through its scope: the
    lean route drops the watch from the scope at its end, so that the cycle (and its scope, its
    headers) goes by its reference counts, not by the cyclic collector's passes (turned off here)."""
    async with serve_as_sluice([sim_url], log_level="warning") as served:
        body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        gc.collect()
        gc.disable()
        try:
            for _ in range(20):
                r = await http.post(served.url + "/v1/chat/completions", json=body)
                assert r.status_code == 200
            # The last request's is still held by its connection (until the next request comes).
            # Only this server's cycles are counted: other tests' servers in this process (and
            # their polls) may leave theirs meanwhile.
            port = httpx.URL(served.url).port
            alive = sum(
                isinstance(o, RequestResponseCycle) and (o.scope.get("server") or (None, None))[1] == port
                for o in gc.get_objects()
            )
        finally:
            gc.enable()
    assert alive <= 2


async def test_the_error_bodies_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    monkeypatch.setattr(lean, "_BODIES", {})
    monkeypatch.setattr(lean, "BODIES_KEPT", 3)
    for i in range(10):
        error = APIError(429, f"Queue full for 'm{i}'; retry later.", "queue_full", retry_after_s=1.0)
        await send_error(send, error)
        assert sent[-1]["body"] == error.response().body
        assert len(lean._BODIES) <= 3


async def test_errors_differing_in_one_part_keep_their_own_body(monkeypatch: pytest.MonkeyPatch) -> None:
    # The same message, each differing from the first in one of the key's other parts (type, code,
    # param): each answered with its own body, not a kept one of another.
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    monkeypatch.setattr(lean, "_BODIES", {})
    message = "Invalid value for 'n'."
    errors = [
        APIError(400, message, "invalid_value", param="n"),
        APIError(400, message, "invalid_value", param="best_of"),
        APIError(400, message, "invalid_value", type="not_found_error", param="n"),
        APIError(400, message, "too_large", param="n"),
    ]
    for error in errors + errors:
        await send_error(send, error)
        assert sent[-1]["body"] == error.response().body
    assert len({message["body"] for message in sent[1::2]}) == len(errors)


def test_the_header_names_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # Names of a caller's own, more than are kept: each answer's headers still JSONResponse's.
    monkeypatch.setattr(relay, "_RAW_NAMES", {})
    monkeypatch.setattr(relay, "RAW_NAMES_KEPT", 3)
    for i in range(10):
        headers = {f"X-Own-{i}": "a", "x-request-id": "job_a"}
        made, expected = WholeAnswer(_ANSWER, headers), JSONResponse(_ANSWER, headers=headers)
        assert made.raw_headers == expected.raw_headers
        assert len(relay._RAW_NAMES) <= 3


async def test_the_lean_route_sends_a_whole_answer_as_its_response_would(
    sim_url: str, http: httpx.AsyncClient
) -> None:
    # lean.serve sends a WholeAnswer's two messages itself: what reaches the client is that
    # Response's status, body and headers (after the server's own date and server).
    async with serve_as_sluice([sim_url], log_level="warning") as served:
        body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = await http.post(served.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200
    job_id = r.headers["x-sluice-job-id"]
    expected = WholeAnswer(r.json(), {"x-sluice-job-id": job_id, "x-request-id": job_id})
    assert r.content == expected.body
    sent = [
        (name.lower(), value) for name, value in r.headers.raw if name.lower() not in (b"date", b"server")
    ]
    assert sent == expected.raw_headers
