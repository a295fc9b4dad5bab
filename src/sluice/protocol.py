"""OpenAI wire shapes: errors, streamed chunks, and whole responses assembled from chunks."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.core.c_json import c_encoder as _c_encoder
from sluice.core.job import Endpoint, Job

#: json.loads' own scanner (its default decoder's: the C one where there is one), called straight
#: for a text that is one object and nothing else, without the two Python calls and the two
#: whitespace matches around it (``JSONDecoder.decode`` and ``raw_decode``).
_scan_once: Callable[[str, int], tuple[Any, int]] = json.decoder.JSONDecoder().scan_once  # type: ignore[attr-defined]


def loads(raw: bytes) -> Any:
    """``json.loads(raw)``, the same value or error, without its guess of the bytes' encoding (a
    Python share of every decode): plain UTF-8 is decoded as text first; what may be another
    encoding (a BOM, a NUL in the first four bytes: UTF-16, UTF-32) goes json.loads' own way."""
    # A NUL looked for as the byte's number: ``b"\x00" in`` would first try the bytes as a number,
    # and make, then drop, a TypeError with its message on every call.
    if 0 not in raw[:4]:
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            pass
        else:
            if text[:1] == "{" and text[-1:] == "}":
                # What json.loads does with such a text: scan one value from 0, then find nothing
                # after it. Anything else (an error, text after the object) goes its way, for its
                # own error.
                try:
                    value, end = _scan_once(text, 0)
                except (StopIteration, ValueError):
                    pass
                else:
                    if not text[end:]:  # nothing after the object (a slice: no call of len)
                        return value
            if not text.startswith("\ufeff"):
                return json.loads(text)
    return json.loads(raw)


