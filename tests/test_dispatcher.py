"""The dispatcher against in-process fake backends (a unit test of the dispatcher alone)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from sluice import dispatcher as dispatcher_module
from sluice.backends.base import Backend, BackendError
from sluice.broker.base import BrokerSettings, BrokerUnavailable
from sluice.broker.memory import MemoryBroker
from sluice.core.health import EngineHealth, HealthState
from sluice.core.job import Job, JobState
from sluice.dispatcher import Dispatcher
from sluice.fleet import Fleet, PoolSpec
from tests.helpers import make_job, wait_until


class FakeBackend(Backend):
    def __init__(
        self, name: str, concurrency: int, *, tokens: int | None = None, delay: float = 0.02
    ) -> None:
        super().__init__(name, max_concurrency=concurrency, max_inflight_tokens=tokens, models=["m"])
        self.delay = delay
        self.active = 0
        self.peak = 0
        self.active_cost = 0
        self.peak_cost = 0
        # Sequences the engine runs at once, each job's counted up to the backend's concurrency.
        self.active_sequences = 0
        self.peak_sequences = 0
        self.served = 0

    async def discover_models(self) -> list[str]:
        return ["m"]

    async def healthy(self) -> bool:
        return True

    async def stream(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        sequences = min(job.sequences, self.max_concurrency)
        self.active += 1
        self.active_cost += job.cost
        self.active_sequences += sequences
        self.peak = max(self.peak, self.active)
        self.peak_cost = max(self.peak_cost, self.active_cost)
        self.peak_sequences = max(self.peak_sequences, self.active_sequences)
        try:
            await asyncio.sleep(self.delay)
            yield {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]}
            self.served += 1
        finally:
            self.active -= 1
            self.active_cost -= job.cost
            self.active_sequences -= sequences


async def run_jobs(backends: list[FakeBackend], jobs: list[Job]) -> MemoryBroker:
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, backends)
    await dispatcher.start()
    try:
        for job in jobs:
            await broker.admit(job)
        for job in jobs:
            done = await broker.wait(job.id, 10)
            assert done is not None and done.state is JobState.SUCCEEDED
    finally:
        await dispatcher.stop()
        await broker.close()
    return broker


async def test_never_more_than_max_concurrency() -> None:
    backend = FakeBackend("a", 3)
    await run_jobs([backend], [make_job() for _ in range(30)])
    assert backend.peak == 3 and backend.served == 30


async def test_token_budget_bounds_inflight_cost() -> None:
    backend = FakeBackend("a", 8, tokens=100)
    await run_jobs([backend], [make_job(prompt_tokens=10, max_tokens=30) for _ in range(12)])
    assert backend.peak_cost <= 100 and backend.peak == 2


async def test_backends_share_by_free_capacity() -> None:
    big, small = FakeBackend("big", 6), FakeBackend("small", 2)
    await run_jobs([big, small], [make_job() for _ in range(64)])
    assert big.peak == 6 and small.peak == 2
    assert big.served > small.served > 0


async def test_finished_jobs_feed_the_drain_rate() -> None:
    backend = FakeBackend("a", 2)
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, [backend])
    await dispatcher.start()
    try:
        job = make_job()
        await broker.admit(job)
        await broker.wait(job.id, 10)
        await wait_until(lambda: _measured(broker))
        stats = (await broker.stats())["m"]
        assert stats.slots == 2 and stats.drain_rate > 0
    finally:
        await dispatcher.stop()
        await broker.close()


async def _measured(broker: MemoryBroker) -> bool:
    return (await broker.stats())["m"].measured


# --- a claimed job waiting for room in a token budget -------------------------------------------


class GatedBackend(FakeBackend):
    """A FakeBackend whose answers wait for ``gate``, and which records every job it starts."""

    def __init__(self, name: str, *, tokens: int | None, models: list[str]) -> None:
        super().__init__(name, 8, tokens=tokens, delay=0)
        self.models = list(models)
        self.gate = asyncio.Event()
        self.started: list[str] = []

    async def discover_models(self) -> list[str]:
        return list(self.models)

    async def stream(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        self.started.append(job.id)
        await self.gate.wait()
        async for chunk in super().stream(job):
            yield chunk


async def _state(broker: MemoryBroker, job: Job) -> JobState | None:
    found = await broker.get(job.id)
    return found.state if found is not None else None


async def _claimed(broker: MemoryBroker, job: Job) -> bool:
    return await _state(broker, job) is JobState.RUNNING


async def test_a_job_waiting_for_budget_past_its_lease_runs_once() -> None:
    """The waiting job is leased like any running one: its lease is renewed while it waits, so the
    broker never queues it again and it reaches the engine exactly once."""
    backend = GatedBackend("a", tokens=100, models=["m"])
    broker = MemoryBroker(BrokerSettings(lease_s=0.3))
    await broker.start()
    dispatcher = Dispatcher(broker, [backend])
    await dispatcher.start()
    try:
        first, second = (make_job(prompt_tokens=10, max_tokens=70) for _ in range(2))
        await broker.admit(first)
        await wait_until(lambda: backend.started == [first.id])
        await broker.admit(second)
        await wait_until(lambda: _claimed(broker, second))  # claimed, waiting for room
        await asyncio.sleep(1.0)  # three leases: long enough for an unrenewed lease to lapse
        backend.gate.set()
        for job in (first, second):
            done = await broker.wait(job.id, 10)
            assert done is not None and done.state is JobState.SUCCEEDED and done.attempts == 1
        await asyncio.sleep(0.3)  # a second copy, if the broker had queued one, would start now
        assert backend.started == [first.id, second.id]
    finally:
        await dispatcher.stop()
        await broker.close()


async def test_a_full_budget_on_one_model_does_not_stall_another() -> None:
    full = GatedBackend("a", tokens=100, models=["a"])
    other = GatedBackend("b", tokens=None, models=["b"])
    other.gate.set()
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, [full, other])
    await dispatcher.start()
    try:
        a1, a2 = (make_job(model="a", prompt_tokens=10, max_tokens=70) for _ in range(2))
        await broker.admit(a1)
        await wait_until(lambda: full.started == [a1.id])
        await broker.admit(a2)
        await wait_until(lambda: _claimed(broker, a2))  # claimed, waiting for room
        b1 = make_job(model="b")
        await broker.admit(b1)
        done = await broker.wait(b1.id, 5)
        assert done is not None and done.state is JobState.SUCCEEDED
        assert full.started == [a1.id] and await _state(broker, a1) is JobState.RUNNING
        full.gate.set()
        for job in (a1, a2):
            finished = await broker.wait(job.id, 10)
            assert finished is not None and finished.state is JobState.SUCCEEDED
    finally:
        await dispatcher.stop()
        await broker.close()


async def test_a_waiting_job_expires_at_its_deadline_and_can_be_cancelled() -> None:
    backend = GatedBackend("a", tokens=100, models=["m"])
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, [backend])
    await dispatcher.start()
    try:
        blocker = make_job(prompt_tokens=10, max_tokens=70)
        await broker.admit(blocker)
        await wait_until(lambda: backend.started == [blocker.id])

        late = make_job(prompt_tokens=10, max_tokens=70, timeout=0.5)
        await broker.admit(late)
        expired = await broker.wait(late.id, 5)
        assert expired is not None and expired.state is JobState.EXPIRED
        assert expired.error is not None and expired.error.code == "deadline_exceeded"
        await wait_until(lambda: late.id not in dispatcher.running)

        cancelled = make_job(prompt_tokens=10, max_tokens=70)
        await broker.admit(cancelled)
        await wait_until(lambda: _claimed(broker, cancelled))
        await broker.cancel(cancelled.id)
        await wait_until(lambda: cancelled.id not in dispatcher.running, timeout=5)
        assert await _state(broker, cancelled) is JobState.CANCELLED

        backend.gate.set()
        after = make_job(prompt_tokens=10, max_tokens=70)
        await broker.admit(after)
        done = await broker.wait(after.id, 10)
        assert done is not None and done.state is JobState.SUCCEEDED
        assert backend.started == [blocker.id, after.id]  # neither waiting job reached the engine
    finally:
        await dispatcher.stop()
        await broker.close()


def armed_deadlines() -> int:
    """The running loop's timers still armed to end a running attempt at its deadline."""
    loop: Any = asyncio.get_running_loop()
    return sum(
        not h.cancelled() and getattr(h, "_callback", None) is dispatcher_module._expire
        for h in loop._scheduled
    )


