"""The Responses API over chat completions: requests, answers and stream events, translated without I/O.

A ``POST /v1/responses`` body becomes a chat-completions body (:func:`chat_plan`) that runs as any
chat job on the queue. The job's answer becomes a Response object (:func:`response_object`), and
the chat chunks it streams become the Responses API's typed events (:class:`ResponseEvents`).
Both answers come out of the same builder, so a streamed response ends with the object that
``GET /v1/responses/{id}`` returns. What is and is not translated: docs/responses.md.

A response is its job: the response id is the job id with ``resp_`` for ``job_``, and what the
Response object echoes of the request (instructions, tools, metadata, ...) is kept in the job's
``extra`` under :data:`RECORD_KEY`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.core.job import Job, JobState
from sluice.core.request import RequestRejected

__all__ = [
    "RECORD_KEY",
    "ChatPlan",
    "ResponseEvents",
    "chat_plan",
    "follow_up",
    "job_id_of",
    "response_id",
    "response_object",
    "usage",
]

#: the key of ``Job.extra`` that holds what a response echoes of its request
RECORD_KEY = "response"
#: the ``include`` value that asks for the output text's log probabilities
LOGPROBS_INCLUDE = "message.output_text.logprobs"

_JOB_PREFIX = "job_"
_RESPONSE_PREFIX = "resp_"

# Request fields that change what the answer means and have no chat-completions counterpart:
# refused rather than dropped, so that nobody gets an answer to a question they did not ask.
_REFUSED_FIELDS = {
    "conversation": "conversations are stored by OpenAI; send the history as 'input' instead",
    "prompt": "prompt templates are stored by OpenAI; send the text as 'input' or 'instructions'",
}

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}

# A chat finish_reason that cuts the answer, and how the Responses API says so.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def response_id(job_id: str) -> str:
    """The response id of a job (``resp_…`` for ``job_…``)."""
    return _RESPONSE_PREFIX + job_id.removeprefix(_JOB_PREFIX)


def job_id_of(response_id: str) -> str | None:
    """The job behind a response id; None when the text is no response id at all."""
    rest = response_id.removeprefix(_RESPONSE_PREFIX)
    if rest == response_id or not rest:
        return None
    return _JOB_PREFIX + rest


# --- requests ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """A Responses request, translated.

    Attributes:
        body: the chat-completions body: ``messages``, and ``model``, ``max_tokens``, ``tools``,
            ``tool_choice``, sampling and Sluice's own ``priority`` and ``timeout`` where the
            request had them.
        record: what the Response object echoes of the request, kept with the job (see
            :func:`response_object`); ``instruction_messages`` counts the messages at the head of
            ``body["messages"]`` that came from ``instructions``, which a follow-up leaves out.
    """

    body: dict[str, Any]
    record: dict[str, Any]


def _reject(message: str, param: str | None, code: str = "invalid_value") -> RequestRejected:
    return RequestRejected(400, message, code, param=param)


def _unsupported(message: str, param: str) -> RequestRejected:
    return RequestRejected(400, message, "unsupported_value", param=param)


def _text_of(parts: Sequence[Any], where: str, allowed: tuple[str, ...]) -> str:
    """The text of content parts that may only be text (a tool's output)."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed or not isinstance(part.get("text"), str):
            raise _unsupported(
                f"Only text parts ({', '.join(allowed)}) are translated here, not '{kind}'.",
                f"{where}.{j}.type",
            )
        texts.append(part["text"])
    return "".join(texts)


def _content(value: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content in chat's shape: one text as a string, anything else as parts."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _reject("A message's content must be a string or a list of content parts.", where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(value):
        at = f"{where}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "refusal"):
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise _reject(
                    f"A '{kind}' part needs a string '{'refusal' if kind == 'refusal' else 'text'}'.", at
                )
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise _unsupported(
                    "Images are translated from 'image_url' (a URL or a data: URL); file ids need "
                    "OpenAI's file store.",
                    f"{at}.image_url",
                )
            image: dict[str, Any] = {"url": url}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise _unsupported(
                f"Content parts of type '{kind}' are not translated to chat completions; use "
                "input_text, output_text or input_image.",
                f"{at}.type",
            )
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _input_messages(value: Any) -> list[dict[str, Any]]:
    """The chat messages of ``input``: a string is one user message; items are translated one by
    one, a function call joining the assistant message before it as chat has it."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise _reject("Each input item must be an object.", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(str(item.get("role")))
            if role is None:
                raise _reject(
                    "A message's role must be user, assistant, system or developer.", f"{where}.role"
                )
            if "content" not in item:
                raise _reject("Missing required parameter: 'content'.", f"{where}.content")
            messages.append({"role": role, "content": _content(item["content"], f"{where}.content")})
        elif kind == "function_call":
            for name in ("call_id", "name"):
                if not isinstance(item.get(name), str):
                    raise _reject(f"A function_call item needs a string '{name}'.", f"{where}.{name}")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": _arguments(item.get("arguments", ""))},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _reject("A function_call_output item needs a string 'call_id'.", f"{where}.call_id")
            output = item.get("output")
            if isinstance(output, list):
                output = _text_of(output, f"{where}.output", ("input_text", "output_text"))
            elif not isinstance(output, str):
                raise _reject(
                    "A function_call_output's output must be a string or text parts.", f"{where}.output"
                )
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # the engine's own thoughts of an earlier turn: chat has no way to send them back
        else:
            raise _unsupported(
                f"Input items of type '{kind}' are not translated to chat completions; use message, "
                "function_call, function_call_output or reasoning items.",
                f"{where}.type",
            )
    return messages


def _tools(value: list[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Function tools as chat has them, and as the Response object echoes them."""
    chat: list[dict[str, Any]] = []
    echo: list[dict[str, Any]] = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _unsupported(
                f"Only function tools are served here; '{kind}' is one of OpenAI's hosted tools.",
                f"tools.{i}.type",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _reject("A function tool needs a 'name'.", f"tools.{i}.name")
        function: dict[str, Any] = {"name": tool["name"]}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        chat.append({"type": "function", "function": function})
        echo.append(
            {
                "type": "function",
                "name": tool["name"],
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict"),
            }
        )
    return chat, echo


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[Any, list[dict[str, Any]]]:
    """``tool_choice`` in chat's shape, and the tools left once ``allowed_tools`` has chosen."""
    if value in ("none", "auto", "required"):
        return value, tools
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}, tools
    if kind == "allowed_tools" and value.get("mode") in ("auto", "required"):
        listed = value.get("tools")
        allowed = (
            {t.get("name") for t in listed if isinstance(t, dict)} if isinstance(listed, list) else set()
        )
        return value["mode"], [t for t in tools if t["function"]["name"] in allowed]
    raise _unsupported(
        "tool_choice must be none, auto, required, a function or allowed_tools of functions.", "tool_choice"
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        schema = {k: fmt[k] for k in ("name", "schema", "description", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise _unsupported("text.format must be text, json_object or json_schema.", "text.format.type")


def chat_plan(body: Mapping[str, Any], history: Sequence[dict[str, Any]] = ()) -> ChatPlan:
    """The chat-completions job a Responses request makes.

    ``body`` is the request as sent (validated for types by the HTTP layer); ``history`` the chat
    messages of the response that ``previous_response_id`` names (see :func:`follow_up`). Raises
    :class:`~sluice.core.request.RequestRejected` for what has no chat counterpart, with ``param``
    naming the field as the client sent it (``input.2.content.0.type``).
    """
    for name, why in _REFUSED_FIELDS.items():
        if body.get(name) is not None:
            raise RequestRejected(
                400, f"'{name}' is not supported here: {why}.", "unsupported_parameter", param=name
            )
    if body.get("input") is None and not history:
        raise RequestRejected(
            400, "Missing required parameter: 'input'.", "missing_required_parameter", param="input"
        )

    instructions = body.get("instructions")
    head = [{"role": "system", "content": instructions}] if instructions else []
    messages = [*head, *history, *(_input_messages(body["input"]) if body.get("input") is not None else [])]
    if len(messages) == len(head):
        raise _reject("'input' must hold at least one message.", "input")

    chat: dict[str, Any] = {"messages": messages}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", "user", "priority", "timeout"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools, echoed_tools = _tools(body.get("tools") or [])
    if body.get("tool_choice") is not None:
        chat["tool_choice"], tools = _tool_choice(body["tool_choice"], tools)
    if tools:
        chat["tools"] = tools
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    # Log probabilities of the output text: asked for with top_logprobs, or by include.
    if isinstance(body.get("top_logprobs"), int):
        chat["logprobs"], chat["top_logprobs"] = True, body["top_logprobs"]
    elif LOGPROBS_INCLUDE in (body.get("include") or ()):
        chat["logprobs"] = True

    record = {
        "background": bool(body.get("background")),
        "instructions": instructions,
        "instruction_messages": len(head),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": reasoning,
        "store": body.get("store", True),
        "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": echoed_tools,
        "top_logprobs": body.get("top_logprobs"),
        "top_p": body.get("top_p"),
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user"),
    }
    return ChatPlan(body=chat, record=record)


def follow_up(previous: Job) -> list[dict[str, Any]]:
    """The chat messages a response continues when it names ``previous`` as its
    ``previous_response_id``: that job's messages without its instructions (they are not carried
    over), then its answer as an assistant message."""
    record = previous.extra.get(RECORD_KEY) or {}
    messages = list(previous.body.get("messages") or [])[int(record.get("instruction_messages", 0)) :]
    choices = (previous.result or {}).get("choices") or [{}]
    message = choices[0].get("message") or {}
    answer: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
    calls = _merged_calls(message.get("tool_calls") or [])
    if calls:
        answer["tool_calls"] = [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return [*messages, answer]


# --- answers ------------------------------------------------------------------------------------


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
class _Call:
    """One tool call as its fragments arrive: chat's ``tool_calls[index]``."""

    call_id: str = ""
    name: str = ""
    arguments: str = ""


def _call_index(calls: dict[int, _Call], fragment: Mapping[str, Any]) -> int:
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


def _mapping(value: Any) -> Mapping[str, Any]:
    """``value`` if it is an object, else an empty one: an engine's odd chunk is read as saying nothing."""
    return value if isinstance(value, dict) else {}


def _merged_calls(fragments: Sequence[Any]) -> list[_Call]:
    calls: dict[int, _Call] = {}
    for fragment in fragments:
        if isinstance(fragment, dict):
            _merge(calls.setdefault(_call_index(calls, fragment), _Call()), fragment)
    return [calls[i] for i in sorted(calls)]


def _merge(call: _Call, fragment: Mapping[str, Any]) -> str:
    """Add a fragment to its call; return the arguments it added."""
    function = _mapping(fragment.get("function"))
    if fragment.get("id") and not call.call_id:
        call.call_id = str(fragment["id"])
    name = function.get("name")
    # Engines send the name once, or repeat it whole in every fragment; a few split it in pieces.
    if name and name != call.name:
        call.name += str(name)
    added = function.get("arguments")
    text = _arguments(added) if added is not None else ""
    call.arguments += text
    return text


@dataclass
class _Item:
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
    call: _Call | None = None
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
            call = self.call or _Call()
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


_ID_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc"}
_DELTA_EVENT = {
    "output_text": "response.output_text.delta",
    "refusal": "response.refusal.delta",
    "reasoning_text": "response.reasoning_text.delta",
}


class ResponseEvents:
    """The Responses API's stream of one response, made from its job's chat chunks.

    Feed it in the order of the job's events: :meth:`opening` first, then :meth:`started`,
    :meth:`chunk` for each chunk of choices, and one of :meth:`done`, :meth:`failed` or
    :meth:`retried` (which ends the stream if output was already sent). Each returns the events
    to send, numbered by ``sequence_number`` from 0. The numbering depends only on what was fed,
    so a stream replayed from the job's event log numbers its events as the first one did, and a
    client can resume after any of them. After the last event, :attr:`final` is the Response
    object.
    """

    def __init__(self, job: Job) -> None:
        self.job = job
        self.id = response_id(job.id)
        self.record: dict[str, Any] = job.extra.get(RECORD_KEY) or {}
        self.background = bool(self.record.get("background"))
        self.sequence = 0
        self.items: list[_Item] = []
        self.message: _Item | None = None
        self.reasoning: _Item | None = None
        self.calls: dict[int, _Item] = {}
        self.finish_reason: str | None = None
        #: the engine's service tier, as its chunks (or its whole answer) said it; None if never
        self.service_tier: str | None = None
        self.in_progress = False
        #: the Response object once the stream has ended, else None
        self.final: dict[str, Any] | None = None

    @property
    def ended(self) -> bool:
        return self.final is not None

    @property
    def has_output(self) -> bool:
        return bool(self.items)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def snapshot(
        self,
        status: str,
        *,
        output: list[dict[str, Any]] | None = None,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        incomplete: str | None = None,
        completed_at: float | None = None,
    ) -> dict[str, Any]:
        """The Response object as it stands, with ``status``."""
        r = self.record
        response = {
            "id": self.id,
            "object": "response",
            "created_at": int(self.job.created_at),
            "status": status,
            "background": self.background,
            "completed_at": int(completed_at) if status == "completed" and completed_at else None,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.get("instructions"),
            "max_output_tokens": r.get("max_output_tokens"),
            "max_tool_calls": r.get("max_tool_calls"),
            "metadata": r.get("metadata") or {},
            "model": self.job.model,
            "output": output or [],
            "parallel_tool_calls": r.get("parallel_tool_calls", True),
            "previous_response_id": r.get("previous_response_id"),
            "reasoning": r.get("reasoning"),
            "store": r.get("store", True),
            "temperature": r.get("temperature"),
            "text": r.get("text") or {"format": {"type": "text"}},
            "tool_choice": r.get("tool_choice", "auto"),
            "tools": r.get("tools") or [],
            "top_logprobs": r.get("top_logprobs"),
            "top_p": r.get("top_p"),
            "truncation": r.get("truncation") or "disabled",
            "usage": usage,
            "user": r.get("user"),
            "service_tier": self.service_tier,
        }
        # The spec has no null for these: a response without them leaves them out.
        optional = ("usage", "user", "service_tier")
        return {k: v for k, v in response.items() if v is not None or k not in optional}

    # --- what the job's events say ---------------------------------------------------------

    def opening(self) -> list[dict[str, Any]]:
        """``response.created``, then ``response.queued`` for a background response (it waits in
        the queue, and says so) or ``response.in_progress`` for one a client waits on."""
        if self.background:
            first = self._event("response.created", response=self.snapshot("queued"))
            return [first, self._event("response.queued", response=self.snapshot("queued"))]
        return [self._event("response.created", response=self.snapshot("in_progress")), *self._progress()]

    def _progress(self) -> list[dict[str, Any]]:
        if self.in_progress:
            return []
        self.in_progress = True
        output = [item.view("in_progress") for item in self.items]
        return [self._event("response.in_progress", response=self.snapshot("in_progress", output=output))]

    def started(self) -> list[dict[str, Any]]:
        """A dispatcher took the job: ``response.in_progress``, once."""
        return self._progress()

    def _open(self, kind: str) -> tuple[_Item, list[dict[str, Any]]]:
        index = len(self.items)
        item = _Item(kind, index, f"{_ID_PREFIX[kind]}_{self.id.removeprefix(_RESPONSE_PREFIX)}_{index}")
        if kind == "function_call":
            item.call = _Call()
        self.items.append(item)
        return item, [
            self._event("response.output_item.added", output_index=index, item=item.view("in_progress"))
        ]

    def _text(
        self, item_kind: str, part_kind: str, delta: str, logprobs: Sequence[Any] = ()
    ) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self.reasoning if item_kind == "reasoning" else self.message
        if item is None:
            item, events = self._open(item_kind)
            if item_kind == "reasoning":
                self.reasoning = item
            else:
                self.message = item
        content_index, new = item.part(part_kind)
        where = {"item_id": item.id, "output_index": item.index, "content_index": content_index}
        if new:
            part = {**item.part_object(content_index)}
            events.append(self._event("response.content_part.added", **where, part=part))
        item.parts[content_index][1] += delta
        extra: dict[str, Any] = {}
        if part_kind == "output_text":
            tokens = [_logprob(t) for t in logprobs if isinstance(t, dict)]
            item.logprobs.setdefault(content_index, []).extend(tokens)
            extra["logprobs"] = [_delta_logprob(t) for t in tokens]
        events.append(self._event(_DELTA_EVENT[part_kind], **where, delta=delta, **extra))
        return events

    def _tool(self, fragment: Mapping[str, Any]) -> list[dict[str, Any]]:
        calls = {i: item.call for i, item in self.calls.items() if item.call is not None}
        index = _call_index(calls, fragment)
        events: list[dict[str, Any]] = []
        item = self.calls.get(index)
        if item is None:
            item, events = self._open("function_call")
            self.calls[index] = item
            assert item.call is not None
            # The call's id and name come first: the item added says them.
            function = _mapping(fragment.get("function"))
            item.call.call_id = str(fragment.get("id") or "")
            item.call.name = str(function.get("name") or "")
            events[0]["item"] = item.view("in_progress")
            fragment = {**fragment, "id": None, "function": {**function, "name": None}}
        assert item.call is not None
        added = _merge(item.call, fragment)
        if added:
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=item.index,
                    delta=added,
                )
            )
        return events

    def _tier(self, fields: Mapping[str, Any] | None) -> None:
        tier = (fields or {}).get("service_tier")
        if isinstance(tier, str) and tier:
            self.service_tier = tier

    def chunk(self, choices: Sequence[Any], fields: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """The events of one chunk's choices (only choice 0: a response has one answer).
        ``fields``: the chunk's own fields (a token event's, see
        :meth:`sluice.protocol.Assembler.event`): its ``service_tier`` is the response's."""
        self._tier(fields)
        events = self._progress()
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = _mapping(choice.get("delta"))
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(thought, str) and thought:
                events += self._text("reasoning", "reasoning_text", thought)
            if isinstance(delta.get("content"), str) and delta["content"]:
                tokens = _mapping(choice.get("logprobs")).get("content")
                tokens = tokens if isinstance(tokens, list) else []
                events += self._text("message", "output_text", delta["content"], tokens)
            if isinstance(delta.get("refusal"), str) and delta["refusal"]:
                events += self._text("message", "refusal", delta["refusal"])
            fragments = delta.get("tool_calls")
            for fragment in fragments if isinstance(fragments, list) else []:
                if isinstance(fragment, dict):
                    events += self._tool(fragment)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not self.items:  # an empty answer is still a message, as a whole answer would be
            self.message, events = self._open("message")
            self.message.part("output_text")
            where = {"item_id": self.message.id, "output_index": 0, "content_index": 0}
            events.append(
                self._event("response.content_part.added", **where, part=self.message.part_object(0))
            )
        for item in self.items:
            for i, (kind, text) in enumerate(item.parts):
                where = {"item_id": item.id, "output_index": item.index, "content_index": i}
                if kind == "output_text":
                    done = [_delta_logprob(t) for t in item.logprobs.get(i, [])]
                    events.append(self._event("response.output_text.done", **where, text=text, logprobs=done))
                elif kind == "refusal":
                    events.append(self._event("response.refusal.done", **where, refusal=text))
                else:
                    events.append(self._event("response.reasoning_text.done", **where, text=text))
                events.append(self._event("response.content_part.done", **where, part=item.part_object(i)))
            if item.call is not None:
                events.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item.id,
                        output_index=item.index,
                        name=item.call.name,
                        arguments=item.call.arguments,
                    )
                )
            events.append(
                self._event("response.output_item.done", output_index=item.index, item=item.view(status))
            )
        return events

    def done(
        self,
        chat_usage: Mapping[str, Any] | None,
        result: Mapping[str, Any] | None = None,
        finished_at: float | None = None,
    ) -> list[dict[str, Any]]:
        """The job succeeded: close every item, then ``response.completed``, or
        ``response.incomplete`` when the answer was cut (``finish_reason`` length or
        content_filter). ``result`` (the chat completion) fills in what no chunk said: the
        finish reason, or the whole answer when nothing was streamed."""
        choices = (result or {}).get("choices") or []
        first = choices[0] if choices and isinstance(choices[0], dict) else {}
        self._tier(result)
        events = self._progress()
        if not self.items and first.get("message"):
            events += self.chunk([{"index": 0, "delta": first["message"], "logprobs": first.get("logprobs")}])
        self.finish_reason = self.finish_reason or first.get("finish_reason")
        incomplete = _INCOMPLETE.get(self.finish_reason or "")
        status = "incomplete" if incomplete else "completed"
        events += self._close(status)
        self.final = self.snapshot(
            status,
            output=[item.view(status) for item in self.items],
            usage=usage(chat_usage),
            incomplete=incomplete,
            completed_at=finished_at,
        )
        events.append(self._event(f"response.{status}", response=self.final))
        return events

    def failed(self, state: JobState, error: Mapping[str, Any] | None) -> list[dict[str, Any]]:
        """The job ended without an answer: ``response.failed``, its status ``cancelled`` for a
        cancelled job (the API has no event of its own for that) and ``failed`` otherwise."""
        status = "cancelled" if state is JobState.CANCELLED else "failed"
        err = None
        if status == "failed":
            err = _error(error)
        self.final = self.snapshot(status, output=[item.view("incomplete") for item in self.items], error=err)
        return [self._event("response.failed", response=self.final)]

    def retried(self) -> list[dict[str, Any]]:
        """An attempt failed and the job will be retried. Before any output nothing changes; after
        some, what was sent cannot be taken back: the stream ends with ``response.failed``."""
        if not self.items:
            return []
        return self.failed(
            JobState.FAILED,
            {"message": "The engine failed mid-answer; retry the request.", "type": "server_error"},
        )


def _logprob(token: Mapping[str, Any]) -> dict[str, Any]:
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


def _delta_logprob(token: Mapping[str, Any]) -> dict[str, Any]:
    """A token's log probability as the stream's text events have it (no bytes)."""
    top = [{"token": t["token"], "logprob": t["logprob"]} for t in token["top_logprobs"]]
    return {"token": token["token"], "logprob": token["logprob"], "top_logprobs": top}


def _error(error: Mapping[str, Any] | None) -> dict[str, Any]:
    """A job's error as a Response's: the Responses API has a short list of codes, so a refused
    request is ``invalid_prompt`` and anything else ``server_error``; the message keeps Sluice's
    words."""
    err = error or {}
    code = "invalid_prompt" if err.get("type") == "invalid_request_error" else "server_error"
    return {"code": code, "message": str(err.get("message") or "The response failed.")}


def response_object(job: Job) -> dict[str, Any]:
    """The Response object of a job as it stands: ``queued`` or ``in_progress`` with no output
    yet, else its answer (built as the stream builds it) or its failure."""
    events = ResponseEvents(job)
    if job.state is JobState.QUEUED:
        return events.snapshot("queued")
    if job.state is JobState.RUNNING:
        return events.snapshot("in_progress")
    events.opening()
    if job.state is JobState.SUCCEEDED:
        events.done(job.usage, job.result, job.finished_at)
    else:
        events.failed(job.state, job.error.to_dict() if job.error else None)
    assert events.final is not None
    return events.final
