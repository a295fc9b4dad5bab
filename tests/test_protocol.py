"""The OpenAI wire shapes of sluice.protocol, and the Assembler that builds a whole response from chunks.

The chunk sequences below are written by hand in the shapes the engines send (the simulator emits
neither tool calls, logprobs nor reasoning): OpenAI's own streams (refusal, service_tier,
obfuscation), vLLM's (hermes tool parser fragments, reasoning_content, stop_reason, token_ids,
completions logprobs) and llama-server's (system_fingerprint, timings, tool calls opened with empty
arguments). The shapes follow the openai SDK's types (ChatCompletionChunk, ChatCompletion,
Completion). The end-to-end tests at the bottom replay such a recording from a small engine of their
own, through OpenAIBackend, the dispatcher and the gateway, on both paths a job can take.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import types
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from hypothesis import example, given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion

from sluice import protocol
from sluice.core.job import Endpoint, Job
from sluice.protocol import (
    Assembler,
    TokenChunks,
    chunk,
    chunk_fields,
    compact_json,
    error_body,
    loads,
    response_id,
)
from tests.helpers import FakeClock, make_job
from tests.servers import Gateway, run_app, run_gateway


def chat_job() -> Job:
    return make_job(FakeClock(), model="m", prompt_tokens=11)


def completions_job() -> Job:
    job = chat_job()
    return dataclasses.replace(job, endpoint=Endpoint.COMPLETIONS, body={"model": "m", "prompt": "p"})


_UNSAID: Any = object()


def delta(
    content: str | None = _UNSAID, *, index: int = 0, finish: str | None = None, **fields: Any
) -> dict[str, Any]:
    """A chat chunk; ``content=None`` sends an explicit null, as many engines do."""
    d: dict[str, Any] = dict(fields)
    if content is not _UNSAID:
        d["content"] = content
    return {"choices": [{"index": index, "delta": d, "finish_reason": finish}]}


def text(piece: str, *, index: int = 0, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": index, "text": piece, "finish_reason": finish}]}


def assemble(job: Job, chunks: list[dict[str, Any]]) -> dict[str, Any]:
    a = Assembler(job)
    for data in chunks:
        a.add(data)
    return a.response()


def as_engine_chunk(whole: dict[str, Any]) -> dict[str, Any]:
    """A whole chat answer as OpenAIBackend yields it: every field, each choice's message as its delta."""
    choices = [
        {**{k: v for k, v in c.items() if k != "message"}, "delta": c["message"]} for c in whole["choices"]
    ]
    return {**whole, "choices": choices}


def in_job_identity(job: Job, whole: dict[str, Any]) -> dict[str, Any]:
    return {
        **whole,
        "id": response_id(job),
        "created": int(job.created_at),
        "model": job.model,
    }


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
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": "Hello, world", "refusal": None},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert r["usage"] == USAGE


def test_the_role_a_delta_names_is_kept_and_assistant_is_the_default() -> None:
    a = Assembler(chat_job())
    a.add(delta("x"))
    assert a.response()["choices"][0]["message"]["role"] == "assistant"
    b = Assembler(chat_job())
    b.add(delta("x", role="tool"))
    b.add(delta("y", role="tool"))  # repeated on every chunk by some engines: not "tooltool"
    assert b.response()["choices"][0]["message"]["role"] == "tool"
    c = Assembler(chat_job())
    c.add(delta("", role=""))  # an empty role names none yet
    c.add(delta("x", role="tool"))
    assert c.response()["choices"][0]["message"]["role"] == "tool"


def test_add_returns_the_choices_to_relay_and_nothing_for_a_usage_chunk() -> None:
    a = Assembler(chat_job())
    data = delta("a", role="assistant")
    assert a.add(data) == data["choices"]
    assert a.add({"choices": [], "usage": USAGE}) == []
    assert a.add({"choices": ["not a choice", None]}) == []
    assert a.response()["choices"][0]["message"]["content"] == "a"


def test_the_relayed_choices_are_the_objects_among_them_in_order() -> None:
    a = Assembler(chat_job())
    first, second = {"index": 1, "delta": {"content": "a"}}, {"index": 0, "delta": {"content": "b"}}
    assert a.add({"choices": [first, "not a choice", second]}) == [first, second]
    assert a.add({"choices": (second,)}) == [second]  # not a list: a list all the same
    assert [c["message"]["content"] for c in a.response()["choices"]] == ["bb", "a"]


COMMON_SHAPES = [
    [delta("a", role="assistant"), delta("b"), delta(""), delta("c", finish="stop")],
    [delta(None, role="assistant"), delta("a"), delta(None), delta("b"), delta(finish="length")],
    [delta(role="assistant"), delta("", finish=None), delta("x"), delta("y", index=1), delta("z")],
    [delta(None, reasoning_content="r"), delta("a"), delta(None, reasoning_content="s"), delta("b")],
    [{"choices": [{"index": True, "delta": {"content": "a"}}]}, delta("b", index=1), delta("c", index="0")],
]


