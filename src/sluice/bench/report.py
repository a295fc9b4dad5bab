"""The reporting side of ``sluice bench``: statistics, the summary, markdown, JSON, and plots.

Everything here works on plain records and dictionaries, so that ``sluice bench compare`` can
rebuild tables and plots from saved result files without the run that made them.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from sluice.bench.load import QUEUE_GAUGES, Profile, Record
from sluice.bench.validity import above_capacity, run_warnings

__all__ = [
    "PLOTS_NEED",
    "RESULT_VERSION",
    "bins",
    "goodput",
    "goodput_after_first_answer",
    "load_result",
    "markdown",
    "percentile",
    "plot_compare",
    "plot_run",
    "plots_available",
    "summarize",
    "write_result",
]

RESULT_VERSION = 1


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0 to 100) by linear interpolation between ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _dist(values: Sequence[float], qs: Iterable[int] = (50, 90, 99)) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q}": percentile(values, q) for q in qs}
    out["mean"] = sum(values) / len(values) if values else None
    out["max"] = max(values) if values else None
    return out


def answered_at(records: Iterable[Record]) -> list[float]:
    """When each answer was delivered: successful first tries and successful retries."""
    times = [r.ended_s for r in records if r.outcome == "ok"]
    times += [r.retry_ended_s for r in records if r.retry_outcome == "ok" and r.retry_ended_s is not None]
    return times


def goodput(records: Sequence[Record], start: float, end: float) -> float:
    """Answers delivered within the client's deadline and completed inside ``[start, end]``, per second.

    A success is by definition within the deadline: the client gives up at its deadline, so a late
    answer is recorded as a timeout, never as a success. A retry that succeeds is an answer too: the
    engine's time went into it.
    """
    if end <= start:
        return 0.0
    done = sum(1 for t in answered_at(records) if start <= t <= end)
    return done / (end - start)


def goodput_after_first_answer(records: Sequence[Record], end: float) -> float:
    """Answers after the first one, until ``end``, per second since the first one (0 if none by then).

    The first answer opens the window, so it is not counted in it: n answers span n - 1 intervals,
    and counting the one that opens the window would add one answer to every run (0.5 % of a 40 s
    capacity run). From the first answer on because an idle engine cannot answer before one
    generation's time, whatever sits in front of it; see :mod:`sluice.bench.validity` for why a
    short window still reads high.
    """
    first = min(answered_at(records), default=end)
    if first >= end:
        return 0.0
    after = sum(1 for t in answered_at(records) if first <= t <= end) - 1
    return after / (end - first)


def bins(times: Iterable[float], width: float = 1.0, until: float | None = None) -> list[int]:
    """Counts of ``times`` in consecutive bins of ``width`` seconds from 0."""
    clean = [t for t in times if not math.isnan(t) and t >= 0]
    last = max([*clean, until or 0.0], default=0.0)
    counts = [0] * (int(last // width) + 1)
    for t in clean:
        counts[int(t // width)] += 1
    return counts


#: what a run reads from its targets' metrics besides the records (see :func:`summarize`)
COUNTERS = (
    "engine_generated_tokens",
    "engine_wasted_tokens",
    "server_admitted",
    "server_broken_promises",
    "stuck",
)


def summarize(
    records: Sequence[Record],
    *,
    duration: float,
    capacity: float | None = None,
    counters: dict[str, Any] | None = None,
    capacity_source: str | None = None,
    profile: Profile | None = None,
    client_timeout: float | None = None,
) -> dict[str, Any]:
    """The run's headline numbers from its records and the counters read from the targets.

    ``counters`` may hold ``engine_generated_tokens`` and ``engine_wasted_tokens`` (deltas over the
    run), ``server_admitted`` (jobs the gateway says it admitted), ``server_broken_promises`` (of
    those, how many the gateway says ended past their deadline), and ``stuck`` (jobs still queued or
    running at the target once every client had its outcome). ``capacity_source`` says where the
    capacity came from, ``profile`` is the offered load and ``client_timeout`` when clients give up
    (None: never); with them, ``warnings`` lists why the run may not show what its table says (see
    :mod:`sluice.bench.validity`), and ``above_capacity`` the reasons, in a few words, for each goodput
    above capacity.
    """
    counters = counters or {}
    n = len(records)
    outcomes = Counter(r.outcome or "none" for r in records)
    by_code = Counter(f"{r.outcome} {r.status or '-'} {r.code or '-'}" for r in records)
    ok = [r for r in records if r.outcome == "ok"]
    refused = [r for r in records if r.outcome == "refused"]
    accepted = [r for r in records if r.outcome != "refused"]
    # An accepted request ends visibly when it is answered, the server states its end (a code), or
    # the client gives up at its own deadline. Anything else (a reset connection, a body that is not
    # an answer) is a request the system lost.
    lost = [r for r in accepted if r.outcome == "error" and r.status is None]
    retry = [r.retry_after_s for r in refused if r.retry_after_s is not None]
    lags = [r.sent_s - r.scheduled_s for r in records if not math.isnan(r.sent_s)]
    ends = [r.ended_s for r in records if not math.isnan(r.ended_s)]
    first_ok = min(answered_at(records), default=None)

    summary: dict[str, Any] = {
        "offered": n,
        "offered_rps": n / duration,
        "outcomes": {k: outcomes.get(k, 0) for k in ("ok", "refused", "timeout", "error")},
        "by_code": dict(sorted(by_code.items(), key=lambda kv: -kv[1])),
        "success_rate": len(ok) / n if n else None,
        "accepted": len(accepted),
        "accepted_ok_rate": len(ok) / len(accepted) if accepted else None,
        "goodput_rps": goodput(records, 0.0, duration),
        "goodput_steady_rps": goodput_after_first_answer(records, duration),
        "makespan_s": max(ends, default=0.0),
        "latency_ok_s": _dist([r.latency_s for r in ok]),
        "ttft_ok_s": _dist([r.ttft_s for r in ok if r.ttft_s is not None]),
        "refuse_s": _dist([r.latency_s for r in refused]),
        "retry_after_s": {**_dist(retry), "min": min(retry, default=None), "count": len(retry)},
        "send_lag_s": _dist(lags),
        "capacity_rps": capacity,
        "goodput_pct_capacity": None,
        "goodput_steady_pct_capacity": None,
        "lost": len(lost),
        "stuck": counters.get("stuck"),
        "server_admitted": counters.get("server_admitted"),
        "broken_promises": _broken_promises(records),
        "server_broken_promises": counters.get("server_broken_promises"),
    }
    if capacity:
        summary["goodput_pct_capacity"] = 100.0 * summary["goodput_rps"] / capacity
        summary["goodput_steady_pct_capacity"] = 100.0 * summary["goodput_steady_rps"] / capacity

    generated, wasted = counters.get("engine_generated_tokens"), counters.get("engine_wasted_tokens")
    summary["engine_generated_tokens"] = generated
    summary["engine_wasted_tokens"] = wasted
    if generated is not None and wasted is not None:
        summary["wasted_share"] = wasted / generated if generated else 0.0
        summary["wasted_source"] = "engine counter sim:wasted_generation_tokens_total"
    else:
        summary["wasted_share"] = None
        summary["wasted_source"] = None
    # What the clients themselves can see: tokens streamed to requests that then gave up. It is a
    # lower bound of the engine's waste (tokens generated but not yet relayed are invisible here).
    streamed = sum(r.tokens for r in records)
    given_up = sum(r.tokens for r in records if r.outcome != "ok")
    summary["client_wasted_share"] = (
        given_up / streamed if streamed and any(r.ttft_s for r in records) else None
    )
    if summary["wasted_share"] is None and summary["client_wasted_share"] is not None:
        summary["wasted_share"] = summary["client_wasted_share"]
        summary["wasted_source"] = "client side: streamed tokens of requests given up (lower bound)"
    summary["nothing_lost"] = len(lost) == 0 and not counters.get("stuck")
    summary["retries"] = _retries(records)
    goodputs = {k: summary[k] for k in ("goodput_rps", "goodput_steady_rps")}
    reasons = above_capacity(summary["goodput_rps"], summary["goodput_steady_rps"], capacity, capacity_source)
    summary["above_capacity"] = {k: ", ".join(r.short for r in why) for k, why in reasons.items()}
    summary["warnings"] = run_warnings(
        profile=profile,
        capacity=capacity,
        capacity_source=capacity_source,
        client_timeout=client_timeout,
        first_answer_s=first_ok,
        shortest_answer_s=min((r.latency_s for r in ok), default=None),
        goodputs=goodputs,
        reasons=reasons,
    )
    return summary


def _broken_promises(records: Sequence[Record]) -> dict[str, int]:
    """Requests accepted (first tries and retries) that then ended without their answer in time: a
    promise of the gateway's admission broken. ``expired``: the server said ``deadline_exceeded``;
    ``gave_up``: the client's own time-out came first."""
    ends = [(r.outcome, r.code) for r in records]
    ends += [(r.retry_outcome, r.retry_code) for r in records if r.retry_outcome is not None]
    accepted = sum(1 for outcome, _ in ends if outcome not in ("refused", None))
    gave_up = sum(1 for outcome, code in ends if outcome == "timeout" and code == "client_gave_up")
    expired = sum(1 for outcome, code in ends if outcome == "timeout" and code != "client_gave_up")
    return {"count": gave_up + expired, "accepted": accepted, "expired": expired, "gave_up": gave_up}


