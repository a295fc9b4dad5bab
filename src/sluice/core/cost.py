"""Token estimates made before the engine has seen a request.

The real tokenizer lives in the engine; the gateway only needs an estimate good enough for
admission and fairness, so it uses the common rule of thumb of about four characters per token,
and the engine's reported usage settles the real count afterwards.

The estimate counts everything the engine reads, not only the messages' ``content``: a message's
``name``, its ``tool_calls`` (function names and arguments) and any other field a chat template may
render; the request's ``tools`` and ``functions`` definitions and ``response_format``'s
``json_schema`` (as their JSON text); a completions prompt as text, texts, token ids or lists of
them. Text nobody counts would be text a client sends for free, past ``max_prompt_tokens`` and the
tenant's token budget.

It runs on every request, so it stays cheap: strings are measured, not scanned, and structures
are measured as their compact JSON text, which the C encoder writes in about the time the body
took to parse (measured: 7 ms for one 1 MB tool description, 40 to 70 ms for 1.5 MB in 6,000
small definitions, where ``json.loads`` of the same takes 37 ms).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sluice.core.c_json import c_encoder

CHARS_PER_TOKEN = 4
# Chat templates wrap every message in role markers and separators.
TOKENS_PER_MESSAGE = 4
# A chat's template adds a few tokens of its own (the assistant's turn marker).
TOKENS_PER_CHAT = 3
# Images and audio: engines charge hundreds of tokens for each; be conservative.
TOKENS_PER_MEDIA_PART = 256
# Each tool call the template renders is wrapped in markers of its own.
TOKENS_PER_TOOL_CALL = 4

# What a mapping is, a parsed body's dict first: isinstance() with this tuple answers a dict by its
# exact type in one call, where isinstance(x, Mapping) is three (the ABC's __instancecheck__ and
# its cache's), for every message and part of every request.
_MAPS = (dict, Mapping)

# Message fields that are not text the engine reads as such (the role is in TOKENS_PER_MESSAGE).
_MESSAGE_SKIPPED = frozenset({"role"})

# Compact, no escaping of non-ASCII (a character is a character), no cycle check: a parsed JSON
# body has no cycles, and the check costs a third of the time.
_encode = json.JSONEncoder(ensure_ascii=False, check_circular=False, separators=(",", ":")).encode


# _encode's C encoder itself, made once (c_json); None where json has none: _encode then.
_C_ENCODE = c_encoder(ascii=False, item_sep=",", key_sep=":", allow_nan=True)


def estimate_text_tokens(text: str) -> int:
    """Tokens of ``text``: about four characters each, at least one."""
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


def _json_chars(value: Any) -> int:
    """The length of ``value``'s compact JSON text."""
    try:
        if _C_ENCODE is None or isinstance(value, str):
            return len(_encode(value))
        return len("".join(_C_ENCODE(value, 0)))
    except RecursionError:
        # Nested deeper than the encoder's recursion allows (a legitimate deep schema can be):
        # measure it by walking it instead, without recursion.
        return _walk_chars(value)
    except (TypeError, ValueError):
        return len(str(value))


def _walk_chars(value: Any) -> int:
    """About the length of ``value``'s JSON text, for values too deep for the encoder."""
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, _MAPS):
            total += 2 + len(v)
            for key, item in v.items():
                total += len(str(key)) + 3
                stack.append(item)
        elif isinstance(v, list | tuple):
            total += 2 + len(v)
            stack.extend(v)
        else:
            total += len(str(v))
    return total


def estimate_json_tokens(value: Any) -> int:
    """Tokens of a structure the engine reads as JSON text (tool definitions, a schema); none for
    None."""
    if value is None:
        return 0
    return max(1, -(-_json_chars(value) // CHARS_PER_TOKEN))


def _value_tokens(value: Any) -> int:
    """Tokens of one field's value as a template renders it: text as text, structures as JSON."""
    if value is None:
        return 0
    if isinstance(value, str):
        return estimate_text_tokens(value)
    return estimate_json_tokens(value)


def _content_tokens(content: Any) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return estimate_text_tokens(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, _MAPS) and isinstance(part.get("text"), str):
                total += estimate_text_tokens(part["text"])
            else:
                total += TOKENS_PER_MEDIA_PART
        return total
    return estimate_json_tokens(content)


def _function_tokens(call: Any) -> int:
    """A function call as a template renders it: its name and its arguments (a JSON string)."""
    if not isinstance(call, _MAPS):
        return estimate_json_tokens(call)
    return sum(_value_tokens(call.get(name)) for name in ("name", "arguments"))


def _tool_calls_tokens(calls: Any) -> int:
    if not isinstance(calls, list):
        return estimate_json_tokens(calls)
    total = 0
    for call in calls:
        if isinstance(call, _MAPS) and isinstance(call.get("function"), _MAPS):
            total += TOKENS_PER_TOOL_CALL + _function_tokens(call["function"])
        else:
            total += TOKENS_PER_TOOL_CALL + estimate_json_tokens(call)
    return total


def estimate_message_tokens(message: Any) -> int:
    """Tokens of one chat message: its markers, content, ``name``, ``tool_calls``,
    ``function_call``, and any other field a template may render (``tool_call_id`` and the like)."""
    if not isinstance(message, _MAPS):
        return TOKENS_PER_MESSAGE + estimate_json_tokens(message)
    total = TOKENS_PER_MESSAGE
    for key, value in message.items():
        if key in _MESSAGE_SKIPPED:
            continue
        if key == "content":
            total += _content_tokens(value)
        elif key == "tool_calls":
            total += _tool_calls_tokens(value)
        elif key == "function_call":
            total += _function_tokens(value)
        else:
            total += _value_tokens(value)
    return total


def estimate_definitions_tokens(
    *, tools: Any = None, functions: Any = None, response_format: Any = None
) -> int:
    """Tokens of what a request gives the engine besides its prompt: ``tools`` and ``functions``
    definitions, and ``response_format``'s ``json_schema`` (a format without one is a few tokens
    of the template's, not counted)."""
    if tools is None and functions is None and response_format is None:
        return 0  # a plain chat's: three calls of estimate_json_tokens saved, each 0 for None
    schema = response_format.get("json_schema") if isinstance(response_format, _MAPS) else response_format
    return estimate_json_tokens(tools) + estimate_json_tokens(functions) + estimate_json_tokens(schema)


def estimate_chat_tokens(messages: list[Any]) -> int:
    """Tokens of a chat's messages, with the template's own."""
    # A loop, not sum() over a generator, each of whose steps is a call of its own.
    total = TOKENS_PER_CHAT
    for message in messages:
        total += estimate_message_tokens(message)
    return total


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


def prompt_count(prompt: Any) -> int:
    """How many prompts a completions ``prompt`` holds, each a sequence of its own: one for text or
    token ids, one per item for a list of texts or of token-id lists."""
    if isinstance(prompt, list) and prompt and not _is_token_ids(prompt):
        return len(prompt)
    return 1


def estimate_prompt_tokens(prompt: Any) -> int:
    """Tokens of a completions ``prompt``, all its prompts together: text by its length, token ids
    one each."""
    if isinstance(prompt, str):
        return estimate_text_tokens(prompt)
    if not isinstance(prompt, list) or not prompt:
        return 1 if not prompt else estimate_json_tokens(prompt)
    if _is_token_ids(prompt):
        return len(prompt)  # already token ids
    total = 0
    for item in prompt:
        if isinstance(item, str):
            total += estimate_text_tokens(item)
        elif _is_token_ids(item):
            total += len(item)
        else:
            total += estimate_json_tokens(item) if item else 1
    return total