@pytest.mark.parametrize("chunks", COMMON_SHAPES)
def test_a_piece_of_content_folds_as_the_general_fold_folds_it(chunks: list[dict[str, Any]]) -> None:
    # The same chunks with each delta a Mapping that is not a dict (so the general fold takes
    # every one): the same answer, the same count of generated chunks, the same choices relayed.
    job = chat_job()
    short, general = Assembler(job), Assembler(job)
    folded: list[Any] = []  # the deltas the short way left to the general fold
    fold = short._add_delta

    def counted(c: Any, delta: Any) -> None:
        folded.append(delta)
        fold(c, delta)

    short._add_delta = counted  # type: ignore[method-assign]
    for data in chunks:
        proxied = copy.deepcopy(data)
        for choice in proxied["choices"]:
            choice["delta"] = types.MappingProxyType(choice["delta"])
        assert short.add(copy.deepcopy(data)) == data["choices"]
        assert [{**c, "delta": dict(c["delta"])} for c in general.add(proxied)] == data["choices"]
    assert short.response() == general.response()
    assert short.tokens == general.tokens
    assert len(folded) < len(chunks)  # the short way was taken: two ways compared, not one twice


def test_the_chunks_relayed_are_never_changed_by_what_follows() -> None:
    # The dispatcher publishes each chunk's choices as they come: folding later chunks into the
    # answer must not reach back into them.
    first = delta("a", role="assistant", tool_calls=[{"index": 0, "id": "c", "function": {"arguments": "{"}}])
    first["choices"][0]["logprobs"] = {"content": [{"token": "a", "logprob": -0.5, "top_logprobs": []}]}
    kept = copy.deepcopy(first)
    a = Assembler(chat_job())
    a.add(first)
    second = delta("b", tool_calls=[{"index": 0, "function": {"arguments": "}"}}])
    second["choices"][0]["logprobs"] = {"content": [{"token": "b", "logprob": -0.1, "top_logprobs": []}]}
    a.add(second)
    a.response()
    assert first == kept


def test_a_delta_without_content_relays_but_adds_no_text() -> None:
    a = Assembler(chat_job())
    a.add(delta(role="assistant"))  # engines often open with the role alone
    a.add(delta("", finish=None))
    a.add(delta("x"))
    a.add(delta(finish="length"))
    assert a.tokens == 1
    [choice] = a.response()["choices"]
    assert choice["message"]["content"] == "x" and choice["finish_reason"] == "length"


def test_an_empty_answer_has_empty_content_and_finish_reason_stop_by_default() -> None:
    [choice] = assemble(chat_job(), [delta(role="assistant")])["choices"]
    assert choice["message"] == {"role": "assistant", "content": "", "refusal": None}
    assert choice["finish_reason"] == "stop"
    [empty] = assemble(chat_job(), [{"choices": []}])["choices"]  # no choice at all
    assert empty["index"] == 0 and empty["message"]["content"] == ""


def test_content_the_engine_said_was_null_stays_null() -> None:
    # vLLM with a reasoning parser, cut by max_tokens before the answer began: only reasoning.
    r = assemble(
        chat_job(),
        [
            delta(None, role="assistant"),
            delta(None, reasoning_content="Let me think"),
            delta(None, reasoning_content=" about it", finish="length"),
        ],
    )
    message = r["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"] == "Let me think about it"


# -- tool calls ----------------------------------------------------------------------------------


def tool_call(index: int, **fields: Any) -> dict[str, Any]:
    return {"index": index, **fields}


def test_openai_streamed_tool_call_fragments_merge_into_one_call() -> None:
    # OpenAI's own stream: the first fragment names the call, the rest carry pieces of arguments.
    chunks = [
        delta(
            role="assistant",
            content=None,
            refusal=None,
            tool_calls=[
                tool_call(
                    0, id="call_Ab12", type="function", function={"name": "get_weather", "arguments": ""}
                )
            ],
        ),
        delta(tool_calls=[tool_call(0, function={"arguments": '{"'})]),
        delta(tool_calls=[tool_call(0, function={"arguments": 'city":"'})]),
        delta(tool_calls=[tool_call(0, function={"arguments": 'Paris"}'})]),
        delta(finish="tool_calls"),
    ]
    [choice] = assemble(chat_job(), chunks)["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,  # OpenAI's null, never ""
        "refusal": None,
        "tool_calls": [
            {
                "id": "call_Ab12",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            }
        ],
    }
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_vllm_parallel_tool_calls_merge_by_index_in_order() -> None:
    # vLLM's hermes parser: content "" first, each call opened with its name (no arguments key),
    # then argument pieces; the calls' fragments may interleave.
    chunks = [
        delta("", role="assistant"),
        delta(
            tool_calls=[tool_call(0, id="chatcmpl-tool-1", type="function", function={"name": "get_weather"})]
        ),
        delta(tool_calls=[tool_call(0, function={"arguments": '{"city": "Par'})]),
        delta(
            tool_calls=[tool_call(1, id="chatcmpl-tool-2", type="function", function={"name": "get_time"})]
        ),
        delta(tool_calls=[tool_call(0, function={"arguments": 'is"}'})]),
        delta(tool_calls=[tool_call(1, function={"arguments": '{"tz": "CET"}'})]),
        {
            "choices": [
                {"index": 0, "delta": {"content": ""}, "finish_reason": "tool_calls", "stop_reason": None}
            ]
        },
    ]
    message = assemble(chat_job(), chunks)["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {
            "id": "chatcmpl-tool-1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {
            "id": "chatcmpl-tool-2",
            "type": "function",
            "function": {"name": "get_time", "arguments": '{"tz": "CET"}'},
        },
    ]


