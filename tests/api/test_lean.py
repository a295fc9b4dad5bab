"""The lean routes' own answers (sluice.api.lean) are byte for byte the framework's."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.api.errors import APIError
from sluice.api.lean import send_error


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


@pytest.mark.parametrize("error", _errors(), ids=lambda e: str(e.code))
async def test_an_error_is_answered_as_its_response_would_be(error: APIError) -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await send_error(send, error)
    expected = error.response()
    start, body = sent
    assert start["status"] == expected.status_code
    *headers, (name, request_id) = start["headers"]
    assert headers == expected.raw_headers
    assert name == b"x-request-id"
    assert request_id == (error.job_id.encode() if error.job_id else request_id)
    assert request_id.startswith(b"job_" if error.job_id else b"req_")
    assert body["body"] == expected.body
