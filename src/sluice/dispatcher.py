"""The dispatcher: claims a job only when a backend has a free slot, runs it, settles it.

One dispatcher per process. It keeps every backend's in-flight sequences below its concurrency (and
in-flight cost below its token budget), so the engine's own waiting queue stays empty and the
scheduling decisions stay in the broker. A job takes a slot per sequence the engine runs for it
(``Job.sequences``: prompts times ``max(n, best_of)``), at most all of a backend's. One heartbeat
loop renews all leases, re-registers the capacity, and aborts the jobs the broker says were
cancelled or lost.

A claimed job is in ``running`` from the moment it is claimed, also while it waits for room in a
token budget: its lease is renewed, its deadline watched and a cancel reaches it, so the broker
never hands it out a second time. A job that waits holds back new claims only for the backends it
could run on, so that it is next in when room frees; models served elsewhere are claimed as before.
Claims are made only for models with a backend that has room.

A failed attempt is retried (on another backend if there is one) only while the job's deadline
leaves time: no attempt starts after it, and no backoff or backend cooldown is waited out past it.
A job that gives up after several attempts says how many in its error, and the HTTP answer then
tells the client not to retry it again (``x-should-retry: false``).

The dispatcher also tells the broker what it knows of each model it serves (``ModelInfo``): what
the engines' model lists say, and how long the answers of requests without a length limit were
(:class:`~sluice.core.output_lengths.OutputLengths`), from which the gateway estimates their cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from sluice.backends.base import Backend, BackendError, public_name
from sluice.broker.base import Broker, EventType
from sluice.core.errors import deadline_error, internal_error
from sluice.core.job import Job, JobError, JobState
from sluice.core.model_info import ModelInfo, merge
from sluice.core.output_lengths import OutputLengths
from sluice.metrics import Metrics
from sluice.outage import OutageLog
from sluice.protocol import Assembler

log = logging.getLogger("sluice.worker")

# After a connection error a backend sits out this long (doubling, capped) before it gets work again.
COOLDOWN_S = 1.0
MAX_COOLDOWN_S = 30.0
CLAIM_WAIT_S = 1.0


@dataclass
class _Slots:
    backend: Backend
    #: what clients may be told of the backend (its name, or "backend N" when the name is a URL)
    label: str = ""
    inflight: int = 0
    inflight_tokens: int = 0
    cooldown_until: float = 0.0
    failures: int = 0

    draining: bool = False
    #: whether the engine's model list was read (``Backend.model_info`` holds what it said)
    described: bool = False

    def available(self, now: float) -> bool:
        return (
            self.inflight < self.backend.max_concurrency and now >= self.cooldown_until and not self.draining
        )

    def width(self, job: Job) -> int:
        """The slots ``job`` takes here: one per sequence the engine runs for it, at most all of
        the backend's. A job wider than the backend takes it whole (the engine queues the rest of
        its sequences): it runs alone there rather than never."""
        return max(1, min(job.sequences, self.backend.max_concurrency))

    def has_slots_for(self, job: Job) -> bool:
        return self.inflight + self.width(job) <= self.backend.max_concurrency

    def has_room(self) -> bool:
        """Whether the token budget has any room left (a claim is worth making for it)."""
        budget = self.backend.max_inflight_tokens
        return budget is None or self.inflight == 0 or self.inflight_tokens < budget

    def fits(self, cost: int) -> bool:
        budget = self.backend.max_inflight_tokens
        # An idle engine takes any job, or a job larger than the budget would wait forever.
        return budget is None or self.inflight == 0 or self.inflight_tokens + cost <= budget

    @property
    def free_fraction(self) -> float:
        return 1.0 - self.inflight / self.backend.max_concurrency


class Dispatcher:
    """Feeds ``backends`` from ``broker``.

    Args:
        heartbeat_s: how often leases are renewed and the capacity re-registered; well under the
            broker's lease.
        retry_backoff_s: pause before a failed attempt is retried, doubled each time.
        clock: wall-clock seconds, the same clock the broker uses for deadlines.
    """

    def __init__(
        self,
        broker: Broker,
        backends: Sequence[Backend],
        *,
        worker_id: str | None = None,
        heartbeat_s: float | None = None,
        retry_backoff_s: float = 0.1,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.broker = broker
        self.slots = [_Slots(b, public_name(b.name, i)) for i, b in enumerate(backends)]
        self.worker_id = worker_id or f"worker-{uuid.uuid4().hex[:12]}"
        self.heartbeat_s = heartbeat_s or max(min(broker.settings.lease_s / 3, 5.0), 0.05)
        self.retry_backoff_s = retry_backoff_s
        self.metrics = metrics
        self.clock = clock
        self.running: dict[str, asyncio.Task[None]] = {}
        self._claims_outage = OutageLog(log, "claims")
        self._heartbeat_outage = OutageLog(log, "heartbeat")
        #: per model: the answers' lengths of finished jobs whose engine decided their length
        self.output_lengths: dict[str, OutputLengths] = {}
        #: per model: when this dispatcher first served it (the creation time of a model whose
        #: engine gives none)
        self._first_seen: dict[str, int] = {}
        #: claimed jobs waiting for a slot with room, in the order they began to wait
        self._waiting: dict[str, Job] = {}
        self._capacity = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        for s in self.slots:
            if not s.backend.models:
                try:
                    s.backend.models = await s.backend.discover_models()
                    s.described = True
                except BackendError as exc:
                    log.warning("backend %s: %s; will retry", s.backend.name, exc.detail)
        await self.broker.register(self.worker_id, self.capacity())
        await self.broker.describe_models(self.worker_id, self.model_info())
        self._tasks = [
            asyncio.create_task(self._dispatch_forever(), name="dispatch"),
            asyncio.create_task(self._heartbeat_forever(), name="heartbeat"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        running = list(self.running.values())
        for task in running:
            task.cancel()
        await asyncio.gather(*self._tasks, *running, return_exceptions=True)
        self._tasks = []
        with contextlib.suppress(Exception):
            await self.broker.unregister(self.worker_id)

    def capacity(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.slots:
            for model in s.backend.models:
                out[model] = out.get(model, 0) + s.backend.max_concurrency
        return out

    def apply_draining(self, names: set[str]) -> None:
        for s in self.slots:
            s.draining = s.backend.name in names
        self._capacity.set()

    def backends(self) -> list[dict[str, object]]:
        return [
            {
                "name": s.backend.name,
                "models": list(s.backend.models),
                "max_concurrency": s.backend.max_concurrency,
                "inflight": s.inflight,
                "inflight_tokens": s.inflight_tokens,
                "draining": s.draining,
                "failures": s.failures,
            }
            for s in self.slots
        ]

    def models(self) -> list[str]:
        return sorted(self.capacity())

    def model_info(self) -> dict[str, ModelInfo]:
        """What this dispatcher knows of each model it serves: its engines' accounts merged, the
        time it first served the model where no engine gives a creation time, and the answers'
        lengths it measured."""
        out: dict[str, ModelInfo] = {}
        now = int(self.clock())
        for model in self.capacity():
            engines = merge(
                s.backend.model_info[model]
                for s in self.slots
                if model in s.backend.models and model in s.backend.model_info
            )
            created = engines.created or self._first_seen.setdefault(model, now)
            learned = self.output_lengths.get(model) or OutputLengths()
            out[model] = replace(
                engines, created=created, output_tokens=learned.estimate, output_samples=learned.samples
            )
        return out

    def _learn(self, job: Job, usage: dict[str, object] | None) -> None:
        """Count a finished job's answer length, if the engine decided it (the request set no
        limit): that is what a request without a limit is expected to generate."""
        if usage is None or "max_tokens" in job.body or "max_completion_tokens" in job.body:
            return
        tokens = usage.get("completion_tokens")
        if isinstance(tokens, int) and not isinstance(tokens, bool):
            lengths = self.output_lengths.setdefault(job.model, OutputLengths())
            lengths.observe(tokens / max(job.sequences, 1))

    # --- dispatch -----------------------------------------------------------------------------

    def _ahead(self, job: Job | None) -> set[str]:
        """The models of the jobs that began to wait for a slot before ``job`` (all, for None)."""
        models: set[str] = set()
        for job_id, waiting in self._waiting.items():
            if job is not None and job_id == job.id:
                break
            models.add(waiting.model)
        return models

    def _free_models(self) -> list[str]:
        """The models worth claiming: served by a slot that is available, has room in its budget
        and that no waiting job is next in line for."""
        now = time.monotonic()
        ahead = self._ahead(None)
        return sorted(
            {
                m
                for s in self.slots
                if s.available(now) and s.has_room() and ahead.isdisjoint(s.backend.models)
                for m in s.backend.models
            }
        )

    def _pick(self, job: Job, exclude: Collection[str] = ()) -> _Slots | None:
        now = time.monotonic()
        ahead = self._ahead(job)  # a slot a job waits for goes to it first
        candidates = [
            s
            for s in self.slots
            if job.model in s.backend.models and s.available(now) and ahead.isdisjoint(s.backend.models)
        ]
        preferred = [s for s in candidates if s.backend.name not in exclude] or candidates
        fitting = [s for s in preferred if s.has_slots_for(job) and s.fits(job.cost)]
        if not fitting:
            return None
        return max(fitting, key=lambda s: s.free_fraction)

    async def _wait_capacity(self, timeout: float) -> None:
        self._capacity.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._capacity.wait()

    async def _dispatch_forever(self) -> None:
        while True:
            models = self._free_models()
            if not models:
                await self._wait_capacity(CLAIM_WAIT_S)
                continue
            try:
                job = await self.broker.claim(self.worker_id, models, timeout=CLAIM_WAIT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._claims_outage.failed(exc)
                await asyncio.sleep(0.5)
                continue
            self._claims_outage.ok()
            if job is None:
                continue
            # Running (leased, deadline-checked, cancellable) from now on, before it has a slot; it
            # counts as waiting until its task takes one, so no claim overtakes it meanwhile.
            self._waiting[job.id] = job
            task = asyncio.create_task(self._run(job), name=f"job-{job.id}")
            self.running[job.id] = task
            task.add_done_callback(functools.partial(self._forget, job.id))

    def _forget(self, job_id: str, task: asyncio.Task[None]) -> None:
        # Here, not in the task: a task cancelled before its first step runs none of its own code.
        # Only this task's entries: the job may have been claimed again since (its lease lost).
        if self.running.get(job_id) is task:
            del self.running[job_id]
            if self._waiting.pop(job_id, None) is not None:
                self._capacity.set()

    async def _acquire(self, job: Job, exclude: Collection[str] = ()) -> _Slots | None:
        """Wait for a slot with room for the job and reserve it; None once its deadline passes."""
        self._waiting.setdefault(job.id, job)
        try:
            while self.clock() < job.deadline:
                slot = self._pick(job, exclude)
                if slot is not None:
                    self._reserve(slot, job)
                    return slot
                await self._wait_capacity(min(0.5, max(job.deadline - self.clock(), 0.01)))
            return None
        finally:
            self._waiting.pop(job.id, None)
            self._capacity.set()  # claims held back behind this job may go on

    def _reserve(self, slot: _Slots, job: Job) -> None:
        slot.inflight += slot.width(job)
        slot.inflight_tokens += job.cost

    def _release(self, slot: _Slots, job: Job) -> None:
        slot.inflight -= slot.width(job)
        slot.inflight_tokens -= job.cost
        self._capacity.set()

    # --- one job ------------------------------------------------------------------------------

    async def _run(self, job: Job) -> None:
        attempts = job.attempts
        tried: set[str] = set()
        held: _Slots | None = None
        backend: Backend | None = None
        try:
            held = await self._acquire(job)
            while held is not None:
                backend = held.backend
                try:
                    remaining = job.deadline - self.clock()
                    async with asyncio.timeout(max(remaining, 0)):
                        assembler = await self._generate(job, backend)
                except BackendError as exc:
                    self._note_failure(held, exc)
                    tried.add(backend.name)
                    label = held.label
                    self._release(held, job)
                    held = None
                    retry_at = self._retry_at(job, attempts) if exc.retryable else None
                    if retry_at is None or attempts >= job.max_attempts:
                        error = _job_error(exc, attempts)
                        await self._finish(job, JobState.FAILED, attempts, backend, error=error)
                        return
                    await self.broker.publish(
                        job.id,
                        EventType.RETRY,
                        {"attempt": attempts, "reason": exc.message, "backend": label},
                    )
                    held = await self._reacquire(job, tried, retry_at)
                    if held is None:
                        # The deadline came before a backend could take the job again: what
                        # stopped it is the engine's failure.
                        error = _job_error(exc, attempts)
                        await self._finish(job, JobState.FAILED, attempts, backend, error=error)
                        return
                    attempts += 1
                    continue
                except TimeoutError:
                    break
                except Exception as exc:
                    # Anything else the backend raises (encoding or sending the request, reading the
                    # answer) is a bug that would come again on every attempt: the job fails now,
                    # and this task, like the worker, lives on. Logged by type and frames only.
                    log.error(
                        "unexpected error running a job",
                        exc_info=exc,
                        extra={"fields": {"job": job.id, "backend": backend.name}},
                    )
                    await self._finish(job, JobState.FAILED, attempts, backend, error=internal_error())
                    return
                held.failures = 0
                await self._finish(
                    job,
                    JobState.SUCCEEDED,
                    attempts,
                    backend,
                    result=assembler.response(),
                    usage=assembler.final_usage(),
                )
                return
            await self._finish(job, JobState.EXPIRED, attempts, backend, error=deadline_error())
        except asyncio.CancelledError:
            # Cancelled by the client, or the lease was lost: the broker already knows the outcome.
            # Leaving here closes the engine stream, which aborts the generation.
            if self.metrics:
                self.metrics.aborted.inc()
            raise
        finally:
            if held is not None:
                self._release(held, job)

    def _retry_at(self, job: Job, attempts: int) -> float | None:
        """When the job's next attempt may start (clock time): after the backoff, and once some
        backend of its model is out of its cooldown; None when that is not before the deadline."""
        backoff = min(self.retry_backoff_s * 2 ** (attempts - 1), 2.0)
        serving = [s for s in self.slots if job.model in s.backend.models and not s.draining]
        if not serving:
            return None
        mono = time.monotonic()
        cooldown = min(max(s.cooldown_until - mono, 0.0) for s in serving)
        at = self.clock() + max(backoff, cooldown)
        return at if at < job.deadline else None

    async def _reacquire(self, job: Job, tried: set[str], retry_at: float) -> _Slots | None:
        await asyncio.sleep(max(retry_at - self.clock(), 0.0))
        return await self._acquire(job, exclude=tried)

    async def _generate(self, job: Job, backend: Backend) -> Assembler:
        assembler = Assembler(job)
        stream = backend.stream(job)
        try:
            async for data in stream:
                choices = assembler.add(data)
                if choices:
                    await self.broker.publish(job.id, EventType.TOKEN, assembler.event(choices))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return assembler

    def _note_failure(self, slot: _Slots, exc: BackendError) -> None:
        if exc.retryable:
            slot.failures += 1
            slot.cooldown_until = time.monotonic() + min(
                COOLDOWN_S * 2 ** (slot.failures - 1), MAX_COOLDOWN_S
            )
            log.warning("backend %s failed: %s", slot.backend.name, exc.detail)

    async def _finish(
        self,
        job: Job,
        state: JobState,
        attempts: int,
        backend: Backend | None,
        *,
        result: dict[str, object] | None = None,
        usage: dict[str, object] | None = None,
        error: JobError | None = None,
    ) -> None:
        # A client disconnect must not interrupt the settlement halfway.
        done = await asyncio.shield(
            self.broker.finish(
                job.id,
                self.worker_id,
                state,
                result=result,
                usage=usage,
                error=error,
                attempts=attempts,
                backend=backend.name if backend is not None else None,
            )
        )
        if done is not None:
            log_outcome(done)
            if self.metrics:
                self.metrics.observe_job(done)
            if state is JobState.SUCCEEDED:
                self._learn(job, usage)

    # --- heartbeat ----------------------------------------------------------------------------

    async def _heartbeat_forever(self) -> None:
        while True:
            await self.broker.wait_abort_signal(self.heartbeat_s)
            try:
                await self.broker.register(self.worker_id, self.capacity())
                await self.broker.describe_models(self.worker_id, self.model_info())
                abort = await self.broker.heartbeat(self.worker_id, list(self.running))
                self.apply_draining(await self.broker.draining())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._heartbeat_outage.failed(exc)
                await asyncio.sleep(self.heartbeat_s)
                continue
            self._heartbeat_outage.ok()
            for job_id in abort:
                task = self.running.get(job_id)
                if task is not None:
                    task.cancel()
            await self._rediscover()

    async def _rediscover(self) -> None:
        for s in self.slots:
            if not s.backend.models:
                with contextlib.suppress(BackendError):
                    s.backend.models = await s.backend.discover_models()
                    s.described = True
                    if s.backend.models:
                        log.info("backend %s serves %s", s.backend.name, ", ".join(s.backend.models))
                        self._capacity.set()
            elif not s.described:
                # Models configured, not listed: the engine's list still says what it knows of
                # them (their context window), and the configured names stay.
                with contextlib.suppress(BackendError):
                    await s.backend.discover_models()
                    s.described = True


def _job_error(exc: BackendError, attempts: int = 1) -> JobError:
    """The job's error for the engine's failure; after several attempts it says how many (the
    client is then told not to retry: Sluice did)."""
    message = exc.message if attempts <= 1 else f"{exc.message} (gave up after {attempts} attempts)"
    return JobError(message, exc.type, exc.code, exc.param)


def log_outcome(job: Job) -> None:
    """One structured line per finished request; never the prompt or the answer."""
    started = job.started_at or job.finished_at or job.created_at
    usage = job.usage or {}
    log.info(
        "job finished",
        extra={
            "fields": {
                "job": job.id,
                "model": job.model,
                "tenant": job.tenant,
                "priority": job.priority,
                "status": job.state.value,
                "code": job.error.code if job.error else None,
                "attempts": job.attempts,
                "backend": job.backend,
                "queue_s": round(started - job.created_at, 4),
                "ttft_s": round(job.first_token_at - job.created_at, 4) if job.first_token_at else None,
                "total_s": round((job.finished_at or started) - job.created_at, 4),
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
            }
        },
    )
