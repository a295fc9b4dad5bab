"""What the Redis broker's scripts read and write, in Python terms: the job record (one hash per
job), the capacity hash, and the replies of the scripts that answer with more than one value (one
decoder per reply layout; ``lua/README.md`` says which script answers with which).

Fields the scripts read or write are fields of their own, as JSON text when they are numbers or
JSON (so a script can splice them into a reply unchanged); the fields that never change after
admission travel as one JSON field, ``spec``: every argument and reply element that crosses into a
script costs Redis time, and a record is read whole on every claim and finish. The layout follows
the ``Job`` dataclass's type hints, so a field added to ``Job`` is stored without a change here
(in ``spec``, unless it is listed in :data:`~sluice.broker.redis_keys.JOB_OWN_FIELDS` because a
script needs it).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar

from sluice.broker.redis_keys import (
    JOB_OWN_FIELDS,
    SLOTS_PREFIX,
    JobField,
    drain_fill_field,
    drain_rate_field,
    drain_resid_field,
    drain_samples_field,
    drain_service_field,
    drain_slow_field,
    slots_field,
)
from sluice.core.admission import QueueView
from sluice.core.capacity import DrainRate
from sluice.core.job import Job, JobError
from sluice.core.policy import PolicyState
from sluice.core.ratelimit import TenantLimiter, TenantLimits

#: One compact encoder for all: json.dumps with arguments builds a new encoder on every call.
_encode = json.JSONEncoder(separators=(",", ":")).encode
_decode = json.JSONDecoder().decode


def to_json(value: Any) -> str:
    return _encode(value)


def _field_kinds() -> dict[str, tuple[str, Any]]:
    """How each Job field is stored, from its type: strings and enums as text; numbers, dicts and
    the error as JSON text, so that the scripts can splice them into event data unchanged."""
    hints = typing.get_type_hints(Job)
    kinds: dict[str, tuple[str, Any]] = {}
    for f in dataclasses.fields(Job):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (types.UnionType, typing.Union) and len(args) == 1:
            hint = args[0]
        if hint is str:
            kinds[f.name] = ("str", str)
        elif hint is int or hint is float:
            kinds[f.name] = ("num", hint)
        elif isinstance(hint, type) and issubclass(hint, enum.Enum):
            kinds[f.name] = ("enum", hint)
        elif hint is JobError:
            kinds[f.name] = ("error", JobError)
        else:  # dicts and lists
            kinds[f.name] = ("json", hint)
    return kinds


_KINDS = _field_kinds()


Conv = Callable[[Any], Any] | None  # None: the value as it is
Plan = list[tuple[str, Conv]]


def _num_text(cls: type) -> Callable[[Any], str]:
    return lambda value: repr(cls(value))  # repr of an int or a float is its JSON text


def _convs(kind: str, cls: Any) -> tuple[Conv, Conv, Conv, Conv]:
    """(to hash text, to spec JSON, from hash text, from spec JSON) for one kind of field."""
    if kind == "str":
        return None, None, None, None
    if kind == "num":
        return _num_text(cls), None, cls, cls
    if kind == "enum":
        return (lambda v: v.value), (lambda v: v.value), cls, cls
    if kind == "error":
        return (
            lambda v: to_json(v.to_dict()),
            lambda v: v.to_dict(),
            lambda t: JobError(**_decode(t)),
            lambda d: JobError(**d),
        )
    return to_json, None, _decode, None


def _plans() -> tuple[Plan, Plan, Plan, Plan]:
    """How each field is written and read: own field out, spec out, own field in, spec in."""
    own_out: Plan = []
    spec_out: Plan = []
    own_in: Plan = []
    spec_in: Plan = []
    for name, (kind, cls) in _KINDS.items():
        text_out, json_out, text_in, json_in = _convs(kind, cls)
        if name in JOB_OWN_FIELDS:
            own_out.append((name, text_out))
            own_in.append((name, text_in))
        else:
            spec_out.append((name, json_out))
            spec_in.append((name, json_in))
    return own_out, spec_out, own_in, spec_in


_OWN_OUT, _SPEC_OUT, _OWN_IN, _SPEC_IN = _plans()


def _compile() -> tuple[Callable[[Job], list[str]], Callable[[Mapping[str, str]], Job]]:
    """encode_job and decode_job, written out field by field from the plans above: a loop over the
    plans cost more client CPU than the Redis call each of them goes with (a claim and a finish
    decode a record each, an admit encodes one)."""
    env: dict[str, Any] = {"Job": Job, "_encode": _encode, "_decode": _decode}

    def fields(plans: Plan, kind: str, read: str, store: str) -> list[str]:
        """Per field: ``v = <read>``, and when it is set, ``<store>`` of it through its converter."""
        lines = []
        for i, (name, conv) in enumerate(plans):
            value = "v"
            if conv is not None:
                env[f"{kind}{i}"] = conv
                value = f"{kind}{i}(v)"
            lines += [
                f"    v = {read.format(name=name)}",
                "    if v is not None:",
                f"        {store.format(name=repr(name), value=value)}",
            ]
        return lines

    enc = ["def encode_job(job):", f"    out = [{JobField.COST!r}, str(job.cost)]"]
    enc += fields(_OWN_OUT, "oo", "job.{name}", "out += ({name}, {value})")
    enc.append("    spec = {}")
    enc += fields(_SPEC_OUT, "so", "job.{name}", "spec[{name}] = {value}")
    enc += [f"    out += ({JobField.SPEC!r}, _encode(spec))", "    return out"]

    dec = ["def decode_job(data):", "    kw = {}", f"    get = _decode(data[{JobField.SPEC!r}]).get"]
    dec += fields(_SPEC_IN, "si", "get({name!r})", "kw[{name}] = {value}")
    dec.append("    get = data.get")
    dec += fields(_OWN_IN, "oi", "get({name!r})", "kw[{name}] = {value}")
    dec.append("    return Job(**kw)")
    exec("\n".join(enc + dec), env)  # our own text, built from the Job dataclass
    return env["encode_job"], env["decode_job"]


_encode_job, _decode_job = _compile()


def encode_job(job: Job) -> list[str]:
    """Field, value pairs of the job's hash; None is left out. ``cost`` is added for the scripts."""
    return _encode_job(job)