def error_body(message: str, type: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def response_id(job: Job) -> str:
    prefix = "chatcmpl-" if job.endpoint is Endpoint.CHAT else "cmpl-"
    return prefix + job.id.removeprefix("job_")


def chunk(
    job: Job,
    choices: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    fields: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A streamed chunk in the job's own identity (id, model), whatever engine produced it, with
    the engine chunk's own ``fields`` (``system_fingerprint``, ``service_tier``, ...) as it sent
    them: the identity, ``choices`` and ``usage`` stay Sluice's whatever ``fields`` holds."""
    out: dict[str, Any] = {
        "id": response_id(job),
        "object": "chat.completion.chunk" if job.endpoint is Endpoint.CHAT else "text_completion",
        "created": int(job.created_at),
        "model": job.model,
    }
    for key, value in (fields or {}).items():
        if key not in _OWN:
            out[key] = value
    out["choices"] = choices
    if usage is not None:
        out["usage"] = usage
    return out


class TokenChunks:
    """The JSON text of a job's streamed token chunks, the same characters as
    ``json.dumps(chunk(job, data["choices"], fields=chunk_fields(data)))`` for each engine chunk
    ``data``: the identity (id, object, created, model) is the same for every chunk of a job, so it
    is encoded once, and each chunk encodes only what follows it (a long answer's every token paid
    for the identity, ``response_id`` and a dict of its own before)."""

    __slots__ = ("_head",)

    def __init__(self, job: Job) -> None:
        # json.dumps' default separators: ", " between items, as the whole chunk's encoding has.
        self._head = json.dumps(chunk(job, []))[: -len(', "choices": []}')] + ", "

    def encode(self, data: Mapping[str, Any]) -> str:
        if type(data) is dict and len(data) == 1 and _PLAIN is not None and data.get("choices"):
            # A token event of choices alone (what a chunk of no fields of its own gives, every
            # token of most engines): it is what follows the identity, as it is.
            return self._head + "".join(_PLAIN(data, 0))[1:]
        rest = {k: v for k, v in data.items() if k not in _OWN}
        rest["choices"] = data.get("choices") or []
        return self._head + plain_json(rest)[1:]


#: json.dumps with its default options (the token chunks a client is sent)
_PLAIN = _c_encoder(ascii=True, item_sep=", ", key_sep=": ", allow_nan=True)


def plain_json(value: dict[str, Any]) -> str:
    """``json.dumps(value)`` for a dict, the same characters (and errors, a loop apart), without a
    JSONEncoder made per call: for what is sent once per token (a chunk, a job's or a response's
    event)."""
    if _PLAIN is None:
        return json.dumps(value)
    return "".join(_PLAIN(value, 0))


#: json.dumps(ensure_ascii=False, separators=(",", ":"), allow_nan=False): the engine request's
#: body and a whole answer, as starlette's JSONResponse renders one
_COMPACT = _c_encoder(ascii=False, item_sep=",", key_sep=":", allow_nan=False)


def compact_json(value: dict[str, Any]) -> bytes:
    """``json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)`` as UTF-8,
    the same bytes and errors (ValueError for a number that is not finite, UnicodeEncodeError for
    a lone surrogate, RecursionError for nesting past the limit, TypeError for what is not JSON),
    without a JSONEncoder made per call (1.5 against 3.0 µs for a chat request's body, 2.8
    against 5.4 µs for a short answer as starlette's JSONResponse renders it)."""
    if _COMPACT is None:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    return "".join(_COMPACT(value, 0)).encode()


def chunk_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """What a chunk (or a whole answer, or a token event) says besides its identity, its choices
    and its usage: ``system_fingerprint``, ``service_tier``, any field an engine adds."""
    return {k: v for k, v in data.items() if k not in _OWN}


# --- folding chunks into one answer ---------------------------------------------------------------

#: A response's identity: always the job's, as in every chunk relayed to a streaming client, so that
#: an answer names the same id, model and time whichever path it took.
_IDENTITY = frozenset({"id", "object", "created", "model"})
#: Chunk fields that exist only in a stream and mean nothing in a whole answer: OpenAI's size
#: padding against side channels (its own SDK drops it when it accumulates a stream, too).
_STREAM_ONLY = frozenset({"obfuscation"})
#: A chunk's fields that are Sluice's to fill, whatever the engine's chunk said.
_OWN = _IDENTITY | _STREAM_ONLY | {"choices", "usage"}
#: Keys that name something rather than carry generated text (a call's id, its function's name, a
#: discriminator): the first value stays, as engines may repeat them on every fragment.
_NAMES = frozenset({"id", "type", "name", "role", "index"})
#: A choice's keys that are not its own fields (see :attr:`_Choice.fields`), in a chat stream and in a
#: completions one.
_CHAT_OWN = frozenset({"index", "delta", "message"})
_TEXT_OWN = frozenset({"index", "text", "delta", "message"})
#: The fields of a chunk that says nothing besides its identity, choices and usage (never changed).
_NO_FIELDS: dict[str, Any] = {}
#: Delta fields whose text is generated, and counts as tokens where the engine reports no usage.
_GENERATED = ("content", "refusal", "reasoning_content", "reasoning")


class _Text:
    """Text arriving in pieces, joined once at the end (joining on every chunk is quadratic)."""

    __slots__ = ("parts",)

    def __init__(self, first: str) -> None:
        self.parts = [first]


def _fold(acc: dict[str, Any], new: Mapping[str, Any], concat: bool) -> None:
    """Fold ``new`` into ``acc``. With ``concat`` (a delta: generated text in pieces) strings gather
    in order; without (a choice's or a chunk's own fields: state, repeated on each chunk) the latest
    string stays. Numbers and flags keep the latest value; lists extend (logprobs, token ids);
    objects fold the same way, one level down; names (:data:`_NAMES`) keep their first value. A null
    never erases a value (engines send null for "nothing new"), but is kept where nothing else came.

    The types are read by ``__class__`` (an attribute, not a call) and compared with the plain
    ones that parsed JSON and the accumulators are made of; only a value of another class goes
    through the ``isinstance`` checks (a Mapping's is three calls), so what each value becomes is
    what those checks alone decide."""
    for key, value in new.items():
        old = acc.get(key)
        if value is None:
            acc.setdefault(key, None)
        elif old is None or old == "":  # an empty name names nothing yet
            cls = value.__class__
            if cls is str:
                acc[key] = _Text(value) if concat and key not in _NAMES else value
            elif cls in _SCALARS:
                acc[key] = value
            else:
                acc[key] = _start(value, concat and key not in _NAMES)
        elif key in _NAMES:
            continue
        else:
            old_cls = old.__class__
            if old_cls is _Text and (value.__class__ is str or isinstance(value, str)):
                old.parts.append(value)
            elif old_cls is list and isinstance(value, list):
                old.extend(_start(v, concat) for v in value)
            elif old_cls is dict and isinstance(value, Mapping):
                _fold(old, value, concat)
            else:
                acc[key] = _start(value, concat)


#: The classes of parsed JSON's numbers and flags: a fresh accumulator is the value itself.
_SCALARS = frozenset({int, float, bool})


def _start(value: Any, concat: bool) -> Any:
    """A fresh accumulator holding ``value`` (copied: the engine's chunk is relayed as it is)."""
    cls = value.__class__
    if cls is str:
        return _Text(value) if concat else value
    if cls is dict:
        out: dict[str, Any] = {}
        _fold(out, value, concat)
        return out
    if cls is list:
        return [_start(v, concat) for v in value]
    if cls in _SCALARS:
        return value
    # Anything else by the checks themselves (a str, Mapping or list of another class).
    if isinstance(value, str):
        return _Text(value) if concat else value
    if isinstance(value, Mapping):
        out = {}
        _fold(out, value, concat)
        return out
    if isinstance(value, list):
        return [_start(v, concat) for v in value]
    return value


#: What an accumulator holds that :func:`_final` must turn into plain JSON: gathered text, and the
#: plain dicts and lists that :func:`_start` makes (it makes no other container; every other value
#: in an accumulator is one the engine sent, kept as it is).
_GATHERED = frozenset({_Text, dict, list})


def _final(value: Any) -> Any:
    """An accumulator as plain JSON: every gathered text joined. A value that is none of
    :data:`_GATHERED` is kept as it is without a call for it."""
    cls = value.__class__
    if cls is _Text:
        return "".join(value.parts)
    if cls is dict:
        return {k: _final(v) if v.__class__ in _GATHERED else v for k, v in value.items()}
    if cls is list:
        return [_final(v) if v.__class__ in _GATHERED else v for v in value]
    return value


@dataclass
class _Choice:
    """One choice (one of ``n``) as its chunks built it.

    Fields:
        index: its place among the choices, as the engine numbers them.
        message: the folded deltas of a chat choice (role, content, refusal, reasoning_content or
            reasoning, audio, any field the engine adds), tool calls apart; for a completions choice,
            ``text`` alone.
        tool_calls: a chat choice's tool calls in the order they began, each folded from its
            fragments (id, type and function.name once, function.arguments concatenated).
        call_at: the engine's ``index`` of each tool call -> its place in ``tool_calls``.
        fields: everything else the engine said on the choice, folded: ``finish_reason``,
            ``logprobs`` (chat's content/refusal lists, completions' tokens, token_logprobs,
            top_logprobs and text_offset, each extended in order), vLLM's ``stop_reason`` and
            ``token_ids``, Azure's content filter results...
    """

    index: int
    message: dict[str, Any] = field(default_factory=dict)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    call_at: dict[int, int] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)

    def add_tool_calls(self, fragments: list[Any]) -> None:
        for fragment in fragments:
            if isinstance(fragment, Mapping):
                _fold(self._call_for(fragment), {k: v for k, v in fragment.items() if k != "index"}, True)

    def _call_for(self, fragment: Mapping[str, Any]) -> dict[str, Any]:
        """The tool call a fragment continues, or a new one. OpenAI, vLLM and llama-server number
        every fragment with ``index``; a fragment without one (a whole message's calls, some
        engines' streams) continues the call of the same id, or the last call when it has no id."""
        index, call_id = fragment.get("index"), fragment.get("id")
        if isinstance(index, int) and index in self.call_at:
            call = self.tool_calls[self.call_at[index]]
            # A new id at a used index is a new call (an engine that numbers every call 0).
            if not call_id or call.get("id") in (None, call_id):
                return call
        elif not isinstance(index, int):
            if call_id:
                for call in self.tool_calls:
                    if call.get("id") == call_id:
                        return call
            elif self.tool_calls:
                return self.tool_calls[-1]
        self.tool_calls.append({})
        if isinstance(index, int):
            self.call_at[index] = len(self.tool_calls) - 1
        return self.tool_calls[-1]

    def chat(self) -> dict[str, Any]:
        message = _final(self.message)
        calls = [_tool_call(c) for c in _final(self.tool_calls)]
        content, refusal = message.pop("content", ""), message.pop("refusal", None) or None
        if not content and (calls or refusal or message.get("function_call") or message.get("audio")):
            content = None  # OpenAI's null for "no text", never ""
        out: dict[str, Any] = {
            "role": message.pop("role", None) or "assistant",
            "content": content,
            "refusal": refusal,
        }
        if calls:
            out["tool_calls"] = calls
        out.update(message)
        return {"index": self.index, "message": out, **self._closing()}

    def completion(self) -> dict[str, Any]:
        text = _final(self.message).get("text") or ""
        return {"index": self.index, "text": text, **self._closing()}

    def _closing(self) -> dict[str, Any]:
        rest = _final(self.fields)
        return {
            "logprobs": rest.pop("logprobs", None),
            "finish_reason": rest.pop("finish_reason", None) or "stop",
            **rest,
        }


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    if isinstance(call.get("function"), dict) and not call.get("type"):
        call["type"] = "function"  # the SDKs tell call kinds apart by it
    return call


class Assembler:
    """Builds the non-streaming response from the chunks of a streamed one, losing nothing.

    It takes what :meth:`sluice.backends.base.Backend.stream` yields: a stream's chunks, or a whole
    answer as one chunk whose choices carry their message as ``delta``. Chat deltas fold into one
    message per choice: content, refusal and reasoning (``reasoning_content``, or ``reasoning`` as
    some engines name it) concatenated, tool-call fragments merged by ``index``, any other field the
    engine adds folded (see :func:`_fold`). Logprobs lists extend in order; ``finish_reason`` and any
    other choice field keep their latest value; ``usage`` is the latest the engine sent; the chunk's
    own fields (``system_fingerprint``, ``service_tier``, anything else) keep their latest value.
    The id, object, creation time and model are the job's, as in the chunks relayed to streaming
    clients. A whole answer therefore comes out as the engine sent it, with the job's identity, and
    with OpenAI's nulls where it left a required field out (``refusal``, ``logprobs``).

    Attributes:
        job: the job whose answer this is: its identity, endpoint and prompt estimate.
        choices: the choices so far, by the engine's index.
        usage: the engine's latest ``usage``, None while it sent none.
        tokens: chunks that carried generated text (counted once per choice), the completion
            tokens of an engine that reports no usage.
        fields: the chunks' own fields besides identity, choices and usage, folded.
        last_fields: those of the latest chunk alone, as it sent them: a token event is these
            beside the chunk's choices (built where it is published, :func:`sluice.attempt.generate`).
    """

    def __init__(self, job: Job) -> None:
        self.job = job
        self.choices: dict[int, _Choice] = {}
        self.usage: dict[str, Any] | None = None
        self.tokens = 0
        self.fields: dict[str, Any] = {}
        self.last_fields: dict[str, Any] = {}

    def add(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one engine chunk; return the choices worth relaying (empty for a usage-only chunk).

        Called for every token: the common chunk (identity, one choice whose delta is a piece of
        content, nulls) takes a short way to the same answer as the general fold: its piece of
        content appended in this call, its types checked with ``type() is`` before ``isinstance``,
        its choice found by a subscript, its own list of choices relayed. (``dict.get`` stays where
        the key is there: ``in`` and a subscript look it up twice, which costs more instructions
        than the call, though fewer calls.)"""
        usage = data.get("usage")
        if usage is not None and isinstance(usage, dict):
            self.usage = usage
        if data.keys() <= _OWN:
            self.last_fields = _NO_FIELDS
        else:
            self.last_fields = chunk_fields(data)
            _fold(self.fields, self.last_fields, False)
        choices = data.get("choices")
        if not choices:
            return []
        chat = self.job.endpoint is Endpoint.CHAT
        skip = _CHAT_OWN if chat else _TEXT_OWN
        # The relayed choices are the chunk's own list where every choice is an object (the same
        # values as a list of them made anew); a copy of those that are where one is not.
        skipped = type(choices) is not list
        for raw in choices:
            if type(raw) is not dict and not isinstance(raw, dict):
                skipped = True
                continue
            index = raw.get("index", 0)
            if type(index) is not int and not isinstance(index, int):
                index = 0
            try:
                c = self.choices[index]
            except KeyError:
                c = self.choices[index] = _Choice(index)
            if chat:
                delta = raw.get("delta")
                message = c.message
                if type(delta) is dict and len(delta) == 1 and "content" in delta and "content" in message:
                    content, text = delta["content"], message["content"]
                    if type(content) is str and type(text) is _Text:
                        # A piece of content after the first: the fold would append it, as here.
                        text.parts.append(content)
                        self.tokens += bool(content)
                    else:
                        self._add_delta(c, delta)
                else:
                    self._add_delta(c, delta)
            else:
                text = raw.get("text")
                if isinstance(text, str):
                    _fold(c.message, {"text": text}, True)
                    self.tokens += bool(text)
            # The choice's own fields: only what is new (a null the choice has already says nothing).
            fields = c.fields
            rest: dict[str, Any] | None = None
            for key, value in raw.items():
                if (value is None and key in fields) or key in skip:
                    continue
                if rest is None:
                    rest = {}
                rest[key] = value
            if rest is not None:
                _fold(fields, rest, False)
        if skipped:
            return [raw for raw in choices if isinstance(raw, dict)]
        relayed: list[dict[str, Any]] = choices
        return relayed

    def _add_delta(self, c: _Choice, delta: Any) -> None:
        """Fold a chat delta (the general way: :meth:`add` appends the common piece of content)."""
        if type(delta) is not dict and not isinstance(delta, Mapping):
            return
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            c.add_tool_calls(calls)
        _fold(c.message, {k: v for k, v in delta.items() if k != "tool_calls"}, True)
        if calls or any(delta.get(k) for k in _GENERATED):
            self.tokens += 1

    def final_usage(self) -> dict[str, Any]:
        if self.usage is not None:
            return self.usage
        completion = self.tokens
        return {
            "prompt_tokens": self.job.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.job.prompt_tokens + completion,
        }

    def response(self) -> dict[str, Any]:
        chat = self.job.endpoint is Endpoint.CHAT
        ordered = sorted(self.choices.values(), key=lambda c: c.index) or [_Choice(0)]
        return {
            "id": response_id(self.job),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(self.job.created_at),
            "model": self.job.model,
            "choices": [c.chat() if chat else c.completion() for c in ordered],
            "usage": self.final_usage(),
            **_final(self.fields),
        }
