"""The rules that turn what a request asked into a job's fields: priority, caps, defaults, cost, deadline.

:func:`plan_job` is pure: it reads a :class:`RequestedJob` (what the client sent, already parsed
from its body and headers), the server's :class:`RequestLimits` and the caller's
:class:`~sluice.core.ratelimit.TenantLimits`, and returns a :class:`JobPlan` or raises
:class:`RequestRejected`. The HTTP layer reads the request, calls it, and turns a rejection into its
error response; the queue's own admission (bounds, deadlines, rates) comes after, in the broker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from sluice.core.cost import (
    estimate_chat_tokens,
    estimate_definitions_tokens,
    estimate_prompt_tokens,
    prompt_count,
)
from sluice.core.job import Endpoint
from sluice.core.model_info import ModelInfo
from sluice.core.ratelimit import TenantLimits

__all__ = [
    "JobPlan",
    "RequestLimits",
    "RequestRejected",
    "RequestedJob",
    "best_of",
    "choices",
    "max_tokens",
    "plan_job",
    "priority",
    "prompt_tokens",
    "reserved_tokens",
    "sequences_per_prompt",
    "timeout_s",
]


class RequestedJob(NamedTuple):
    """What one request asked for, as sent; None wherever the client left a field out.

    A NamedTuple, immutable as the frozen dataclass it was, and made in a fifth of its time
    (15 fields: 5.0 against 1.4 µs; a frozen dataclass sets each field through
    ``object.__setattr__``): one is made for every request, refused or not.

    Attributes:
        endpoint: chat completions (``messages``) or completions (``prompt``).
        messages: the chat messages (chat only); an absent list counts as empty.
        prompt: the completions prompt: text, texts, token ids or lists of them (completions only).
        n: how many choices to generate; None: one.
        best_of: the body's ``best_of`` as sent (any JSON value: it is checked here): how many
            sequences the engine generates per prompt to return the best ``n`` of them.
        max_tokens: the body's ``max_tokens``.
        max_completion_tokens: the body's ``max_completion_tokens`` (OpenAI's newer name for the
            same limit); it wins over ``max_tokens`` when both are set, as in vLLM.
        priority: the body's ``priority``; it wins over the header.
        priority_header: the ``X-Priority`` header.
        timeout_s: the body's ``timeout`` (seconds); it wins over the header.
        timeout_header: the ``X-Request-Timeout`` header, unparsed: its text is checked here.
        client_timeout_header: the time-out the client library itself waits, unparsed: the
            official SDKs send it as ``x-stainless-timeout`` (openai-node) or
            ``x-stainless-read-timeout`` (openai-python), in seconds. Used when neither the body
            nor X-Request-Timeout sets one; a value that is not a positive number is ignored.
        tools: the body's ``tools`` (chat), as sent: their definitions are prompt text too.
        functions: the body's ``functions`` (chat; the older name for tools), as sent.
        response_format: the body's ``response_format``, as sent: its ``json_schema`` counts.
    """

    endpoint: Endpoint
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[Any] | None = None
    n: int | None = None
    best_of: object = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    priority: str | None = None
    priority_header: str | None = None
    timeout_s: float | None = None
    timeout_header: str | None = None
    client_timeout_header: str | None = None
    tools: Any = None
    functions: Any = None
    response_format: Any = None


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What this server lets one request ask for, and what it gives one that asks nothing.

    Attributes:
        classes: the priority class names, highest first.
        default_priority: the class of a request that names none (a key's ceiling may lower it).
        max_n: the most choices (``n``) one request may ask for, and the most sequences
            (``best_of``) it may have generated per prompt.
        default_max_tokens: ``max_tokens`` of a request that sets none; None: such a request
            reaches the engine without a limit, and the engine decides.
        max_tokens_cap: the most ``max_tokens`` (per choice) a request may ask for; also the most
            a request without a limit is charged per sequence before its model's answers have
            been measured.
        max_messages: the most chat messages one request may carry.
        max_prompt_tokens: the longest prompt taken, in estimated tokens: everything the engine
            reads (a completions prompt list's prompts together), counted once.
        default_timeout_s: the deadline of a request that sets none (seconds from now).
        max_timeout_s: the longest deadline a request may ask for; longer ones are cut to it.
    """

    classes: tuple[str, ...]
    default_priority: str
    max_n: int
    default_max_tokens: int | None
    max_tokens_cap: int
    max_messages: int
    max_prompt_tokens: int
    default_timeout_s: float
    max_timeout_s: float