def test_several_fragments_of_one_call_in_one_delta_merge_too() -> None:
    chunks = [
        delta(
            tool_calls=[
                tool_call(0, id="c1", type="function", function={"name": "f", "arguments": '{"a":'}),
                tool_call(0, function={"arguments": " 1}"}),
            ]
        )
    ]
    [call] = assemble(chat_job(), chunks)["choices"][0]["message"]["tool_calls"]
    assert call == {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_a_name_and_id_repeated_on_every_fragment_are_kept_once() -> None:
    chunks = [
        delta(
            tool_calls=[
                tool_call(0, id="c1", type="function", function={"name": "lookup", "arguments": '{"q":'})
            ]
        ),
        delta(
            tool_calls=[
                tool_call(0, id="c1", type="function", function={"name": "lookup", "arguments": ' "x"}'})
            ]
        ),
    ]
    [call] = assemble(chat_job(), chunks)["choices"][0]["message"]["tool_calls"]
    assert call == {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}


def test_fragments_without_an_index_follow_their_id_or_the_last_call() -> None:
    # Engines that leave index out: a new id opens a call, a fragment without one continues the last.
    chunks = [
        delta(tool_calls=[{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{"}}]),
        delta(tool_calls=[{"function": {"arguments": "}"}}]),
        delta(tool_calls=[{"id": "b", "type": "function", "function": {"name": "g", "arguments": "[]"}}]),
    ]
    calls = assemble(chat_job(), chunks)["choices"][0]["message"]["tool_calls"]
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("a", "f", "{}"),
        ("b", "g", "[]"),
    ]


def test_a_new_id_at_a_used_index_is_a_new_call() -> None:
    # Some engines send each whole call in its own delta, every one at index 0.
    chunks = [
        delta(tool_calls=[tool_call(0, id="a", type="function", function={"name": "f", "arguments": "{}"})]),
        delta(tool_calls=[tool_call(0, id="b", type="function", function={"name": "g", "arguments": "{}"})]),
    ]
    calls = assemble(chat_job(), chunks)["choices"][0]["message"]["tool_calls"]
    assert [c["id"] for c in calls] == ["a", "b"] and [c["function"]["name"] for c in calls] == ["f", "g"]


def test_a_call_without_a_type_is_a_function_call() -> None:
    chunks = [delta(tool_calls=[tool_call(0, id="a", function={"name": "f", "arguments": "{}"})])]
    [call] = assemble(chat_job(), chunks)["choices"][0]["message"]["tool_calls"]
    assert call["type"] == "function" and "index" not in call


def test_text_before_a_tool_call_is_kept() -> None:
    chunks = [
        delta("Checking", role="assistant"),
        delta(" the weather."),
        delta(tool_calls=[tool_call(0, id="a", type="function", function={"name": "f", "arguments": "{}"})]),
        delta(finish="tool_calls"),
    ]
    message = assemble(chat_job(), chunks)["choices"][0]["message"]
    assert message["content"] == "Checking the weather." and len(message["tool_calls"]) == 1


def test_a_chat_message_has_no_tool_calls_key_when_there_were_none() -> None:
    a = Assembler(chat_job())
    a.add(delta("x", finish="stop"))
    assert "tool_calls" not in a.response()["choices"][0]["message"]


def test_the_deprecated_function_call_folds_like_a_tool_call() -> None:
    chunks = [
        delta(role="assistant", content=None, function_call={"name": "f", "arguments": ""}),
        delta(function_call={"arguments": '{"x":'}),
        delta(function_call={"arguments": " 1}"}, finish="function_call"),
    ]
    message = assemble(chat_job(), chunks)["choices"][0]["message"]
    assert message["function_call"] == {"name": "f", "arguments": '{"x": 1}'}
    assert message["content"] is None


# -- refusal, reasoning, logprobs ----------------------------------------------------------------


def token(t: str, logprob: float) -> dict[str, Any]:
    return {
        "token": t,
        "logprob": logprob,
        "bytes": list(t.encode()),
        "top_logprobs": [{"token": t, "logprob": logprob, "bytes": list(t.encode())}],
    }


def test_an_openai_refusal_streams_into_refusal_with_its_logprobs() -> None:
    # OpenAI with structured outputs: content stays null, the refusal comes in pieces, and its
    # tokens' logprobs under logprobs.refusal.
    def piece(s: str, lp: float) -> dict[str, Any]:
        data = delta(refusal=s)
        data["choices"][0]["logprobs"] = {"content": None, "refusal": [token(s, lp)]}
        return data

    chunks = [
        delta(role="assistant", content=None, refusal=""),
        piece("I'm sorry", -0.01),
        piece(", I can't", -0.2),
        piece(" help.", -0.03),
        delta(finish="stop"),
    ]
    [choice] = assemble(chat_job(), chunks)["choices"]
    assert choice["message"] == {"role": "assistant", "content": None, "refusal": "I'm sorry, I can't help."}
    assert choice["logprobs"] == {
        "content": None,
        "refusal": [token("I'm sorry", -0.01), token(", I can't", -0.2), token(" help.", -0.03)],
    }


def test_chat_logprobs_accumulate_in_order() -> None:
    def piece(s: str, lp: float, finish: str | None = None) -> dict[str, Any]:
        data = delta(s, finish=finish)
        data["choices"][0]["logprobs"] = {"content": [token(s, lp)]}
        return data

    chunks = [
        delta("", role="assistant"),
        piece("Hello", -0.1),
        piece(",", -0.5),
        piece(" you", -1.5, "length"),
    ]
    [choice] = assemble(chat_job(), chunks)["choices"]
    assert choice["message"]["content"] == "Hello, you"
    assert choice["logprobs"] == {"content": [token("Hello", -0.1), token(",", -0.5), token(" you", -1.5)]}


def test_logprobs_are_null_when_the_engine_sent_none() -> None:
    chunks = [
        {"choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": "stop"}]}
    ]
    assert assemble(chat_job(), chunks)["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("name", ["reasoning_content", "reasoning"])
def test_reasoning_concatenates_under_the_engines_own_name(name: str) -> None:
    # vLLM and llama-server name it reasoning_content; newer vLLM, Ollama and OpenRouter reasoning.
    chunks = [
        delta(role="assistant", **{name: "The user"}),
        delta(**{name: " greets me."}),
        delta("Hi!", finish="stop"),
    ]
    message = assemble(chat_job(), chunks)["choices"][0]["message"]
    assert message[name] == "The user greets me." and message["content"] == "Hi!"
    assert message["refusal"] is None


def test_reasoning_and_tool_call_chunks_count_as_generated_without_usage() -> None:
    a = Assembler(chat_job())
    a.add(delta(role="assistant"))
    a.add(delta(reasoning_content="think"))
    a.add(
        delta(tool_calls=[tool_call(0, id="a", type="function", function={"name": "f", "arguments": "{}"})])
    )
    a.add(delta("done", finish="stop"))
    assert a.final_usage()["completion_tokens"] == 3


# -- what the chunk and the choice say besides the message ---------------------------------------


def test_system_fingerprint_and_service_tier_are_kept_and_the_identity_is_the_jobs() -> None:
    # OpenAI's chunks: its own id, created and model on each, system_fingerprint, service_tier and
    # the obfuscation padding (stream-only: no whole answer has it).
    job = chat_job()
    head = {
        "id": "chatcmpl-engine",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o-2024-08-06",
        "system_fingerprint": "fp_50cad350e4",
        "service_tier": "default",
    }
    chunks = [
        {**head, "obfuscation": "xK2", **delta("Hi", role="assistant")},
        {**head, "obfuscation": "q", **delta("!", finish="stop")},
        {**head, "choices": [], "usage": USAGE},
    ]
    r = assemble(job, chunks)
    assert r["id"] == response_id(job) and r["object"] == "chat.completion"
    assert r["created"] == int(job.created_at) and r["model"] == "m"
    assert r["system_fingerprint"] == "fp_50cad350e4" and r["service_tier"] == "default"
    assert "obfuscation" not in r
    assert r["usage"] == USAGE


def test_each_chunks_own_fields_are_kept_as_the_engine_sent_them_and_the_latest_folded() -> None:
    # A token event is last_fields beside the choices (tests/test_attempt.py, where it is built):
    # each chunk's own fields, never the engine's identity, usage or padding.
    job = chat_job()
    a = Assembler(job)
    head = {"id": "chatcmpl-engine", "object": "chat.completion.chunk", "created": 1, "model": "gpt"}
    first = {**head, "system_fingerprint": "fp_1", "service_tier": "default", "obfuscation": "x"}
    a.add({**first, **delta("Hi", role="assistant")})
    assert a.last_fields == {"system_fingerprint": "fp_1", "service_tier": "default"}
    # The next chunk says another fingerprint and a field of its own: last_fields says what it said.
    a.add({**head, "system_fingerprint": "fp_2", "timings": {"n": 1}, **delta("!")})
    assert a.last_fields == {"system_fingerprint": "fp_2", "timings": {"n": 1}}
    # A chunk with nothing but choices has no fields of its own.
    a.add(delta("?"))
    assert a.last_fields == {}
    # The whole answer keeps the latest value of each.
    r = a.response()
    assert (r["system_fingerprint"], r["service_tier"], r["timings"]) == ("fp_2", "default", {"n": 1})


def test_a_relayed_chunk_has_the_jobs_identity_and_the_engines_own_fields() -> None:
    job = completions_job()
    a = Assembler(job)
    engine = {"id": "cmpl-e", "object": "text_completion", "created": 5, "model": "e", "usage": USAGE}
    choices = a.add({**engine, "system_fingerprint": "fp_c", **text("a")})
    relayed = chunk(job, choices, fields={**a.last_fields, "choices": choices})  # a token event
    assert relayed == {
        "id": response_id(job),
        "object": "text_completion",
        "created": int(job.created_at),
        "model": "m",
        "system_fingerprint": "fp_c",
        "choices": choices,
    }
    # Fields that are Sluice's to say are never taken from what an engine sent.
    odd = chunk(job, [], usage=USAGE, fields={"id": "x", "model": "y", "choices": [1], "usage": {}})
    assert odd["id"] == response_id(job) and odd["model"] == "m"
    assert odd["choices"] == [] and odd["usage"] == USAGE


def test_unknown_fields_are_kept_text_in_deltas_joined_and_state_the_latest() -> None:
    # vLLM's stop_reason (null until the end) and token_ids (per chunk), llama-server's timings
    # (the chunk's, latest wins), an unknown delta text (joined like content).
    chunks = [
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "x_note": "a"},
                    "stop_reason": None,
                    "token_ids": [1],
                }
            ],
            "timings": {"predicted_n": 1, "predicted_ms": 5.0},
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "ok", "x_note": "b"},
                    "stop_reason": "</s>",
                    "token_ids": [2, 3],
                    "finish_reason": "stop",
                }
            ],
            "timings": {"predicted_n": 3, "predicted_ms": 9.5},
        },
        {"choices": [], "usage": USAGE, "timings": None},
    ]
    r = assemble(chat_job(), chunks)
    [choice] = r["choices"]
    assert choice["message"]["x_note"] == "ab"
    assert choice["stop_reason"] == "</s>" and choice["token_ids"] == [1, 2, 3]
    assert r["timings"] == {"predicted_n": 3, "predicted_ms": 9.5}


