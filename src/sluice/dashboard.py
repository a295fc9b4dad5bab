"""What the dashboard draws, built from what the broker and the processes' reports say. No I/O:
:mod:`sluice.dashboard_feed` does the reading, once a second, and hands the results here.

Two parts:

* :class:`History`, the fleet's recent past: how much each counter of every process grew at each
  tick (a process that restarts starts its counters again from zero, which is read as such, never
  as a drop), kept for a bounded number of ticks; rates, percentiles and the charts' points are
  taken from it;
* :func:`snapshot`, the page's whole state at one tick: per model its queue (by class and by top
  tenants, its bound, the predicted wait, the engines busy), every engine with its health, the
  admission and refusal rates by code, goodput, latency percentiles, the Retry-After given, and the
  processes of the fleet.

The snapshot is plain JSON; docs/dashboard.md lists its fields. Fields that the fleet issue fills
(pools, learned limits): ``pools`` per model (:func:`pool_views`), ``pool``, ``limit_source``
and ``health`` per engine.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.broker.base import ModelStats, QueueBreakdown
from sluice.core.admission import MIN_RETRY_AFTER_S, QueueLimits

#: one sample of a metric: its name (``sluice_jobs_total``) and its labels, sorted
SampleKey = tuple[str, tuple[tuple[str, str], ...]]

#: the version of the snapshot's shape, for clients other than the page
SNAPSHOT_VERSION = 1
#: ticks kept (at one a second, ten minutes)
HISTORY_TICKS = 600
#: the window of the latency percentiles, refusal counts and Retry-After shown (seconds)
WINDOW_S = 300.0
#: the window of the rates on the tiles (seconds): short enough to follow a burst
RATE_WINDOW_S = 5.0
#: the window of the latency percentiles in each chart point (seconds)
POINT_WINDOW_S = 30.0
#: how long a process that stopped reporting is remembered, so that it is not counted from zero
#: again when it comes back (seconds)
FORGET_S = 900.0
#: an engine whose worker has not reported for this long is shown as stale (seconds)
STALE_S = 3.0
#: tenants listed per model
TOP_TENANTS = 10

SUCCEEDED = "succeeded"


#: the sample keys already made, by their name and labels as a report gives them: a report's
#: samples are the same series tick after tick, and one key object for each series spares making
#: it again, and lets the history's dict lookups find it by identity rather than comparing tuples
_KEYS: dict[tuple[Any, ...], SampleKey] = {}
#: keys kept at most, past which the cache starts again (the processes' label sets are bounded)
KEYS_MAX = 10_000


def _key(name: Any, labels: Any) -> SampleKey:
    raw = (name, *labels.items()) if type(labels) is dict else None
    try:
        key = _KEYS.get(raw) if raw is not None else None
    except TypeError:  # a label's value that cannot be hashed: made as it comes
        key = raw = None
    if key is None:
        key = (str(name), tuple(sorted((str(k), str(v)) for k, v in dict(labels).items())))
        # kept only when every part is a string: a later lookup equal to it is then the same series
        # (a number would equal a number of another type, whose str differs: 1 and 1.0)
        if (
            raw is not None
            and type(name) is str
            and all(type(k) is type(v) is str for k, v in labels.items())
        ):
            if len(_KEYS) >= KEYS_MAX:
                _KEYS.clear()
            _KEYS[raw] = key
    return key


def samples_of(report: Mapping[str, Any]) -> dict[SampleKey, float]:
    """A report's samples, by :data:`SampleKey`; malformed entries are skipped, and so are the
    histograms' ``_sum`` samples, which nothing here draws."""
    out: dict[SampleKey, float] = {}
    for entry in report.get("samples") or ():
        try:
            name, labels, value = entry
            if type(name) is str and name[-4:] == "_sum":
                continue
            out[_key(name, labels)] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def grown(before: Mapping[SampleKey, float] | None, now: Mapping[SampleKey, float]) -> dict[SampleKey, float]:
    """How much each counter grew from ``before`` to ``now``; one that went down was reset (its
    process restarted) and grew by its whole value. ``before`` None: everything is new."""
    out: dict[SampleKey, float] = {}
    for key, value in now.items():
        last = before[key] if before is not None and key in before else 0.0
        delta = value - last if value >= last else value
        if delta:
            out[key] = delta
    return out


