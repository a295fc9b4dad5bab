"""The Responses API's requests, translated without I/O: a ``POST /v1/responses`` body becomes a
chat-completions body (:func:`chat_plan`) that runs as any chat job on the queue, and a follow-up
(``previous_response_id``) continues the chat of the response it names (:func:`follow_up`).

A response is its job: the response id is the job id with ``resp_`` for ``job_``, and what the
Response object echoes of the request (instructions, tools, metadata, ...) is kept in the job's
``extra`` under :data:`RECORD_KEY`. What is and is not translated: docs/responses.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.core.job import Job
from sluice.core.request import RequestRejected
from sluice.core.response_output import arguments_text, merged_calls

__all__ = [
    "LOGPROBS_INCLUDE",
    "RECORD_KEY",
    "RESPONSE_PREFIX",
    "ChatPlan",
    "chat_plan",
    "follow_up",
    "job_id_of",
    "response_id",
]

#: the key of ``Job.extra`` that holds what a response echoes of its request
RECORD_KEY = "response"
#: the ``include`` value that asks for the output text's log probabilities
LOGPROBS_INCLUDE = "message.output_text.logprobs"

_JOB_PREFIX = "job_"
#: what a response id starts with, where its job's id has ``job_``
RESPONSE_PREFIX = "resp_"

# Request fields that change what the answer means and have no chat-completions counterpart:
# refused rather than dropped, so that nobody gets an answer to a question they did not ask.
_REFUSED_FIELDS = {
    "conversation": "conversations are stored by OpenAI; send the history as 'input' instead",
    "prompt": "prompt templates are stored by OpenAI; send the text as 'input' or 'instructions'",
}

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def response_id(job_id: str) -> str:
    """The response id of a job (``resp_…`` for ``job_…``)."""
    return RESPONSE_PREFIX + job_id.removeprefix(_JOB_PREFIX)


def job_id_of(response_id: str) -> str | None:
    """The job behind a response id; None when the text is no response id at all."""
    rest = response_id.removeprefix(RESPONSE_PREFIX)
    if rest == response_id or not rest:
        return None
    return _JOB_PREFIX + rest


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
                "function": {"name": item["name"], "arguments": arguments_text(item.get("arguments", ""))},
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
    calls = merged_calls(message.get("tool_calls") or [])
    if calls:
        answer["tool_calls"] = [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return [*messages, answer]