async def test_a_running_job_expires_at_its_deadline_and_a_cancelled_one_leaves_no_deadline_armed() -> None:
    backend = GatedBackend("a", tokens=None, models=["m"])
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, [backend])
    await dispatcher.start()
    try:
        late = make_job(timeout=0.3)
        await broker.admit(late)
        await wait_until(lambda: backend.started == [late.id])
        assert armed_deadlines() == 1
        expired = await broker.wait(late.id, 5)
        assert expired is not None and expired.state is JobState.EXPIRED
        assert expired.error is not None and expired.error.code == "deadline_exceeded"
        await wait_until(lambda: late.id not in dispatcher.running)

        cancelled = make_job(timeout=60)
        await broker.admit(cancelled)
        await wait_until(lambda: cancelled.id in backend.started)
        await broker.cancel(cancelled.id)
        await wait_until(lambda: cancelled.id not in dispatcher.running, timeout=5)
        assert await _state(broker, cancelled) is JobState.CANCELLED
        assert armed_deadlines() == 0  # the cancelled attempt took its deadline's timer with it

        backend.gate.set()
        done = make_job(timeout=60)
        await broker.admit(done)
        finished = await broker.wait(done.id, 10)
        assert finished is not None and finished.state is JobState.SUCCEEDED
        await wait_until(lambda: done.id not in dispatcher.running)
        assert armed_deadlines() == 0
    finally:
        await dispatcher.stop()
        await broker.close()