@dataclass
class Tick:
    """One tick of the fleet's history.

    Attributes:
        at: when (the broker's clock, seconds).
        span_s: seconds since the previous tick (the first one counts one).
        grew: how much each counter and histogram bucket grew since the previous tick, summed
            over every process.
        point: the charts' values at this tick (see :func:`chart_point`).
    """

    at: float
    span_s: float
    grew: dict[SampleKey, float]
    point: dict[str, Any] = field(default_factory=dict)


#: a contribution to a window's sum at or past this size might round: its sum is made afresh
_EXACT_BELOW = 2.0**43


@dataclass
class _Window:
    """The running sum of the ticks inside one window length, carried from one tick to the next
    so that a tick costs what it adds and drops, not the whole window again.

    Sums of whole numbers under :data:`_EXACT_BELOW` are exact in any order, so the running sum
    equals the sum over the window's ticks, newest first, that :meth:`History.window` defines; a
    key that some tick grew by anything else (a fraction, a NaN) is summed afresh in that order.
    """

    #: the window's ticks (the history's count of ticks appended at each), oldest first
    ticks: deque[tuple[int, Tick]] = field(default_factory=deque)
    sums: dict[SampleKey, float] = field(default_factory=dict)
    #: how many of the window's ticks grew each key (a key none grew is not in ``sums``)
    counts: dict[SampleKey, int] = field(default_factory=dict)
    #: how many of the window's ticks grew each key by other than a whole number
    inexact: dict[SampleKey, int] = field(default_factory=dict)
    #: the history's count of ticks appended when the window last took one
    upto: int = 0

    def add(self, seq: int, tick: Tick) -> None:
        self.ticks.append((seq, tick))
        sums, counts, inexact = self.sums, self.counts, self.inexact
        for key, value in tick.grew.items():
            if key in sums:
                sums[key] += value
                counts[key] += 1
            else:
                sums[key] = value
                counts[key] = 1
            if value % 1.0 or not -_EXACT_BELOW < value < _EXACT_BELOW:
                inexact[key] = inexact[key] + 1 if key in inexact else 1

    def drop(self) -> None:
        _, tick = self.ticks.popleft()
        sums, counts, inexact = self.sums, self.counts, self.inexact
        for key, value in tick.grew.items():
            left = counts[key] - 1
            if left:
                sums[key] -= value
                counts[key] = left
            else:
                del sums[key], counts[key]
            if key in inexact and (value % 1.0 or not -_EXACT_BELOW < value < _EXACT_BELOW):
                if inexact[key] > 1:
                    inexact[key] -= 1
                else:
                    del inexact[key]
                    if left:  # what is left is whole numbers, but the running sum kept a rounding
                        sums[key] = self._summed(key)

    def _summed(self, key: SampleKey) -> float:
        """``key``'s sum over the window's ticks, newest first (as :meth:`History.window` says)."""
        value = 0.0
        for _, tick in reversed(self.ticks):
            if key in tick.grew:
                value += tick.grew[key]
        return value

    def total(self) -> tuple[dict[SampleKey, float], float]:
        total = dict(self.sums)
        for key in self.inexact:
            total[key] = self._summed(key)
        span = 0.0
        for _, tick in reversed(self.ticks):
            span += tick.span_s
        return total, span