class JobPlan(NamedTuple):
    """The job's fields that the rules decide (a NamedTuple, as :class:`RequestedJob` is, and for
    the same reason: one for every request).

    Attributes:
        priority: the job's priority class.
        engine_max_tokens: the limit per sequence the engine is given: the request's own
            (``max_completion_tokens``, else ``max_tokens``), else the server's
            ``default_max_tokens``; None: none, the engine decides.
        max_tokens: the tokens the job is charged for generating, in all: per sequence
            (:func:`reserved_tokens`: ``engine_max_tokens``, or an estimate when there is none)
            times ``sequences`` (the job's ``max_tokens``, what admission reserves).
        prompt_tokens: the prompt tokens the engine reads for the job: every prompt's estimate
            times the sequences generated from it (each sequence reads its prompt).
        deadline: when nobody waits for the answer any more (seconds since the epoch).
        sequences: how many sequences the engine runs for the job: the prompts (one, or a
            completions prompt list's length) times ``max(n, best_of)``; the dispatch slots it
            takes.
    """

    priority: str
    engine_max_tokens: int | None
    max_tokens: int
    prompt_tokens: int
    deadline: float
    sequences: int = 1

    @property
    def cost(self) -> int:
        """What the job costs the engine, in tokens: the prompt plus the most it may generate."""
        return self.prompt_tokens + self.max_tokens