def test_the_latest_finish_reason_of_each_choice_wins() -> None:
    chunks = [delta("a", finish="length"), delta(index=1, content="b", finish="stop")]
    choices = assemble(chat_job(), chunks)["choices"]
    assert [c["finish_reason"] for c in choices] == ["length", "stop"]


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
    assert choice == {"index": 0, "text": "Once upon a time", "logprobs": None, "finish_reason": "length"}
    assert r["usage"] == USAGE


def test_completion_logprobs_accumulate_their_four_lists_in_order() -> None:
    # vLLM's streamed completions with logprobs=2: one token per chunk, text offsets absolute.
    def piece(t: str, offset: int, lp: float, finish: str | None = None) -> dict[str, Any]:
        logprobs = {
            "text_offset": [offset],
            "token_logprobs": [lp],
            "tokens": [t],
            "top_logprobs": [{t: lp, "?": -9.0}],
        }
        return {
            "id": "cmpl-vllm",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [
                {"index": 0, "text": t, "logprobs": logprobs, "finish_reason": finish, "stop_reason": None}
            ],
        }

    chunks = [
        piece("The", 5, -0.2),
        piece(" sky", 8, -1.0),
        piece(" is", 12, -0.1, "length"),
        {"choices": [], "usage": USAGE},
    ]
    [choice] = assemble(completions_job(), chunks)["choices"]
    assert choice["text"] == "The sky is" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "text_offset": [5, 8, 12],
        "token_logprobs": [-0.2, -1.0, -0.1],
        "tokens": ["The", " sky", " is"],
        "top_logprobs": [{"The": -0.2, "?": -9.0}, {" sky": -1.0, "?": -9.0}, {" is": -0.1, "?": -9.0}],
    }
    assert choice["stop_reason"] is None
    sdk = Completion.model_validate(assemble(completions_job(), chunks))
    assert sdk.choices[0].logprobs is not None and sdk.choices[0].logprobs.tokens == ["The", " sky", " is"]