class History:
    """The fleet's counters, tick by tick, the last ``keep`` ticks."""

    def __init__(self, keep: int = HISTORY_TICKS) -> None:
        self.ticks: deque[Tick] = deque(maxlen=keep)
        #: each process's samples as last seen, and when
        self._seen: dict[str, tuple[float, dict[SampleKey, float]]] = {}
        #: ticks appended so far: the one at ``ticks[i]`` was the ``appended - len(ticks) + i + 1``th
        self._appended = 0
        #: the count of ticks appended when the latest one earlier than the one before it came (a
        #: clock stepped back); while both are in :attr:`ticks` the windows are summed afresh
        self._unordered = -1
        #: the running sums of the windows asked for, by their length
        self._windows: dict[float, _Window] = {}

    def advance(self, now: float, reports: Mapping[str, Mapping[str, Any]]) -> Tick:
        """Add the tick at ``now`` from the processes' reports. At the first tick every process's
        counters so far are the baseline; a process first seen later is new, and all it counted
        is growth."""
        first = not self.ticks and not self._seen
        grew: dict[SampleKey, float] = {}
        for process_id, report in reports.items():
            current = samples_of(report)
            last = self._seen.get(process_id)
            if not first:
                for key, delta in grown(last[1] if last is not None else None, current).items():
                    grew[key] = grew[key] + delta if key in grew else delta
            self._seen[process_id] = (now, current)
        for process_id in [p for p, (seen, _) in self._seen.items() if now - seen > FORGET_S]:
            del self._seen[process_id]
        span = now - self.ticks[-1].at if self.ticks else 1.0
        if self.ticks and now < self.ticks[-1].at:
            self._unordered = self._appended + 1
        tick = Tick(now, span if span > 0 else 1.0, grew)
        self.ticks.append(tick)
        self._appended += 1
        return tick

    def window(self, seconds: float, now: float | None = None) -> tuple[dict[SampleKey, float], float]:
        """What grew over the last ``seconds`` (the ticks after ``now - seconds``, newest first
        until the first at or before it), and the seconds those ticks span.

        Without ``now`` (the latest tick's time), from the running sum of that window length
        while the ticks' times are in order, updated with the ticks that came and went since."""
        if not self.ticks:
            return {}, 0.0
        oldest = self._appended - len(self.ticks) + 1
        if (now is not None and now != self.ticks[-1].at) or self._unordered > oldest:
            self._windows.clear()
            return self._summed(seconds, self.ticks[-1].at if now is None else now)
        w = self._windows.get(seconds)
        if w is None:
            w = self._windows[seconds] = _Window()
        new = self._appended - w.upto
        if new > len(self.ticks):  # the window is older than the history: taken again
            w = self._windows[seconds] = _Window()
            new = len(self.ticks)
        for i in range(len(self.ticks) - new, len(self.ticks)):
            w.add(self._appended - len(self.ticks) + i + 1, self.ticks[i])
        w.upto = self._appended
        start = self.ticks[-1].at - seconds
        while w.ticks and (w.ticks[0][0] < oldest or w.ticks[0][1].at <= start):
            w.drop()
        return w.total()

    def _summed(self, seconds: float, end: float) -> tuple[dict[SampleKey, float], float]:
        total: dict[SampleKey, float] = {}
        span = 0.0
        for tick in reversed(self.ticks):
            if tick.at <= end - seconds:
                break
            span += tick.span_s
            for key, value in tick.grew.items():
                total[key] = total.get(key, 0.0) + value
        return total, span

    def points(self) -> list[dict[str, Any]]:
        return [t.point for t in self.ticks if t.point]


def matching(
    grew: Mapping[SampleKey, float], name: str, **labels: str
) -> Iterable[tuple[dict[str, str], float]]:
    """The samples named ``name`` whose labels include ``labels``, with all their labels."""
    for (sample, pairs), value in grew.items():
        if sample != name:
            continue
        have = dict(pairs)
        # with no labels asked (a histogram's buckets, a total), every sample of the name matches
        if not labels or all(have.get(k) == v for k, v in labels.items()):
            yield have, value


def total(grew: Mapping[SampleKey, float], name: str, **labels: str) -> float:
    return sum(v for _, v in matching(grew, name, **labels))


