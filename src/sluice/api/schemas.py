"""Request bodies: the OpenAI fields Sluice reads, the scheduling options it adds; the rest passes through."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

PositiveTimeout = Annotated[float, Field(gt=0, description="Seconds the client will wait; capped by config.")]

#: How deep a body's JSON may nest (the body itself is level 1). Far above any real request (a
#: json_schema of 40 levels sits at 44) and far below what the serializers stop at (pydantic at
#: 255 levels, json at the recursion limit), so deep input is a 400 and never a crash on the way.
MAX_JSON_DEPTH = 128

#: The validation error type of a body the engine cannot take; ``ctx`` holds ``param`` and
#: ``reason`` (api.errors turns it into a 400 invalid_value naming ``param``).
UNREADABLE = "unreadable_value"

# A UTF-16 surrogate on its own: JSON's "\ud800" escape decodes to one, and no UTF-8 encoder
# (the engine request's, Redis's) can write it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _segment(key: str) -> str:
    return key.encode("utf-8", "backslashreplace").decode("utf-8") if _SURROGATE.search(key) else key


def unreadable(body: dict[str, Any], max_depth: int = MAX_JSON_DEPTH) -> tuple[str, str] | None:
    """The first place in a request body the engine could not take, as (param, reason); None if
    there is none. Walked without recursion, so no depth of input can overflow the walk itself.

    A value nested deeper than ``max_depth`` is named by its top-level field; a string (or an
    object's key) holding a lone surrogate by its dotted path (``messages.0.content``).
    """
    stack: list[tuple[Any, tuple[str, ...], int]] = [(body, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return ".".join(path), "it holds a lone UTF-16 surrogate, which is not text"
        elif isinstance(value, dict | list):
            if depth > max_depth:
                return path[0], f"JSON nested more than {max_depth} levels deep"
            if isinstance(value, dict):
                for key, item in value.items():
                    if isinstance(key, str) and _SURROGATE.search(key):
                        where = ".".join((*path, _segment(key)))
                        return where, "a key holds a lone UTF-16 surrogate, which is not text"
                    stack.append((item, (*path, key), depth + 1))
            else:
                stack.extend((item, (*path, str(i)), depth + 1) for i, item in enumerate(value))
    return None


def plainly_readable(raw: bytes) -> bool:
    """Whether the JSON text ``raw``, whichever way it decodes, makes a body in which
    :func:`unreadable` cannot find anything, known from its bytes alone. A lone surrogate comes
    only from a ``\\u`` escape or from its own bytes (``\\xed\\xa0-\\xbf``, which json.loads
    lets through); UTF-16 and UTF-32 hide both, and have NULs; and nesting deeper than
    MAX_JSON_DEPTH needs more opening brackets than that. False says only "walk it to know"
    (Korean text, for one, has the byte 0xED)."""
    if b"\\u" in raw or b"\xed" in raw or b"\x00" in raw:
        return False
    return raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH


#: The validation context (``model_validate(..., context=READABLE)``) of a body that
#: :func:`plainly_readable` cleared: its walk is skipped.
READABLE: dict[str, Any] = {"sluice.readable": True}


class EngineInput(BaseModel):
    """A body whose fields reach the engine: before any field is read, the whole body is checked to
    be JSON the engine can take (see :func:`unreadable`), so that nothing downstream (the
    serializers, the broker, the engine request) fails on it; unless its validation context is
    :data:`READABLE` (its bytes said so already)."""

    @model_validator(mode="before")
    @classmethod
    def _readable(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict) and info.context is not READABLE:
            problem = unreadable(data)
            if problem is not None:
                param, reason = problem
                raise PydanticCustomError(UNREADABLE, "{reason}", {"param": param, "reason": reason})
        return data


class SchedulingOptions(EngineInput):
    """Sluice's own options; stripped before the body goes to the engine."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = Field(default=None, description="Defaults to the only model served, if one.")
    max_tokens: StrictInt | None = Field(default=None, description="Must be > 0 and ≤ the configured cap.")
    max_completion_tokens: StrictInt | None = None
    n: StrictInt | None = Field(default=None, ge=1)
    stream: StrictBool | None = None
    priority: StrictStr | None = Field(default=None, description="A priority class, e.g. high, normal, low.")
    timeout: PositiveTimeout | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatRequest(SchedulingOptions):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(SchedulingOptions):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class JobRequest(SchedulingOptions):
    """``POST /v1/jobs``: a chat (``messages``) or a completions (``prompt``) body."""

    messages: list[Message] | None = Field(default=None, min_length=1)
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] | None = None
    callback_url: StrictStr | None = Field(
        default=None,
        max_length=2048,
        description="A webhook: Sluice POSTs the finished job here, signed with the key's webhook secret.",
    )


class SubmitRequest(EngineInput):
    """The article's ``POST /submit``."""

    model_config = ConfigDict(extra="allow")

    prompt: StrictStr = Field(min_length=1)
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    priority: StrictStr | None = None
    timeout: PositiveTimeout | None = None