def decode_job(data: Mapping[str, str]) -> Job:
    return _decode_job(data)


def settle_fields(
    *,
    result: dict[str, Any] | None,
    usage: dict[str, Any] | None,
    error: JobError | None,
    attempts: int | None,
    backend: str | None,
) -> list[str]:
    """Field, value pairs finish.lua records in a job's hash when it settles it; None is left out."""
    fields: list[str] = []
    if result is not None:
        fields += [JobField.RESULT, to_json(result)]
    if usage is not None:
        fields += [JobField.USAGE, to_json(usage)]
    if error is not None:
        fields += [JobField.ERROR, to_json(error.to_dict())]
    if attempts is not None:
        fields += [JobField.ATTEMPTS, str(attempts)]
    if backend is not None:
        fields += [JobField.BACKEND, backend]
    return fields


def pairs(flat: Sequence[Any]) -> dict[str, str]:
    """A flat reply ``[field, value, ...]`` as a dict."""
    it = iter(flat)
    return dict(zip(it, it, strict=False))


# --- the capacity hash ---------------------------------------------------------------------------------


def capacity_slots(capacity: Mapping[str, str]) -> dict[str, int]:
    """Model → slots of the live workers, from the capacity hash (workers.lua's reply)."""
    n = len(SLOTS_PREFIX)
    return {f[n:]: int(v) for f, v in capacity.items() if f.startswith(SLOTS_PREFIX)}


def capacity_drain(capacity: Mapping[str, str], model: str, prior_per_slot: float) -> DrainRate:
    """A model's DrainRate as the capacity hash holds it: the measured rate, its samples, the slots,
    the mean service time and how slow a job gets."""
    return DrainRate(
        prior_per_slot=prior_per_slot,
        per_slot=float(capacity.get(drain_rate_field(model), 0.0)),
        samples=int(capacity.get(drain_samples_field(model), 0)),
        slots=int(capacity.get(slots_field(model), 0)),
        service=float(capacity.get(drain_service_field(model), 0.0)),
        slow=float(capacity.get(drain_slow_field(model), 0.0)),
        resid=float(capacity.get(drain_resid_field(model), 0.0)),
        **drain_fill(capacity.get(drain_fill_field(model), "")),
    )