def test_a_completions_job_ignores_chat_deltas() -> None:
    a = Assembler(completions_job())
    a.add(delta("chat words"))
    a.add(text("text"))
    [choice] = a.response()["choices"]
    assert choice["text"] == "text" and "delta" not in choice


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


def test_each_choice_merges_its_own_tool_calls() -> None:
    chunks = [
        delta(
            index=0,
            tool_calls=[tool_call(0, id="a", type="function", function={"name": "f", "arguments": "{"})],
        ),
        delta(
            index=1,
            tool_calls=[tool_call(0, id="b", type="function", function={"name": "g", "arguments": "["})],
        ),
        delta(index=1, tool_calls=[tool_call(0, function={"arguments": "]"})], finish="tool_calls"),
        delta(index=0, tool_calls=[tool_call(0, function={"arguments": "}"})], finish="tool_calls"),
    ]
    choices = assemble(chat_job(), chunks)["choices"]
    assert [[c["function"]["arguments"] for c in ch["message"]["tool_calls"]] for ch in choices] == [
        ["{}"],
        ["[]"],
    ]
    assert [ch["message"]["tool_calls"][0]["id"] for ch in choices] == ["a", "b"]


def test_completion_choices_are_kept_apart_too() -> None:
    a = Assembler(completions_job())
    a.add({"choices": [{"index": 1, "text": "y"}, {"index": 0, "text": "x"}]})
    a.add(text("z", index=1, finish="stop"))
    assert [c["text"] for c in a.response()["choices"]] == ["x", "yz"]


# -- a whole answer as one chunk (OpenAIBackend's non-streaming path) ----------------------------

#: vLLM's whole answer (reasoning and tool parsers on, logprobs asked for), as it sends it.
VLLM_WHOLE: dict[str, Any] = {
    "id": "chatcmpl-9f3c2b",
    "object": "chat.completion",
    "created": 1750000000,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "reasoning_content": "The user asks for the weather.",
                "content": None,
                "tool_calls": [
                    {
                        "id": "chatcmpl-tool-41d0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            "logprobs": {"content": [token("<tool_call>", -0.02)]},
            "finish_reason": "tool_calls",
            "stop_reason": None,
        }
    ],
    "usage": {
        "prompt_tokens": 30,
        "total_tokens": 52,
        "completion_tokens": 22,
        "prompt_tokens_details": None,
    },
    "prompt_logprobs": None,
    "kv_transfer_params": None,
}


def test_a_whole_answer_passes_through_as_the_engine_sent_it_in_the_jobs_identity() -> None:
    job = chat_job()
    a = Assembler(job)
    a.add(as_engine_chunk(VLLM_WHOLE))
    expected = in_job_identity(job, VLLM_WHOLE)
    expected["choices"][0]["message"] = {**VLLM_WHOLE["choices"][0]["message"], "refusal": None}
    assert a.response() == expected
    assert a.final_usage() == VLLM_WHOLE["usage"]


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
    assert choice["message"] == {"role": "assistant", "content": "all of it", "refusal": None}
    assert choice["finish_reason"] == "length" and a.final_usage() == USAGE