def _retries(records: Sequence[Record]) -> dict[str, Any]:
    """How the clients that retry once after a Retry-After fared: whether that Retry-After was true.

    ``told_not_to`` counts the retriers' refusals that said ``x-should-retry: false``.
    """
    retried = [r for r in records if r.retry_outcome is not None]
    ok = sum(1 for r in retried if r.retry_outcome == "ok")
    waited = [r.retry_after_s for r in retried if r.retry_after_s is not None]
    return {
        "retriers": sum(1 for r in records if r.retrier),
        "refused_retriers": sum(1 for r in records if r.retrier and r.outcome == "refused"),
        "told_not_to": sum(1 for r in records if r.retrier and r.should_retry is False),
        "count": len(retried),
        "ok": ok,
        "ok_share": ok / len(retried) if retried else None,
        "retry_after_s": {"p50": percentile(waited, 50), "max": max(waited, default=None)},
        "outcomes": dict(Counter(r.retry_outcome or "none" for r in retried)),
    }


# -- files ---------------------------------------------------------------------------------------


def write_result(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")


def load_result(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("version") != RESULT_VERSION or "summary" not in data:
        raise ValueError(f"{path} is not a sluice bench result (version {RESULT_VERSION})")
    return data


def records_of(result: dict[str, Any]) -> list[Record]:
    return [Record.from_json(r) for r in result.get("records", [])]


def resummarize(result: dict[str, Any]) -> dict[str, Any]:
    """The result with its summary computed again from its records by the current definitions (a
    saved run keeps every record, so a comparison never mixes old and new ways of counting)."""
    old = result["summary"]
    config = result["config"]
    counters = {name: old.get(name) for name in COUNTERS}  # summarize() keeps them under their names
    summary = summarize(
        records_of(result),
        duration=float(config["duration"]),
        capacity=old.get("capacity_rps"),
        counters=counters,
        capacity_source=config.get("capacity_source"),
        profile=Profile(**config["profile"]) if config.get("profile") else None,
        client_timeout=config.get("client_timeout"),
    )
    summary["idle_rtt_s"] = old.get("idle_rtt_s")
    return {**result, "summary": summary}


# -- markdown ------------------------------------------------------------------------------------


def _num(value: float | None, fmt: str = "{:.2f}", unit: str = "") -> str:
    return "-" if value is None else fmt.format(value) + unit


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _above(reasons: dict[str, str], key: str) -> str:
    """The note that follows a percentage of capacity above 100: why it can be."""
    return f"; above capacity: {reasons[key]}" if key in reasons else ""


def _rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    out = s["outcomes"]
    codes = s["by_code"]
    refused = ", ".join(
        f"{k.split()[1]} {k.split()[2]}: {v}" for k, v in codes.items() if k.startswith("refused")
    )
    gave_up = sum(v for k, v in codes.items() if k.endswith("client_gave_up"))
    above = s.get("above_capacity") or {}
    goodput = _num(s["goodput_rps"], "{:.2f}", " req/s")
    if s.get("goodput_pct_capacity") is not None:
        goodput += (
            f" ({s['goodput_pct_capacity']:.1f} % of {s['capacity_rps']:.2f}{_above(above, 'goodput_rps')})"
        )
    steady = _num(s["goodput_steady_rps"], "{:.2f}", " req/s")
    if s.get("goodput_steady_pct_capacity") is not None:
        steady += f" ({s['goodput_steady_pct_capacity']:.1f} %{_above(above, 'goodput_steady_rps')})"
    lat, ref, ra = s["latency_ok_s"], s["refuse_s"], s["retry_after_s"]
    wasted = _pct(s["wasted_share"])
    if s.get("engine_wasted_tokens") is not None:
        wasted += f" ({s['engine_wasted_tokens']:,} of {s['engine_generated_tokens']:,} tokens)"
    elif s["wasted_share"] is None:
        wasted = "n/a (no engine counter; use --stream for a client-side bound)"
    lost = f"{s['lost']} lost"
    if s.get("stuck") is not None:
        lost += f", {s['stuck']} stuck"
    lost = ("yes" if s["nothing_lost"] else "**no**") + f" ({lost})"
    broken = s.get("broken_promises")
    promises = "-"
    if broken:
        promises = (
            f"{broken['count']} of {broken['accepted']} "
            f"({broken['expired']} expired, {broken['gave_up']} gave up)"
        )
        if s.get("server_broken_promises") is not None:
            promises += f"; the gateway counted {s['server_broken_promises']}"
    retries = s.get("retries") or {}
    retried = "-"
    if retries.get("count"):
        retried = f"{retries['count']}, {_pct(retries['ok_share'])} then succeeded"
        waited = retries["retry_after_s"]
        retried += f" (after {_num(waited['p50'], unit=' s')} p50, {_num(waited['max'], unit=' s')} max)"
    return [
        ("offered", f"{s['offered']} ({s['offered_rps']:.2f} req/s)"),
        ("success rate", _pct(s["success_rate"])),
        ("goodput", goodput),
        ("goodput after the first answer", steady),
        (
            "latency of successes p50 / p90 / p99",
            " / ".join(_num(lat[k], "{:.2f}", " s") for k in ("p50", "p90", "p99")),
        ),
        ("time to refuse p50 / p99", f"{_ms(ref['p50'])} / {_ms(ref['p99'])}"),
        ("idle round trip (floor of the times above)", _ms(s.get("idle_rtt_s"))),
        ("ok", str(out["ok"])),
        ("refused", f"{out['refused']}" + (f" ({refused})" if refused else "")),
        (
            "timed out",
            f"{out['timeout']} ({gave_up} gave up, {out['timeout'] - gave_up} expired by the server)",
        ),
        ("errors", str(out["error"])),
        ("Retry-After p50 / max", f"{_num(ra['p50'], unit=' s')} / {_num(ra['max'], unit=' s')}"),
        ("retried once after Retry-After", retried),
        ("broken promises: accepted, then not answered in time", promises),
        ("engine tokens wasted", wasted),
        ("accepted, of which answered", f"{s['accepted']}, {_pct(s['accepted_ok_rate'])}"),
        (
            "admitted (the gateway's count)",
            "-" if s.get("server_admitted") is None else str(s["server_admitted"]),
        ),
        ("nothing accepted lost", lost),
        ("send lag p99 (open loop kept up)", _ms(s["send_lag_s"]["p99"])),
    ]


def markdown(results: Sequence[dict[str, Any]]) -> str:
    """One table, a column per run, a row per measure; then how each run was made."""
    labels = [r.get("label") or f"run {i + 1}" for i, r in enumerate(results)]
    table = [_rows(r["summary"]) for r in results]
    lines = ["| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for i, (name, _) in enumerate(table[0]):
        lines.append(f"| {name} | " + " | ".join(rows[i][1] for rows in table) + " |")
    lines.append("")
    for label, r in zip(labels, results, strict=True):
        c = r["config"]
        lines.append(
            f"- **{label}**: {c['mode']} → {c['target']}"
            + (f" (queue policy {c['policy']})" if c.get("policy") not in (None, "direct") else "")
            + f", {c['profile_text']}, seed {c['seed']}, "
            + (
                f"client timeout {c['client_timeout']:g} s"
                if c["client_timeout"]
                else "clients never give up"
            )
            + f", max_tokens {c['max_tokens']}"
            + (f", {c['users']} users" if c.get("users", 1) > 1 else "")
            + (f", {100 * c['retriers']:g} % of clients retry once" if c.get("retriers") else "")
            + (
                f"; load average {c['load_avg_1m'][0]} → {c['load_avg_1m'][1]}"
                if c.get("load_avg_1m")
                else ""
            )
            + (f"; `{c['command']}`" if c.get("command") else "")
        )
    warned = [
        (label, w)
        for label, r in zip(labels, results, strict=True)
        for w in r["summary"].get("warnings") or []
    ]
    if warned:
        lines += ["", "Warnings:", ""]
        lines += [f"- **{label}**: {warning}" for label, warning in warned]
    return "\n".join(lines) + "\n"


# -- plots ---------------------------------------------------------------------------------------


# matplotlib is the ``bench`` extra, not a dependency of the gateway: imported only to draw.
PLOTS_NEED = "plots need matplotlib: pip install 'sluice[bench]'"


def plots_available() -> bool:
    """Whether matplotlib can be imported (it then stays imported: the plots come next)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(PLOTS_NEED) from exc

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt

    return plt


def _waiting(sample: dict[str, float]) -> float | None:
    keys = ("sluice_queued_jobs", "vllm:num_requests_waiting", "llamacpp:requests_deferred")
    present = [sample[k] for k in keys if k in sample]
    return sum(present) if present else None


def plot_run(result: dict[str, Any], path: Path) -> None:
    """Rates per second, latency of successes, and queue depth, over the run's time."""
    plt = _pyplot()
    records = records_of(result)
    duration = float(result["config"]["duration"])
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    ax = axes[0]
    until = max([duration, *(r.ended_s for r in records if not math.isnan(r.ended_s))])
    series = [
        ("offered", [r.sent_s for r in records], "tab:gray"),
        ("answered (retries too)", answered_at(records), "tab:green"),
        ("refused", [r.ended_s for r in records if r.outcome == "refused"], "tab:orange"),
        ("timed out", [r.ended_s for r in records if r.outcome == "timeout"], "tab:red"),
        ("errors", [r.ended_s for r in records if r.outcome == "error"], "black"),
    ]
    for name, times, color in series:
        if times or name != "errors":
            counts = bins(times, 1.0, until)
            ax.step(range(len(counts)), counts, where="post", label=name, color=color)
    capacity = result["summary"].get("capacity_rps")
    if capacity:
        ax.axhline(capacity, color="tab:green", linestyle=":", label=f"capacity {capacity:.2f}/s")
    ax.set_ylabel("requests / s (1 s bins)")
    ax.legend(loc="upper right", fontsize="small")
    ax.set_title(f"{result.get('label') or 'run'}: {result['config']['profile_text']}")

    ax = axes[1]
    ok = [r for r in records if r.outcome == "ok"]
    ax.scatter([r.sent_s for r in ok], [r.latency_s for r in ok], s=4, color="tab:green", label="success")
    timeout = result["config"].get("client_timeout")
    if timeout:
        ax.axhline(timeout, color="tab:red", linestyle=":", label=f"client gives up ({timeout:g} s)")
    ax.set_ylabel("latency of successes (s)\nby send time")
    ax.legend(loc="upper right", fontsize="small")

    ax = axes[2]
    samples = result.get("samples") or []
    plotted = False
    for key in QUEUE_GAUGES:
        points = [(s["t"], s[key]) for s in samples if key in s]
        if points:
            ax.plot(*zip(*points, strict=True), label=key)
            plotted = True
    if plotted:
        ax.legend(loc="upper right", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no /metrics sampled", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("requests")
    ax.set_xlabel("time since start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_compare(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Several runs overlaid: answers per second, latency of successes, and requests waiting."""
    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    first = records_of(results[0])
    offered = bins([r.scheduled_s for r in first], 1.0)
    axes[0].step(range(len(offered)), offered, where="post", color="tab:gray", label="offered")
    for i, result in enumerate(results):
        color = colors[i % len(colors)]
        label = result.get("label") or f"run {i + 1}"
        records = records_of(result)
        ok = [r for r in records if r.outcome == "ok"]
        counts = bins(answered_at(records), 1.0)
        axes[0].step(range(len(counts)), counts, where="post", color=color, label=f"{label}: answered")
        axes[1].scatter([r.sent_s for r in ok], [r.latency_s for r in ok], s=4, color=color, label=label)
        points = [(s["t"], w) for s in result.get("samples") or [] if (w := _waiting(s)) is not None]
        if points:
            axes[2].plot(*zip(*points, strict=True), color=color, label=f"{label}: waiting")
    capacity = next(
        (r["summary"].get("capacity_rps") for r in results if r["summary"].get("capacity_rps")), None
    )
    if capacity:
        axes[0].axhline(capacity, color="black", linestyle=":", label=f"capacity {capacity:.2f}/s")
    timeout = results[0]["config"].get("client_timeout")
    if timeout:
        axes[1].axhline(timeout, color="tab:red", linestyle=":", label=f"client gives up ({timeout:g} s)")
    axes[0].set_ylabel("requests / s (1 s bins)")
    axes[1].set_ylabel("latency of successes (s)\nby send time")
    axes[2].set_ylabel("requests waiting\n(gateway queue + engine queue)")
    axes[2].set_xlabel("time since start (s)")
    axes[0].set_title(results[0]["config"]["profile_text"])
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
