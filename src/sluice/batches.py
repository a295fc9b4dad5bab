"""The batch runner: a batch's lines become jobs in the batch class, and their answers its files.

It runs in every gateway process (``sluice serve``, ``sluice gateway``), beside the routes: a line
is turned into a job exactly as a request is (``Gateway.build_job``, with the key of the batch's
creator, then ``Gateway.admit``), which needs the model registry, the key ring and the request
rules that only a gateway holds. Gateways share batches through the store: each batch is driven by
the one runner holding its lease, and when that gateway dies another takes the batch over once the
lease lapses (docs/batches.md).

A batch's life (OpenAI's statuses): ``validating`` (its file is read; a file that is not JSONL fails
the batch, with each bad line listed), ``in_progress`` (lines are submitted), ``finalizing`` (the
output and error files are written), then ``completed``; or ``failed``, ``expired`` (its
completion window ended: unfinished lines go to the error file as ``batch_expired``),
``cancelling`` then ``cancelled`` (nothing more is dispatched, what finished is kept).

Lines go to the broker a few at a time: per model, at most ``batch_max_inflight`` (default: the
model's slots) are queued or running, taken from the batch whose deadline comes first. The engines
stay busy whenever a batch has work, and the queue never holds a batch backlog in front of
interactive requests' admission. A refusal (queue full, rate limit) is retried later, never a
failure of the line. Each line's job carries the idempotency key ``batch id + custom_id``, and its
result is recorded by ``custom_id``, first write wins: a runner that dies anywhere in between makes
its successor find the same job again, and no line is ever written twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request

from sluice.api.auth import Caller, KeyRing
from sluice.api.batch_records import ENDPOINTS
from sluice.api.errors import APIError
from sluice.api.gateway import OWN_FIELDS, Gateway
from sluice.api.relay import failure
from sluice.api.schemas import ChatRequest, CompletionRequest
from sluice.core.job import Endpoint, Job, JobState
from sluice.core.ratelimit import TenantLimits
from sluice.filestore.base import TERMINAL_BATCH_STATUSES, BatchStore, FileMeta

log = logging.getLogger("sluice.batches")

#: how long a refused line waits before it is offered again, when the refusal names no time
RETRY_S = 1.0
#: how often the runner looks for batches to take and renews its leases (seconds)
SCAN_S = 1.0
#: how long one wait on a job lasts before it is asked again (seconds)
WAIT_S = 15.0
#: after this long without interactive work on a model, batch lines may take its every slot
#: (the headroom is kept again as soon as interactive work is seen)
QUIET_S = 30.0


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output (``kind`` ``output``) or error file: derived from the batch's own
    unguessable id, so that a finalisation done twice writes the same file."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:32]


def request_line_id(batch_id: str, custom_id: str) -> str:
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{custom_id}".encode()).hexdigest()[:32]


def idempotency_key(batch_id: str, custom_id: str) -> str:
    """The job's idempotency key: one job per line, whoever submits it and however often."""
    return f"batch:{batch_id}:" + hashlib.sha256(custom_id.encode()).hexdigest()[:40]


