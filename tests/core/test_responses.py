"""The Responses API's translation to chat completions and back, without a server: requests,
Response objects and stream events, each checked against the official SDK's types."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from sluice.api.responses import ResponseRequest
from sluice.core.job import Job, JobError, JobState
from sluice.core.request import RequestRejected
from sluice.core.response_output import usage
from sluice.core.response_request import RECORD_KEY, chat_plan, follow_up, job_id_of, response_id
from sluice.core.responses import ResponseEvents, response_object
from tests.helpers import make_job

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}


def rejected(body: dict[str, Any]) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        chat_plan(body)
    return info.value


def response_job(body: dict[str, Any], state: JobState = JobState.QUEUED, **fields: Any) -> Job:
    plan = chat_plan(body)
    job = make_job()
    job.body = {**plan.body, "model": job.model}
    job.extra[RECORD_KEY] = plan.record
    job.state = state
    for name, value in fields.items():
        setattr(job, name, value)
    return job


def chunk(delta: dict[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
    return [{"index": 0, "delta": delta, "finish_reason": finish}]


# --- ids ----------------------------------------------------------------------------------------


def test_a_response_id_is_its_job_id() -> None:
    assert response_id("job_abc") == "resp_abc" and job_id_of("resp_abc") == "job_abc"
    assert job_id_of("job_abc") is None and job_id_of("resp_") is None and job_id_of("") is None


# --- requests -----------------------------------------------------------------------------------


def test_text_input_and_instructions() -> None:
    plan = chat_plan({"model": "m", "input": "hi", "instructions": "Be brief.", "max_output_tokens": 9})
    assert plan.body == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "model": "m",
        "max_tokens": 9,
    }
    assert plan.record["instruction_messages"] == 1 and plan.record["max_output_tokens"] == 9


def test_items_become_messages() -> None:
    plan = chat_plan(
        {
            "input": [
                {"role": "developer", "content": "rules"},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "look"}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "this"},
                        {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "low"},
                    ],
                },
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "calling", "annotations": []}],
                },
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "two"}],
                },
                {"type": "function_call", "call_id": "c3", "name": "g", "arguments": {"b": 2}},
            ]
        }
    )
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    call.append({"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}})
    assert plan.body["messages"] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "look"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "this"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "low"}},
            ],
        },
        {"role": "assistant", "content": "calling", "tool_calls": call},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c3", "type": "function", "function": {"name": "g", "arguments": '{"b": 2}'}}
            ],
        },
    ]


def test_tools_choices_formats_and_reasoning() -> None:
    plan = chat_plan(
        {
            "input": "x",
            "tools": [TOOL, {**TOOL, "name": "g", "description": "G."}],
            "tool_choice": {"type": "function", "name": "g"},
            "text": {
                "format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}
            },
            "reasoning": {"effort": "low", "summary": "auto"},
            "parallel_tool_calls": False,
            "temperature": 0.2,
            "top_p": 0.9,
            "metadata": {"k": "v"},
            "store": False,
            "include": ["reasoning.encrypted_content"],
        }
    )
    body = plan.body
    assert body["tools"][1] == {
        "type": "function",
        "function": {"name": "g", "parameters": {"type": "object"}, "strict": True, "description": "G."},
    }
    assert body["tool_choice"] == {"type": "function", "function": {"name": "g"}}
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
    }
    assert (body["reasoning_effort"], body["parallel_tool_calls"], body["temperature"], body["top_p"]) == (
        "low",
        False,
        0.2,
        0.9,
    )
    assert "metadata" not in body and "store" not in body and "include" not in body
    assert plan.record["metadata"] == {"k": "v"} and plan.record["store"] is False
    assert plan.record["tools"][1] == {**TOOL, "name": "g", "description": "G."}

    allowed = chat_plan(
        {
            "input": "x",
            "tools": [TOOL, {**TOOL, "name": "g"}],
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "g"}],
            },
        }
    )
    assert allowed.body["tool_choice"] == "required"
    assert [t["function"]["name"] for t in allowed.body["tools"]] == ["g"]
    assert chat_plan({"input": "x", "text": {"format": {"type": "json_object"}}}).body["response_format"] == {
        "type": "json_object"
    }
    assert "response_format" not in chat_plan({"input": "x", "text": {"format": {"type": "text"}}}).body


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({}, "input", "missing_required_parameter"),
        ({"input": []}, "input", "invalid_value"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type", "unsupported_value"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools.0.name", "invalid_value"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "unsupported_value"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type", "unsupported_value"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({"input": "x", "prompt": {"id": "p"}}, "prompt", "unsupported_parameter"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "unsupported_value"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", "invalid_value"),
        ({"input": [{"role": "user"}]}, "input.0.content", "invalid_value"),
        ({"input": [{"role": "user", "content": 5}]}, "input.0.content", "invalid_value"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "input.0.content.0.type",
            "unsupported_value",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input.0.content.0.image_url",
            "unsupported_value",
        ),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.0.call_id", "invalid_value"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]},
            "input.0.output",
            "invalid_value",
        ),
        (
            {
                "input": [
                    {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}
                ]
            },
            "input.0.output.0.type",
            "unsupported_value",
        ),
    ],
)
def test_what_has_no_chat_counterpart_is_refused(body: dict[str, Any], param: str, code: str) -> None:
    error = rejected(body)
    assert (error.status, error.param, error.code) == (400, param, code)
    assert error.message


def test_follow_up_drops_the_old_instructions_and_adds_the_answer() -> None:
    job = response_job({"input": "one", "instructions": "Old."}, JobState.SUCCEEDED)
    job.result = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": ""},
                        },
                        {"index": 0, "function": {"arguments": "{}"}},
                    ],
                },
            }
        ]
    }
    assert follow_up(job) == [
        {"role": "user", "content": "one"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]
    plan = chat_plan({"input": "two", "instructions": "New."}, follow_up(job))
    assert [m["role"] for m in plan.body["messages"]] == ["system", "user", "assistant", "user"]
    assert plan.body["messages"][0]["content"] == "New."


# --- answers ------------------------------------------------------------------------------------


def test_usage_in_the_responses_words() -> None:
    chat = {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 6},
        "completion_tokens_details": {"reasoning_tokens": 2},
    }
    assert usage(chat) == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 6, "cache_write_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 14,
    }
    assert usage(None) is None


def test_response_objects_of_every_state() -> None:
    body = {"input": "x", "instructions": "I.", "metadata": {"a": "b"}, "tools": [TOOL], "background": True}
    for state, status in ((JobState.QUEUED, "queued"), (JobState.RUNNING, "in_progress")):
        r = response_object(response_job(body, state))
        Response.model_validate(r)
        assert (r["status"], r["output"], r["background"]) == (status, [], True) and "usage" not in r
        assert (r["instructions"], r["metadata"], r["tools"][0]["name"]) == ("I.", {"a": "b"}, "f")

    failed = response_object(
        response_job(
            body,
            JobState.FAILED,
            error=JobError("engine said no", "invalid_request_error", "engine_rejected"),
        )
    )
    assert failed["status"] == "failed" and failed["error"] == {
        "code": "invalid_prompt",
        "message": "engine said no",
    }
    expired = response_object(response_job(body, JobState.EXPIRED, error=JobError("too late", "timeout")))
    assert expired["status"] == "failed" and expired["error"]["code"] == "server_error"
    cancelled = response_object(response_job(body, JobState.CANCELLED, error=JobError("cancelled")))
    assert cancelled["status"] == "cancelled" and cancelled["error"] is None
    for r in (failed, expired, cancelled):
        Response.model_validate(r)


def succeeded(message: dict[str, Any], finish: str, body: dict[str, Any] | None = None) -> Job:
    return response_job(
        body or {"input": "x"},
        JobState.SUCCEEDED,
        result={"choices": [{"index": 0, "message": message, "finish_reason": finish}]},
        usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        finished_at=time.time(),
    )


def test_a_whole_answer_as_a_response() -> None:
    text = response_object(succeeded({"role": "assistant", "content": "hi"}, "stop"))
    Response.model_validate(text)
    assert text["status"] == "completed" and text["completed_at"] is not None
    assert text["output"][0]["content"] == [
        {"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}
    ]
    assert text["usage"]["output_tokens"] == 2

    cut = response_object(succeeded({"role": "assistant", "content": "h"}, "length"))
    assert (cut["status"], cut["incomplete_details"], cut["completed_at"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
        None,
    )
    assert cut["output"][0]["status"] == "incomplete"
    filtered = response_object(succeeded({"role": "assistant", "content": ""}, "content_filter"))
    assert filtered["incomplete_details"] == {"reason": "content_filter"}

    tools = response_object(
        succeeded(
            {
                "role": "assistant",
                "content": "",  # what the assembler writes beside tool calls: no message item of its own
                "reasoning_content": "hmm",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
                    {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
                ],
            },
            "tool_calls",
        )
    )
    Response.model_validate(tools)
    assert [o["type"] for o in tools["output"]] == ["reasoning", "function_call", "function_call"]
    assert tools["output"][0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert [(o["call_id"], o["name"], o["arguments"]) for o in tools["output"][1:]] == [
        ("c1", "f", '{"a":1}'),
        ("c2", "g", "{}"),
    ]
    assert len({o["id"] for o in tools["output"]}) == 3

    refused = response_object(succeeded({"role": "assistant", "content": None, "refusal": "No."}, "stop"))
    assert refused["output"][0]["content"] == [{"type": "refusal", "refusal": "No."}]
    empty = response_object(succeeded({"role": "assistant", "content": None}, "stop"))
    assert empty["output"][0]["content"][0]["text"] == ""


# --- streams ------------------------------------------------------------------------------------


def stream_of(
    job: Job, chunks: list[list[dict[str, Any]]], end: str = "done"
) -> tuple[list[dict[str, Any]], ResponseEvents]:
    events = ResponseEvents(job)
    out = events.opening() + events.started()
    for choices in chunks:
        out += events.chunk(choices)
    if end == "done":
        out += events.done({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}, None, time.time())
    for event in out:
        EVENTS.validate_python(event)
    return out, events


def test_a_streamed_answer_ends_with_the_whole_answer() -> None:
    job = response_job({"input": "x", "tools": [TOOL]}, JobState.RUNNING)
    chunks = [
        chunk({"role": "assistant", "reasoning_content": "hm"}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo"}),
        chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}
                ]
            }
        ),
        chunk(
            {
                "tool_calls": [
                    {"index": 1, "id": "c2", "type": "function", "function": {"name": "g", "arguments": "{"}}
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": "}"}}]}, "tool_calls"),
    ]
    out, events = stream_of(job, chunks)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    types = [e["type"] for e in out]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert out[0]["response"]["status"] == "in_progress"
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 4
    assert [e["delta"] for e in out if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    args = {
        e["output_index"]: e["arguments"] for e in out if e["type"] == "response.function_call_arguments.done"
    }
    assert args == {2: '{"a":1}', 3: "{}"}
    names = [e["name"] for e in out if e["type"] == "response.function_call_arguments.done"]
    assert names == ["f", "g"]
    added = [e["item"] for e in out if e["type"] == "response.output_item.added"]
    assert added[2]["call_id"] == "c1" and added[2]["name"] == "f"

    final = out[-1]["response"]
    Response.model_validate(final)
    assert final == events.final
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Hello"

    # The same answer read back whole, as GET /v1/responses/{id} reads a finished job.
    assert events.final is not None
    job.state, job.finished_at = JobState.SUCCEEDED, events.final["completed_at"]
    job.usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    job.result = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "reasoning_content": "hm",
                    "content": "Hello",
                    "tool_calls": [d["delta"]["tool_calls"][0] for d in (c[0] for c in chunks[3:])],
                },
            }
        ]
    }
    assert response_object(job)["output"] == final["output"]


def test_a_background_stream_says_queued_first() -> None:
    job = response_job({"input": "x", "background": True})
    events = ResponseEvents(job)
    opening = events.opening()
    assert [(e["type"], e["response"]["status"]) for e in opening] == [
        ("response.created", "queued"),
        ("response.queued", "queued"),
    ]
    assert [e["type"] for e in events.started()] == ["response.in_progress"]
    assert events.started() == []  # a retry's second start says nothing new


def test_replays_number_events_alike() -> None:
    job = response_job({"input": "x"}, JobState.RUNNING)
    chunks = [chunk({"content": "a"}), chunk({"content": "b"}, "length")]
    first, _ = stream_of(job, chunks)
    second, _ = stream_of(job, chunks)
    assert first == second and first[-1]["type"] == "response.incomplete"


def test_an_empty_answer_is_an_empty_message() -> None:
    out, events = stream_of(
        response_job({"input": "x"}, JobState.RUNNING), [chunk({"role": "assistant"}, "stop")]
    )
    assert events.final is not None and events.final["output"][0]["content"][0]["text"] == ""
    assert "response.content_part.added" in [e["type"] for e in out]


def test_failures_and_retries() -> None:
    job = response_job({"input": "x"}, JobState.RUNNING)
    events = ResponseEvents(job)
    events.opening()
    assert events.retried() == []  # nothing sent yet: the retry is invisible
    events.chunk(chunk({"content": "a"}))
    [failed] = events.retried()
    EVENTS.validate_python(failed)
    assert failed["type"] == "response.failed" and failed["response"]["error"]["code"] == "server_error"
    assert failed["response"]["output"][0]["status"] == "incomplete" and events.ended

    cancelled = ResponseEvents(job)
    cancelled.opening()
    [event] = cancelled.failed(JobState.CANCELLED, {"message": "cancelled", "type": "server_error"})
    assert event["response"]["status"] == "cancelled" and event["response"]["error"] is None


def test_odd_engine_chunks_say_nothing() -> None:
    events = ResponseEvents(response_job({"input": "x"}, JobState.RUNNING))
    events.opening()
    for choices in (
        ["x"],
        [{"delta": "text"}],
        [{"delta": {"tool_calls": 5}}],
        [{"index": 1, "delta": {"content": "n"}}],
    ):
        assert events.chunk(choices) == []
    weird = events.chunk([{"delta": {"tool_calls": [{"function": "f"}]}}])
    assert [e["type"] for e in weird] == ["response.output_item.added"]


# --- whatever a client sends --------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
parts = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["input_text", "output_text", "refusal", "input_image", "input_file"]),
            "text": json_values,
            "refusal": json_values,
            "image_url": json_values,
        },
    ),
    max_size=3,
)
items = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"]),
        "role": st.sampled_from(["user", "assistant", "developer", "tool"]),
        "content": st.text(max_size=4) | parts | json_values,
        "call_id": st.text(max_size=4) | json_values,
        "name": st.text(max_size=4) | json_values,
        "arguments": json_values,
        "output": st.text(max_size=4) | parts | json_values,
    },
)
tools = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["function", "web_search"]),
        "name": json_values,
        "parameters": json_values,
    },
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "input": st.text(max_size=4) | st.lists(items, max_size=4) | json_values,
        "instructions": st.text(max_size=4) | json_values,
        "tools": st.lists(tools, max_size=2) | json_values,
        "tool_choice": st.sampled_from(["auto", "none", "required", "x"])
        | st.dictionaries(st.sampled_from(["type", "name", "mode", "tools"]), json_values),
        "text": st.fixed_dictionaries({"format": json_values}) | json_values,
        "reasoning": json_values,
    },
)


@given(bodies)
@settings(max_examples=200, deadline=None)
def test_any_body_is_translated_or_refused_cleanly(body: dict[str, Any]) -> None:
    try:
        parsed = ResponseRequest.model_validate(body).model_dump(exclude_none=True, mode="json")
    except ValidationError:
        return
    try:
        plan = chat_plan(parsed)
    except RequestRejected as rejection:
        assert rejection.status == 400 and rejection.message
        return
    assert plan.body["messages"] and json.dumps(plan.body)
