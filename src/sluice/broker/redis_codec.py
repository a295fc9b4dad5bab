"""What the Redis broker's scripts read and write, in Python terms: the job record (one hash per
job) and the tenant-limit state admit.lua hands back.

Fields the scripts read or write are fields of their own, as JSON text when they are numbers or
JSON (so a script can splice them into a reply unchanged); the fields that never change after
admission travel as one JSON field, ``spec``: every argument and reply element that crosses into a
script costs Redis time, and a record is read whole on every claim and finish. The layout follows
the ``Job`` dataclass's type hints, so a field added to ``Job`` is stored without a change here
(in ``spec``, unless it is listed in :data:`OWN_FIELDS` because a script needs it).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sluice.core.job import Job, JobError
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

#: Job fields the scripts read or write, each a field of the record hash; the others go in ``spec``.
OWN_FIELDS = frozenset(
    {
        "model", "tenant", "priority", "weight", "created_at", "deadline", "max_attempts", "state",
        "attempts", "started_at", "first_token_at", "finished_at", "backend", "result", "usage",
        "error", "extra", "callback_url",
    }
)  # fmt: skip


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
        if name in OWN_FIELDS:
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

    enc = ["def encode_job(job):", "    out = ['cost', str(job.cost)]"]
    enc += fields(_OWN_OUT, "oo", "job.{name}", "out += ({name}, {value})")
    enc.append("    spec = {}")
    enc += fields(_SPEC_OUT, "so", "job.{name}", "spec[{name}] = {value}")
    enc += ["    out += ('spec', _encode(spec))", "    return out"]

    dec = ["def decode_job(data):", "    kw = {}", "    get = _decode(data['spec']).get"]
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


def pairs(flat: Sequence[Any]) -> dict[str, str]:
    """A flat reply ``[field, value, ...]`` as a dict."""
    it = iter(flat)
    return dict(zip(it, it, strict=False))


# --- tenant limits ----------------------------------------------------------------------------


def bound(value: int | None) -> int:
    """A limit for a script: -1 for none."""
    return -1 if value is None else value


def tenant_limit_args(limits: TenantLimits | None) -> list[int]:
    """ARGV of admit.lua for a tenant's limits: given or not, then its four limits."""
    if limits is None:
        return [0, -1, -1, -1, -1]
    values = (limits.rpm, limits.tpm, limits.max_queued, limits.max_concurrent)
    return [1, *map(bound, values)]


def limiter_from_state(tenant: str, state: Sequence[str]) -> TenantLimiter:
    """A TenantLimiter as the admit script left (or found) the tenant: rpm, tpm, max queued, max
    concurrent, queued, requests level and stamp, tokens level and stamp ('' for none)."""

    def opt(i: int) -> float | None:
        return float(state[i]) if state[i] != "" else None

    def opt_int(i: int) -> int | None:
        value = opt(i)
        return None if value is None else int(value)

    limits = TenantLimits(
        tenant, rpm=opt_int(0), tpm=opt_int(1), max_queued=opt_int(2), max_concurrent=opt_int(3)
    )
    limiter = TenantLimiter(limits)
    for bucket, level, stamp in ((limiter.requests, opt(5), opt(6)), (limiter.tokens, opt(7), opt(8))):
        if bucket is not None and level is not None and stamp is not None:
            bucket.level, bucket.stamp = level, stamp
    return limiter