# --- the input file ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One line of a batch's input file.

    Attributes:
        number: its line number in the file (from 1).
        key: what its result is recorded under: its ``custom_id``, or ``#<number>`` for a line whose
            ``custom_id`` is missing or repeats an earlier line's.
        custom_id: the line's ``custom_id`` as given (None when it has none that is a string).
        body: the request body to run (validated as the endpoint's requests are); None when the
            line fails before it runs.
        error: why the line fails without running (``code``, ``message``, ``param``), or None.
    """

    number: int
    key: str
    custom_id: str | None
    body: dict[str, Any] | None
    error: dict[str, Any] | None = None

    @property
    def model(self) -> str:
        return str((self.body or {}).get("model") or "")


@dataclass(frozen=True)
class ParsedFile:
    """A batch's input file, read.

    Attributes:
        lines: every line that is a JSON object, in order.
        errors: what makes the file as a whole invalid (each with its ``line``); when there are
            any the batch fails in ``validating`` and no line runs.
    """

    lines: list[Line]
    errors: list[dict[str, Any]]


def _line_error(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param}


def parse_input(content: bytes, url: str, max_lines: int) -> ParsedFile:
    """Read an input file for a batch of ``url``. A file that is not JSONL (not UTF-8, a line that
    is not a JSON object, no line at all, more than ``max_lines``) is invalid as a whole; a line that
    is JSON but not a request for ``url`` (no ``custom_id``, a repeated one, another method or URL, a
    body the endpoint refuses) fails alone."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        return ParsedFile(
            [], [{**_line_error("invalid_file", f"The file is not UTF-8 ({exc.reason})."), "line": None}]
        )
    errors: list[dict[str, Any]] = []
    raw_lines = [(n, raw) for n, raw in enumerate(text.splitlines(), start=1) if raw.strip()]
    if not raw_lines:
        return ParsedFile(
            [], [{**_line_error("empty_file", "The input file has no requests."), "line": None}]
        )
    if len(raw_lines) > max_lines:
        message = f"The input file has {len(raw_lines)} requests; a batch may have at most {max_lines}."
        return ParsedFile([], [{**_line_error("too_many_requests", message), "line": None}])
    seen: set[str] = set()
    lines: list[Line] = []
    schema = ChatRequest if ENDPOINTS[url] is Endpoint.CHAT else CompletionRequest
    for number, raw in raw_lines:
        try:
            item = json.loads(raw)
        except json.JSONDecodeError as exc:
            errors.append(
                {
                    **_line_error("invalid_json_line", f"Line {number} is not valid JSON: {exc.msg}."),
                    "line": number,
                }
            )
            continue
        if not isinstance(item, dict):
            errors.append(
                {**_line_error("invalid_json_line", f"Line {number} is not a JSON object."), "line": number}
            )
            continue
        lines.append(_read_line(number, item, url, schema, seen))
    return ParsedFile(lines, errors)


def _read_line(
    number: int, item: dict[str, Any], url: str, schema: type[ChatRequest | CompletionRequest], seen: set[str]
) -> Line:
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        error = _line_error(
            "missing_required_parameter", "Each line needs a 'custom_id' string.", "custom_id"
        )
        return Line(number, f"#{number}", None, None, error)
    if custom_id in seen:
        error = _line_error(
            "duplicate_custom_id", f"The custom_id '{custom_id}' is used by an earlier line.", "custom_id"
        )
        return Line(number, f"#{number}", custom_id, None, error)
    seen.add(custom_id)
    if item.get("method", "POST") != "POST":
        return Line(
            number,
            custom_id,
            custom_id,
            None,
            _line_error("invalid_method", "The method must be POST.", "method"),
        )
    if item.get("url") != url:
        message = f"The url must be the batch's endpoint, {url}."
        return Line(number, custom_id, custom_id, None, _line_error("invalid_url", message, "url"))
    body = item.get("body")
    if not isinstance(body, dict):
        return Line(
            number,
            custom_id,
            custom_id,
            None,
            _line_error("invalid_body", "The body must be a JSON object.", "body"),
        )
    body = {k: v for k, v in body.items() if k not in (*OWN_FIELDS, "stream", "stream_options")}
    try:
        parsed = schema.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = f"Invalid body: {param + ': ' if param else ''}{first['msg']}."
        return Line(number, custom_id, custom_id, None, _line_error("invalid_request", message, param))
    return Line(number, custom_id, custom_id, parsed.model_dump(exclude_none=True, mode="json"))


# --- what the API shows -----------------------------------------------------------------------


# --- the runner -------------------------------------------------------------------------------


