"""A lease lost while its job runs, and the job handed back to the same worker: it must not run twice.

A heartbeat that comes late (a stalled loop, a paused process) or a Redis failover that loses the
claim leaves a running job queued again; the worker that still runs it may be the one that claims it
next. The broker gives that worker a new lease (on Redis a new fencing token), and the dispatcher
carries on with the attempt it already runs under it: the engine sees one request per job, the job
is settled once, with its whole answer.

The lease is lost here the way a late heartbeat loses it: the broker's clock moves past the lease
while the dispatcher's heartbeat sleeps, and the broker's upkeep hands the jobs back to the queue.
Both brokers, a real ``redis-server`` and the simulator engine behind a layer that counts its
requests per job.
"""

from __future__ import annotations

import collections
import contextlib
import json
from collections.abc import AsyncIterator, Iterator

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.backends.openai import OpenAIBackend
from sluice.broker.base import Broker
from sluice.broker.memory import MemoryBroker
from sluice.broker.redis import RedisBroker
from sluice.core.job import JobState
from sluice.dispatcher import Dispatcher
from sluice.sim.model import preset
from sluice.sim.server import create_app
from tests.broker.brokers import make_settings
from tests.helpers import FakeClock, make_job, wait_until
from tests.redis_server import RedisServer
from tests.servers import run_app

JOBS = 3
TOKENS = 200


class Counted:
    """The simulator's app, counting the completion requests it is sent per prompt (one per job)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.requests: collections.Counter[str] = collections.Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/completions"):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        self.requests[json.loads(body)["messages"][0]["content"]] += 1
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


@contextlib.asynccontextmanager
async def counted_sim() -> AsyncIterator[tuple[str, Counted]]:
    # Slow enough that the lease is lost while every job still generates (about 2 s each).
    app = create_app(preset("fast", model="m", base_step_s=0.01))
    counted = Counted(app)
    async with app.router.lifespan_context(app), run_app(counted) as url:  # type: ignore[arg-type]
        yield url, counted


@pytest.fixture(params=["memory", "redis"])
def broker_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.contextmanager
def maybe_redis(kind: str) -> Iterator[RedisServer | None]:
    if kind == "redis":
        with RedisServer() as server:
            yield server
    else:
        yield None


async def test_a_lost_lease_reclaimed_by_its_worker_runs_once(broker_kind: str) -> None:
    clock = FakeClock()
    settings = make_settings(clock)
    with maybe_redis(broker_kind) as server:
        broker: Broker = RedisBroker(server.url, settings) if server else MemoryBroker(settings)
        async with broker, counted_sim() as (url, sim):
            # Room for more than the jobs it runs: the worker claims whatever the queue hands back.
            backend = OpenAIBackend(url, name="sim", max_concurrency=2 * JOBS, models=["m"])
            # The heartbeat sleeps through the test: it is the late one.
            dispatcher = Dispatcher(broker, [backend], heartbeat_s=3600, clock=clock)
            await dispatcher.start()
            try:
                jobs = [make_job(clock, max_tokens=TOKENS) for _ in range(JOBS)]
                for i, job in enumerate(jobs):
                    job.body["messages"] = [{"role": "user", "content": f"job {i}"}]
                    await broker.admit(job)

                async def generating() -> bool:
                    records = [await broker.get(j.id) for j in jobs]
                    return all(r is not None and r.first_token_at is not None for r in records)

                await wait_until(generating, timeout=30)
                assert sum(sim.requests.values()) == JOBS

                # The heartbeat is late: the leases run out and upkeep queues the jobs again.
                clock.advance(settings.lease_s + 1)
                await broker.maintain()

                async def claimed_again() -> bool:
                    records = [await broker.get(j.id) for j in jobs]
                    return all(
                        r is not None and r.state is JobState.RUNNING and r.attempts == 2 for r in records
                    )

                await wait_until(claimed_again, timeout=30)
                # The runs go on under the new leases: a heartbeat now renews every one of them.
                assert await broker.heartbeat(dispatcher.worker_id, [j.id for j in jobs]) == set()

                for i, job in enumerate(jobs):
                    done = await broker.wait(job.id, 30)
                    assert done is not None and done.state is JobState.SUCCEEDED, done
                    assert done.usage is not None and done.usage["completion_tokens"] == TOKENS
                    assert sim.requests[f"job {i}"] == 1, sim.requests  # nothing ran twice
                    assert done.attempts == 2  # as the broker counted its claims
                await wait_until(lambda: not dispatcher.running)
            finally:
                await dispatcher.stop()
                await backend.aclose()
