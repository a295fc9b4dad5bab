"""OpenAI wire shapes: errors, streamed chunks, and whole responses assembled from chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.core.job import Endpoint, Job


def error_body(message: str, type: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def response_id(job: Job) -> str:
    prefix = "chatcmpl-" if job.endpoint is Endpoint.CHAT else "cmpl-"
    return prefix + job.id.removeprefix("job_")


def chunk(job: Job, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """A streamed chunk in the job's own identity (id, model), whatever engine produced it."""
    out: dict[str, Any] = {
        "id": response_id(job),
        "object": "chat.completion.chunk" if job.endpoint is Endpoint.CHAT else "text_completion",
        "created": int(job.created_at),
        "model": job.model,
        "choices": choices,
    }
    if usage is not None:
        out["usage"] = usage
    return out


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    role: str = "assistant"
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class Assembler:
    """Builds the non-streaming response from the chunks of a streamed one."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.choices: dict[int, _Choice] = {}
        self.usage: dict[str, Any] | None = None
        self.tokens = 0  # content chunks seen, a fallback for engines that report no usage

    def add(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one engine chunk; return the choices worth relaying (empty for a usage-only chunk)."""
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]
        choices = data.get("choices") or []
        relay = []
        for raw in choices:
            if not isinstance(raw, dict):
                continue
            index = int(raw.get("index", 0))
            c = self.choices.setdefault(index, _Choice(index))
            if self.job.endpoint is Endpoint.CHAT:
                delta = raw.get("delta") or {}
                if delta.get("role"):
                    c.role = delta["role"]
                if delta.get("content"):
                    c.text.append(delta["content"])
                    self.tokens += 1
                if delta.get("tool_calls"):
                    c.tool_calls.extend(delta["tool_calls"])
            elif raw.get("text"):
                c.text.append(raw["text"])
                self.tokens += 1
            if raw.get("finish_reason"):
                c.finish_reason = raw["finish_reason"]
            relay.append(raw)
        return relay

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
        choices = []
        for c in sorted(self.choices.values(), key=lambda c: c.index) or [_Choice(0)]:
            text = "".join(c.text)
            if self.job.endpoint is Endpoint.CHAT:
                message: dict[str, Any] = {"role": c.role, "content": text}
                if c.tool_calls:
                    message["tool_calls"] = c.tool_calls
                choices.append(
                    {
                        "index": c.index,
                        "message": message,
                        "finish_reason": c.finish_reason or "stop",
                        "logprobs": None,
                    }
                )
            else:
                choices.append(
                    {
                        "index": c.index,
                        "text": text,
                        "finish_reason": c.finish_reason or "stop",
                        "logprobs": None,
                    }
                )
        return {
            "id": response_id(self.job),
            "object": "chat.completion" if self.job.endpoint is Endpoint.CHAT else "text_completion",
            "created": int(self.job.created_at),
            "model": self.job.model,
            "choices": choices,
            "usage": self.final_usage(),
        }