class RequestRejected(Exception):
    """A request the rules refuse, with what its error response says.

    Attributes:
        status: the HTTP status (400 for a bad value, 403 for one the key may not use); the error's
            type follows from it, as for every error of the API.
        message: for the client, saying what to change.
        code: the error's machine-readable code, where it has one.
        param: the parameter at fault (a body field, or a header's name).
    """

    def __init__(
        self, status: int, message: str, code: str | None = None, *, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def plan_job(
    asked: RequestedJob,
    limits: RequestLimits,
    tenant: TenantLimits,
    now: float,
    model: ModelInfo | None = None,
) -> JobPlan:
    """The job ``asked`` makes, under ``limits`` and the caller's ``tenant`` limits, created at
    ``now``, for a model the workers describe as ``model`` (None: nothing known of it).

    The checks run in a fixed order, so that a request with several faults always hears of the same
    one first: ``n``, ``best_of``, ``max_tokens``, the messages' count, the prompt's length, the
    priority, the time-out. Raises :class:`RequestRejected` at the first fault.

    A job runs ``sequences`` sequences (prompts times ``max(n, best_of)``), and its cost counts
    them all: each reads its prompt and may generate ``max_tokens`` (or what
    :func:`reserved_tokens` expects of a request without a limit).
    """
    width = sequences_per_prompt(asked, limits)
    engine_max_tokens = max_tokens(asked, limits)
    prompt = prompt_tokens(asked, limits)
    sequences = width * (prompt_count(asked.prompt) if asked.endpoint is Endpoint.COMPLETIONS else 1)
    per_sequence = reserved_tokens(engine_max_tokens, prompt, limits, tenant, model)
    # By place, in JobPlan's order (priority, engine_max_tokens, max_tokens, prompt_tokens,
    # deadline, sequences; mypy checks each against its field's type): six keywords cost more
    # than the tuple (6.2k -> 3k instructions, callgrind).
    return JobPlan(
        priority(asked, limits, tenant),
        engine_max_tokens,
        per_sequence * sequences,
        prompt * width,
        now + timeout_s(asked, limits),
        sequences,
    )


def sequences_per_prompt(asked: RequestedJob, limits: RequestLimits) -> int:
    """How many sequences the engine generates from each prompt: ``n``, or ``best_of`` when it
    asks for more (the engine generates ``best_of`` and returns the best ``n``)."""
    if asked.n is None and asked.best_of is None and limits.max_n >= 1:
        return 1  # most requests: what choices() and best_of() say, without their three calls
    n = choices(asked, limits)
    return max(n, best_of(asked, limits) or n)


def choices(asked: RequestedJob, limits: RequestLimits) -> int:
    """How many choices the request asks for: ``n``, one by default, at most ``max_n``."""
    n = 1 if asked.n is None else asked.n
    if n < 1:
        raise RequestRejected(400, "'n' must be at least 1.", "invalid_value", param="n")
    if n > limits.max_n:
        raise RequestRejected(400, f"'n' must be at most {limits.max_n} on this server.", param="n")
    return n


def best_of(asked: RequestedJob, limits: RequestLimits) -> int | None:
    """The request's ``best_of``, an integer within 1 and ``max_n``; None when it sets none."""
    value = asked.best_of
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestRejected(400, "'best_of' must be an integer.", "invalid_type", param="best_of")
    if value < 1:
        raise RequestRejected(400, "'best_of' must be at least 1.", "invalid_value", param="best_of")
    if value > limits.max_n:
        raise RequestRejected(
            400, f"'best_of' must be at most {limits.max_n} on this server.", param="best_of"
        )
    return value


def max_tokens(asked: RequestedJob, limits: RequestLimits) -> int | None:
    """The limit per choice: the request's (``max_completion_tokens``, else ``max_tokens``, as vLLM
    reads them), or ``default_max_tokens`` when it sets neither (None: no limit). Each one the
    request sets must be within 1 and ``max_tokens_cap``."""
    limit: int | None = None
    for name, value in (
        ("max_tokens", asked.max_tokens),
        ("max_completion_tokens", asked.max_completion_tokens),
    ):
        if value is None:
            continue
        if value <= 0:
            raise RequestRejected(400, f"'{name}' must be at least 1.", "invalid_value", param=name)
        if value > limits.max_tokens_cap:
            raise RequestRejected(
                400,
                f"'{name}' must be at most {limits.max_tokens_cap} on this server.",
                "invalid_value",
                param=name,
            )
        limit = int(value)  # the later name wins
    return limit if limit is not None else limits.default_max_tokens


def reserved_tokens(
    limit: int | None,
    prompt: int,
    limits: RequestLimits,
    tenant: TenantLimits,
    model: ModelInfo | None = None,
) -> int:
    """The tokens one sequence is charged for generating: its ``limit``; without one, what the
    model's answers have been measured to need (``ModelInfo.output_tokens``), or ``max_tokens_cap``
    before that, never more than the model's context window leaves after the ``prompt``, nor more
    than the key's ``tpm`` leaves (a charge it could never pay would refuse every such request:
    real usage above the charge is taken at settlement instead). At least one."""
    if limit is not None:
        return limit
    guess = limits.max_tokens_cap
    if model is not None and model.output_tokens is not None:
        guess = model.output_tokens
    if model is not None and model.context_window is not None:
        guess = min(guess, model.context_window - prompt)
    if tenant.tpm is not None:
        guess = min(guess, tenant.tpm - prompt)
    return max(guess, 1)


def prompt_tokens(asked: RequestedJob, limits: RequestLimits) -> int:
    """The prompt's estimated length in tokens, once the messages' count and that length are within
    ``max_messages`` and ``max_prompt_tokens``.

    The prompt is everything the engine reads (:mod:`sluice.core.cost`): the messages whole, tool
    and function definitions, the response format's schema; a completions prompt list's prompts
    together."""
    if asked.endpoint is Endpoint.CHAT:
        messages = asked.messages or []
        if len(messages) > limits.max_messages:
            raise RequestRejected(
                400, f"At most {limits.max_messages} messages per request on this server.", param="messages"
            )
        definitions = estimate_definitions_tokens(
            tools=asked.tools, functions=asked.functions, response_format=asked.response_format
        )
        tokens = estimate_chat_tokens(messages) + definitions
    else:
        definitions = estimate_definitions_tokens(response_format=asked.response_format)
        tokens = estimate_prompt_tokens(asked.prompt if asked.prompt is not None else "") + definitions
    if tokens > limits.max_prompt_tokens:
        what = f"about {tokens} tokens"
        if definitions:
            what += f" ({definitions} of them tool definitions and schemas)"
        raise RequestRejected(
            400,
            f"The prompt is {what}; the most this server takes is {limits.max_prompt_tokens}.",
            "context_length_exceeded",
            param="messages" if asked.endpoint is Endpoint.CHAT else "prompt",
        )
    return tokens


def priority(asked: RequestedJob, limits: RequestLimits, tenant: TenantLimits) -> str:
    """The job's class: the body's, else the header's, else the default; never above the key's ceiling.

    The default is the server's ``default_priority``, or the key's ``max_priority`` when that is
    lower: a key held below the server's default must not have every request without a priority
    refused.
    """
    names = limits.classes
    ceiling = tenant.max_priority
    default = limits.default_priority
    if ceiling is not None and names.index(default) < names.index(ceiling):
        default = ceiling
    value = asked.priority or asked.priority_header or default
    if value not in names:
        raise RequestRejected(
            400,
            f"Unknown priority '{value}'; use one of {', '.join(names)}.",
            "invalid_value",
            param="priority",
        )
    if ceiling is not None and names.index(value) < names.index(ceiling):
        raise RequestRejected(
            403,
            f"This key may use priority '{ceiling}' at most; '{value}' is above it.",
            "priority_not_allowed",
            param="priority",
        )
    return value


def timeout_s(asked: RequestedJob, limits: RequestLimits) -> float:
    """Seconds until the job's deadline: the body's ``timeout``, else the ``X-Request-Timeout``
    header (which must be a positive, finite number), else the client library's own time-out
    (``client_timeout_header``: the client waits that long, and no longer), else
    ``default_timeout_s``; at most ``max_timeout_s``."""
    value = asked.timeout_s
    if value is None and asked.timeout_header is not None:
        try:
            value = float(asked.timeout_header)
        except ValueError:
            value = -1.0
        # 'not > 0' also catches NaN; an infinite wait is no deadline at all.
        if not value > 0 or math.isinf(value):
            raise RequestRejected(
                400, "X-Request-Timeout must be a positive number of seconds.", param="X-Request-Timeout"
            )
    if value is None and asked.client_timeout_header is not None:
        value = _seconds(asked.client_timeout_header)
    return min(value or limits.default_timeout_s, limits.max_timeout_s)


def _seconds(text: str) -> float | None:
    """A positive, finite number of seconds, or None: a header the client did not write itself
    (its library did) is read when it makes sense and ignored otherwise, never refused."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value > 0 and math.isfinite(value) else None
