"""The body check's short way (sluice.api.schemas.plainly_readable): bytes that cannot hold what
the walk (``unreadable``) finds skip it, and every body that could goes through it."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from sluice.api.schemas import MAX_JSON_DEPTH, READABLE, ChatRequest, plainly_readable, unreadable

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hé, 你好"}]}


def nested(depth: int) -> bytes:
    """A chat body whose extra field nests ``depth`` lists (the body itself is a level more)."""
    return json.dumps({**CHAT, "extra": json.loads("[" * depth + "]" * depth)}, ensure_ascii=False).encode()


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps(CHAT, ensure_ascii=False).encode(),
        json.dumps(
            {**CHAT, "x": "[[{{"}, ensure_ascii=False
        ).encode(),  # brackets in strings only count against it
        nested(MAX_JSON_DEPTH - 4),  # the brackets of the whole body count, 127 here
    ],
)
def test_plain_bodies_skip_the_walk_and_the_walk_agrees(raw: bytes) -> None:
    assert plainly_readable(raw)
    assert unreadable(json.loads(raw)) is None


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',  # an escaped lone surrogate
        b'{"\\udfff": 1}',
        b'{"a": "\xed\xa0\x80"}',  # its own bytes, which json.loads lets through
        '{"a": "\\ud800"}'.encode("utf-16"),  # another encoding hides the escape: NULs
        '{"a": 1}'.encode("utf-32"),
        nested(MAX_JSON_DEPTH),  # one level past the limit, the body counted
        b'{"a": "\\u00e9"}',  # any escape, even a harmless one, is walked
        '{"a": "한국어"}'.encode(),  # so is a 0xED byte of plain text
    ],
)
def test_bodies_that_might_hold_something_are_walked(raw: bytes) -> None:
    assert not plainly_readable(raw)


def test_the_walk_is_skipped_only_in_the_readable_context() -> None:
    surrogate = {"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}
    with pytest.raises(ValidationError, match="lone UTF-16 surrogate"):
        ChatRequest.model_validate(surrogate)
    with pytest.raises(ValidationError, match="lone UTF-16 surrogate"):
        ChatRequest.model_validate(surrogate, context={"sluice.readable": True})  # not the same object
    # With READABLE (which only a body whose bytes cannot hold one gets) the walk does not run.
    assert ChatRequest.model_validate(surrogate, context=READABLE).messages[0].content == "\ud800"