def test_a_whole_answers_several_tool_calls_stay_apart() -> None:
    # A whole message's calls carry no index: each is its own call, in order.
    whole = copy.deepcopy(VLLM_WHOLE)
    calls = whole["choices"][0]["message"]["tool_calls"]
    calls.append(
        {"id": "chatcmpl-tool-77aa", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    )
    r = assemble(chat_job(), [as_engine_chunk(whole)])
    assert r["choices"][0]["message"]["tool_calls"] == calls


# -- end to end: a recorded engine behind the gateway, both paths ---------------------------------

#: llama-server's stream for one answer (--jinja, --reasoning-format deepseek, logprobs asked
#: for): reasoning, then one tool call opened with empty arguments and filled in pieces, timings
#: on the last chunks, then the usage chunk. Written by hand in llama-server's shapes.
_HEAD = {"created": 1750000000, "id": "chatcmpl-Qx7", "model": "replay", "system_fingerprint": "b6123-4a1c"}
_TIMINGS = {"prompt_n": 31, "prompt_ms": 12.5, "predicted_n": 6, "predicted_ms": 40.1}
_CALL_ARGS = ['{"city":', '"Paris"}']
_STREAM: list[dict[str, Any]] = [
    {
        **_HEAD,
        "object": "chat.completion.chunk",
        "choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}],
    },
    *(
        {
            **_HEAD,
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "finish_reason": None,
                    "index": 0,
                    "delta": {"reasoning_content": piece},
                    "logprobs": {"content": [token(piece, lp)]},
                }
            ],
        }
        for piece, lp in (("Weather", -0.3), (" in Paris.", -0.05))
    ),
    {
        **_HEAD,
        "object": "chat.completion.chunk",
        "choices": [
            {
                "finish_reason": None,
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "gVx2Kc",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": ""},
                        }
                    ]
                },
            }
        ],
    },
    *(
        {
            **_HEAD,
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "finish_reason": None,
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": a}}]},
                }
            ],
        }
        for a in _CALL_ARGS
    ),
    {
        **_HEAD,
        "object": "chat.completion.chunk",
        "choices": [{"finish_reason": "tool_calls", "index": 0, "delta": {}}],
        "timings": _TIMINGS,
    },
    {
        **_HEAD,
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {"completion_tokens": 6, "prompt_tokens": 31, "total_tokens": 37},
        "timings": _TIMINGS,
    },
]
#: The same answer as llama-server sends it whole (stream: false).
_WHOLE: dict[str, Any] = {
    **_HEAD,
    "object": "chat.completion",
    "choices": [
        {
            "finish_reason": "tool_calls",
            "index": 0,
            "message": {
                "role": "assistant",
                "reasoning_content": "Weather in Paris.",
                "content": None,
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": "".join(_CALL_ARGS)},
                        "id": "gVx2Kc",
                    }
                ],
            },
            "logprobs": {"content": [token("Weather", -0.3), token(" in Paris.", -0.05)]},
        }
    ],
    "usage": {"completion_tokens": 6, "prompt_tokens": 31, "total_tokens": 37},
    "timings": _TIMINGS,
}
_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
_ASK = {
    "model": "replay",
    "messages": [{"role": "user", "content": "Weather in Paris?"}],
    "tools": _TOOLS,
    "logprobs": True,
    "top_logprobs": 1,
    "max_tokens": 64,
}


