"""The Backend interface: stream a completion, abort it by closing the stream, report models and health."""

from __future__ import annotations

import contextlib
import ipaddress
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from sluice.core.concurrency import EngineLoad
from sluice.core.job import Job
from sluice.core.model_info import ModelInfo


def public_name(name: str, index: int) -> str:
    """What clients may be told of a backend: its name, unless the name gives away where the engine
    is (a URL, the default name, or a host and port), then ``backend <index + 1>``."""
    looks_like_address = "/" in name or ":" in name or "@" in name
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(name)
        looks_like_address = True
    return f"backend {index + 1}" if looks_like_address or not name else name


class BackendError(Exception):
    """An engine failed a request.

    Args:
        message: what the client is told (the job's error, the ``retry`` event's reason): never
            where the engine is (its URL, host or port).
        retryable: another attempt (on this or another backend) may succeed: connection errors, 5xx,
            429. False when the engine rejected the request itself (4xx): retrying cannot help.
        status: the engine's HTTP status, when it answered.
        detail: what the operator's log is told, which may name the engine's address; unset: the
            message.
        param: the parameter the engine refused, as its error names it.
        reached: False when no connection to the engine could be opened (refused, DNS, the
            connect timeout): it never saw the request, so the try is not one of the job's
            ``max_attempts`` (an engine restarting for longer than the retries' backoff would
            otherwise fail the jobs that wait for it); the job's deadline still bounds the wait.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        type: str = "server_error",
        code: str | None = "engine_error",
        detail: str | None = None,
        param: str | None = None,
        reached: bool = True,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail if detail is not None else message
        self.retryable = retryable
        self.status = status
        self.type = type
        self.code = code
        self.param = param
        self.reached = reached


class Backend(ABC):
    """One inference engine endpoint.

    Args:
        name: unique, for logs, metrics and the job's ``backend`` field.
        max_concurrency: sequences the engine runs at once (vLLM's ``max_num_seqs``, llama-server's
            ``-np``); the dispatcher never sends more, so the engine's own waiting queue stays empty.
        max_inflight_tokens: optional budget of in-flight cost (prompt + max_tokens) on this engine,
            e.g. its KV-cache size in tokens, so long requests do not cause preemption.
        models: the models it serves; empty means "ask the engine" (``/v1/models``).

    ``model_info`` holds what the engine's model list says of each model it serves (its context
    window, when it was created); :meth:`discover_models` fills it.
    """

    def __init__(
        self,
        name: str,
        *,
        max_concurrency: int,
        max_inflight_tokens: int | None = None,
        models: list[str] | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        self.name = name
        self.max_concurrency = max_concurrency
        self.max_inflight_tokens = max_inflight_tokens
        self.models: list[str] = list(models or [])
        self.model_info: dict[str, ModelInfo] = {}

    @abstractmethod
    async def discover_models(self) -> list[str]:
        """The models the engine lists, and what it says of them into ``model_info``; raises
        :class:`BackendError` when it cannot be reached."""

    @abstractmethod
    def stream(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        """Run the job, yielding OpenAI stream chunks. Closing the iterator aborts the request."""

    #: whether :meth:`whole` runs a job that does not stream (``job.stream_tokens`` false): the
    #: dispatcher then awaits it instead of iterating a stream of its one chunk
    whole_answers = False

    async def whole(self, job: Job) -> dict[str, Any]:
        """Run a job that does not stream: the one chunk :meth:`stream` would yield for it (its
        whole answer in the shape of a stream chunk). Cancelling the call aborts the request.
        Only where :attr:`whole_answers` says so."""
        raise NotImplementedError

    @abstractmethod
    async def healthy(self) -> bool:
        """Whether the engine answers at all."""

    async def engine_load(self) -> EngineLoad | None:
        """What the engine reports of its own load now (running, waiting, KV use, preemptions),
        for the adaptive in-flight limit; None: it reports nothing, or could not be read. Never
        raises: a report is a hint, polled on the heartbeat."""
        return None

    async def aclose(self) -> None:
        """Release connections."""
