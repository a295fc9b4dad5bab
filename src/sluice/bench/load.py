"""The load side of ``sluice bench``: arrival schedules, simulated clients, and metric sampling.

The generator is open-loop: arrival times are drawn up front from a Poisson process and each
arrival becomes its own asyncio task at its planned time, whatever the target is doing. A
closed-loop tool (a fixed pool of users, each waiting for its answer before sending the next)
slows down exactly when the target does, so it never offers the overload it claims to.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

__all__ = [
    "MODES",
    "PROMPT",
    "Client",
    "MetricsSampler",
    "Outcome",
    "Profile",
    "Record",
    "arrivals",
    "is_retrier",
    "parse_prometheus",
    "run_load",
]

Outcome = Literal["ok", "refused", "timeout", "error"]
MODES = ("direct", "sync", "async")

# About 100 characters: 32 prompt tokens by the simulator's estimate (4 chars/token plus the chat
# template's markers), the prompt size the simulator's capacity is quoted for.
PROMPT = (
    "Explain how the Transformer architecture works, in simple terms, for a new engineer on our own team."
)

# Long polls are cut into pieces no longer than this, so a give-up is never stuck behind one.
_MAX_POLL_S = 30.0
# A cancellation sent after a give-up gets this long; it is bookkeeping, not part of the client's wait.
_CANCEL_TIMEOUT_S = 5.0
# A retrier waits for a Retry-After up to this long, as the issue describes the openai SDK's limit; a
# longer one is a "do not come back soon", and the client does not retry.
MAX_RETRY_AFTER_S = 120.0


# -- arrivals ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Profile:
    """An offered-load shape: rate (requests/s) as a function of time over ``duration`` seconds.

    ``steady``: ``rate`` throughout. ``spike``: ``rate``, then ``peak`` during
    ``[spike_at, spike_at + spike_for)``, then ``rate`` again. ``ramp``: linear from ``rate`` to
    ``to`` over the whole duration.
    """

    kind: Literal["steady", "spike", "ramp"] = "steady"
    rate: float = 10.0
    duration: float = 60.0
    peak: float = 30.0
    spike_at: float = 20.0
    spike_for: float = 10.0
    to: float = 20.0

    def __post_init__(self) -> None:
        if self.duration <= 0:
            raise ValueError("duration must be positive")
        if min(self.rate, self.peak, self.to) < 0:
            raise ValueError("rates must not be negative")
        if self.kind == "spike" and (self.spike_at < 0 or self.spike_for <= 0):
            raise ValueError("the spike needs spike_at >= 0 and spike_for > 0")

    def rate_at(self, t: float) -> float:
        if self.kind == "spike":
            return self.peak if self.spike_at <= t < self.spike_at + self.spike_for else self.rate
        if self.kind == "ramp":
            return self.rate + (self.to - self.rate) * min(max(t / self.duration, 0.0), 1.0)
        return self.rate

    @property
    def max_rate(self) -> float:
        if self.kind == "spike":
            return max(self.rate, self.peak)
        if self.kind == "ramp":
            return max(self.rate, self.to)
        return self.rate

    def expected_count(self) -> float:
        """The mean number of arrivals: the integral of the rate."""
        if self.kind == "spike":
            inside = max(0.0, min(self.spike_at + self.spike_for, self.duration) - self.spike_at)
            return self.rate * (self.duration - inside) + self.peak * inside
        if self.kind == "ramp":
            return (self.rate + self.to) / 2 * self.duration
        return self.rate * self.duration

    def describe(self) -> str:
        if self.kind == "spike":
            end = self.spike_at + self.spike_for
            return (
                f"spike {self.rate:g} → {self.peak:g} → {self.rate:g} req/s "
                f"(peak {self.spike_at:g} to {end:g} s of {self.duration:g} s)"
            )
        if self.kind == "ramp":
            return f"ramp {self.rate:g} → {self.to:g} req/s over {self.duration:g} s"
        return f"steady {self.rate:g} req/s for {self.duration:g} s"


def arrivals(profile: Profile, seed: int) -> list[float]:
    """Arrival offsets (seconds from the start) of a Poisson process with the profile's rate.

    Varying rates are drawn by thinning (Lewis and Shedler): candidates at the peak rate, each kept
    with probability rate(t) / peak. The same seed and profile always give the same arrivals, so
    runs against different targets or policies face identical traffic.
    """
    rng = random.Random(seed)
    top = profile.max_rate
    out: list[float] = []
    if top <= 0:
        return out
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= profile.duration:
            return out
        # Draw the thinning coin even at full rate, so that the stream of randomness (and thus
        # the arrivals) depends only on the seed and the peak rate.
        if rng.random() * top < profile.rate_at(t):
            out.append(t)


# -- one request ---------------------------------------------------------------------------------


def is_retrier(index: int, seed: int, fraction: float) -> bool:
    """Whether client ``index`` retries once after a Retry-After, for ``fraction`` of the clients.

    A hash of the seed and the index, not a random stream: the same clients retry in every run with
    that seed, whatever the target and whatever order their requests end in, so runs of different
    policies on the same arrivals also face the same retriers.
    """
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


@dataclass(slots=True)
class Record:
    """One simulated request, from its planned arrival to its first outcome, and its one retry if any.

    Times are seconds from the start of the run. ``latency_s`` is from sending to the outcome (for a
    refusal, the time to refuse). ``tokens`` are completion tokens the client received.
    ``should_retry`` is the refusal's ``x-should-retry`` header (None when absent).

    A ``retrier`` refused with a Retry-After (and not told ``x-should-retry: false``) sleeps exactly
    that long and sends the same request once more; the ``retry_*`` fields hold that attempt. The
    first outcome stays the record's outcome, so refusals and success rates compare across runs
    whatever share of the clients retries; goodput counts an answer that came on the retry too.
    """

    index: int
    scheduled_s: float
    sent_s: float = math.nan
    ended_s: float = math.nan
    outcome: Outcome | None = None
    status: int | None = None
    code: str | None = None
    latency_s: float = math.nan
    ttft_s: float | None = None
    tokens: int = 0
    retry_after_s: float | None = None
    job_id: str | None = None
    detail: str | None = None
    should_retry: bool | None = None
    retrier: bool = False
    retry_outcome: Outcome | None = None
    retry_status: int | None = None
    retry_code: str | None = None
    retry_sent_s: float | None = None
    retry_ended_s: float | None = None
    retry_latency_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        # JSON has no NaN; a missing time is null.
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in data.items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        for name in ("sent_s", "ended_s", "latency_s"):
            if known.get(name) is None:
                known[name] = math.nan
        return cls(**known)


class _Finished(Exception):
    """Raised inside a client to end its request with an outcome other than success."""

    def __init__(
        self, outcome: Outcome, status: int | None = None, code: str | None = None, detail: str | None = None
    ) -> None:
        super().__init__(detail or code or outcome)
        self.outcome = outcome
        self.status = status
        self.code = code
        self.detail = detail


def _retry_after(headers: httpx.Headers) -> float | None:
    # retry-after-ms (OpenAI's SDK convention) keeps the precision that whole-second Retry-After loses.
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        raw = headers.get(name)
        if raw is None:
            continue
        with contextlib.suppress(ValueError):
            return float(raw) / scale
    return None


def _error_code(body: bytes) -> tuple[str | None, str | None]:
    """The ``code`` and ``message`` of an OpenAI-shaped error body, if it is one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None, body[:200].decode("utf-8", "replace") or None
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        code = err.get("code")
        message = err.get("message")
        return (str(code) if code is not None else None), (str(message)[:200] if message else None)
    if isinstance(data, dict) and isinstance(data.get("detail"), str):
        return None, data["detail"][:200]
    return None, None