def _replay_engine(seen: list[dict[str, Any]]) -> FastAPI:
    """An engine that answers every chat request with the recording above, streamed or whole."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "replay", "object": "model"}]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        seen.append(body)
        if not body.get("stream"):
            return JSONResponse(_WHOLE)

        async def events() -> AsyncIterator[bytes]:
            for data in _STREAM:
                yield f"data: {json.dumps(data)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
async def replay() -> AsyncIterator[tuple[Gateway, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    async with run_app(_replay_engine(seen)) as engine, run_gateway([engine]) as gw:
        yield gw, seen


def _expected(answer_id: str, created: int) -> dict[str, Any]:
    expected = {**copy.deepcopy(_WHOLE), "id": answer_id, "created": created}
    expected["choices"][0]["message"]["refusal"] = None
    return expected


async def test_a_job_streamed_from_the_engine_answers_what_the_engine_said(
    replay: tuple[Gateway, list[dict[str, Any]]], http: httpx.AsyncClient
) -> None:
    gw, seen = replay
    r = await http.post(gw.url + "/v1/jobs", json=_ASK)
    assert r.status_code == 202, r.text
    done = (await http.get(f"{gw.url}/v1/jobs/{r.json()['id']}", params={"wait": 10})).json()
    assert done["status"] == "succeeded", done
    result = done["result"]
    [sent] = seen
    assert sent["stream"] is True  # a job streams from the engine
    assert sent["logprobs"] is True and sent["top_logprobs"] == 1 and sent["tools"] == _TOOLS
    assert result == _expected(result["id"], result["created"])
    assert result["id"] == "chatcmpl-" + done["id"].removeprefix("job_")
    assert json.loads(result["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris"
    }
    _read_by_the_sdk(result)


async def test_a_whole_answer_reaches_the_client_as_the_engine_sent_it(
    replay: tuple[Gateway, list[dict[str, Any]]], http: httpx.AsyncClient
) -> None:
    gw, seen = replay
    r = await http.post(gw.url + "/v1/chat/completions", json=_ASK)
    assert r.status_code == 200, r.text
    result = r.json()
    [sent] = seen
    assert sent["stream"] is False  # nobody reads its tokens: the engine sends the whole answer
    assert sent["logprobs"] is True and sent["top_logprobs"] == 1 and sent["tools"] == _TOOLS
    assert result == _expected(result["id"], result["created"])
    assert result["id"] != _WHOLE["id"] and result["id"].startswith("chatcmpl-")
    _read_by_the_sdk(result)


def _read_by_the_sdk(result: dict[str, Any]) -> None:
    """The answer as the openai SDK reads it: every field where the SDK looks for it."""
    sdk = ChatCompletion.model_validate(result)
    [choice] = sdk.choices
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert choice.message.content is None and choice.message.refusal is None
    assert choice.logprobs is not None and [t.token for t in choice.logprobs.content or []] == [
        "Weather",
        " in Paris.",
    ]
    assert sdk.system_fingerprint == "b6123-4a1c"


async def test_a_stream_relays_each_chunks_own_fields_as_the_engine_sent_them(
    replay: tuple[Gateway, list[dict[str, Any]]], http: httpx.AsyncClient
) -> None:
    gw, _ = replay
    body = {**_ASK, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", gw.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        payloads = [line[5:].strip() async for line in r.aiter_lines() if line.startswith("data:")]
    assert payloads[-1] == "[DONE]"
    relayed = [json.loads(p) for p in payloads[:-1]]
    sent = [c for c in _STREAM if c["choices"]]
    assert [c["choices"] for c in relayed[:-1]] == [c["choices"] for c in sent]
    for mine, theirs in zip(relayed, [*sent, _STREAM[-1]], strict=True):
        # The engine's own fields as each chunk had them (llama-server's timings on the last
        # ones only), in the job's identity.
        assert mine["system_fingerprint"] == theirs["system_fingerprint"]
        assert mine.get("timings") == theirs.get("timings")
        assert mine["id"].startswith("chatcmpl-") and mine["id"] != theirs["id"]
    assert relayed[-1]["choices"] == [] and relayed[-1]["usage"] == _STREAM[-1]["usage"]


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS])
@pytest.mark.parametrize(
    "data",
    [
        {"choices": [{"index": 0, "delta": {"content": 'hé \u2028 "x"'}, "finish_reason": None}]},
        {
            "id": "engine-id",
            "object": "x",
            "created": 1,
            "model": "engine-model",
            "system_fingerprint": "fp_1",
            "choices": [{"index": 0, "text": "a", "finish_reason": "stop", "logprobs": None}],
            "service_tier": "default",
            "obfuscation": "pad",
            "usage": {"total_tokens": 3},
        },
        {"choices": None, "extra": [1.5, None, True]},
        {},
        # one key: the choices alone take a short way, anything else the whole one
        {"choices": [{"index": 1, "delta": {"tool_calls": [{"index": 0, "id": "c"}]}}]},
        {"choices": []},
        {"choices": None},
        {"usage": {"total_tokens": 1}},
    ],
)
def test_token_chunks_encode_the_characters_a_whole_chunk_does(
    endpoint: Endpoint, data: dict[str, Any]
) -> None:
    """The relay's per-job encoder writes what json.dumps of the chunk wrote, character for character."""
    job = dataclasses.replace(make_job(model='m "quoted" é'), endpoint=endpoint)
    expected = json.dumps(chunk(job, data.get("choices") or [], fields=chunk_fields(data)))
    assert TokenChunks(job).encode(data) == expected


def test_token_chunks_refuse_what_json_dumps_refuses() -> None:
    job = make_job()
    with pytest.raises(TypeError, match="not JSON serializable"):
        TokenChunks(job).encode({"choices": [{"index": 0, "delta": {"content": object()}}]})
    with pytest.raises(TypeError):
        TokenChunks(job).encode({"choices": [{1j: "a complex key"}]})


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "h\xc3\xa9"}',
        '\ufeff{"a": 1}'.encode(),
        '{"a": "é"}'.encode("utf-16"),
        '{"a": "é"}'.encode("utf-16-le"),
        '{"a": 1}'.encode("utf-32"),
        b"[1]",
        b"1",
        b"",
        b"\xff{}",
        b'{"a": "\xed\xa0\x80"}',
        b"{nope",
        b'"\x00"',
        # One object and nothing else takes the scanner's short way; all around it, json.loads'.
        b"{}",
        b'{"a": {"b": [1, 2.5, null, true]}, "c": "\\u00e9\\ud83d\\ude00"}',
        b'{"a": 12345678901234567890123, "b": 1e400, "c": NaN, "d": -Infinity}',
        b'{"a": "\\ud800"}',
        b'{"a": 1} ',
        b' {"a": 1}',
        b'{"a": 1}{"b": 2}',
        b'{"a": 1}x}',
        b'{"a": 1,}',
        b'{"a": }',
        b'{"a": "b}',
    ],
)
def test_loads_gives_what_json_loads_gives(raw: bytes) -> None:
    """The decoder of bodies and engine chunks answers json.loads' value, or its kind of error."""
    try:
        expected: Any = json.loads(raw)
    except ValueError as exc:
        with pytest.raises(type(exc)):
            loads(raw)
    else:
        assert loads(raw) == expected