def by_label(grew: Mapping[SampleKey, float], name: str, label: str, **labels: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for have, value in matching(grew, name, **labels):
        out[have.get(label, "")] = out.get(have.get(label, ""), 0.0) + value
    return out


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]], floor: float = 0.0) -> float | None:
    """The ``q`` quantile of a histogram given as (upper bound, cumulative count) pairs, the
    ``+Inf`` bucket last, interpolated inside its bucket as Prometheus does; None with no
    observations. The first bucket starts at ``floor`` (no value is below it), and a quantile in
    the ``+Inf`` bucket is the highest finite bound."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower, below = min(floor, ordered[0][0]), 0.0
    for upper, count in ordered:
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def buckets_of(grew: Mapping[SampleKey, float], histogram: str, **labels: str) -> list[tuple[float, float]]:
    """The cumulative buckets of ``histogram`` (its ``_bucket`` samples) summed over every series
    that matches ``labels``."""
    out: dict[float, float] = {}
    for have, value in matching(grew, histogram + "_bucket", **labels):
        try:
            upper = float(have["le"])
        except (KeyError, ValueError):
            continue
        out[upper] = out.get(upper, 0.0) + value
    return sorted(out.items())


def percentiles(
    grew: Mapping[SampleKey, float], histogram: str, floor: float = 0.0, **labels: str
) -> dict[str, float | None]:
    """p50, p90 and p99 of ``histogram`` and its observation count, over what ``grew`` holds;
    ``floor``: the least value it can hold."""
    buckets = buckets_of(grew, histogram, **labels)
    out: dict[str, float | None] = {
        name: histogram_quantile(q, buckets, floor) for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
    }
    out["count"] = total(grew, histogram + "_count", **labels)
    return out


def per_second(value: float, span_s: float) -> float:
    return value / span_s if span_s > 0 else 0.0


def chart_point(
    at: float, stats: Mapping[str, ModelStats], tick: Tick, recent: Mapping[SampleKey, float]
) -> dict[str, Any]:
    """The charts' values at one tick: queue depth and running jobs (fleet-wide), admissions,
    refusals by code and answers per second at this tick, and the latency percentiles over the
    last :data:`POINT_WINDOW_S` (``recent``)."""
    span = tick.span_s
    wait = percentiles(recent, "sluice_queue_wait_seconds")
    ttft = percentiles(recent, "sluice_time_to_first_token_seconds")
    refused = by_label(tick.grew, "sluice_admissions_total", "code", outcome="refused")
    return {
        "t": at,
        "queued": sum(s.queued_jobs for s in stats.values()),
        "running": sum(s.running_jobs for s in stats.values()),
        "queued_by_model": {m: s.queued_jobs for m, s in stats.items()},
        "admitted": per_second(total(tick.grew, "sluice_admissions_total", outcome="admitted"), span),
        "refused": per_second(sum(refused.values()), span),
        "refused_by_code": {code: per_second(n, span) for code, n in sorted(refused.items())},
        "goodput": per_second(total(tick.grew, "sluice_jobs_total", status=SUCCEEDED), span),
        "tokens": per_second(total(tick.grew, "sluice_completion_tokens_total"), span),
        "wait_p50": wait["p50"],
        "wait_p99": wait["p99"],
        "ttft_p50": ttft["p50"],
        "ttft_p99": ttft["p99"],
    }


def engine_state(engine: Mapping[str, Any], age_s: float) -> str:
    """One word for an engine's health: ``stale`` (its worker stopped reporting), ``draining``,
    ``leaving`` (its address left its pool's DNS records), ``ejected`` (sitting out an ejection
    after errors or timeouts), ``probing`` (the ejection over, one request sent to try it),
    ``recovering`` (errors, no success since) or ``ok``."""
    if age_s > STALE_S:
        return "stale"
    if engine.get("draining"):
        return "draining"
    if engine.get("leaving"):
        return "leaving"
    if float(engine.get("cooldown_s") or 0) > 0 or engine.get("health") == "ejected":
        return "ejected"
    if engine.get("health") == "probing":
        return "probing"
    if int(engine.get("failures") or 0) > 0:
        return "recovering"
    return "ok"


def _wait_s(tokens: float, drain_rate: float) -> float | None:
    return tokens / drain_rate if drain_rate > 0 else None


def _fill(jobs: int, tokens: int, max_jobs: int | None, max_tokens: int | None) -> float | None:
    shares = [jobs / max_jobs if max_jobs else None, tokens / max_tokens if max_tokens else None]
    known = [s for s in shares if s is not None]
    return max(known) if known else None


@dataclass(frozen=True)
class FleetInput:
    """What the feed read at one tick.

    Attributes:
        at: the broker's clock when read (seconds).
        stats: per model: depth, running jobs, slots, drain rate (fleet-wide, the broker's).
        breakdown: per model: depth by class and top tenants (fleet-wide).
        reports: every live process's report (:mod:`sluice.reports`), by process id.
        classes: the priority classes, highest first.
        limits: a model's queue bounds.
        draining: backends marked draining in the broker.
    """

    at: float
    stats: Mapping[str, ModelStats]
    breakdown: Mapping[str, QueueBreakdown]
    reports: Mapping[str, Mapping[str, Any]]
    classes: Sequence[str]
    limits: Callable[[str], QueueLimits]
    draining: frozenset[str] = frozenset()
    #: per model, the scaling signal's desired engines and the classes whose deadlines are at
    #: risk (:mod:`sluice.scaling_signal`, as this gateway's gauges hold it); empty before it read
    desired: Mapping[str, tuple[int, tuple[str, ...]]] = field(default_factory=dict)


def engines(fleet: FleetInput) -> list[dict[str, Any]]:
    """Every engine that some worker reports, with its worker, the age of the report and its state."""
    out = []
    for process_id, report in sorted(fleet.reports.items()):
        if report.get("role") != "worker":
            continue
        age = max(fleet.at - float(report.get("at") or fleet.at), 0.0)
        for engine in report.get("engines") or ():
            row = dict(engine)
            row["worker"] = process_id
            row["report_age_s"] = round(age, 3)
            row["draining"] = bool(row.get("draining")) or row.get("name") in fleet.draining
            row["state"] = engine_state(row, age)
            out.append(row)
    return out


def processes(fleet: FleetInput) -> list[dict[str, Any]]:
    return [
        {
            "id": process_id,
            "role": report.get("role"),
            "host": report.get("host"),
            "pid": report.get("pid"),
            "age_s": round(max(fleet.at - float(report.get("at") or fleet.at), 0.0), 3),
            "up_s": round(max(fleet.at - float(report.get("started_at") or fleet.at), 0.0), 1),
        }
        for process_id, report in sorted(fleet.reports.items())
    ]


def model_view(
    name: str, stats: ModelStats, fleet: FleetInput, engine_rows: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """One model: its queue, bound, predicted wait, classes, top tenants and the engines busy."""
    limits = fleet.limits(name)
    breakdown = fleet.breakdown.get(name)
    classes = []
    through = 0
    for cls in fleet.classes:
        depth = breakdown.classes.get(cls) if breakdown is not None else None
        jobs, tokens = (depth.jobs, depth.tokens) if depth is not None else (0, 0)
        through += tokens
        bound = limits.classes.get(cls)
        classes.append(
            {
                "name": cls,
                "jobs": jobs,
                "tokens": tokens,
                # a new job of this class waits for its class and every class above it
                "predicted_wait_s": _wait_s(through, stats.drain_rate),
                "max_jobs": bound.max_jobs if bound is not None else None,
                "max_tokens": bound.max_tokens if bound is not None else None,
            }
        )
    serving = [e for e in engine_rows if name in (e.get("models") or ()) and e.get("state") != "stale"]
    demand = stats.running_jobs + stats.queued_jobs
    ratio = demand / stats.slots if stats.slots else None
    per_engine = stats.slots / len(serving) if serving and stats.slots else None
    return {
        "name": name,
        "queued_jobs": stats.queued_jobs,
        "queued_tokens": stats.queued_tokens,
        "running_jobs": stats.running_jobs,
        "slots": stats.slots,
        "drain_rate": stats.drain_rate,
        "measured": stats.measured,
        "max_queued_jobs": limits.model.max_jobs,
        "max_queued_tokens": limits.model.max_tokens,
        "fill": _fill(stats.queued_jobs, stats.queued_tokens, limits.model.max_jobs, limits.model.max_tokens),
        "predicted_wait_s": _wait_s(stats.queued_tokens, stats.drain_rate),
        "classes": classes,
        "tenants": [
            {"tenant": t.tenant, "jobs": t.jobs, "tokens": t.tokens}
            for t in (breakdown.tenants if breakdown is not None else ())
        ],
        "tenant_count": breakdown.tenant_count if breakdown is not None else 0,
        "engines": len(serving),
        # the work present (running and queued), in engines' worth of slots: above the engines
        # serving it, more engines would be busy; the autoscaling issue brings the real signal
        "engines_busy": demand / per_engine if per_engine else None,
        "demand_ratio": ratio,
        "pools": pool_views(serving),
        "desired_engines": fleet.desired[name][0] if name in fleet.desired else None,
        "deadlines_at_risk": list(fleet.desired[name][1]) if name in fleet.desired else [],
    }


def pool_views(serving: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The pools of the engines serving a model: per pool, its engines (those not stale), their
    work and limits summed (learned or configured), and how many are ejected or draining."""
    pools: dict[str, dict[str, Any]] = {}
    for e in serving:
        name = str(e.get("pool") or e.get("name"))
        p = pools.setdefault(
            name, {"name": name, "engines": 0, "inflight": 0, "limit": 0, "learned": 0, "out": 0}
        )
        p["engines"] += 1
        p["inflight"] += int(e.get("inflight") or 0)
        p["limit"] += int(e.get("limit") or 0)
        p["learned"] += 1 if e.get("limit_source") == "learned" else 0
        p["out"] += 1 if e.get("state") in ("ejected", "draining", "leaving") else 0
    return [pools[k] for k in sorted(pools)]


def snapshot(fleet: FleetInput, history: History) -> dict[str, Any]:
    """The page's state at this tick; :meth:`History.advance` must have taken the tick first."""
    engine_rows = engines(fleet)
    models = [model_view(name, s, fleet, engine_rows) for name, s in sorted(fleet.stats.items())]
    recent, recent_span = history.window(RATE_WINDOW_S)
    windowed, window_span = history.window(WINDOW_S)
    refused_now = by_label(recent, "sluice_admissions_total", "code", outcome="refused")
    refused_window = by_label(windowed, "sluice_admissions_total", "code", outcome="refused")
    jobs_window = by_label(windowed, "sluice_jobs_total", "status")
    retry_after = percentiles(windowed, "sluice_retry_after_seconds", floor=MIN_RETRY_AFTER_S)
    slots = sum(s.slots for s in fleet.stats.values())
    demand = sum(s.running_jobs + s.queued_jobs for s in fleet.stats.values())
    live = [e for e in engine_rows if e["state"] != "stale"]
    cumulative = buckets_of(windowed, "sluice_retry_after_seconds")
    return {
        "v": SNAPSHOT_VERSION,
        "at": fleet.at,
        "window_s": WINDOW_S,
        "rate_window_s": RATE_WINDOW_S,
        "processes": processes(fleet),
        "models": models,
        "engines": engine_rows,
        "rates": {
            "admitted": per_second(total(recent, "sluice_admissions_total", outcome="admitted"), recent_span),
            "duplicate": per_second(
                total(recent, "sluice_admissions_total", outcome="duplicate"), recent_span
            ),
            "refused": per_second(sum(refused_now.values()), recent_span),
            "refused_by_code": {c: per_second(n, recent_span) for c, n in sorted(refused_now.items())},
            "goodput": per_second(total(recent, "sluice_jobs_total", status=SUCCEEDED), recent_span),
            "tokens": per_second(total(recent, "sluice_completion_tokens_total"), recent_span),
        },
        "window": {
            "span_s": window_span,
            "admitted": total(windowed, "sluice_admissions_total", outcome="admitted"),
            "refused_by_code": dict(sorted(refused_window.items())),
            "jobs_by_status": dict(sorted(jobs_window.items())),
            "client_retries": total(windowed, "sluice_client_retries_total"),
        },
        "latency": {
            "queue_wait": percentiles(windowed, "sluice_queue_wait_seconds"),
            "ttft": percentiles(windowed, "sluice_time_to_first_token_seconds"),
        },
        "retry_after": {
            **retry_after,
            "by_code": by_label(windowed, "sluice_retry_after_seconds_count", "code"),
            # per bucket, not cumulative: refusals whose Retry-After fell at or under ``le`` and
            # above the bound before it
            "buckets": [
                {"le": None if math.isinf(le) else le, "count": n - prev}
                for (le, n), prev in zip(cumulative, [0.0] + [n for _, n in cumulative], strict=False)
            ],
        },
        "scaling": {
            # the scaling signal (sluice_desired_engines) summed over the models; None before it read
            "desired_engines": sum(d for d, _ in fleet.desired.values()) if fleet.desired else None,
            "demand_ratio": demand / slots if slots else None,
            "engines": len(live),
            "engines_busy": demand / (slots / len(live)) if live and slots else None,
        },
        "point": history.ticks[-1].point if history.ticks else {},
    }
