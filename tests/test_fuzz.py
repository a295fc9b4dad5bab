"""Fuzzing: schemathesis on every operation of /openapi.json, and hypothesis on the request models.

Whatever arrives, the gateway answers in time, never with a 5xx, and every error is in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from sluice.api.auth import hash_key
from sluice.api.schemas import ChatRequest, CompletionRequest, JobRequest
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
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