def _classify_status(status: int, body: bytes, headers: httpx.Headers, record: Record) -> _Finished:
    code, message = _error_code(body)
    if status in (429, 503):
        record.retry_after_s = _retry_after(headers)
        flag = headers.get("x-should-retry")
        record.should_retry = None if flag is None else flag.strip().lower() == "true"
        return _Finished("refused", status, code or f"http_{status}", message)
    if status == 504 or code == "deadline_exceeded":
        # The server's own deadline ran out: an honest end, but not an answer.
        return _Finished("timeout", status, code or "gateway_timeout", message)
    return _Finished("error", status, code or f"http_{status}", message)


@dataclass(slots=True)
class Client:
    """How each simulated client talks to the target; one instance is shared by all requests.

    ``client_timeout`` is when a client gives up (None: never): it closes its connection, which an
    engine treats as an abort and Sluice as a cancellation; in ``async`` mode it also DELETEs its job.
    ``retriers`` is the share of clients (chosen by :func:`is_retrier` with ``seed``) that retry once
    after a refusal's Retry-After, as the official openai SDK would.
    """

    http: httpx.AsyncClient
    target: str
    mode: str = "direct"
    model: str | None = None
    max_tokens: int = 128
    client_timeout: float | None = 15.0
    stream: bool = False
    users: int = 1
    retriers: float = 0.0
    seed: int = 1
    prompt: str = PROMPT
    clock: Callable[[], float] = time.perf_counter
    origin: float = field(default_factory=time.perf_counter)

    def now(self) -> float:
        return self.clock() - self.origin

    def _body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": self.prompt}],
            "max_tokens": self.max_tokens,
        }
        if self.model:
            body["model"] = self.model
        if self.mode == "async" and self.client_timeout is not None:
            body["timeout"] = self.client_timeout
        if self.stream and self.mode != "async":
            body["stream"] = True
        return body

    def _headers(self, index: int, retry_count: int = 0) -> dict[str, str]:
        headers: dict[str, str] = {}
        # The official openai SDK marks its retries so; a server may count or treat them apart.
        if retry_count:
            headers["x-stainless-retry-count"] = str(retry_count)
        # Sluice learns the client's deadline from this header; an engine ignores it.
        if self.mode == "sync" and self.client_timeout is not None:
            headers["X-Request-Timeout"] = f"{self.client_timeout:g}"
        # In open mode a gateway tells callers apart by their bearer token: one per simulated user,
        # so per-key limits and fair shares see N users instead of one anonymous crowd.
        if self.users > 1 and self.mode != "direct":
            headers["Authorization"] = f"Bearer bench-user-{index % self.users}"
        return headers

    async def run(self, record: Record) -> None:
        """Send one request and fill ``record`` with its outcome, and a retrier's one retry; never raises."""
        record.retrier = is_retrier(record.index, self.seed, self.retriers)
        await self._attempt(record, self._headers(record.index))
        wait = record.retry_after_s
        if (
            not record.retrier
            or record.outcome != "refused"
            or wait is None
            or not 0 <= wait <= MAX_RETRY_AFTER_S
            or record.should_retry is False
        ):
            return
        # Exactly the Retry-After, on the run's own clock: asyncio's timers may fire a hair early.
        while (left := record.ended_s + wait - self.now()) > 0:  # noqa: ASYNC110 (a deadline, no event)
            await asyncio.sleep(left)
        retry = Record(index=record.index, scheduled_s=record.ended_s + wait)
        await self._attempt(retry, self._headers(record.index, retry_count=1))
        record.retry_outcome, record.retry_status, record.retry_code = retry.outcome, retry.status, retry.code
        record.retry_sent_s, record.retry_ended_s = retry.sent_s, retry.ended_s
        record.retry_latency_s = retry.latency_s

    async def _attempt(self, record: Record, headers: dict[str, str]) -> None:
        """One try, with its own client timeout: fill ``record``'s outcome and times."""
        record.sent_s = self.now()
        try:
            async with asyncio.timeout(self.client_timeout):
                if self.mode == "async":
                    await self._run_job(record, headers)
                elif self.stream:
                    await self._run_stream(record, headers)
                else:
                    await self._run_whole(record, headers)
            record.outcome = "ok"
            record.status = 200
        except TimeoutError:
            record.outcome, record.code = "timeout", "client_gave_up"
            if self.mode == "async" and record.job_id is not None:
                await self._cancel(record.job_id, headers)
        except _Finished as end:
            record.outcome, record.status, record.code, record.detail = (
                end.outcome,
                end.status,
                end.code,
                end.detail,
            )
        except httpx.HTTPError as exc:
            record.outcome, record.code, record.detail = "error", type(exc).__name__, str(exc)[:200] or None
        except (ValueError, KeyError, TypeError) as exc:
            record.outcome, record.code, record.detail = "error", "bad_response", repr(exc)[:200]
        record.ended_s = self.now()
        record.latency_s = record.ended_s - record.sent_s

    async def _run_whole(self, record: Record, headers: dict[str, str]) -> None:
        response = await self.http.post(
            f"{self.target}/v1/chat/completions", json=self._body(), headers=headers
        )
        if response.status_code != 200:
            raise _classify_status(response.status_code, response.content, response.headers, record)
        record.job_id = response.headers.get("x-sluice-job-id")
        data = response.json()
        usage = data.get("usage") or {}
        record.tokens = int(usage.get("completion_tokens") or 0)

    async def _run_stream(self, record: Record, headers: dict[str, str]) -> None:
        url = f"{self.target}/v1/chat/completions"
        async with self.http.stream("POST", url, json=self._body(), headers=headers) as response:
            if response.status_code != 200:
                raise _classify_status(response.status_code, await response.aread(), response.headers, record)
            record.job_id = response.headers.get("x-sluice-job-id")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                data = json.loads(payload)
                if "error" in data:
                    code, message = _error_code(payload.encode())
                    outcome: Outcome = "timeout" if code == "deadline_exceeded" else "error"
                    raise _Finished(outcome, 200, code or "stream_error", message)
                for choice in data.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        if record.ttft_s is None:
                            record.ttft_s = self.now() - record.sent_s
                        record.tokens += 1
        raise _Finished("error", 200, "stream_truncated", "the stream ended without [DONE]")

    async def _run_job(self, record: Record, headers: dict[str, str]) -> None:
        response = await self.http.post(f"{self.target}/v1/jobs", json=self._body(), headers=headers)
        if response.status_code not in (200, 202):
            raise _classify_status(response.status_code, response.content, response.headers, record)
        record.job_id = str(response.json()["id"])
        while True:
            left = _MAX_POLL_S
            if self.client_timeout is not None:
                left = min(left, self.client_timeout - (self.now() - record.sent_s))
            wait = max(round(left, 3), 0.001)
            poll = await self.http.get(
                f"{self.target}/v1/jobs/{record.job_id}", params={"wait": wait}, headers=headers
            )
            if poll.status_code != 200:
                raise _classify_status(poll.status_code, poll.content, poll.headers, record)
            view = poll.json()
            status = view.get("status")
            if status == "succeeded":
                usage = view.get("usage") or {}
                record.tokens = int(usage.get("completion_tokens") or 0)
                return
            if status in ("failed", "cancelled", "expired"):
                err = view.get("error") or {}
                outcome: Outcome = "timeout" if status == "expired" else "error"
                raise _Finished(outcome, 200, err.get("code") or status, err.get("message"))

    async def _cancel(self, job_id: str, headers: dict[str, str]) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.http.delete(
                f"{self.target}/v1/jobs/{job_id}", headers=headers, timeout=_CANCEL_TIMEOUT_S
            )


