"""The dispatcher: claims a job only when a backend has a free slot, runs it, settles it.

One dispatcher per process. It keeps every backend's in-flight sequences below its concurrency (and
in-flight cost below its token budget), so the engine's own waiting queue stays empty and the
scheduling decisions stay in the broker. A job takes a slot per sequence the engine runs for it
(``Job.sequences``: prompts times ``max(n, best_of)``), at most all of a backend's. One heartbeat
loop renews all leases, re-registers the capacity, and aborts the jobs the broker says were
cancelled or lost.

A claimed job is in ``running`` from the moment it is claimed, also while it waits for room in a
token budget: its lease is renewed, its deadline watched and a cancel reaches it, so the broker
never hands it out a second time. Should it hand it out again all the same (its lease was lost: a
late heartbeat, a failover that lost the claim) to this dispatcher while it still runs the job, the
running attempt goes on under the new lease: the engine is not asked twice. A job that waits
holds back new claims only for the backends it could run on, so that it is next in when room
frees; models served elsewhere are claimed as before. Claims are made only for models with a
backend that has room.

A failed attempt is retried (on another backend if there is one) only while the job's deadline
leaves time: no attempt starts after it, and no backoff or engine ejection is waited out past it.
A job that gives up after several attempts says how many in its error, and the HTTP answer then
tells the client not to retry it again (``x-should-retry: false``).

The dispatcher also tells the broker what it knows of each model it serves (``ModelInfo``): what
the engines' model lists say, and how long the answers of requests without a length limit were
(:class:`~sluice.core.output_lengths.OutputLengths`), from which the gateway estimates their cost.

The engines are a :class:`~sluice.fleet.Fleet`: pools whose members may join and leave (DNS), and
aliases from public model names to engine models. Each engine's room is its current in-flight
limit (:class:`~sluice.core.concurrency.ConcurrencyLimit`, learned from every finished stream's
token timestamps and from the load the engine reports, polled about every ``load_poll_s`` while it
is busy), so the capacity registered with the broker, the sum of the limits, moves with them. A
job goes to the engine a :class:`~sluice.core.routing.Router` picks among those serving its model
(the soonest predicted completion, its prompt prefix's home engine while load allows), never to
one ejected by its :class:`~sluice.core.health.EngineHealth` (errors eject it with backoff; when
the ejection ends one request, the probe, goes through, and its success brings it back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Literal

from sluice import attempt
from sluice.attempt import Hold
from sluice.backends.base import Backend, BackendError
from sluice.broker.base import Broker, EventType
from sluice.broker.outage import OutageLog
from sluice.core.concurrency import EngineLoad
from sluice.core.errors import deadline_error, internal_error
from sluice.core.health import speed_weights
from sluice.core.job import Job, JobError, JobState
from sluice.core.model_info import ModelInfo, merge
from sluice.core.output_lengths import OutputLengths
from sluice.core.routing import Candidate, Router, prefix_key
from sluice.fleet import Engine, Fleet, PoolSpec
from sluice.metrics import Metrics

log = logging.getLogger("sluice.worker")

CLAIM_WAIT_S = 1.0
#: the longest an engine's load report may take before it is skipped this round
LOAD_TIMEOUT_S = 1.0

Routing = Literal["predicted", "least_loaded"]


class Dispatcher:
    """Feeds the engines of a fleet from ``broker``.

    Args:
        backends: engines given built, each a pool of one with its fixed ``max_concurrency``
            (tests, and callers without pools); more may come in ``fleet``.
        fleet: the pools, their engines and the aliases (built from ``backends`` when None).
        heartbeat_s: how often leases are renewed and the capacity re-registered; well under the
            broker's lease.
        retry_backoff_s: pause before a failed attempt is retried, doubled each time.
        unreached_grace_s: for how long tries that could not open a connection to an engine that
            answered before (one restarting) are not counted as the job's attempts: a restart that
            outlasts a few ejection backoffs does not fail the jobs waiting for it, and an engine
            that stays gone fails them after this long. An engine that never answered (a wrong
            address) gets no grace.
        routing: ``predicted`` (soonest predicted completion, engines weighted by speed) or
            ``least_loaded`` (the largest free fraction of the limit).
        prefix_affinity: jobs sharing a prompt prefix go to its home engine while load allows.
        router: the router, built from the settings (its affinity, load factor and memory); one
            with ``prefix_affinity`` and the router's defaults when None.
        load_poll_s: how often busy engines are asked for their load (idle ones every heartbeat).
        dns_refresh_s: how often the fleet's ``dns://`` names are resolved again.
        clock: wall-clock seconds, the same clock the broker uses for deadlines.
    """

    def __init__(
        self,
        broker: Broker,
        backends: Sequence[Backend] = (),
        *,
        fleet: Fleet | None = None,
        worker_id: str | None = None,
        heartbeat_s: float | None = None,
        retry_backoff_s: float = 0.1,
        unreached_grace_s: float = 60.0,
        routing: Routing = "predicted",
        prefix_affinity: bool = True,
        router: Router | None = None,
        load_poll_s: float = 0.5,
        dns_refresh_s: float = 5.0,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.broker = broker
        self.fleet = fleet or Fleet()
        for b in backends:
            spec = PoolSpec(
                b.name,
                max_concurrency=b.max_concurrency,
                adaptive=False,
                max_inflight_tokens=b.max_inflight_tokens,
            )
            self.fleet.adopt(b, spec)
        self.worker_id = worker_id or f"worker-{uuid.uuid4().hex[:12]}"
        self.heartbeat_s = heartbeat_s or max(min(broker.settings.lease_s / 3, 5.0), 0.05)
        self.retry_backoff_s = retry_backoff_s
        self.unreached_grace_s = unreached_grace_s
        self.routing = routing
        self.router = router or Router(affinity=prefix_affinity)
        self.load_poll_s = load_poll_s
        self.dns_refresh_s = dns_refresh_s
        self.metrics = metrics
        self.clock = clock
        self.running: dict[str, asyncio.Task[None]] = {}
        self._claims_outage = OutageLog(log, "claims")
        self._heartbeat_outage = OutageLog(log, "heartbeat")
        self._registry_outage = OutageLog(log, "model descriptions and draining")
        #: per model: the answers' lengths of finished jobs whose engine decided their length
        self.output_lengths: dict[str, OutputLengths] = {}
        #: per model: when this dispatcher first served it (the creation time of a model whose
        #: engine gives none)
        self._first_seen: dict[str, int] = {}
        #: claimed jobs waiting for a slot with room, in the order they began to wait
        self._waiting: dict[str, Job] = {}
        #: per running job: the engine model its current attempt goes to (an alias's draw)
        self._targets: dict[str, str] = {}
        #: per running job: how many times this dispatcher claimed it while it ran here (more than
        #: once when its lease was lost and the queue handed it back: :meth:`_adopt`)
        self._claims: dict[str, int] = {}
        #: the engine and pool names the broker says are draining
        self._drained: set[str] = set()
        self._capacity = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if self.fleet.dynamic:
            await self.fleet.refresh()
        await asyncio.gather(*(self._describe(e, first=True) for e in self.fleet.engines))
        await self.broker.register(self.worker_id, self.capacity())
        await self.broker.describe_models(self.worker_id, self.model_info())
        self._tasks = [
            asyncio.create_task(self._dispatch_forever(), name="dispatch"),
            asyncio.create_task(self._heartbeat_forever(), name="heartbeat"),
            asyncio.create_task(self._engines_forever(), name="engines"),
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
        """Public model name -> the sum of the current limits of the engines that may run it."""
        return self.fleet.capacity()

    def apply_draining(self, names: set[str]) -> None:
        """Drain the engines named, or whose pool is named; resume the others."""
        self._drained = set(names)
        for e in self.fleet.engines:
            e.draining = e.name in names or e.pool in names
        self._capacity.set()

    def backends(self) -> list[dict[str, object]]:
        """Each engine for ``/admin``: its row (:meth:`Engine.row`), with its health and its
        limiter in full."""
        now = time.monotonic()
        return [
            {
                **e.row(now),
                "max_concurrency": e.limiter.ceiling,
                "adaptive": e.limiter.adaptive,
                "health": e.health.snapshot(now),
                "limiter": e.limiter.snapshot(),
            }
            for e in self.fleet.engines
        ]

    def models(self) -> list[str]:
        return sorted(self.capacity())

    def model_info(self) -> dict[str, ModelInfo]:
        """What this dispatcher knows of each model it serves: its engines' accounts merged (an
        alias's, those of its targets), the time it first served the model where no engine gives
        a creation time, and the answers' lengths it measured."""
        out: dict[str, ModelInfo] = {}
        now = int(self.clock())
        for model in self.capacity():
            targets = [m for m, _ in self.fleet.targets(model)]
            engines = merge(
                e.backend.model_info[m]
                for m in targets
                for e in self.fleet.serving(m)
                if m in e.backend.model_info
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
        """The public models worth claiming: run by an engine that is available, has room in its
        budget and that no waiting job is next in line for."""
        now = time.monotonic()
        ahead = self._ahead(None)
        free: set[str] = set()
        for e in self.fleet.engines:
            if e.available(now) and e.has_room():
                names = self.fleet.public_names(e)
                if ahead.isdisjoint(names):
                    free |= names
        return sorted(free)

    def _pick(
        self, job: Job, target: str, prefix: str | None, exclude: Collection[str] = ()
    ) -> Engine | None:
        """The engine for the job's next attempt on engine model ``target`` (its prompt prefix
        key ``prefix``, None when the router has no use for it: least-loaded without affinity),
        or None while none serving it has room. Engines in ``exclude`` (tried already) only when
        no other fits."""
        now = time.monotonic()
        ahead = self._ahead(job)  # an engine a job waits for goes to it first
        # One loop where comprehensions were (a frame each, on every job's pick); the same
        # engines, sets and order.
        cost = job.cost
        predicted = self.routing == "predicted"
        engines: list[Engine] = []
        names: list[str] = []  # engines' names, read once: Engine.name is a property (a call)
        speeds: dict[str, float | None] = {}  # each engine's seconds per token, where predicted
        fitting: set[str] = set()
        for e in self.fleet.serving(target):
            if e.open_for_work(now) and (not ahead or ahead.isdisjoint(self.fleet.public_names(e))):
                name = e.name
                engines.append(e)
                names.append(name)
                if predicted:
                    speeds[name] = e.limiter.seconds_per_token
                if e.has_slots_for(job) and e.fits(cost):
                    fitting.add(name)
        preferred = (fitting.difference(exclude) or fitting) if exclude else fitting
        if not preferred:
            return None
        weights = speed_weights(speeds) if predicted else {}
        candidates = []
        for i, e in enumerate(engines):
            name = names[i]
            candidates.append(
                Candidate(
                    name=name,
                    inflight=e.inflight,
                    # An engine the job does not fit stays on the ring (prefix homes stay put) but
                    # full.
                    limit=e.limit if name in preferred else e.inflight,
                    seconds_per_token=speeds[name] if predicted else None,
                    ttft_s=e.ttft_s if predicted else None,
                    weight=weights.get(name, 1.0),
                )
            )
        picked = self.router.pick(
            candidates,
            prompt_tokens=job.prompt_tokens,
            output_tokens=job.max_tokens or 1,
            prefix=prefix,
        )
        for i, e in enumerate(engines):
            if names[i] == picked:
                return e
        return None

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
            if job is None or self._adopt(job):
                continue
            self._claims[job.id] = 1
            # Running (leased, deadline-checked, cancellable) from now on, before it has a slot; it
            # counts as waiting until its task takes one, so no claim overtakes it meanwhile.
            self._waiting[job.id] = job
            # This task runs the job from here on, and a new one takes over the claims: the engine
            # request goes out in this turn of the event loop rather than in the next, and a loop
            # that is also the gateway's may take long to turn when intake is flooded.
            task = asyncio.current_task()
            assert task is not None
            successor = asyncio.create_task(self._dispatch_forever(), name="dispatch")
            self._tasks = [successor if t is task else t for t in self._tasks]
            task.set_name(f"job-{job.id}")
            self.running[job.id] = task
            # Forgotten as the run ends, in this task (it has run from the start: no cancellation
            # can skip its code), rather than by a done callback (a partial, the callback and
            # a turn of the loop for it, a job): nothing awaits between the two ends.
            try:
                await self._run(job, task)
            finally:
                self._forget(job.id, task)
            return

    def _adopt(self, job: Job) -> bool:
        """Whether ``job`` is one this dispatcher runs already, claimed again: its lease was lost (a
        late heartbeat, a failover that lost the claim) and the queue handed it back here. The
        broker holds the new lease for this worker (on Redis its new fencing token replaces the
        old), so the attempt that runs carries on under it: a second one would ask the engine for
        the same answer again, and only one of them could settle it. A run already told to stop
        (cancelled, its lease known lost) is not adopted: the claim starts the job afresh."""
        task = self.running.get(job.id)
        if task is None or task.done() or task.cancelling():
            return False
        self._claims[job.id] = self._claims.get(job.id, 1) + 1
        log.info(
            "a job running here was claimed again (its lease was lost): the running attempt goes on",
            extra={"fields": {"job": job.id, "attempts": job.attempts}},
        )
        return True

    def _forget(self, job_id: str, task: asyncio.Task[None]) -> None:
        # Only this task's entries: the job may have been claimed again since (its lease lost).
        if self.running.get(job_id) is task:
            del self.running[job_id]
            self._claims.pop(job_id, None)
            self._targets.pop(job_id, None)
            if self._waiting.pop(job_id, None) is not None:
                self._capacity.set()

    async def _acquire(self, job: Job, exclude: Collection[str] = ()) -> Hold | None:
        """Wait for an engine with room for the job and reserve it; None once its deadline passes.
        An alias's target is drawn once per attempt."""
        self._waiting.setdefault(job.id, job)
        target = self._targets[job.id] = self.fleet.choose(job.model)
        # Hashed once per attempt, not at every wake-up while the job waits for room. Predicted
        # completion reads it too (a prefix's last engine skips its prefill: docs/routing.md).
        uses_prefix = self.router.affinity or self.routing == "predicted"
        prefix = prefix_key({**job.body, "model": target}) if uses_prefix else None
        try:
            while self.clock() < job.deadline:
                engine = self._pick(job, target, prefix, exclude)
                if engine is not None:
                    return self._reserve(engine, job, target)
                await self._wait_capacity(min(0.5, max(job.deadline - self.clock(), 0.01)))
            return None
        finally:
            self._waiting.pop(job.id, None)
            self._capacity.set()  # claims held back behind this job may go on

    def _reserve(self, engine: Engine, job: Job, target: str) -> Hold:
        # The width is kept: the limit (and so a wide job's width) may change while it runs.
        hold = Hold(engine, engine.width(job), job.cost, target)
        engine.inflight += hold.width
        engine.inflight_tokens += hold.cost
        engine.health.on_dispatch(time.monotonic())
        return hold

    def _release(self, hold: Hold) -> None:
        hold.engine.inflight -= hold.width
        hold.engine.inflight_tokens -= hold.cost
        self._capacity.set()

    # --- one job ------------------------------------------------------------------------------

    async def _run(self, job: Job, task: asyncio.Task[None]) -> None:
        """Run ``job`` to its end in ``task``, the current one (its deadline cancels it)."""
        loop = asyncio.get_running_loop()
        attempts = job.attempts
        unreached_since: float | None = None  # since when tries found no engine to connect to
        tried: set[str] = set()
        held: Hold | None = None
        backend: Backend | None = None
        try:
            held = await self._acquire(job)
            while held is not None:
                engine, backend = held.engine, held.engine.backend
                try:
                    remaining = job.deadline - self.clock()
                    # asyncio.timeout's bound, without its steps (its context manager's two
                    # coroutines, asyncio.current_task in Python, its states): the deadline's
                    # timer cancels this task, and that cancellation, ours alone, is the
                    # TimeoutError, as asyncio.timeout turns it into one.
                    expired: list[bool] = []
                    cancelling = task.cancelling()
                    timer = loop.call_later(max(remaining, 0), _expire, task, expired)
                    try:
                        # attempt.generate awaited here, not through a method of its own:
                        # every engine read resumes each coroutine frame between the task and
                        # the read, once per streamed token
                        assembler, limit_moved = await attempt.generate(self.broker, job, held)
                    except asyncio.CancelledError:
                        # The deadline's, unless someone else cancelled the task too.
                        if expired and task.uncancel() <= cancelling:
                            raise TimeoutError from None
                        raise
                    except BaseException:
                        if expired:  # the deadline's cancellation taken back: the error goes on
                            task.uncancel()
                        raise
                    finally:
                        timer.cancel()
                    if expired:  # the attempt ended with its answer all the same
                        task.uncancel()
                    if limit_moved:
                        self._capacity.set()
                except BackendError as exc:
                    attempt.note_failure(engine, exc)
                    tried.add(engine.name)
                    label = engine.label
                    self._release(held)
                    held = None
                    retry_at = self._retry_at(job, attempts) if exc.retryable else None
                    # A try that never reached an engine known to be up before (no connection: it
                    # restarts) is not an attempt for a while: the job waits out the restart (its
                    # deadline still bounds it). An engine that never answered, a wrong address,
                    # gets no grace: its jobs fail as fast as before.
                    if exc.reached or not engine.described:
                        unreached_since = None
                    elif unreached_since is None:
                        unreached_since = self.clock()
                    counted = unreached_since is None or (
                        self.clock() - unreached_since >= self.unreached_grace_s
                    )
                    if retry_at is None or (counted and attempts >= job.max_attempts):
                        error = attempt.job_error(exc, attempts)
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
                        error = attempt.job_error(exc, attempts)
                        await self._finish(job, JobState.FAILED, attempts, backend, error=error)
                        return
                    if counted:
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
                engine.health.on_success(time.monotonic())
                engine.failures = 0
                # The engine is done with it: its slot goes to the next job now, not after the
                # settlement (a task and a few turns of a loop that may be busy with intake).
                self._release(held)
                held = None
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
                # No outcome came (cancelled, expired): a probe it carried is over all the same.
                held.engine.health.probe_in_flight = False
                self._release(held)

    def _retry_at(self, job: Job, attempts: int) -> float | None:
        """When the job's next attempt may start (clock time): after the backoff, and once some
        engine of its model is out of its ejection; None when that is not before the deadline."""
        backoff = min(self.retry_backoff_s * 2 ** (attempts - 1), 2.0)
        serving = [
            e
            for model, _ in self.fleet.targets(job.model)
            for e in self.fleet.serving(model)
            if not e.draining
        ]
        if not serving:
            return None
        mono = time.monotonic()
        ejected = min(e.ejected_for(mono) for e in serving)
        at = self.clock() + max(backoff, ejected)
        return at if at < job.deadline else None

    async def _reacquire(self, job: Job, tried: set[str], retry_at: float) -> Hold | None:
        await asyncio.sleep(max(retry_at - self.clock(), 0.0))
        return await self._acquire(job, exclude=tried)

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
        # The claims of a lost lease adopted by the running attempt count, as the broker counted
        # them (its STARTED events numbered them).
        attempts += self._claims.get(job.id, 1) - 1
        settle = self.broker.finish(
            job.id,
            self.worker_id,
            state,
            result=result,
            usage=usage,
            error=error,
            attempts=attempts,
            backend=backend.name if backend is not None else None,
        )
        # A client disconnect must not interrupt the settlement halfway: a broker that awaits in
        # it (Redis) settles in a shielded task; one whose finish awaits nothing cannot be
        # interrupted, and is awaited as it is (no task, and two turns of the loop fewer, a job).
        done = await (settle if self.broker.finish_at_once else asyncio.shield(settle))
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
                sent = dict(self._claims)
                abort = await self.broker.heartbeat(self.worker_id, list(self.running))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._heartbeat_outage.failed(exc)
                await asyncio.sleep(self.heartbeat_s)
                continue
            self._heartbeat_outage.ok()
            # What the models are and which engines drain live on the queue-wide keys (one
            # cluster master): their outage must not stop the leases above being renewed.
            try:
                await self.broker.describe_models(self.worker_id, self.model_info())
                self.apply_draining(await self.broker.draining())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._registry_outage.failed(exc)
            else:
                self._registry_outage.ok()
            for job_id in abort:
                task = self.running.get(job_id)
                # A job claimed again while the heartbeat was on its way runs under the new lease:
                # the abort was for the lease it lost.
                if task is not None and self._claims.get(job_id) == sent.get(job_id):
                    task.cancel()
            await self._rediscover()

    async def _describe(self, engine: Engine, *, first: bool = False) -> None:
        """Read the engine's model list: the models it serves when none are configured, what it
        says of them (their context window) either way."""
        if engine.described and engine.backend.models:
            return
        try:
            listed = await engine.backend.discover_models()
        except BackendError as exc:
            if first:
                log.warning("backend %s: %s; will retry", engine.name, exc.detail)
            return
        engine.described = True
        if not engine.backend.models:
            # Models configured, not listed: the configured names stay.
            engine.backend.models = listed
            if listed and not first:
                log.info("backend %s serves %s", engine.name, ", ".join(listed))
            self._capacity.set()

    async def _rediscover(self) -> None:
        await asyncio.gather(*(self._describe(e) for e in self.fleet.engines))

    # --- engines: their load, and who is in the fleet ----------------------------------------

    async def _engines_forever(self) -> None:
        """Every ``load_poll_s``: ask the busy engines for their load (every engine once per
        heartbeat), resolve the fleet's DNS names every ``dns_refresh_s``, and drop the engines
        that left once their work is done."""
        mono = time.monotonic
        polled_all = refreshed = mono()
        while True:
            await asyncio.sleep(self.load_poll_s)
            everyone = mono() - polled_all >= self.heartbeat_s
            if everyone:
                polled_all = mono()
            await self._poll_loads([e for e in self.fleet.engines if everyone or e.inflight > 0])
            if self.fleet.dynamic and mono() - refreshed >= self.dns_refresh_s:
                refreshed = mono()
                await self.refresh_membership()
            for engine in self.fleet.departed():
                log.info("backend %s left the fleet", engine.name)
                with contextlib.suppress(Exception):
                    await engine.backend.aclose()

    async def _poll_loads(self, engines: Sequence[Engine]) -> None:
        loads = await asyncio.gather(*(self._load(e) for e in engines))
        changed = False
        for engine, load in zip(engines, loads, strict=True):
            if load is not None:
                before = engine.limit
                engine.limiter.on_engine_load(load)
                changed = changed or engine.limit != before
        if changed:
            self._capacity.set()

    async def _load(self, engine: Engine) -> EngineLoad | None:
        """What the engine says of its load now (None: it says nothing, or not in time)."""
        try:
            async with asyncio.timeout(LOAD_TIMEOUT_S):
                return await engine.backend.engine_load()
        except asyncio.CancelledError:
            raise
        except Exception:
            return None

    async def refresh_membership(self) -> None:
        """Resolve the fleet's DNS names now: engines that joined are described and take work,
        those that left take no more."""
        change = await self.fleet.refresh()
        for engine in change.joined:
            engine.draining = engine.name in self._drained or engine.pool in self._drained
        await asyncio.gather(*(self._describe(e, first=True) for e in change.joined))
        if change.joined or change.leaving:
            self._capacity.set()
            with contextlib.suppress(Exception):
                await self.broker.register(self.worker_id, self.capacity())
                await self.broker.describe_models(self.worker_id, self.model_info())


def log_outcome(job: Job) -> None:
    """One structured line per finished request; never the prompt or the answer."""
    if not log.isEnabledFor(logging.INFO):
        return  # its fields are a dict of thirteen built for every job, to be dropped
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


def _expire(task: asyncio.Task[None], expired: list[bool]) -> None:
    """A job's deadline, come while its attempt runs: the attempt's task is cancelled (the
    dispatcher's run turns that cancellation into the job's expiry)."""
    expired.append(True)
    task.cancel()