# --- a job takes a slot per sequence ---------------------------------------------------------


def wide_job(sequences: int) -> Job:
    job = make_job()
    job.sequences = sequences
    return job


async def test_a_job_takes_a_slot_per_sequence() -> None:
    # Jobs of 3 sequences on 4 slots: one at a time (two would run 6 sequences on 4 slots).
    backend = FakeBackend("a", 4)
    await run_jobs([backend], [wide_job(3) for _ in range(6)])
    assert backend.peak == 1 and backend.peak_sequences == 3 and backend.served == 6
    # Two of 2 fill them; a narrow job goes beside a job of 3.
    pairs = FakeBackend("b", 4)
    await run_jobs([pairs], [wide_job(2) for _ in range(6)])
    assert pairs.peak == 2 and pairs.peak_sequences == 4
    mixed = FakeBackend("c", 4, delay=0.05)
    await run_jobs([mixed], [wide_job(3), make_job(), make_job(), wide_job(3), make_job()])
    assert mixed.peak_sequences == 4 and mixed.served == 5


async def test_a_job_wider_than_its_backend_takes_it_whole() -> None:
    # 200 prompts on 4 slots: the job runs, alone, with every slot; the narrow jobs wait for it.
    backend = FakeBackend("a", 4, delay=0.05)
    jobs = [make_job(), wide_job(200), *(make_job() for _ in range(6))]
    await run_jobs([backend], jobs)
    assert backend.served == 8 and backend.peak_sequences == 4


# --- the fleet: aliases, health, draining --------------------------------------------------------


class ModelBackend(FakeBackend):
    """A FakeBackend serving ``models``, recording the model each request asked for, failing its
    first ``fail_first`` requests as an engine error would."""

    def __init__(
        self,
        name: str,
        models: list[str],
        *,
        fail_first: int = 0,
        refuse_first: int = 0,
        delay: float = 0.01,
    ) -> None:
        super().__init__(name, 4, delay=delay)
        self.models = list(models)
        self.fail_first = fail_first
        #: Requests refused as a port with nothing listening refuses them (never reached).
        self.refuse_first = refuse_first
        self.refused = 0
        self.asked: list[str] = []

    async def discover_models(self) -> list[str]:
        return list(self.models)

    async def stream(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        self.asked.append(str(job.body.get("model")))
        if self.refuse_first > 0:
            self.refuse_first -= 1
            self.refused += 1
            raise BackendError("the engine did not answer (refused)", retryable=True, reached=False)
        if self.fail_first > 0:
            self.fail_first -= 1
            raise BackendError("engine answered 500", retryable=True, status=500)
        async for chunk in super().stream(job):
            yield chunk


async def test_an_alias_asks_the_engine_for_its_target_model() -> None:
    v1, v2 = ModelBackend("one", ["chat-v1"]), ModelBackend("two", ["chat-v2"])
    fleet = Fleet(
        engines=[(b, PoolSpec(b.name, max_concurrency=4, adaptive=False)) for b in (v1, v2)],
        aliases={"chat": [("chat-v1", 1.0), ("chat-v2", 1.0)]},
        rng=random.Random(3),
    )
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, fleet=fleet)
    await dispatcher.start()
    try:
        assert await broker.served_models() == {"chat": 8, "chat-v1": 4, "chat-v2": 4}
        jobs = [make_job(model="chat") for _ in range(40)]
        for job in jobs:
            await broker.admit(job)
        for job in jobs:
            done = await broker.wait(job.id, 10)
            assert done is not None and done.state is JobState.SUCCEEDED
            assert done.model == "chat" and done.backend in ("one", "two")
    finally:
        await dispatcher.stop()
        await broker.close()
    assert set(v1.asked) == {"chat-v1"} and set(v2.asked) == {"chat-v2"}
    assert v1.served > 5 and v2.served > 5 and v1.served + v2.served == 40


