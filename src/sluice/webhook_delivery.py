"""Webhook delivery: sends each ended job's callback, records every attempt, and acknowledges it.

One :class:`WebhookDelivery` per worker process, beside its dispatcher. The broker hands out the ids
of jobs that ended with a ``callback_url`` (``ended_callbacks``); each is delivered by its own task
through one :class:`sluice.webhooks.WebhookSender`, its attempts are recorded on the job
(``add_delivery``), and it is acknowledged once delivered or given up, so that a worker killed
mid-delivery leaves it to another worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from sluice.broker.base import Broker
from sluice.broker.outage import OutageLog
from sluice.core.job import Job
from sluice.views import job_view
from sluice.webhooks import DeliveryAttempt, WebhookSender

log = logging.getLogger("sluice.worker")

# How long one fetch of ended callbacks blocks before it looks again.
FETCH_WAIT_S = 1.0


class WebhookDelivery:
    """Delivers the webhooks of jobs that ended, for any worker sharing ``broker``.

    Args:
        broker: where ended callbacks are queued and attempts recorded.
        worker_id: the id the broker knows this process by (a delivery in progress is held by it).
        secrets: the configured keys' webhook secrets, by the key's SHA-256; a key missing here is
            looked up among the keys stored in the broker (``POST /admin/keys``). A job is signed
            with the secret of the key that submitted it (``Job.key_sha256``), never with another
            key's of its tenant.
        allow_private: deliver to private and loopback addresses too (tests, closed networks).
        clock: wall-clock seconds, for the attempts' timestamps.
    """

    def __init__(
        self,
        broker: Broker,
        worker_id: str,
        *,
        secrets: Mapping[str, str] | None = None,
        allow_private: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.broker = broker
        self.worker_id = worker_id
        self.secrets = dict(secrets or {})
        self.clock = clock
        self._sender = WebhookSender(allow_private=allow_private)
        self._loop: asyncio.Task[None] | None = None
        self._deliveries: set[asyncio.Task[None]] = set()
        self._outage = OutageLog(log, "webhook delivery")

    async def start(self) -> None:
        await self._sender.__aenter__()
        self._loop = asyncio.create_task(self._fetch_forever(), name="webhooks")

    async def stop(self) -> None:
        tasks = [t for t in (self._loop, *self._deliveries) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop = None
        await self._sender.__aexit__(None, None, None)

    async def _fetch_forever(self) -> None:
        while True:
            try:
                ids = await self.broker.ended_callbacks(self.worker_id, timeout=FETCH_WAIT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._outage.failed(exc)
                await asyncio.sleep(1.0)
                continue
            self._outage.ok()
            for job_id in ids:
                task = asyncio.create_task(self.deliver(job_id), name=f"webhook-{job_id}")
                self._deliveries.add(task)
                task.add_done_callback(self._deliveries.discard)

    async def _secret(self, job: Job) -> str | None:
        """The secret of the key that submitted ``job``; None (the webhook goes out unsigned) in open
        mode, when that key has no secret, or when it was revoked since."""
        if job.key_sha256 is None:
            return None
        secret = self.secrets.get(job.key_sha256)
        if secret is not None:
            return secret
        # A key made with POST /admin/keys keeps its secret in the broker.
        stored = await self.broker.get_key(job.key_sha256)
        found = stored.get("webhook_secret") if stored else None
        return found if isinstance(found, str) and found else None

    async def deliver(self, job_id: str) -> None:
        """Deliver one ended job's webhook (all its attempts), then acknowledge it."""
        job = await self.broker.get(job_id)
        if job is None or job.callback_url is None:
            await self.broker.ack_callback(job_id)
            return

        async def record(attempt: DeliveryAttempt) -> None:
            await self.broker.add_delivery(job_id, attempt.to_dict())

        secret = await self._secret(job)
        try:
            attempts = await self._sender.deliver(job_view(job), job.callback_url, secret, on_attempt=record)
        except Exception as exc:  # a refused URL (its address changed since admission) or a bug
            await record(
                DeliveryAttempt(attempt=1, at=self.clock(), status=None, error=str(exc), duration_ms=0.0)
            )
            attempts = []
        ok = bool(attempts) and attempts[-1].ok
        log.info("webhook", extra={"fields": {"job": job_id, "delivered": ok, "attempts": len(attempts)}})
        await self.broker.ack_callback(job_id)
