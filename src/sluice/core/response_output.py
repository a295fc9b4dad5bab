"""The pieces of a Response's output, built from a chat completion's answer without I/O: its tool
calls merged from their fragments (:class:`ToolCall`), its output items as they grow
(:class:`OutputItem`), the log probabilities of its text, its usage and its error, each in the
Responses API's shape. :mod:`sluice.core.responses` puts them together into the stream's events and
the Response object.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ITEM_ID_PREFIX",
    "OutputItem",
    "ToolCall",
    "arguments_text",
    "as_mapping",
    "call_index",
    "delta_logprob",
    "logprob_of",
    "merge_fragment",
    "merged_calls",
    "response_error",
    "usage",
]


def arguments_text(value: Any) -> str:
    """A tool call's arguments as text: chat sends a JSON string, an odd engine an object."""
    return value if isinstance(value, str) else json.dumps(value)


def usage(chat: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Chat's token accounting in the Responses API's words. Chat reports no cache writes: they
    count as 0."""
    if not chat:
        return None
    prompt = int(chat.get("prompt_tokens") or 0)
    completion = int(chat.get("completion_tokens") or 0)
    prompt_details = chat.get("prompt_tokens_details") or {}
    completion_details = chat.get("completion_tokens_details") or {}
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": int(prompt_details.get("cached_tokens") or 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": int(completion_details.get("reasoning_tokens") or 0)},
        "total_tokens": int(chat.get("total_tokens") or prompt + completion),
    }


@dataclass
class ToolCall:
    """One tool call as its fragments arrive: chat's ``tool_calls[index]``."""

    call_id: str = ""
    name: str = ""
    arguments: str = ""


def call_index(calls: dict[int, ToolCall], fragment: Mapping[str, Any]) -> int:
    """Which call a fragment belongs to: its ``index``; else the call with its id; else, with no
    id either, the latest call (a continuation); else a new one."""
    index = fragment.get("index")
    if isinstance(index, int):
        return index
    for i, call in calls.items():
        if fragment.get("id") and call.call_id == fragment.get("id"):
            return i
    if not fragment.get("id") and calls:
        return max(calls)
    return max(calls, default=-1) + 1


def as_mapping(value: Any) -> Mapping[str, Any]:
    """``value`` if it is an object, else an empty one: an engine's odd chunk is read as saying nothing."""
    return value if isinstance(value, dict) else {}


def merged_calls(fragments: Sequence[Any]) -> list[ToolCall]:
    calls: dict[int, ToolCall] = {}
    for fragment in fragments:
        if isinstance(fragment, dict):
            merge_fragment(calls.setdefault(call_index(calls, fragment), ToolCall()), fragment)
    return [calls[i] for i in sorted(calls)]


def merge_fragment(call: ToolCall, fragment: Mapping[str, Any]) -> str:
    """Add a fragment to its call; return the arguments it added."""
    function = as_mapping(fragment.get("function"))
    if fragment.get("id") and not call.call_id:
        call.call_id = str(fragment["id"])
    name = function.get("name")
    # Engines send the name once, or repeat it whole in every fragment; a few split it in pieces.
    if name and name != call.name:
        call.name += str(name)
    added = function.get("arguments")
    text = arguments_text(added) if added is not None else ""
    call.arguments += text
    return text


@dataclass
class OutputItem:
    """One output item of a response being built.

    Attributes:
        kind: ``message``, ``reasoning`` or ``function_call``.
        index: its place in ``output`` (the events' ``output_index``).
        id: its id, made of the response's and the index (``msg_…_0``).
        parts: for a message, its content parts in order, each ``output_text`` or ``refusal``
            with its text so far; for reasoning, one ``reasoning_text``.
        call: the tool call, for a function call.
        logprobs: the log probabilities of an ``output_text`` part's tokens so far, by the
            part's index, in the Response's shape (token, logprob, bytes, top_logprobs).
    """

    kind: str
    index: int
    id: str
    parts: list[list[str]] = field(default_factory=list)
    call: ToolCall | None = None
    logprobs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    def part(self, kind: str) -> tuple[int, bool]:
        """The index of this item's part of ``kind``, and whether it is new."""
        for i, (k, _) in enumerate(self.parts):
            if k == kind:
                return i, False
        self.parts.append([kind, ""])
        return len(self.parts) - 1, True

    def part_object(self, i: int) -> dict[str, Any]:
        kind, text = self.parts[i]
        if kind == "output_text":
            return {
                "type": "output_text",
                "text": text,
                "annotations": [],
                "logprobs": list(self.logprobs.get(i, [])),
            }
        if kind == "refusal":
            return {"type": "refusal", "refusal": text}
        return {"type": kind, "text": text}

    def view(self, status: str) -> dict[str, Any]:
        if self.kind == "function_call":
            call = self.call or ToolCall()
            return {
                "id": self.id,
                "type": "function_call",
                "status": status,
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            }
        content = [self.part_object(i) for i in range(len(self.parts))]
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "status": status, "summary": [], "content": content}
        return {"id": self.id, "type": "message", "status": status, "role": "assistant", "content": content}


#: what an output item's id starts with, by its kind
ITEM_ID_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc"}


def logprob_of(token: Mapping[str, Any]) -> dict[str, Any]:
    """A chat token's log probability as a Response's output text has it: ``bytes`` always a
    list (chat may send null: the token's UTF-8 then), and so each of ``top_logprobs``."""

    def one(t: Mapping[str, Any]) -> dict[str, Any]:
        text = str(t.get("token") or "")
        raw = t.get("bytes")
        return {
            "token": text,
            "logprob": float(t.get("logprob") or 0.0),
            "bytes": raw if isinstance(raw, list) else list(text.encode("utf-8", "replace")),
        }

    top = token.get("top_logprobs")
    return {
        **one(token),
        "top_logprobs": [one(t) for t in top if isinstance(t, dict)] if isinstance(top, list) else [],
    }


def delta_logprob(token: Mapping[str, Any]) -> dict[str, Any]:
    """A token's log probability as the stream's text events have it (no bytes)."""
    top = [{"token": t["token"], "logprob": t["logprob"]} for t in token["top_logprobs"]]
    return {"token": token["token"], "logprob": token["logprob"], "top_logprobs": top}


def response_error(error: Mapping[str, Any] | None) -> dict[str, Any]:
    """A job's error as a Response's: the Responses API has a short list of codes, so a refused
    request is ``invalid_prompt`` and anything else ``server_error``; the message keeps Sluice's
    words."""
    err = error or {}
    code = "invalid_prompt" if err.get("type") == "invalid_request_error" else "server_error"
    return {"code": code, "message": str(err.get("message") or "The response failed.")}
