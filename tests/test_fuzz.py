"""Fuzzing: schemathesis on every operation of /openapi.json, and hypothesis on the request models.

Whatever arrives, the gateway answers in time, never with a 5xx, and every error is in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from websockets.exceptions import ConnectionClosedOK, InvalidStatus
from websockets.sync.client import connect

from sluice.api.auth import hash_key
from sluice.api.schemas import ChatRequest, CompletionRequest, JobRequest
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.redis_server import RedisServer
from tests.servers import run_gateway

KEY = "sk-fuzz"
ADMIN_KEY = "sk-fuzz-admin"  # reads the whole description, admin routes included


@pytest.fixture(autouse=True)
def outside_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Schemathesis (.schemathesis/) and hypothesis (.hypothesis/) keep their files in the working
    directory: run from a temporary one, so a test run leaves nothing behind in the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def live_url() -> Iterator[str]:
    """A gateway (with keys) and a fast simulator, served from a thread with its own event loop."""
    ready: dict[str, Any] = {}
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        async with (
            serve_in_background(preset("fast", model="sim")) as sim,
            run_gateway(
                [sim],
                keys=[
                    {"key_sha256": hash_key(KEY), "tenant": "fuzz"},
                    {"key_sha256": hash_key(ADMIN_KEY), "tenant": "fuzz-admin", "admin": True},
                ],
                max_tokens_cap=32,
                max_poll_wait_s=1.0,
                max_stream_s=5.0,
                default_timeout_s=5.0,
            ) as gw,
        ):
            ready["url"] = gw.url
            started.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    assert started.wait(30), "the gateway did not start"
    try:
        yield ready["url"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


@pytest.fixture(scope="module")
def api_schema(live_url: str) -> Any:
    return schemathesis.openapi.from_url(
        live_url + "/openapi.json", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )


# The documented overload answers: a fuzzed `timeout` of a few milliseconds is honestly refused
# (503 deadline_unmeetable, with Retry-After) or expires while running (504). Any other 5xx is a bug.
OVERLOAD = {503: {"deadline_unmeetable", "no_backend"}, 504: {"deadline_exceeded"}}


def check(case: Any, key: str | None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = case.call(headers=headers, timeout=15)
    where = f"{case.method} {case.formatted_path}: {response.text}"
    if response.status_code >= 500:
        assert response.json()["error"]["code"] in OVERLOAD.get(response.status_code, set()), where
        if response.status_code == 503:
            assert int(response.headers["retry-after"][0]) >= 1, where
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and "type" in error and "code" in error


# schemathesis's own pytest plugin does not run on this pytest; its strategies, driven here, do.
@pytest.mark.slow
def test_every_operation_with_and_without_a_key(api_schema: Any) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10

    modes = list(schemathesis.GenerationMode)  # valid inputs, and inputs that break the schema
    for operation in operations:

        @given(case=st.one_of(*(operation.as_strategy(mode) for mode in modes)))
        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case: Any) -> None:
            check(case, KEY)
            check(case, None)

        fuzz()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


@given(
    st.dictionaries(
        st.sampled_from(
            ["model", "messages", "prompt", "max_tokens", "n", "stream", "priority", "timeout", "x"]
        ),
        json_values,
        max_size=6,
    )
)
@settings(max_examples=300, deadline=None)
def test_request_models_accept_or_reject_cleanly(body: dict[str, Any]) -> None:
    for model in (ChatRequest, CompletionRequest, JobRequest):
        with contextlib.suppress(ValidationError):  # rejecting is fine; any other exception is a bug
            parsed = model.model_validate(body)
            parsed.model_dump(exclude_none=True, mode="json")


# --- strategies for the input that used to be a 500 (issue: deep JSON, huge numbers, event ids) ---------


@contextlib.contextmanager
def _gateway_in_a_thread(**overrides: Any) -> Iterator[str]:
    """A keyed gateway and a fast simulator served from a thread with its own event loop."""
    ready: dict[str, Any] = {}
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        async with (
            serve_in_background(preset("fast", model="sim")) as sim,
            run_gateway(
                [sim],
                keys=[{"key_sha256": hash_key(KEY), "tenant": "fuzz"}],
                max_tokens_cap=32,
                max_poll_wait_s=1.0,
                max_stream_s=5.0,
                default_timeout_s=5.0,
                **overrides,
            ) as gw,
        ):
            ready["url"] = gw.url
            started.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    assert started.wait(30), "the gateway did not start"
    try:
        yield ready["url"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


@pytest.fixture(scope="module")
def live_redis_url() -> Iterator[str]:
    """The same gateway on a Redis broker (its stream ids are where event ids broke)."""
    with RedisServer() as redis, _gateway_in_a_thread(broker=redis.url) as url:
        yield url


AUTH = {"Authorization": f"Bearer {KEY}"}


def assert_answered_cleanly(r: httpx.Response, where: str) -> None:
    """No 5xx but the documented overload answers, and every error in OpenAI's shape."""
    if r.status_code >= 500:
        assert r.json()["error"]["code"] in OVERLOAD.get(r.status_code, set()), f"{where}: {r.text[:300]}"
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and "code" in error, where