@dataclass
class _Run:
    """A batch this runner drives.

    Attributes:
        record: its record, as last written.
        caller: who it runs as (None: its key is gone, so its remaining lines fail).
        lines: the lines still to submit, in file order (refused ones go back to the front).
        inflight: the lines submitted whose jobs have not ended: key → (line, job id).
        watchers: the tasks that wait on those jobs.
        order: every runnable line's key, in file order, for the output files.
        retry_at: no line is submitted before this (monotonic) time, after a refusal.
        cancelling: a cancel was asked: nothing more is submitted.
    """

    record: dict[str, Any]
    caller: Caller | None
    lines: deque[Line] = field(default_factory=deque)
    inflight: dict[str, tuple[Line, str]] = field(default_factory=dict)
    watchers: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    order: dict[str, int] = field(default_factory=dict)
    retry_at: float = 0.0
    cancelling: bool = False

    @property
    def id(self) -> str:
        return str(self.record["id"])

    @property
    def deadline(self) -> float:
        return float(self.record["_sluice"]["deadline"])


class BatchRunner:
    """Drives the batches whose leases it holds; see the module's docstring."""

    def __init__(
        self,
        store: BatchStore,
        gateway: Gateway,
        keyring: KeyRing,
        *,
        scan_s: float = SCAN_S,
        lease_s: float | None = None,
    ) -> None:
        self.store = store
        self.gateway = gateway
        self.keyring = keyring
        self.settings = gateway.settings
        self.scan_s = scan_s
        self.lease_s = lease_s if lease_s is not None else self.settings.lease_s
        self.owner = "runner-" + secrets.token_hex(8)
        self.runs: dict[str, _Run] = {}
        self._wake = asyncio.Event()
        #: per model: the jobs queued or running that are not this runner's lines, as last read
        self._interactive: dict[str, int] = {}
        #: per model: when (monotonic) interactive work was last seen there
        self._seen_interactive: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def poke(self) -> None:
        """Look at the batches again now (a batch was created or cancelled, a line ended)."""
        self._wake.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._forever(), name="batch-runner")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for run in list(self.runs.values()):
            await self._drop(run)
            with contextlib.suppress(Exception):
                await self.store.release_lease(run.id, self.owner)

    async def _forever(self) -> None:
        next_scan = 0.0
        while True:
            try:
                if time.monotonic() >= next_scan:
                    await self._scan()
                    next_scan = time.monotonic() + self.scan_s
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store or the broker is away: the next round tries again
                log.warning("batch runner round failed: %s: %s", type(exc).__name__, exc)
                next_scan = 0.0
                await asyncio.sleep(min(self.scan_s, 1.0))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.scan_s):
                    await self._wake.wait()

    async def _scan(self) -> None:
        """Renew the leases held, take the batches nobody holds."""
        if self.store.unavailable is not None:
            return
        for run in list(self.runs.values()):
            if not await self.store.take_lease(run.id, self.owner, self.lease_s):
                log.warning("batch %s: lease lost to another runner", run.id)
                await self._drop(run)
        for batch_id in await self.store.active_batches():
            if batch_id in self.runs:
                continue
            if not await self.store.take_lease(batch_id, self.owner, self.lease_s):
                continue
            record = await self.store.get_batch(batch_id)
            if record is None or record["status"] in TERMINAL_BATCH_STATUSES:
                await self.store.release_lease(batch_id, self.owner)
                continue
            await self._load(record)

    async def _drop(self, run: _Run) -> None:
        """Stop driving a batch (its jobs go on: whoever takes it over finds them)."""
        self.runs.pop(run.id, None)
        for task in run.watchers.values():
            task.cancel()
        await asyncio.gather(*run.watchers.values(), return_exceptions=True)

    async def _caller(self, record: dict[str, Any]) -> Caller | None:
        own = record["_sluice"]
        if not own.get("keyed") or own.get("key_sha256") is None:
            return Caller(TenantLimits(own["tenant"]), keyed=False)
        key = await self.keyring.lookup(own["key_sha256"])
        return self.keyring._caller(key) if key is not None else None

    async def _load(self, record: dict[str, Any]) -> None:
        """Start driving a batch: validate it, or pick it up where its last runner left it."""
        run = _Run(record, await self._caller(record))
        content = await self.store.file_content(record["input_file_id"])
        if content is None:
            error = {
                "code": "file_not_found",
                "message": "The input file is gone.",
                "param": None,
                "line": None,
            }
            await self._fail(run, [error])
            return
        parsed = parse_input(content, record["endpoint"], self.settings.batch_max_lines)
        if parsed.errors:
            await self._fail(run, parsed.errors)
            return
        done = await self.store.results(run.id)
        jobs = await self.store.jobs(run.id)
        for line in parsed.lines:
            run.order[line.key] = line.number
            if line.key in done:
                continue
            if line.error is not None:
                await self._record_error(run, line, None, line.error)
            elif line.key in jobs:
                run.inflight[line.key] = (line, jobs[line.key])
            else:
                run.lines.append(line)
        if record["status"] == "validating":
            now = self.gateway.broker.now()
            record.update(
                status="in_progress",
                in_progress_at=int(now),
                model=next((ln.model for ln in parsed.lines if ln.model), None),
            )
            record["request_counts"] = {**record["request_counts"], "total": len(parsed.lines)}
            await self.store.put_batch(record)
        run.cancelling = record["status"] == "cancelling"
        self.runs[run.id] = run
        for key, (line, job_id) in run.inflight.items():
            run.watchers[key] = asyncio.create_task(self._watch(run, line, job_id))
        log.info(
            "batch %s: driving (%d lines to submit, %d running)", run.id, len(run.lines), len(run.inflight)
        )

    async def _fail(self, run: _Run, errors: list[dict[str, Any]]) -> None:
        record = run.record
        record.update(status="failed", failed_at=int(self.gateway.broker.now()))
        record["errors"] = {"object": "list", "data": errors}
        await self.store.put_batch(record)
        await self.store.release_lease(run.id, self.owner)

    # --- one round ---------------------------------------------------------------------------

    async def _step(self) -> None:
        now = self.gateway.broker.now()
        # the jobs other than this runner's lines that every model's queue holds and runs, read
        # once a round for the budgets (the lines submitted during the round are counted as they go)
        stats = await self.gateway.broker.stats() if self.runs else {}
        self._interactive = {
            model: max(s.running_jobs + s.queued_jobs - self._inflight(model), 0)
            for model, s in stats.items()
        }
        for model, busy in self._interactive.items():
            if busy:
                self._seen_interactive[model] = time.monotonic()
        for run in sorted(self.runs.values(), key=lambda r: r.deadline):
            if not run.cancelling and await self.store.cancel_requested(run.id) is not None:
                await self._start_cancelling(run)
            if not run.cancelling and now >= run.deadline:
                await self._expire(run)
                continue
            if not run.cancelling:
                await self._submit_some(run)
            if not run.lines and not run.inflight and run.id in self.runs:
                await self._finalize(run, "cancelled" if run.cancelling else "completed")

    def _inflight(self, model: str) -> int:
        return sum(
            1 for run in self.runs.values() for line, _ in run.inflight.values() if line.model == model
        )

    async def _budget(self, model: str) -> int:
        """How many more lines of ``model`` may be submitted now: the slots that interactive work
        leaves idle, less ``batch_headroom_slots`` kept free for its next arrivals (none after
        QUIET_S without any), at most ``batch_max_inflight`` in all; lines already submitted count."""
        served = await self.gateway.served_models()
        if not served:
            return 0  # no worker at all (one restarting): wait, rather than fail lines as unknown
        slots = served.get(model)
        if slots is None:
            return 1 - self._inflight(model)  # unknown: its first line fails with the model's 404
        mine = self._inflight(model)
        interactive = self._interactive.get(model, 0)
        headroom = self.settings.batch_headroom_slots
        if headroom is None:
            headroom = slots // 2
        if time.monotonic() - self._seen_interactive.get(model, -math.inf) > QUIET_S:
            headroom = 0  # nobody interactive for a while: the batch may fill the engine
        room = slots - headroom - interactive
        cap = self.settings.batch_max_inflight
        if cap is not None:
            room = min(room, cap)
        return room - mine

    async def _submit_some(self, run: _Run) -> None:
        while run.lines and time.monotonic() >= run.retry_at:
            line = run.lines[0]
            if await self._budget(line.model) <= 0:
                return
            run.lines.popleft()
            try:
                submitted = await self._submit(run, line)
            except BaseException:
                # the broker or the store is away: the line is offered again (its idempotency key
                # finds its job if it was queued after all)
                run.lines.appendleft(line)
                raise
            if not submitted:
                run.lines.appendleft(line)
                return

    async def _submit(self, run: _Run, line: Line) -> bool:
        """Queue a line's job; False when it was refused for now (it is offered again later)."""
        assert line.body is not None
        if run.caller is None:
            error = {"code": "invalid_api_key", "message": "The key that created the batch was revoked."}
            await self._record_error(run, line, None, error, status=401)
            return True
        headers = [(b"idempotency-key", idempotency_key(run.id, line.key).encode())]
        request = Request(
            {"type": "http", "method": "POST", "path": run.record["endpoint"], "headers": headers}
        )
        endpoint = ENDPOINTS[run.record["endpoint"]]
        try:
            job = await self.gateway.build_job(request, run.caller, endpoint, line.body)
            job.priority = self.settings.batch_class
            job.deadline = run.deadline
            job.stream_tokens = False
            admission = await self.gateway.admit(job, run.caller)
        except APIError as exc:
            if exc.status in (429, 503) or exc.status >= 500:
                run.retry_at = time.monotonic() + min(exc.retry_after_s or RETRY_S, 30.0)
                return False
            await self._record_error(
                run,
                line,
                None,
                {"code": exc.code, "message": exc.message, "param": exc.param},
                status=exc.status,
            )
            return True
        job_id = admission.job.id
        await self.store.set_job(run.id, line.key, job_id)
        run.inflight[line.key] = (line, job_id)
        run.watchers[line.key] = asyncio.create_task(self._watch(run, line, job_id))
        return True

    async def _watch(self, run: _Run, line: Line, job_id: str) -> None:
        """Wait for a line's job to end and record its result."""
        while True:
            try:
                job = await self.gateway.broker.wait(job_id, WAIT_S)
                if job is None:  # the broker lost it (restarted without its queue): run it again
                    run.lines.appendleft(line)
                    break
                if not job.terminal:
                    continue
                await self._record_job(run, line, job)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the broker or the store is away for now
                log.warning("batch %s: waiting on a line failed: %s: %s", run.id, type(exc).__name__, exc)
                await asyncio.sleep(0.5)
        run.inflight.pop(line.key, None)
        run.watchers.pop(line.key, None)
        self.poke()

    async def _record_job(self, run: _Run, line: Line, job: Job) -> None:
        if job.state is JobState.SUCCEEDED and job.result is not None:
            body = job.result
            out = {
                "id": request_line_id(run.id, line.key),
                "custom_id": line.custom_id,
                "response": {"status_code": 200, "request_id": job.id, "body": body},
                "error": None,
            }
            await self.store.add_result(run.id, line.key, True, json.dumps(out))
            return
        if job.state is JobState.CANCELLED and run.cancelling:
            return  # not run: a cancelled batch lists only what finished
        if job.state is JobState.EXPIRED and self.gateway.broker.now() >= run.deadline:
            await self._record_expired(run, line)
            return
        error = failure(job)
        body = {
            "error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}
        }
        out = {
            "id": request_line_id(run.id, line.key),
            "custom_id": line.custom_id,
            "response": {"status_code": error.status, "request_id": job.id, "body": body},
            "error": None,
        }
        await self.store.add_result(run.id, line.key, False, json.dumps(out))

    async def _record_error(
        self, run: _Run, line: Line, job_id: str | None, error: dict[str, Any], status: int | None = None
    ) -> None:
        """A line that failed without an answer from the engine: refused by the rules (``status``:
        the HTTP status the request would have had), or never valid (``status`` None)."""
        if status is not None:
            body = {
                "error": {
                    "message": error["message"],
                    "type": APIError(status, "").type,
                    "param": error.get("param"),
                    "code": error.get("code"),
                }
            }
            response: dict[str, Any] | None = {"status_code": status, "request_id": job_id, "body": body}
            err = None
        else:
            response = None
            err = {"code": error.get("code"), "message": error.get("message")}
        out = {
            "id": request_line_id(run.id, line.key),
            "custom_id": line.custom_id,
            "response": response,
            "error": err,
        }
        await self.store.add_result(run.id, line.key, False, json.dumps(out))

    async def _record_expired(self, run: _Run, line: Line) -> None:
        error = {
            "code": "batch_expired",
            "message": "This request could not be executed before the completion window expired.",
        }
        await self._record_error(run, line, None, error)

    # --- the end of a batch ------------------------------------------------------------------

    async def _start_cancelling(self, run: _Run) -> None:
        run.cancelling = True
        run.lines.clear()
        asked = await self.store.cancel_requested(run.id) or self.gateway.broker.now()
        if run.record["status"] != "cancelling":
            run.record.update(status="cancelling", cancelling_at=int(asked))
            await self.store.put_batch(run.record)
        for _, job_id in list(run.inflight.values()):
            with contextlib.suppress(Exception):
                await self.gateway.broker.cancel(job_id)

    async def _expire(self, run: _Run) -> None:
        run.cancelling = True  # nothing more is submitted
        for line in list(run.lines):
            await self._record_expired(run, line)
        run.lines.clear()
        for _, job_id in list(run.inflight.values()):
            with contextlib.suppress(Exception):
                await self.gateway.broker.cancel(job_id)
        for line, _ in list(run.inflight.values()):
            await self._record_expired(run, line)  # unless the job's own end was recorded first
        await self._finalize(run, "expired")

    async def _finalize(self, run: _Run, final: str) -> None:
        """Write the output and error files, then the batch's final status."""
        record = run.record
        now = self.gateway.broker.now()
        if final == "completed" and record["status"] != "finalizing":
            record.update(status="finalizing", finalizing_at=int(now))
            await self.store.put_batch(record)
        results = await self.store.results(run.id)
        ordered = sorted(results.items(), key=lambda kv: run.order.get(kv[0], math.inf))
        good = [line for _, (ok, line) in ordered if ok]
        bad = [line for _, (ok, line) in ordered if not ok]
        tenant = record["_sluice"]["tenant"]
        for kind, lines, field_name in (("output", good, "output_file_id"), ("error", bad, "error_file_id")):
            if not lines:
                continue
            content = ("\n".join(lines) + "\n").encode()
            file_id = output_file_id(run.id, kind)
            meta = FileMeta(
                file_id, tenant, f"batch_{run.id}_{kind}.jsonl", "batch_output", len(content), now
            )
            await self.store.put_file(meta, content)
            record[field_name] = file_id
        record["request_counts"] = {**record["request_counts"], "completed": len(good), "failed": len(bad)}
        record["usage"] = _usage(good)
        record.update(status=final)
        record[f"{final}_at"] = int(self.gateway.broker.now())
        await self.store.put_batch(record)
        await self._drop(run)
        with contextlib.suppress(Exception):
            await self.store.release_lease(run.id, self.owner)
        log.info("batch %s: %s (%d answered, %d failed)", run.id, final, len(good), len(bad))


def _usage(lines: list[str]) -> dict[str, Any]:
    """The batch's token usage, summed over its answers (OpenAI's BatchUsage shape)."""
    prompt = completion = cached = reasoning = 0
    for raw in lines:
        usage = (json.loads(raw).get("response") or {}).get("body", {}).get("usage") or {}
        prompt += int(usage.get("prompt_tokens") or 0)
        completion += int(usage.get("completion_tokens") or 0)
        cached += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        reasoning += int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }
