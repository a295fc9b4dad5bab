"""/openapi.json describes the API: every status and content type the gateway sends is documented.

Schemathesis' status-code and content-type conformance checks run on what the gateway answers:
fuzzed requests to every operation (with a key, an admin key and none), and requests made to draw
the answers a fuzzer seldom meets (streams, 409, 413, 429, 405...).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import content_type_conformance, status_code_conformance

from sluice.api.auth import hash_key
from sluice.api.openapi import ERROR_SCHEMA, SCHEMA_REF, WHY
from tests.live import gateway_thread

KEY = "sk-openapi"
ADMIN_KEY = "sk-openapi-admin"
LIMITED_KEY = "sk-openapi-limited"  # one request a minute, low priority at most
CHECKS = [status_code_conformance, content_type_conformance]
EXAMPLES = 8  # per operation and generation mode: the whole fuzz stays well under a minute


@pytest.fixture(autouse=True)
def outside_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Schemathesis and hypothesis may keep files in the working directory: not the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def live_url() -> Iterator[str]:
    keys = [
        {"key_sha256": hash_key(KEY), "tenant": "openapi"},
        {"key_sha256": hash_key(ADMIN_KEY), "tenant": "openapi-admin", "admin": True},
        {"key_sha256": hash_key(LIMITED_KEY), "tenant": "limited", "rpm": 1, "max_priority": "low"},
    ]
    with gateway_thread(
        keys=keys,
        key_store=True,
        max_tokens_cap=32,
        max_body_bytes=64 * 1024,
        max_poll_wait_s=1.0,
        max_stream_s=5.0,
        default_timeout_s=5.0,
    ) as url:
        yield url


@pytest.fixture(scope="module")
def document(live_url: str) -> dict[str, Any]:
    answer = httpx.get(live_url + "/openapi.json", headers=_auth(ADMIN_KEY))
    assert answer.status_code == 200
    body: dict[str, Any] = answer.json()
    return body


@pytest.fixture(scope="module")
def api(live_url: str) -> Any:
    return schemathesis.openapi.from_url(live_url + "/openapi.json", headers=_auth(ADMIN_KEY))


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            yield method.upper(), path, operation


# --- the document itself ----------------------------------------------------------------------------


def test_no_operation_lists_the_frameworks_422(document: dict[str, Any]) -> None:
    """Sluice answers a request that fails validation with 400 in OpenAI's shape, never the
    framework's 422; nor does the document keep the schemas of that answer."""
    for method, path, operation in _operations(document):
        assert "422" not in operation["responses"], f"{method} {path}"
    assert not {"HTTPValidationError", "ValidationError"} & set(document["components"]["schemas"])