def drain_fill(text: str) -> dict[str, Any]:
    """``DrainRate``'s fill fit from the capacity hash's ``g:`` field (``lua/_drain.lua``): the six
    numbers fill, fit_u, fit_t, fit_uu, fit_ut and fills, space-separated; none when absent."""
    parts = text.split()
    if len(parts) != 6:
        return {}
    fill, fit_u, fit_t, fit_uu, fit_ut = map(float, parts[:5])
    return {
        "fill": fill,
        "fit_u": fit_u,
        "fit_t": fit_t,
        "fit_uu": fit_uu,
        "fit_ut": fit_ut,
        "fills": int(parts[5]),
    }


# --- tenant limits ----------------------------------------------------------------------------


def bound(value: int | None) -> int:
    """A limit for a script: -1 for none."""
    return -1 if value is None else value


#: What separates the values of a script's settings argument (``settings_of`` in lua/_keys.lua).
SETTINGS_SEPARATOR = "\x1f"


def created_us(created_at: float) -> int:
    """A job's score in its tenant's list (``QueueKeys.tenant_jobs_us``): its ``created_at`` in whole
    microseconds, an integer below 2**52 (Redis keeps such a score as an integer) until the year
    2112. Jobs created within one microsecond tie, and a tie lists by job id, as equal times do."""
    return round(created_at * 1_000_000)


def _settings_part(value: str | int | float) -> str:
    text = str(value)
    if "%" in text or SETTINGS_SEPARATOR in text:  # names and JSON only; settings_of undoes it
        text = text.replace("%", "%25").replace(SETTINGS_SEPARATOR, "%1F")
    return text


def settings_text(values: Sequence[str | int | float], tail: str = "") -> str:
    """The settings argument of a script: what every call passes the same (the gateway's
    configuration, the core's constants), each value with '%' and the separator escaped as %25 and
    %1F, joined by :data:`SETTINGS_SEPARATOR`, which the library parses once per text
    (``settings_of``); ``tail``, such a text made once, goes after them."""
    parts = [_settings_part(v) for v in values]
    if tail:
        parts.append(tail)
    return SETTINGS_SEPARATOR.join(parts)


def tenant_limit_args(limits: TenantLimits | None) -> list[int | str]:
    """ARGV of admit.lua for the caller's limits: given or not, the id of its key's buckets
    (``TenantLimits.bucket_id``), then its four limits."""
    if limits is None:
        return [0, "", -1, -1, -1, -1]
    values = (limits.rpm, limits.tpm, limits.max_queued, limits.max_concurrent)
    return [1, limits.bucket_id, *map(bound, values)]


def _opt(text: str) -> float | None:
    """A number a script sent as text, '' for none."""
    return float(text) if text != "" else None


def _opt_int(text: str) -> int | None:
    value = _opt(text)
    return None if value is None else int(value)


@dataclass(frozen=True, slots=True)
class TenantState:
    """A tenant and the caller's key as admit.lua leaves (or finds) them: ``T`` in its reply,
    :attr:`WIDTH` elements."""

    #: the key's requests per minute (``TenantLimits.rpm``); None for no limit
    rpm: int | None
    #: the key's tokens per minute (``TenantLimits.tpm``); None for no limit
    tpm: int | None
    #: the key's bound on its tenant's queued jobs (``TenantLimits.max_queued``); None for no limit
    max_queued: int | None
    #: the tenant's cap on jobs running at once (``TenantLimits.max_concurrent``); None for no limit
    max_concurrent: int | None
    #: the tenant's jobs queued now
    queued: int
    #: the key's requests bucket: its level and when it was last refilled; None before its first use
    requests_level: float | None
    requests_stamp: float | None
    #: the key's tokens bucket: its level and when it was last refilled; None before its first use
    tokens_level: float | None
    tokens_stamp: float | None

    #: How many reply elements it takes.
    WIDTH: ClassVar[int] = 9

    @classmethod
    def from_reply(cls, state: Sequence[str]) -> TenantState:
        """From the ``WIDTH`` strings of the reply ('' for none), in field order."""
        return cls(
            _opt_int(state[0]),
            _opt_int(state[1]),
            _opt_int(state[2]),
            _opt_int(state[3]),
            int(float(state[4])),
            _opt(state[5]),
            _opt(state[6]),
            _opt(state[7]),
            _opt(state[8]),
        )

    def limiter(self, tenant: str) -> TenantLimiter:
        """The key's TenantLimiter in this state, as the memory broker would hold it."""
        limits = TenantLimits(
            tenant,
            rpm=self.rpm,
            tpm=self.tpm,
            max_queued=self.max_queued,
            max_concurrent=self.max_concurrent,
        )
        limiter = TenantLimiter(limits)
        buckets = (
            (limiter.requests, self.requests_level, self.requests_stamp),
            (limiter.tokens, self.tokens_level, self.tokens_stamp),
        )
        for bucket, level, stamp in buckets:
            if bucket is not None and level is not None and stamp is not None:
                bucket.level, bucket.stamp = level, stamp
        return limiter


