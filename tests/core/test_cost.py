from __future__ import annotations

import json
import time
from types import MappingProxyType

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core.cost import (
    TOKENS_PER_TOOL_CALL,
    estimate_chat_tokens,
    estimate_definitions_tokens,
    estimate_json_tokens,
    estimate_message_tokens,
    estimate_prompt_tokens,
    prompt_count,
)
from sluice.core.job import Endpoint, Job, JobError, JobState
from sluice.core.routing import prefix_key


def test_prompt_estimates() -> None:
    assert estimate_prompt_tokens("a" * 400) == 100
    assert estimate_prompt_tokens("") == 1
    assert estimate_prompt_tokens([1, 2, 3]) == 3
    assert estimate_prompt_tokens(["abcd", "abcdefgh"]) == 3


def test_chat_estimate_grows_with_messages_and_parts() -> None:
    one = estimate_chat_tokens([{"role": "user", "content": "a" * 40}])
    two = estimate_chat_tokens([{"role": "system", "content": "b"}, {"role": "user", "content": "a" * 40}])
    assert two > one > 10
    parts = estimate_chat_tokens([{"role": "user", "content": [{"type": "text", "text": "a" * 40}]}])
    assert parts == one


def test_job_round_trip_and_cost() -> None:
    job = Job(
        id="job_x",
        model="m",
        endpoint=Endpoint.COMPLETIONS,
        body={"prompt": "hi"},
        tenant="t",
        priority="normal",
        prompt_tokens=7,
        max_tokens=9,
        created_at=1.0,
        deadline=2.0,
        state=JobState.FAILED,
        error=JobError("boom", "server_error", "engine_error"),
    )
    assert job.cost == 16 and job.terminal
    assert Job.from_dict(job.to_dict()) == job
    assert Endpoint.COMPLETIONS.path == "/v1/completions"


# --- everything the engine reads counts -----------------------------------------------------------

TEXT = "a" * 400  # 100 tokens


def test_every_message_field_the_engine_reads_counts() -> None:
    bare = estimate_message_tokens({"role": "assistant", "content": None})
    assert estimate_message_tokens({"role": "user", "content": TEXT}) == bare + 100
    assert estimate_message_tokens({"role": "user", "content": "hi", "name": TEXT}) == bare + 1 + 100
    call = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": TEXT}}
    with_call = estimate_message_tokens({"role": "assistant", "content": None, "tool_calls": [call]})
    assert with_call == bare + TOKENS_PER_TOOL_CALL + 1 + 100
    legacy = {"role": "assistant", "content": None, "function_call": {"name": "get", "arguments": TEXT}}
    assert estimate_message_tokens(legacy) == bare + 1 + 100
    tool = estimate_message_tokens({"role": "tool", "tool_call_id": "c1", "content": TEXT})
    assert tool == bare + 1 + 100
    # An odd shape is counted as its JSON text, never skipped.
    assert estimate_message_tokens({"role": "assistant", "tool_calls": TEXT}) >= bare + 100
    assert estimate_message_tokens({"role": "assistant", "tool_calls": [{"x": TEXT}]}) > bare + 100


def test_definitions_count_as_their_json() -> None:
    tools = [{"type": "function", "function": {"name": "f", "description": TEXT, "parameters": {}}}]
    assert estimate_definitions_tokens(tools=tools) == estimate_json_tokens(tools) > 100
    assert estimate_definitions_tokens(functions=tools[0]["function"]) > 100
    schema = {"name": "s", "schema": {"type": "object", "description": TEXT}}
    assert estimate_definitions_tokens(response_format={"type": "json_schema", "json_schema": schema}) > 100
    assert estimate_definitions_tokens(response_format={"type": "json_object"}) == 0
    assert estimate_definitions_tokens() == 0


def test_a_megabyte_of_tool_description_is_about_a_quarter_million_tokens_and_quick() -> None:
    tools = [{"type": "function", "function": {"name": "f", "description": "x" * 1_000_000}}]
    # The engine counted 270,000 tokens for such a body; the old estimate said 18.
    assert 250_000 <= estimate_json_tokens(tools) <= 270_000
    many = [{"type": "function", "function": {"name": "f", "description": "d" * 100}}] * 8000
    started = time.perf_counter()
    estimate_json_tokens(many)  # about 1 MB in 8000 definitions
    estimate_json_tokens(tools)
    # It runs on every request: milliseconds (about 10 measured); the bound only catches a blunder.
    assert time.perf_counter() - started < 1.0


def test_a_structure_too_deep_for_the_encoder_is_still_measured() -> None:
    deep: dict[str, object] = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"p": deep}}
    # Each level is 39 characters of JSON, about 10 tokens.
    assert 5000 * 9 < estimate_json_tokens(deep) < 5000 * 11


def test_completions_prompt_lists_count_every_prompt() -> None:
    assert estimate_prompt_tokens([TEXT, TEXT, "abcd"]) == 201
    assert estimate_prompt_tokens([[1, 2, 3], [4, 5]]) == 5
    assert (prompt_count("x"), prompt_count([1, 2, 3]), prompt_count(["a", "b"])) == (1, 1, 2)
    assert prompt_count([[1, 2], [3], [4]]) == 3
    assert prompt_count([]) == 1


def test_a_mapping_that_is_not_a_dict_counts_as_a_dict() -> None:
    """Dicts are answered by their type first; any other Mapping still counts as one, the same."""
    message = {
        "role": "assistant",
        "content": [{"type": "text", "text": "abcdefgh"}],
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }
    proxied = MappingProxyType(
        {
            "role": "assistant",
            "content": [MappingProxyType({"type": "text", "text": "abcdefgh"})],
            "tool_calls": [
                MappingProxyType(
                    {"type": "function", "function": MappingProxyType({"name": "f", "arguments": '{"a": 1}'})}
                )
            ],
        }
    )
    assert estimate_chat_tokens([proxied]) == estimate_chat_tokens([message]) == 3 + 4 + 2 + 4 + 1 + 2
    fmt = {"type": "json_schema", "json_schema": {"name": "x"}}
    assert estimate_definitions_tokens(response_format=MappingProxyType(fmt)) == estimate_definitions_tokens(
        response_format=fmt
    )
    assert estimate_definitions_tokens() == 0
    body = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    proxied_body = {"model": "m", "messages": [MappingProxyType(m) for m in body["messages"]]}
    assert prefix_key(proxied_body) == prefix_key(body)


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
    )
)
@settings(max_examples=300, deadline=None)
def test_a_structure_is_measured_as_its_compact_json(value: object) -> None:
    """What a structure counts, by the C encoder made once, is the length of the compact JSON that
    ``JSONEncoder(ensure_ascii=False, check_circular=False, separators=(",", ":"))`` writes."""
    text = json.JSONEncoder(ensure_ascii=False, check_circular=False, separators=(",", ":")).encode(value)
    assert estimate_json_tokens(value) == (0 if value is None else max(1, -(-len(text) // 4)))