async def test_an_ejected_engine_is_probed_back_in() -> None:
    flaky, steady = ModelBackend("flaky", ["m"], fail_first=2), ModelBackend("steady", ["m"])
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, [flaky, steady], retry_backoff_s=0.01, prefix_affinity=False)
    engine = next(e for e in dispatcher.fleet.engines if e.name == "flaky")
    engine.health = EngineHealth(base_ejection_s=0.2, max_ejection_s=1.0)
    await dispatcher.start()
    try:
        ejected_seen = False
        for _ in range(60):
            job = make_job()
            await broker.admit(job)
            done = await broker.wait(job.id, 10)
            assert done is not None and done.state is JobState.SUCCEEDED
            ejected_seen = ejected_seen or engine.health.total_ejections > 0
            if flaky.served > 0 and engine.health.state(time.monotonic()) is HealthState.HEALTHY:
                break
            await asyncio.sleep(0.05)
    finally:
        await dispatcher.stop()
        await broker.close()
    # It failed, was ejected, got a probe when the ejection ended, and took work again after.
    assert ejected_seen and flaky.fail_first == 0 and flaky.served > 0
    assert engine.health.state(time.monotonic()) is HealthState.HEALTHY


async def test_a_drained_pool_takes_no_new_work_and_its_running_work_finishes() -> None:
    a, b = ModelBackend("a", ["m"], delay=0.3), ModelBackend("b", ["m"], delay=0.01)
    fleet = Fleet(
        engines=[
            (a, PoolSpec("gpu-a", max_concurrency=4, adaptive=False)),
            (b, PoolSpec("b", max_concurrency=4, adaptive=False)),
        ]
    )
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, fleet=fleet, prefix_affinity=False)
    await dispatcher.start()
    try:
        first = [make_job() for _ in range(8)]
        for job in first:
            await broker.admit(job)
        await wait_until(lambda: a.active > 0)
        dispatcher.apply_draining({"gpu-a"})  # the pool's name drains its engines
        running_on_a = a.active
        later = [make_job() for _ in range(20)]
        for job in later:
            await broker.admit(job)
        for job in first + later:
            done = await broker.wait(job.id, 10)
            assert done is not None and done.state is JobState.SUCCEEDED
        later_on_a = [j for j in later if (await broker.get(j.id)).backend == "a"]  # type: ignore[union-attr]
        assert later_on_a == [] and running_on_a > 0
        assert {row["name"]: row["draining"] for row in dispatcher.backends()} == {"a": True, "b": False}
    finally:
        await dispatcher.stop()
        await broker.close()


async def unreachable_run(engine: ModelBackend, *, grace_s: float) -> Job:
    """One job with two attempts on ``engine`` alone, ejected briefly after each failure; the job
    as it ended."""
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, [engine], retry_backoff_s=0.01, unreached_grace_s=grace_s)
    dispatcher.fleet.engines[0].health = EngineHealth(base_ejection_s=0.02, max_ejection_s=0.05)
    await dispatcher.start()
    try:
        job = make_job(max_attempts=2)
        await broker.admit(job)
        done = await broker.wait(job.id, 20)
        assert done is not None
        return done
    finally:
        await dispatcher.stop()
        await broker.close()


async def test_an_engine_restarting_longer_than_the_attempts_does_not_fail_the_waiting_job() -> None:
    # Eight refused connections, four times the job's attempts: none of them reached the engine.
    restarting = ModelBackend("restarting", ["m"], refuse_first=8)
    done = await unreachable_run(restarting, grace_s=60.0)
    assert done.state is JobState.SUCCEEDED, done.error
    assert restarting.refused == 8 and restarting.served == 1
    assert done.attempts == 1  # the one try that reached it


async def test_an_address_where_nothing_ever_listens_fails_its_jobs_after_the_grace() -> None:
    nothing = ModelBackend("nothing", ["m"], refuse_first=10**9)
    done = await unreachable_run(nothing, grace_s=0.3)
    assert done.state is JobState.FAILED and done.error is not None
    assert done.attempts == 2  # counted once the grace was over, up to the job's max_attempts
    # Tries within the grace were not counted: more tries than attempts were made.
    assert nothing.refused > 2 and nothing.served == 0