def limiter_from_state(tenant: str, state: Sequence[str]) -> TenantLimiter:
    """A TenantLimiter as the admit script left (or found) the tenant (``T`` of its reply: see
    :class:`TenantState`)."""
    return TenantState.from_reply(state).limiter(tenant)


# --- script replies ------------------------------------------------------------------------------------


class AdmitOutcome(IntEnum):
    """The first element of admit.lua's reply."""

    #: the script refused the job; the core's checks, run again on the state it saw, say why
    REFUSED = 0
    #: the job is queued
    QUEUED = 1
    #: the idempotency key names an earlier live job: nothing was queued
    DUPLICATE = 2
    #: this job id is already admitted: an earlier try of this very call got through
    RETRIED = 3


@dataclass(frozen=True, slots=True)
class AdmitRefusal:
    """What admit.lua saw when it refused a job: the state the core's checks need in order to raise
    the same Refused as the memory broker (tenant limits first, then the queue)."""

    #: the model's queue (jobs and tokens of the model, of the job's class and ahead of it, and the
    #: cost a job at the tail waits for; running jobs, which only the cap policy needs and the
    #: script counts only for it)
    view: QueueView
    #: the model's measured drain rate per slot (``DrainRate.per_slot``)
    per_slot: float
    #: how many jobs that rate was measured on (``DrainRate.samples``)
    samples: int
    #: the slots of the model's live workers
    slots: int
    #: the queue policy's state before the decision (codel's; empty for the others)
    policy: PolicyState
    #: the reservation book before the decision (``admission.Reservations.next_free``)
    next_free: float | None = None
    #: how slow a job gets, per cost unit (``DrainRate.slow``)
    slow: float = 0.0
    #: how a job slows as the batch fills: the capacity hash's ``g:`` field (:func:`drain_fill`)
    fill: str = ""
    #: the mean square of a job's residual (``DrainRate.resid``, the capacity hash's ``r:``; 0: none)
    resid: float = 0.0
    #: the mean service time (``DrainRate.service``, the capacity hash's ``d:``; 0: none)
    service: float = 0.0

    def drain(self, prior_per_slot: float) -> DrainRate:
        return DrainRate(
            prior_per_slot=prior_per_slot,
            per_slot=self.per_slot,
            samples=self.samples,
            slots=self.slots,
            slow=self.slow,
            resid=self.resid,
            service=self.service,
            **drain_fill(self.fill),
        )


