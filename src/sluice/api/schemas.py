"""Request bodies: the OpenAI fields Sluice reads, the scheduling options it adds; the rest passes through."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

PositiveTimeout = Annotated[float, Field(gt=0, description="Seconds the client will wait; capped by config.")]


class SchedulingOptions(BaseModel):
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


class SubmitRequest(BaseModel):
    """The article's ``POST /submit``."""

    model_config = ConfigDict(extra="allow")

    prompt: StrictStr = Field(min_length=1)
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    priority: StrictStr | None = None
    timeout: PositiveTimeout | None = None