class NeverUp(ModelBackend):
    """An address where nothing ever listened: its model list cannot be read either."""

    async def discover_models(self) -> list[str]:
        raise BackendError("cannot list the engine's models", retryable=True, reached=False)


async def test_an_engine_that_never_answered_gets_no_grace() -> None:
    wrong = NeverUp("wrong", ["m"], refuse_first=10**9)
    done = await unreachable_run(wrong, grace_s=60.0)
    assert done.state is JobState.FAILED and done.attempts == 2
    assert wrong.refused == 2  # each refused try counted: a wrong address fails as fast as before


def test_the_public_names_kept_per_engine_follow_its_model_list() -> None:
    """The names the fleet keeps per engine are made again when the engine's model list is replaced
    (a model list read from the engine) or changed in place, and the dispatcher claims by them."""
    one, two = ModelBackend("one", ["chat-v1"]), ModelBackend("two", ["other"])
    fleet = Fleet(
        engines=[(b, PoolSpec(b.name, max_concurrency=4, adaptive=False)) for b in (one, two)],
        aliases={"chat": [("chat-v1", 1.0)]},
    )
    dispatcher = Dispatcher(MemoryBroker(BrokerSettings()), fleet=fleet)
    first, second = fleet.engines
    assert fleet.public_names(first) == {"chat", "chat-v1"}
    assert fleet.public_names(first) is fleet.public_names(first)  # kept
    assert dispatcher._free_models() == ["chat", "chat-v1", "other"]
    two.models = ["chat-v1", "other"]  # replaced
    assert fleet.public_names(second) == {"chat", "chat-v1", "other"}
    one.models.append("extra")  # changed in place
    assert fleet.public_names(first) == {"chat", "chat-v1", "extra"}
    assert dispatcher._free_models() == ["chat", "chat-v1", "extra", "other"]


class ShieldedBroker(MemoryBroker):
    """The memory broker, told to be settled as a broker whose finish may await (Redis)."""

    finish_at_once = False


async def test_a_finish_that_awaits_nothing_is_not_shielded(monkeypatch: Any) -> None:
    """The memory broker's finish settles at once: the dispatcher awaits it as it is (no task); a
    broker whose finish may await is settled in a shielded task, as before."""
    shielded: list[object] = []
    shield = asyncio.shield

    def counted(awaitable: Any) -> Any:
        shielded.append(awaitable)
        return shield(awaitable)

    monkeypatch.setattr(asyncio, "shield", counted)
    for broker_type, shields in ((MemoryBroker, 0), (ShieldedBroker, 3)):
        shielded.clear()
        broker = broker_type(BrokerSettings())
        await broker.start()
        dispatcher = Dispatcher(broker, [FakeBackend("a", 2, delay=0.0)])
        await dispatcher.start()
        try:
            jobs = [make_job() for _ in range(3)]
            for job in jobs:
                await broker.admit(job)
            for job in jobs:
                done = await broker.wait(job.id, 10)
                assert done is not None and done.state is JobState.SUCCEEDED and done.result is not None
        finally:
            await dispatcher.stop()
            await broker.close()
        assert len(shielded) == shields, broker_type.__name__


class GatedFinishBroker(MemoryBroker):
    """The memory broker with a finish that awaits (as Redis's does), held at a gate: a cancel
    can reach the dispatcher's task while the settlement is halfway."""

    finish_at_once = False

    def __init__(self, settings: BrokerSettings) -> None:
        super().__init__(settings)
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.finishes = 0

    async def finish(self, *args: Any, **kwargs: Any) -> Job | None:
        self.finishes += 1
        self.entered.set()
        await self.gate.wait()
        return await super().finish(*args, **kwargs)


class CancellingFinishBroker(MemoryBroker):
    """The memory broker whose finish is asked, as it starts, to cancel the task settling it (a
    client gone, a lost lease seen, at that very moment): its finish awaits nothing, so the
    cancel cannot land halfway."""

    def __init__(self, settings: BrokerSettings) -> None:
        super().__init__(settings)
        self.finishes = 0
        self.settlers: list[asyncio.Task[Any]] = []

    async def finish(self, *args: Any, **kwargs: Any) -> Job | None:
        self.finishes += 1
        task = asyncio.current_task()
        assert task is not None
        self.settlers.append(task)
        task.cancel()
        return await super().finish(*args, **kwargs)