def test_every_error_is_documented_in_openai_shape(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    error = schemas[ERROR_SCHEMA]
    assert error["required"] == ["error"]
    detail = schemas[error["properties"]["error"]["$ref"].removeprefix(SCHEMA_REF)]
    assert set(detail["required"]) == {"message", "type", "param", "code"}  # as OpenAI's spec says
    for method, path, operation in _operations(document):
        for status, response in operation["responses"].items():
            if int(status) < 400 or (path, status) == ("/readyz", "503"):
                continue  # /readyz answers its own body: a load balancer's, not a client's
            where = f"{method} {path} {status}"
            assert response["description"] == WHY[int(status)], where
            assert response["content"] == {
                "application/json": {"schema": {"$ref": SCHEMA_REF + ERROR_SCHEMA}}
            }, where
            if status in ("429", "503"):
                assert {"Retry-After", "retry-after-ms"} <= set(response["headers"]), where


def test_streams_and_metrics_have_their_content_types(document: dict[str, Any]) -> None:
    def content(method: str, path: str) -> set[str]:
        return set(document["paths"][path][method]["responses"]["200"]["content"])

    json_or_events = {"application/json", "text/event-stream"}
    assert content("post", "/v1/chat/completions") == json_or_events
    assert content("post", "/v1/completions") == json_or_events
    assert content("post", "/v1/responses") == json_or_events
    assert content("get", "/v1/responses/{response_id}") == json_or_events
    assert content("get", "/v1/jobs/{job_id}/events") == {"text/event-stream"}
    assert content("get", "/metrics") == {"text/plain"}


def test_every_operation_answers_what_any_request_may_get(document: dict[str, Any]) -> None:
    """Oversized or slow headers, an oversized body and a bug are answered on any route."""
    for method, path, operation in _operations(document):
        assert {"408", "413", "431", "500"} <= set(operation["responses"]), f"{method} {path}"
        keyed = path not in ("/healthz", "/readyz")
        assert keyed == ("401" in operation["responses"]), f"{method} {path}"


# --- what the gateway answers, checked against it -------------------------------------------------


def _conforms(case: Any, key: str | None, **kwargs: Any) -> Any:
    """``case`` sent with ``key``; schemathesis' conformance checks raise on an undocumented status
    or content type."""
    headers = {**_auth(key), **kwargs.pop("headers", {})}
    response = case.call(headers=headers, timeout=15, **kwargs)
    case.validate_response(response, checks=CHECKS, headers=headers)
    return response


@pytest.mark.slow
def test_fuzzed_requests_get_documented_answers(api: Any) -> None:
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 20
    failures: list[str] = []
    modes = list(schemathesis.GenerationMode)  # valid inputs, and inputs that break the schema
    for operation in operations:

        @given(case=st.one_of(*(operation.as_strategy(mode) for mode in modes)))
        @settings(
            max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def fuzz(case: Any) -> None:
            for key in (KEY, ADMIN_KEY, None):
                try:
                    _conforms(case, key)
                except BaseException as exc:  # schemathesis' failures are exception groups
                    failures.append(f"{case.method} {case.formatted_path} (key {key}): {exc}")

        fuzz()
    assert not failures, "\n".join(failures[:10])


def _case(api: Any, method: str, path: str, **parts: Any) -> Any:
    return api[path][method].Case(**parts)


CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_streams_are_documented_as_event_streams(api: Any) -> None:
    for path, body in (
        ("/v1/chat/completions", {**CHAT, "stream": True}),
        ("/v1/completions", {"model": "sim", "prompt": "hi", "max_tokens": 4, "stream": True}),
        ("/v1/responses", {"model": "sim", "input": "hi", "max_output_tokens": 4, "stream": True}),
    ):
        response = _conforms(_case(api, "POST", path, body=body), KEY)
        assert response.status_code == 200
        assert response.headers["content-type"][0].startswith("text/event-stream"), path

    background = {"model": "sim", "input": "hi", "max_output_tokens": 4, "background": True}
    created = _conforms(_case(api, "POST", "/v1/responses", body=background), KEY).json()
    replay = _case(api, "GET", "/v1/responses/{response_id}", path_parameters={"response_id": created["id"]})
    response = _conforms(replay, KEY, params={"stream": "true"})
    assert response.headers["content-type"][0].startswith("text/event-stream")

    job = _conforms(_case(api, "POST", "/v1/jobs", body=CHAT), KEY).json()
    events = _case(api, "GET", "/v1/jobs/{job_id}/events", path_parameters={"job_id": job["id"]})
    response = _conforms(events, KEY)
    assert response.status_code == 200 and "event: done" in response.text


def test_metrics_are_documented_as_text(api: Any) -> None:
    response = _conforms(_case(api, "GET", "/metrics"), ADMIN_KEY)
    assert response.status_code == 200 and response.headers["content-type"][0].startswith("text/plain")
    assert _conforms(_case(api, "GET", "/metrics"), KEY).status_code == 404  # not an admin key
    assert _conforms(_case(api, "GET", "/metrics"), None).status_code == 401


def test_errors_a_fuzzer_seldom_meets_are_documented(api: Any) -> None:
    chat = "/v1/chat/completions"
    assert _conforms(_case(api, "POST", chat, body={**CHAT, "model": "nope"}), KEY).status_code == 404
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}
    assert _conforms(_case(api, "POST", chat, body=big), KEY).status_code == 413
    above = _case(api, "POST", chat, body={**CHAT, "priority": "high"})  # the key's max is low
    assert _conforms(above, LIMITED_KEY).status_code == 403

    # one request a minute: the second is a 429 that says when to retry
    assert _conforms(_case(api, "POST", "/v1/jobs", body=CHAT), LIMITED_KEY).status_code == 202
    limited = _conforms(_case(api, "POST", "/v1/jobs", body=CHAT), LIMITED_KEY)
    assert limited.status_code == 429 and int(limited.headers["retry-after"][0]) >= 1

    job = _conforms(_case(api, "POST", "/v1/jobs", body=CHAT), KEY).json()
    waited = _case(api, "GET", "/v1/jobs/{job_id}", path_parameters={"job_id": job["id"]})
    assert _conforms(waited, KEY, params={"wait": "5"}).json()["status"] == "succeeded"
    cancel = _case(api, "DELETE", "/v1/jobs/{job_id}", path_parameters={"job_id": job["id"]})
    assert _conforms(cancel, KEY).status_code == 409  # it has ended: nothing to cancel

    # an id with a '/' names another route: DELETE /v1/jobs/x/events takes GET only
    slash = _case(api, "DELETE", "/v1/jobs/{job_id}", path_parameters={"job_id": "x/events"})
    assert _conforms(slash, KEY).status_code == 405

    # a deadline no engine can meet is refused at once (503), or expires while running (504)
    hurried = _conforms(_case(api, "POST", chat, body={**CHAT, "timeout": 0.001}), KEY)
    assert hurried.status_code in (503, 504)

    unreadable = _case(api, "GET", "/v1/jobs/{job_id}", path_parameters={"job_id": job["id"]})
    assert _conforms(unreadable, KEY, params={"wait": "-1"}).status_code == 400
