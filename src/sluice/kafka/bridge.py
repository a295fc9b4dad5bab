"""Kafka in, Kafka out: requests consumed from a topic run as jobs of the batch class, and each answer
is written to an output topic keyed by the request's id.

A request is one record whose value is JSON ``{"id", "body", "endpoint"?}`` (``endpoint``:
``/v1/chat/completions``, the default, or ``/v1/completions``); its answer is a record keyed by the
``id`` whose value is a batch output line (``{"id", "custom_id", "response", "error"}``).

Delivery is at least once: an offset is committed only once the answers of every record before it
are written (acks from all in-sync replicas). A bridge that dies re-reads from the last commit; a
record read again finds its job again (the idempotency key is the topic and the request's id), and
an answer written twice has the same key, so the duplicates are removable by key. A job the broker
lost (a Redis restarted without its data) is admitted again, never answered as lost. At most
``max_inflight`` requests are admitted and unanswered at once, and a request the queue refuses is
offered again after its Retry-After, without reading further: a full class stops consumption rather
than buffering without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition  # type: ignore[import-untyped]
from pydantic import ValidationError
from starlette.requests import Request

from sluice.api.auth import Caller
from sluice.api.batch_records import ENDPOINTS
from sluice.api.errors import APIError
from sluice.api.gateway import OWN_FIELDS, Gateway
from sluice.api.relay import failure
from sluice.api.schemas import ChatRequest, CompletionRequest
from sluice.batches import idempotency_key
from sluice.core.job import Endpoint, Job, JobState

log = logging.getLogger("sluice.kafka")


@dataclass
class _Partition:
    """What one partition has in flight: the offsets read and not yet answered, the highest one
    answered, and the offset committed."""

    pending: set[int] = field(default_factory=set)
    done_up_to: int = -1
    committed: int = -1
    """The offset last committed by this bridge (never committed backwards)."""


class KafkaBridge:
    """Consumes ``topic`` as ``group``, admits each record as a job of ``priority``, writes the answers
    to ``output_topic``."""

    def __init__(
        self,
        gateway: Gateway,
        caller: Caller,
        *,
        bootstrap: str,
        topic: str,
        output_topic: str,
        group: str,
        priority: str,
        max_inflight: int = 16,
    ) -> None:
        self.gateway = gateway
        self.caller = caller
        self.topic = topic
        self.output_topic = output_topic
        self.priority = priority
        self.max_inflight = max_inflight
        self.consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=bootstrap,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_interval_ms=3_600_000,  # a full class may hold the loop a long while
        )
        self.producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
        self.partitions: dict[TopicPartition, _Partition] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self._room = asyncio.Semaphore(max_inflight)
        self._commit_lock = asyncio.Lock()
        # Partitions whose last commit failed (the Kafka broker away): the loop commits them again,
        # so that an offset is not left behind when no later answer comes to commit it.
        self._stale: set[TopicPartition] = set()

    async def run(self) -> None:
        """Consume until cancelled."""
        await self.producer.start()
        await self.consumer.start()
        try:
            while True:
                await self._room.acquire()
                self._room.release()
                for tp in self._stale & self.consumer.assignment():  # one moved away: the new owner commits
                    await self._commit(tp)
                records = await self.consumer.getmany(timeout_ms=500, max_records=self.max_inflight)
                for tp, batch in records.items():
                    for record in batch:
                        await self._room.acquire()
                        self.partitions.setdefault(tp, _Partition()).pending.add(record.offset)
                        await self._admit(tp, record)
        finally:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.consumer.stop()
            with contextlib.suppress(Exception):
                await self.producer.stop()

    async def _admit(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes]) -> None:
        """Queue one record's job, retrying refusals (the loop reads nothing more meanwhile)."""
        parsed = self._parse(record)
        if isinstance(parsed, dict):  # not a request: its answer is the error, at once
            await self._answer(tp, record.offset, parsed)
            return
        request_id, endpoint, body = parsed
        headers = [(b"idempotency-key", idempotency_key(f"kafka:{self.topic}", request_id).encode())]
        request = Request({"type": "http", "method": "POST", "path": endpoint.path, "headers": headers})
        while True:
            try:
                if not await self.gateway.served_models():
                    await asyncio.sleep(1.0)  # no worker at all (one restarting): wait, not 404
                    continue
                job = await self.gateway.build_job(request, self.caller, endpoint, body)
                job.priority = self.priority
                job.stream_tokens = False
                admission = await self.gateway.admit(job, self.caller)
                break
            except APIError as exc:
                if exc.status in (429, 503) or exc.status >= 500:
                    await asyncio.sleep(min(exc.retry_after_s or 1.0, 30.0))
                    continue
                await self._answer(tp, record.offset, _line(request_id, None, exc))
                return
            except Exception as exc:  # the broker is away: try again
                log.warning("kafka: admission failed: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(1.0)
        task = asyncio.create_task(self._watch(tp, record, request_id, admission.job.id))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _parse(
        self, record: ConsumerRecord[bytes, bytes]
    ) -> tuple[str, Endpoint, dict[str, Any]] | dict[str, Any]:
        key = record.key.decode("utf-8", "replace") if record.key else None
        try:
            item = json.loads(record.value or b"")
        except ValueError:
            item = None
        if not isinstance(item, dict):
            return _line(key, None, APIError(400, "The record is not a JSON object.", "invalid_json"))
        request_id = item.get("id", key)
        if not isinstance(request_id, str) or not request_id:
            return _line(None, None, APIError(400, "The record has no 'id'.", "missing_required_parameter"))
        url = item.get("endpoint", "/v1/chat/completions")
        body = item.get("body")
        if url not in ENDPOINTS or not isinstance(body, dict):
            return _line(
                request_id,
                None,
                APIError(400, "Need a 'body' object and a known 'endpoint'.", "invalid_request"),
            )
        endpoint = ENDPOINTS[url]
        schema = ChatRequest if endpoint is Endpoint.CHAT else CompletionRequest
        body = {k: v for k, v in body.items() if k not in (*OWN_FIELDS, "stream", "stream_options")}
        try:
            body = schema.model_validate(body).model_dump(exclude_none=True, mode="json")
        except ValidationError as exc:
            return _line(
                request_id, None, APIError(400, f"Invalid body: {exc.errors()[0]['msg']}.", "invalid_request")
            )
        return request_id, endpoint, body

    async def _watch(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], request_id: str, job_id: str
    ) -> None:
        while True:
            try:
                job = await self.gateway.broker.wait(job_id, 15.0)
            except Exception as exc:
                log.warning("kafka: waiting failed: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(0.5)
                continue
            if job is None:
                # The broker lost it (a Redis restarted without its data): the request is admitted
                # again, as the batch runner submits a lost line again, rather than answered as lost.
                log.warning("kafka: job %s of request %s was lost; admitting it again", job_id, request_id)
                await self._admit(tp, record)
                return
            if job.terminal:
                break
        await self._answer(tp, record.offset, _job_line(request_id, job))

    async def _answer(self, tp: TopicPartition, offset: int, line: dict[str, Any]) -> None:
        """Write the answer, then commit what is answered in a row from the partition's start."""
        key = str(line["custom_id"] or "").encode()
        while True:
            try:
                await self.producer.send_and_wait(self.output_topic, json.dumps(line).encode(), key=key)
                break
            except Exception as exc:  # the Kafka broker is away: the answer waits, nothing commits
                log.warning("kafka: answer not written: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(1.0)
        part = self.partitions[tp]
        part.pending.discard(offset)
        part.done_up_to = max(part.done_up_to, offset)
        self._room.release()
        await self._commit(tp)

    async def _commit(self, tp: TopicPartition) -> None:
        """Commit what is answered in a row from the partition's start. The offset is read under the
        lock, so that a commit made late never moves the group's offset back."""
        async with self._commit_lock:
            self._stale.discard(tp)
            part = self.partitions[tp]
            upto = min(part.pending) if part.pending else part.done_up_to + 1
            if upto <= part.committed:
                return
            try:
                await self.consumer.commit({tp: upto})
            except Exception as exc:  # the broker away, or the partition moved in a rebalance
                log.warning("kafka: commit of %s at %d failed: %s: %s", tp, upto, type(exc).__name__, exc)
                self._stale.add(tp)
                return
            part.committed = upto


def _line(request_id: str | None, job_id: str | None, error: APIError) -> dict[str, Any]:
    body = {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
    return {
        "id": request_id,
        "custom_id": request_id,
        "response": {"status_code": error.status, "request_id": job_id, "body": body},
        "error": None,
    }


def _job_line(request_id: str, job: Job) -> dict[str, Any]:
    if job.state is JobState.SUCCEEDED and job.result is not None:
        return {
            "id": request_id,
            "custom_id": request_id,
            "response": {"status_code": 200, "request_id": job.id, "body": job.result},
            "error": None,
        }
    return _line(request_id, job.id, failure(job))