async def test_a_cancel_mid_finish_neither_loses_nor_repeats_the_settlement() -> None:
    """Either way of settling: a broker whose finish awaits is settled in a shielded task that the
    cancel does not reach; the memory broker's, awaited as it is, cannot be cut halfway. The job
    ends once, as the engine answered, and the cancelled task is not run again."""
    gated = GatedFinishBroker(BrokerSettings())
    at_once = CancellingFinishBroker(BrokerSettings())
    for broker in (gated, at_once):
        await broker.start()
        dispatcher = Dispatcher(broker, [FakeBackend("a", 2, delay=0.0)])
        await dispatcher.start()
        try:
            job = make_job()
            await broker.admit(job)
            if broker is gated:
                await asyncio.wait_for(gated.entered.wait(), 5)
                task = dispatcher.running[job.id]
                task.cancel()  # the settlement is halfway: the gate holds it
                await asyncio.wait({task}, timeout=5)
                assert task.cancelled()
                gated.gate.set()
            done = await broker.wait(job.id, 5)
            assert done is not None and done.state is JobState.SUCCEEDED and done.result is not None
            assert broker.finishes == 1
            if broker is at_once:
                (settler,) = at_once.settlers
                await asyncio.wait({settler}, timeout=5)
                assert settler.done()
            running, job_id = dispatcher.running, job.id
            await wait_until(lambda: job_id not in running, 5)  # noqa: B023 (awaited here)
            assert broker.finishes == 1 and (await broker.get(job.id)) is done
        finally:
            await dispatcher.stop()
            await broker.close()


class WholeBackend(FakeBackend):
    """Answers a job that does not stream in one call (``whole``), as the OpenAI backend does."""

    whole_answers = True

    def __init__(self) -> None:
        super().__init__("w", 4, delay=0.0)
        self.wholes = 0
        self.streams = 0

    async def whole(self, job: Job) -> dict[str, Any]:
        self.wholes += 1
        return {"choices": [{"index": 0, "delta": {"content": "whole"}, "finish_reason": "stop"}]}

    async def stream(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        self.streams += 1
        async for chunk in super().stream(job):
            yield chunk


async def test_a_job_that_does_not_stream_is_answered_by_whole_where_the_backend_has_it() -> None:
    backend = WholeBackend()
    whole, streamed = make_job(), make_job()
    whole.stream_tokens, streamed.stream_tokens = False, True
    broker = await run_jobs([backend], [whole, streamed])
    assert backend.wholes == 1 and backend.streams == 1
    done = await broker.get(whole.id)
    assert done is not None and done.result is not None
    assert done.result["choices"][0]["message"]["content"] == "whole"
    tokens = [e for e in await _events(broker, whole.id) if e.type.value == "token"]
    assert len(tokens) == 1  # the whole answer relayed as one token event, as its stream's one chunk


async def _events(broker: MemoryBroker, job_id: str) -> list[Any]:
    return [e async for e in broker.events(job_id, timeout=1.0)]


class _RegistryDown(MemoryBroker):
    """A broker whose queue-wide registry (model descriptions, draining) is unreachable, as a Redis
    Cluster's home master is while it is down, and whose leases are not: counts the heartbeats."""

    heartbeats = 0
    registry_down = False

    async def describe_models(self, worker_id: str, models: Any) -> None:
        if self.registry_down:
            raise BrokerUnavailable("the home master is down")
        await super().describe_models(worker_id, models)

    async def heartbeat(self, worker_id: str, job_ids: list[str]) -> Any:
        self.heartbeats += 1
        return await super().heartbeat(worker_id, job_ids)


async def test_leases_are_renewed_while_the_registry_is_down() -> None:
    """A job that runs for several leases finishes on its first attempt although every heartbeat's
    model description fails: the leases are renewed first, and the registry's outage is its own."""
    broker = _RegistryDown(BrokerSettings(lease_s=0.3))
    await broker.start()
    backend = FakeBackend("a", 1, delay=1.0)
    dispatcher = Dispatcher(broker, [backend], heartbeat_s=0.05)
    await dispatcher.start()
    broker.registry_down = True  # from the first heartbeat on
    try:
        job = make_job()
        await broker.admit(job)
        done = await broker.wait(job.id, 20)
        assert done is not None and done.state is JobState.SUCCEEDED, done
        assert done.attempts == 1
        await wait_until(lambda: broker.heartbeats >= 3)
    finally:
        await dispatcher.stop()
        await broker.close()