# -- metrics -------------------------------------------------------------------------------------

_SAMPLE_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition → ``{name or name{labels}: value}``; also sums per bare name.

    A labelled sample is kept both under its full key (labels sorted) and added into the total under
    its bare name, since the bench usually wants "queued jobs, all models".
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_LINE.match(line)
        if m is None:
            continue
        name, labels, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if labels:
            pairs = sorted(_LABEL.findall(labels))
            out[name + "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}"] = value
        out[name] = out.get(name, 0.0) + value if labels else value
    return out


# Gauges plotted as "queue depth"; whichever the targets expose (llama-server's with --metrics, which
# `sluice engine start` passes).
QUEUE_GAUGES = (
    "sluice_queued_jobs",
    "sluice_running_jobs",
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "llamacpp:requests_deferred",
    "llamacpp:requests_processing",
)


@dataclass(slots=True)
class MetricsSampler:
    """Samples ``/metrics`` endpoints every ``interval`` seconds and keeps the queue gauges."""

    http: httpx.AsyncClient
    urls: list[str]
    interval: float = 0.5
    clock: Callable[[], float] = time.perf_counter
    origin: float = field(default_factory=time.perf_counter)
    samples: list[dict[str, float]] = field(default_factory=list)

    async def scrape(self) -> dict[str, float]:
        """All samples of all URLs merged (later URLs win on a name clash); {} on failure."""
        merged: dict[str, float] = {}
        for url in self.urls:
            with contextlib.suppress(httpx.HTTPError):
                response = await self.http.get(url, timeout=2.0)
                if response.status_code == 200:
                    merged.update(parse_prometheus(response.text))
        return merged

    async def run_forever(self) -> None:
        while True:
            started = self.clock()
            values = await self.scrape()
            if values:
                sample = {"t": started - self.origin}
                sample.update({k: values[k] for k in QUEUE_GAUGES if k in values})
                self.samples.append(sample)
            await asyncio.sleep(max(0.0, self.interval - (self.clock() - started)))


# -- the run -------------------------------------------------------------------------------------


async def run_load(
    client: Client,
    schedule: list[float],
    on_done: Callable[[Record], None] | None = None,
) -> list[Record]:
    """Fire one task per arrival at its planned time; return when every request has its outcome.

    The loop only sleeps until the next arrival and spawns; it never waits on a request, so a slow
    target cannot slow the offered load down.
    """
    records = [Record(index=i, scheduled_s=t) for i, t in enumerate(schedule)]
    tasks: set[asyncio.Task[None]] = set()

    async def one(record: Record) -> None:
        await client.run(record)
        if on_done is not None:
            on_done(record)

    for record in records:
        delay = record.scheduled_s - client.now()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(record), name=f"bench-{record.index}")
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    while tasks:
        await asyncio.gather(*list(tasks))
    return records
