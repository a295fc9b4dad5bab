"""The Responses API over chat completions: a job's chat chunks become the Responses API's typed
stream events (:class:`ResponseEvents`), and its answer the Response object (:func:`response_object`).

Both answers come out of the same builder, so a streamed response ends with the object that
``GET /v1/responses/{id}`` returns. The request's side (a Responses body as a chat job) is
:mod:`sluice.core.response_request`; the output's pieces are :mod:`sluice.core.response_output`.
What is and is not translated: docs/responses.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sluice.core.job import Job, JobState
from sluice.core.response_output import (
    ITEM_ID_PREFIX,
    OutputItem,
    ToolCall,
    as_mapping,
    call_index,
    delta_logprob,
    logprob_of,
    merge_fragment,
    response_error,
    usage,
)
from sluice.core.response_request import RECORD_KEY, RESPONSE_PREFIX, response_id

__all__ = ["ResponseEvents", "response_object"]

# A chat finish_reason that cuts the answer, and how the Responses API says so.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}

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
        self.items: list[OutputItem] = []
        self.message: OutputItem | None = None
        self.reasoning: OutputItem | None = None
        self.calls: dict[int, OutputItem] = {}
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

    def _open(self, kind: str) -> tuple[OutputItem, list[dict[str, Any]]]:
        index = len(self.items)
        item = OutputItem(
            kind, index, f"{ITEM_ID_PREFIX[kind]}_{self.id.removeprefix(RESPONSE_PREFIX)}_{index}"
        )
        if kind == "function_call":
            item.call = ToolCall()
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
            tokens = [logprob_of(t) for t in logprobs if isinstance(t, dict)]
            item.logprobs.setdefault(content_index, []).extend(tokens)
            extra["logprobs"] = [delta_logprob(t) for t in tokens]
        events.append(self._event(_DELTA_EVENT[part_kind], **where, delta=delta, **extra))
        return events

    def _tool(self, fragment: Mapping[str, Any]) -> list[dict[str, Any]]:
        calls = {i: item.call for i, item in self.calls.items() if item.call is not None}
        index = call_index(calls, fragment)
        events: list[dict[str, Any]] = []
        item = self.calls.get(index)
        if item is None:
            item, events = self._open("function_call")
            self.calls[index] = item
            assert item.call is not None
            # The call's id and name come first: the item added says them.
            function = as_mapping(fragment.get("function"))
            item.call.call_id = str(fragment.get("id") or "")
            item.call.name = str(function.get("name") or "")
            events[0]["item"] = item.view("in_progress")
            fragment = {**fragment, "id": None, "function": {**function, "name": None}}
        assert item.call is not None
        added = merge_fragment(item.call, fragment)
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
        :func:`sluice.attempt.generate`): its ``service_tier`` is the response's."""
        self._tier(fields)
        events = self._progress()
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = as_mapping(choice.get("delta"))
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(thought, str) and thought:
                events += self._text("reasoning", "reasoning_text", thought)
            if isinstance(delta.get("content"), str) and delta["content"]:
                tokens = as_mapping(choice.get("logprobs")).get("content")
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
                    done = [delta_logprob(t) for t in item.logprobs.get(i, [])]
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
            err = response_error(error)
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
