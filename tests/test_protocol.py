"""The OpenAI wire shapes of sluice.protocol, and the Assembler that builds a whole response from chunks.

Known field losses of today's Assembler are not asserted here as if they were correct (they are a
separate issue): tool-call fragments are appended rather than merged by index, logprobs are
dropped, and a chat message with tool calls gets ``content: ""`` where OpenAI sends null.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sluice.core.job import Endpoint, Job
from sluice.protocol import Assembler, chunk, error_body, response_id
from tests.helpers import FakeClock, make_job


def chat_job() -> Job:
    return make_job(FakeClock(), model="m", prompt_tokens=11)


def completions_job() -> Job:
    job = chat_job()
    return dataclasses.replace(job, endpoint=Endpoint.COMPLETIONS, body={"model": "m", "prompt": "p"})


def delta(
    content: str | None = None, *, index: int = 0, finish: str | None = None, **fields: Any
) -> dict[str, Any]:
    d: dict[str, Any] = dict(fields)
    if content is not None:
        d["content"] = content
    return {"choices": [{"index": index, "delta": d, "finish_reason": finish}]}


def text(piece: str, *, index: int = 0, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": index, "text": piece, "finish_reason": finish}]}


USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


# -- identity and small shapes -------------------------------------------------------------------


def test_response_ids_carry_the_job_id_under_openais_prefixes() -> None:
    chat, completions = chat_job(), completions_job()
    assert chat.id.startswith("job_") and completions.id.startswith("job_")
    assert response_id(chat) == "chatcmpl-" + chat.id.removeprefix("job_")
    assert response_id(completions) == "cmpl-" + completions.id.removeprefix("job_")


def test_error_body_is_openais_error_object() -> None:
    assert error_body("no", "invalid_request_error", "bad", param="model") == {
        "error": {"message": "no", "type": "invalid_request_error", "param": "model", "code": "bad"}
    }
    assert error_body("x", "server_error", None)["error"]["param"] is None


def test_a_chunk_carries_the_jobs_identity_whatever_engine_made_it() -> None:
    job = chat_job()
    choices = [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]
    out = chunk(job, choices)
    assert out == {
        "id": response_id(job),
        "object": "chat.completion.chunk",
        "created": int(job.created_at),
        "model": "m",
        "choices": choices,
    }
    with_usage = chunk(completions_job(), [], USAGE)
    assert with_usage["object"] == "text_completion" and with_usage["usage"] == USAGE


# -- chat ----------------------------------------------------------------------------------------


def test_chat_deltas_join_into_one_assistant_message() -> None:
    job = chat_job()
    a = Assembler(job)
    a.add(delta("Hel", role="assistant"))
    a.add(delta("lo"))
    a.add(delta(", world", finish="stop"))
    a.add({"choices": [], "usage": USAGE})
    r = a.response()
    assert r["id"] == response_id(job)
    assert r["object"] == "chat.completion"
    assert r["created"] == int(job.created_at) and r["model"] == "m"
    [choice] = r["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "Hello, world"}
    assert r["usage"] == USAGE


def test_the_role_a_delta_names_is_kept_and_assistant_is_the_default() -> None:
    a = Assembler(chat_job())
    a.add(delta("x"))
    assert a.response()["choices"][0]["message"]["role"] == "assistant"
    b = Assembler(chat_job())
    b.add(delta("x", role="tool"))
    b.add(delta("y"))
    assert b.response()["choices"][0]["message"]["role"] == "tool"


def test_add_returns_the_choices_to_relay_and_nothing_for_a_usage_chunk() -> None:
    a = Assembler(chat_job())
    data = delta("a", role="assistant")
    assert a.add(data) == data["choices"]
    assert a.add({"choices": [], "usage": USAGE}) == []
    assert a.add({"choices": ["not a choice", None]}) == []
    assert a.response()["choices"][0]["message"]["content"] == "a"


def test_a_delta_without_content_relays_but_adds_no_text() -> None:
    a = Assembler(chat_job())
    a.add(delta(role="assistant"))  # engines often open with the role alone
    a.add(delta("", finish=None))
    a.add(delta("x"))
    a.add(delta(finish="length"))
    assert a.tokens == 1
    [choice] = a.response()["choices"]
    assert choice["message"]["content"] == "x" and choice["finish_reason"] == "length"


def test_a_whole_tool_call_in_one_delta_reaches_the_message() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    a = Assembler(chat_job())
    a.add(delta(role="assistant", tool_calls=[call]))
    a.add(delta(finish="tool_calls"))
    [choice] = a.response()["choices"]
    assert choice["message"]["tool_calls"] == [call]
    assert choice["finish_reason"] == "tool_calls"
    # Not asserted: fragments of one call spread over several deltas (OpenAI's own streaming) are
    # appended, not merged by index, and content is "" rather than null: known gaps.


def test_a_chat_message_has_no_tool_calls_key_when_there_were_none() -> None:
    a = Assembler(chat_job())
    a.add(delta("x", finish="stop"))
    assert "tool_calls" not in a.response()["choices"][0]["message"]


# -- completions ---------------------------------------------------------------------------------


def test_completion_text_joins_and_the_response_is_a_text_completion() -> None:
    job = completions_job()
    a = Assembler(job)
    for piece in ("Once", " upon", " a time"):
        a.add(text(piece))
    a.add(text("", finish="length"))
    a.add({"choices": [], "usage": USAGE})
    r = a.response()
    assert r["id"] == response_id(job) and r["id"].startswith("cmpl-")
    assert r["object"] == "text_completion"
    [choice] = r["choices"]
    assert choice["index"] == 0 and choice["text"] == "Once upon a time"
    assert choice["finish_reason"] == "length"
    assert "message" not in choice
    assert r["usage"] == USAGE


def test_a_completions_job_ignores_chat_deltas() -> None:
    a = Assembler(completions_job())
    a.add(delta("chat words"))
    a.add(text("text"))
    assert a.response()["choices"][0]["text"] == "text"


# -- usage ---------------------------------------------------------------------------------------


def test_usage_may_ride_on_a_chunk_that_also_has_choices() -> None:
    a = Assembler(chat_job())
    a.add({**delta("x", finish="stop"), "usage": USAGE})
    assert a.final_usage() == USAGE and a.response()["usage"] == USAGE


def test_the_last_usage_the_engine_sends_wins() -> None:
    a = Assembler(chat_job())
    a.add({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1}})
    a.add({"choices": [], "usage": USAGE})
    a.add({"choices": [], "usage": None})  # some engines send null usage on every chunk
    assert a.final_usage() == USAGE


def test_without_engine_usage_the_job_estimate_and_the_content_chunks_stand_in() -> None:
    a = Assembler(chat_job())
    for piece in ("a", "b", "c"):
        a.add(delta(piece))
    assert a.usage is None
    assert a.final_usage() == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    assert a.response()["usage"] == a.final_usage()


# -- several choices (n > 1) ---------------------------------------------------------------------


def test_interleaved_choices_are_kept_apart_and_ordered_by_index() -> None:
    a = Assembler(chat_job())
    a.add(delta("B1", index=1, role="assistant"))
    a.add(delta("A1", index=0, role="assistant"))
    a.add(delta("B2", index=1, finish="length"))
    a.add(delta("A2", index=0, finish="stop"))
    r = a.response()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in r["choices"]] == ["A1A2", "B1B2"]
    assert [c["finish_reason"] for c in r["choices"]] == ["stop", "length"]
    assert a.tokens == 4


def test_completion_choices_are_kept_apart_too() -> None:
    a = Assembler(completions_job())
    a.add({"choices": [{"index": 1, "text": "y"}, {"index": 0, "text": "x"}]})
    a.add(text("z", index=1, finish="stop"))
    assert [c["text"] for c in a.response()["choices"]] == ["x", "yz"]


# -- a whole answer as one chunk (OpenAIBackend's non-streaming path) ----------------------------


def test_a_whole_answer_in_chunk_shape_assembles_like_a_stream() -> None:
    whole = {
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": "all of it"}, "finish_reason": "length"}
        ],
        "usage": USAGE,
    }
    a = Assembler(chat_job())
    a.add(whole)
    [choice] = a.response()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "all of it"}
    assert choice["finish_reason"] == "length" and a.final_usage() == USAGE