@st.composite
def deep_json(draw: st.DrawFn) -> str:
    """A JSON value nested 1 to 1,200 levels deep, as text (json.dumps itself recurses): a chain of
    objects and arrays in a drawn repeating pattern around a small leaf."""
    depth = draw(st.integers(min_value=1, max_value=1200))
    pattern = draw(st.lists(st.sampled_from(["obj", "arr"]), min_size=1, max_size=3))
    leaf = json.dumps(draw(json_values.filter(lambda v: not isinstance(v, float))))
    kinds = [pattern[i % len(pattern)] for i in range(depth)]
    opening = "".join('{"k":' if k == "obj" else "[" for k in kinds)
    closing = "".join("}" if k == "obj" else "]" for k in reversed(kinds))
    return opening + leaf + closing


# Where a deep value can sit in a body: an unknown field, a response_format schema, a tool's
# parameters, a content part.
DEEP_PLACES = [
    '{{"model": "sim", "max_tokens": 1, "messages": [{{"role": "user", "content": "hi"}}], "x_extra": {v}}}',
    '{{"model": "sim", "max_tokens": 1, "messages": [{{"role": "user", "content": "hi"}}], '
    '"response_format": {{"type": "json_schema", "json_schema": {{"name": "s", "schema": {v}}}}}}}',
    '{{"model": "sim", "max_tokens": 1, "messages": [{{"role": "user", "content": "hi"}}], '
    '"tools": [{{"type": "function", "function": {{"name": "f", "parameters": {v}}}}}]}}',
    '{{"model": "sim", "max_tokens": 1, "messages": [{{"role": "user", "content": [{{"type": "text", '
    '"text": "hi", "extra": {v}}}]}}]}}',
    '{{"model": "sim", "max_tokens": 1, "prompt": "hi", "x_extra": {v}}}',
]
DEEP_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/jobs", "/submit"]


@pytest.mark.slow
@given(value=deep_json(), place=st.sampled_from(DEEP_PLACES), path=st.sampled_from(DEEP_PATHS))
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_deeply_nested_json_anywhere_is_never_a_5xx(live_url: str, value: str, place: str, path: str) -> None:
    body = place.format(v=value)
    if path == "/submit":
        body = body.replace('"messages": [{"role": "user", "content": "hi"}]', '"prompt": "hi"', 1)
    headers = {**AUTH, "content-type": "application/json"}
    r = httpx.post(live_url + path, content=body.encode(), headers=headers, timeout=15)
    assert_answered_cleanly(r, f"{path} nested {value.count('[') + value.count('{')} deep")


#: Numbers as clients may spell them in headers: thousands of digits, signs, and the Unicode digits
#: that str.isdigit() takes and int() does not (or does: Arabic-Indic digits).
#: Lengths around the bounds that matter: int()'s 4300 digits, and 64-bit ids' 19 and 20.
digit_counts = st.one_of(st.sampled_from([1, 19, 20, 4300, 4301, 5000]), st.integers(0, 6000))
huge_numbers = st.one_of(
    st.builds(lambda n, sign: sign + "7" * n, digit_counts, st.sampled_from(["", "", "-", "+"])),
    st.integers(min_value=-(2**200), max_value=2**200).map(str),
    st.text(alphabet=st.characters(categories=["Nd", "No"]), min_size=1, max_size=30),
)