@dataclass(frozen=True, slots=True)
class AdmitReply:
    """admit.lua's reply, decoded. Its layout, by outcome (``T``: :class:`TenantState`; ``S``:
    codel's four fields, '' for none)::

        {1, position, estimated_start_s, T...}
        {2, first job id}
        {3}
        {0, model_jobs, model_tokens, class_jobs, class_tokens, ahead_jobs, ahead_tokens,
            runnable_tokens, per_slot, samples, slots, T..., running, S..., victim_tokens,
            next_free, slow, fill, resid, service}
    """

    #: what the script did
    outcome: AdmitOutcome
    #: QUEUED: the jobs that would be dispatched before this one
    position: int = 0
    #: QUEUED: the predicted wait before it starts, in seconds
    estimated_start_s: float = 0.0
    #: DUPLICATE: the id of the earlier job the idempotency key names
    first_id: str | None = None
    #: QUEUED: the tenant after the charge; REFUSED: the tenant before the checks
    tenant: TenantState | None = None
    #: REFUSED: the state the refusal was decided on
    refusal: AdmitRefusal | None = None

    @classmethod
    def from_reply(cls, reply: Sequence[Any]) -> AdmitReply:
        outcome = AdmitOutcome(int(reply[0]))
        w = TenantState.WIDTH
        if outcome is AdmitOutcome.QUEUED:
            return cls(
                outcome, int(reply[1]), float(reply[2]), tenant=TenantState.from_reply(reply[3 : 3 + w])
            )
        if outcome is AdmitOutcome.DUPLICATE:
            return cls(outcome, first_id=str(reply[1]))
        if outcome is AdmitOutcome.RETRIED:
            return cls(outcome)
        model_jobs, model_tokens, class_jobs, class_tokens, ahead_jobs, ahead_tokens, runnable = map(
            int, reply[1:8]
        )
        tenant_end = 11 + w
        running = int(reply[tenant_end])
        above, standing, limit, refused = map(_opt, reply[tenant_end + 1 : tenant_end + 5])
        victim = _opt_int(reply[tenant_end + 5])
        next_free = _opt(reply[tenant_end + 6])
        slow = float(reply[tenant_end + 7])
        fill = str(reply[tenant_end + 8]) if len(reply) > tenant_end + 8 else ""
        resid = _opt(reply[tenant_end + 9]) if len(reply) > tenant_end + 9 else None
        service = _opt(reply[tenant_end + 10]) if len(reply) > tenant_end + 10 else None
        view = QueueView(
            model_jobs,
            model_tokens,
            class_jobs,
            class_tokens,
            ahead_jobs,
            ahead_tokens,
            running,
            runnable,
            victim,
        )
        refusal = AdmitRefusal(
            view,
            per_slot=float(reply[8]),
            samples=int(reply[9]),
            slots=int(reply[10]),
            policy=PolicyState(above, standing, limit or 0.0, refused),
            next_free=next_free,
            slow=slow,
            fill=fill,
            resid=resid or 0.0,
            service=service or 0.0,
        )
        return cls(outcome, tenant=TenantState.from_reply(reply[11:tenant_end]), refusal=refusal)


@dataclass(frozen=True, slots=True)
class JobReply:
    """The reply of the scripts that answer with a job's record: claim.lua, finish.lua, cancel.lua
    (``{1, field, value, ...}``, built by ``job_reply`` in _job.lua), or with a code alone."""

    #: 1: the record follows. 0: cancel: the job is unknown; finish: the caller's lease is gone;
    #: claim: nothing to claim. 2 (claim only): enough expired jobs settled for one call: call again.
    code: int
    #: the record, when ``code`` is 1
    job: Job | None

    @classmethod
    def from_reply(cls, reply: Sequence[Any]) -> JobReply:
        code = int(reply[0])
        return cls(code, decode_job(pairs(reply[1:])) if code == 1 else None)


@dataclass(frozen=True, slots=True)
class PurgeExpiredReply:
    """purge_expired.lua's reply, ``{expired, dropped, more}``."""

    #: queued jobs past their deadline, settled as expired
    expired: int
    #: finished jobs past their result TTL, dropped with their events
    dropped: int
    #: a bound of the call was reached: call again
    more: bool

    @classmethod
    def from_reply(cls, reply: Sequence[Any]) -> PurgeExpiredReply:
        return cls(int(reply[0]), int(reply[1]), bool(int(reply[2])))


@dataclass(frozen=True, slots=True)
class ReapReply:
    """reap.lua's reply, ``{requeued, dead_lettered, more}``."""

    #: jobs whose lease ran out, queued again for another attempt
    requeued: int
    #: jobs whose lease ran out on their last attempt, failed into the dead letters
    dead_lettered: int
    #: the bound of the call was reached: call again
    more: bool

    @classmethod
    def from_reply(cls, reply: Sequence[Any]) -> ReapReply:
        return cls(int(reply[0]), int(reply[1]), bool(int(reply[2])))