COMPACT_CASES: list[Any] = [
    {},
    {"a": "é☃😀", "b": [1, 2.5, None, True, {"c": '\n\t"\\'}], "d": -0.0, "e": 1e300, "f": 10**30},
    {"x": "\u2028\u2029</script>", 1: "an int key", None: "a null key"},
    {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": True},
]


@pytest.mark.parametrize("value", COMPACT_CASES)
def test_compact_json_is_json_dumps_compact_and_starlettes_json_body(value: Any) -> None:
    expected = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    assert compact_json(value) == expected
    if all(isinstance(k, str) for k in value):
        assert JSONResponse(value).body == expected


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ({"a": float("nan")}, ValueError),
        ({"a": float("inf")}, ValueError),
        ({"a": "\ud800"}, UnicodeEncodeError),
        ({"a": object()}, TypeError),
        ({"a": {1, 2}}, TypeError),
    ],
)
def test_compact_json_raises_what_json_dumps_raises(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    with pytest.raises(error):
        compact_json(value)


def test_without_a_c_encoder_the_encoders_fall_back_to_json_dumps(monkeypatch: pytest.MonkeyPatch) -> None:
    # A C encoder that takes other arguments (c_make_encoder is CPython's private API), or none.
    def other_signature(*args: Any) -> Any:
        raise TypeError("takes other arguments")

    monkeypatch.setattr(json.encoder, "c_make_encoder", other_signature)
    assert protocol._c_encoder(ascii=True, item_sep=", ", key_sep=": ", allow_nan=True) is None
    monkeypatch.setattr(json.encoder, "c_make_encoder", None)
    assert protocol._c_encoder(ascii=False, item_sep=",", key_sep=":", allow_nan=False) is None
    monkeypatch.setattr(protocol, "_PLAIN", None)
    monkeypatch.setattr(protocol, "_COMPACT", None)
    value = COMPACT_CASES[1]
    assert protocol.plain_json(value) == json.dumps(value)
    compact = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    assert compact_json(value) == compact
    with pytest.raises(ValueError):
        compact_json({"a": float("nan")})


# -- the fold's types read by their class: what the isinstance checks alone gave -----------------


class _Str(str):
    pass


class _List(list):  # type: ignore[type-arg]
    pass


def _reference_fold(acc: dict[str, Any], new: Any, concat: bool) -> None:
    """protocol._fold as it was before its types were read by ``__class__`` (isinstance alone)."""
    from collections.abc import Mapping

    for key, value in new.items():
        old = acc.get(key)
        if value is None:
            acc.setdefault(key, None)
        elif old is None or old == "":
            acc[key] = _reference_start(value, concat and key not in protocol._NAMES)
        elif key in protocol._NAMES:
            continue
        elif isinstance(old, protocol._Text) and isinstance(value, str):
            old.parts.append(value)
        elif isinstance(old, list) and isinstance(value, list):
            old.extend(_reference_start(v, concat) for v in value)
        elif isinstance(old, dict) and isinstance(value, Mapping):
            _reference_fold(old, value, concat)
        else:
            acc[key] = _reference_start(value, concat)


def _reference_start(value: Any, concat: bool) -> Any:
    from collections.abc import Mapping

    if isinstance(value, str):
        return protocol._Text(value) if concat else value
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        _reference_fold(out, value, concat)
        return out
    if isinstance(value, list):
        return [_reference_start(v, concat) for v in value]
    return value


def _reference_final(value: Any) -> Any:
    if isinstance(value, protocol._Text):
        return "".join(value.parts)
    if isinstance(value, dict):
        return {k: _reference_final(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_reference_final(v) for v in value]
    return value


def _typed(value: Any) -> Any:
    """A value with the class of every part of it, so that a str and a str subclass differ."""
    if isinstance(value, dict):
        return (value.__class__, {k: _typed(v) for k, v in value.items()})
    if isinstance(value, list):
        return (value.__class__, [_typed(v) for v in value])
    return (value.__class__, value)


_KEYS = ["content", "role", "name", "id", "type", "index", "logprobs", "x", ""]
_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(allow_nan=False, width=16)
    | st.sampled_from(["", "a", "bc"])
    | st.sampled_from(["", "z"]).map(_Str)
    | st.just(("a", "tuple"))
)
_values = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=2).map(_List)
        | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=3)
        | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=2).map(types.MappingProxyType)
    ),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.dictionaries(st.sampled_from(_KEYS), _values, max_size=4), min_size=1, max_size=5),
    st.booleans(),
)
# A value of another class onto an accumulator made already (text, a list, an object): the random
# chunks seldom put one after the other under the same key, so these are always tried.
@example([{"content": "a"}, {"content": _Str("z")}], True)
@example([{"x": ["a"]}, {"x": _List(["b"])}], True)
@example([{"x": {"content": "a"}}, {"x": types.MappingProxyType({"content": "b"})}], True)
def test_the_fold_by_class_gives_what_the_isinstance_checks_gave(chunks: list[Any], concat: bool) -> None:
    # Plain JSON takes the class comparisons; a str, list or Mapping of another class (and a
    # tuple, which is none of them) the isinstance checks: each folds, and comes out, as before.
    ours: dict[str, Any] = {}
    theirs: dict[str, Any] = {}
    for chunk_ in chunks:
        protocol._fold(ours, chunk_, concat)
        _reference_fold(theirs, chunk_, concat)
    assert _typed(protocol._final(ours)) == _typed(_reference_final(theirs))
    assert _typed(protocol._final(ours)) == _typed(_reference_final(ours))