NUMERIC_HEADERS = ["x-stainless-retry-count", "x-request-timeout", "x-priority", "idempotency-key"]


@pytest.mark.slow
@given(value=huge_numbers)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_huge_numbers_in_the_numeric_headers_are_never_a_5xx(live_url: str, value: str) -> None:
    body = {"model": "sim", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for header in NUMERIC_HEADERS:  # one at a time: a refusal of one must not hide another
        headers = [(b"authorization", f"Bearer {KEY}".encode()), (header.encode(), value.encode())]
        r = httpx.post(live_url + "/v1/chat/completions", json=body, headers=headers, timeout=15)
        assert_answered_cleanly(r, f"{header}: {value[:40]}")


@pytest.fixture(scope="module")
def finished_jobs(live_url: str, live_redis_url: str) -> dict[str, str]:
    """A finished job on each gateway, by URL: its event stream ends as soon as it is read."""
    jobs = {}
    for url in (live_url, live_redis_url):
        body = {"model": "sim", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        job_id = httpx.post(url + "/v1/jobs", json=body, headers=AUTH, timeout=15).json()["id"]
        done = httpx.get(f"{url}/v1/jobs/{job_id}", params={"wait": 1}, headers=AUTH, timeout=15)
        assert done.json()["status"] == "succeeded"
        jobs[url] = job_id
    return jobs


event_ids = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**130).map(str),
    st.sampled_from([str(2**63 - 1), str(2**63), str(2**64 - 1), str(2**64), "9" * 5000]),
    huge_numbers,
)


@pytest.mark.slow
@given(raw=event_ids, how=st.sampled_from(["header", "query", "websocket"]), on_redis=st.booleans())
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_out_of_range_event_ids_are_never_a_5xx_nor_a_dropped_connection(
    live_url: str, live_redis_url: str, finished_jobs: dict[str, str], raw: str, how: str, on_redis: bool
) -> None:
    url = live_redis_url if on_redis else live_url
    job_id = finished_jobs[url]
    where = f"{how} {raw[:40]} on {'redis' if on_redis else 'memory'}"
    if how == "websocket":
        ws_url = url.replace("http://", "ws://") + f"/v1/jobs/{job_id}/ws?after={quote(raw)}"
        try:
            # Accepted: the events after the id, then a close frame, never a cut connection.
            with (
                connect(ws_url, additional_headers=AUTH, open_timeout=10, close_timeout=10) as ws,
                contextlib.suppress(ConnectionClosedOK),
            ):
                while True:
                    ws.recv(timeout=10)
        except InvalidStatus as refused:
            assert refused.response.status_code < 500, where
        return
    if how == "header":
        headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"last-event-id", raw.encode())]
        r = httpx.get(f"{url}/v1/jobs/{job_id}/events", headers=headers, timeout=15)
    else:
        r = httpx.get(f"{url}/v1/jobs/{job_id}/events", params={"after": raw}, headers=AUTH, timeout=15)
    assert_answered_cleanly(r, where)
    if r.status_code == 200:  # the stream ended as a stream ends: not cut off by an error
        assert r.text == "" or r.text.endswith("\n\n"), where


@given(
    st.dictionaries(
        st.sampled_from(["model", "messages", "prompt", "x", "response_format"]),
        st.one_of(json_values, st.text(alphabet=st.characters(categories=["Cs"]), min_size=1, max_size=3)),
        max_size=4,
    )
)
@settings(max_examples=200, deadline=None)
def test_request_models_refuse_what_has_no_json_form(body: dict[str, Any]) -> None:
    """A body that validates can always be dumped and encoded as the engine request is (UTF-8)."""
    for model in (ChatRequest, CompletionRequest, JobRequest):
        with contextlib.suppress(ValidationError):
            dumped = model.model_validate(body).model_dump(exclude_none=True, mode="json")
            json.dumps(dumped, ensure_ascii=False).encode("utf-8")
