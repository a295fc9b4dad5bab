"""``sluice bench fleet``: one row per arm from its result, the comparison table, and the plots."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sluice.bench.report import goodput, records_of


def _status_counts(records: Sequence[dict[str, Any]]) -> dict[str, int]:
    def count(pred: Any) -> int:
        return sum(1 for r in records if pred(r))

    return {
        "429": count(lambda r: r["status"] == 429),
        "503": count(lambda r: r["status"] == 503),
        "504": count(lambda r: r["status"] == 504),
        "gave_up": count(lambda r: r["code"] == "client_gave_up"),
        "errors": count(lambda r: r["outcome"] == "error"),
    }


def arm_row(result: dict[str, Any]) -> dict[str, Any]:
    """One arm's line of the comparison, from its result (see :func:`run_arm`)."""
    s, fleet = result["summary"], result["fleet"]
    duration = float(result["config"]["duration"])
    lat = s["latency_ok_s"]
    killed = fleet.get("killed")
    kill: dict[str, Any] | None = None
    if killed is not None:
        t = fleet["killed_at_s"]
        inflight = [
            r
            for r in result["records"]
            if r["sent_s"] is not None and r["sent_s"] <= t and (r["ended_s"] or 0) > t
        ]
        kill = {"engine": killed, "at_s": t, "in_flight": len(inflight), "outcomes": {}}
        for r in inflight:
            kill["outcomes"][r["outcome"]] = kill["outcomes"].get(r["outcome"], 0) + 1
    return {
        "label": result["label"],
        "kind": fleet["arm"]["kind"],
        "limits": fleet["arm"]["limits"],
        "offered": s["offered"],
        "goodput_rps": s["goodput_rps"],
        # The second half of the arrivals: once a learned limit has had time to converge.
        "goodput_late_rps": goodput(records_of(result), duration / 2, duration),
        "capacity_rps": fleet["capacity_rps"],
        "ok_p50_s": lat["p50"],
        "ok_p99_s": lat["p99"],
        "wasted_share": s["wasted_share"],
        "outcomes": s["outcomes"],
        "statuses": _status_counts(result["records"]),
        "lost": s["lost"],
        "stuck": s["stuck"],
        "engines": {
            name: {k: e[k] for k in ("share", "finished", "max_waiting", "max_running", "killed")}
            for name, e in fleet["engines"].items()
        },
        "max_waiting": fleet["max_waiting"],
        "kill": kill,
        # Whether the machine kept up: how late requests left, and its load while the arm ran.
        "send_lag_p99_s": s["send_lag_s"]["p99"],
        "load_avg_1m": result["config"].get("load_avg_1m"),
    }


def fleet_table(rows: Sequence[dict[str, Any]]) -> str:
    """The comparison as markdown: one line per arm, the best fixed arm in bold."""
    fixed = [r for r in rows if r["kind"] == "fixed"]
    # "Best" only means something in a sweep of two or more fixed limits.
    best = max(fixed, key=lambda r: r["goodput_rps"])["label"] if len(fixed) > 1 else None
    names = list(rows[0]["engines"]) if rows else []

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else fmt.format(v)

    head = (
        "| arm | limits | goodput | 2nd half | ok p50 / p99 | waste | 429 | 504 | gave up | errors | lost "
        + "| share "
        + " / ".join(names)
        + " | max engine queue | send lag p99 | load |"
    )
    lines = [head, "|---" * 15 + "|"]
    for r in rows:
        label = f"**{r['label']}** (best fixed)" if r["label"] == best else r["label"]
        limits = "learned" if r["kind"] == "adaptive" else " / ".join(str(r["limits"][n]) for n in names)
        rate = f"{r['goodput_rps']:.2f} req/s"
        if r["capacity_rps"]:
            rate += f" ({100 * r['goodput_rps'] / r['capacity_rps']:.0f} %)"
        share = " / ".join(
            num(e["share"] and 100 * e["share"], "{:.0f} %") + (" †" if e["killed"] else "")
            for e in r["engines"].values()
        )
        worst = max(r["engines"].items(), key=lambda kv: kv[1]["max_waiting"] or 0)
        queue = f"{worst[1]['max_waiting']:g} ({worst[0]})" if worst[1]["max_waiting"] is not None else "-"
        late = f"{r['goodput_late_rps']:.2f} req/s"
        st = r["statuses"]
        load = "→".join(f"{v:g}" for v in r.get("load_avg_1m") or []) or "-"
        lines.append(
            f"| {label} | {limits} | {rate} | {late} "
            f"| {num(r['ok_p50_s'], '{:.2f}')} / {num(r['ok_p99_s'], '{:.2f}')} s"
            f" | {num(r['wasted_share'] and 100 * r['wasted_share'], '{:.1f} %')} | {st['429']} | {st['504']}"
            f" | {st['gave_up']} | {st['errors']} | {r['lost']} | {share} | {queue}"
            f" | {num(r.get('send_lag_p99_s') and 1000 * r['send_lag_p99_s'], '{:.0f} ms')} | {load} |"
        )
    killed = [r for r in rows if r["kill"]]
    if killed:
        lines += ["", "Engine killed mid-run (†: its share is what it did before it died):", ""]
        for r in killed:
            k = r["kill"]
            outcomes = ", ".join(f"{v} {o}" for o, v in sorted(k["outcomes"].items())) or "none"
            lines.append(
                f"- **{r['label']}**: {k['engine']} SIGKILLed at {k['at_s']:.1f} s; of the {k['in_flight']} "
                f"requests in flight then (on every engine): {outcomes}"
            )
    return "\n".join(lines) + "\n"


# -- plots ---------------------------------------------------------------------------------------


def plot_fleet(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Goodput, latency, each engine's share and the engines' largest queue, per arm."""
    from sluice.bench.report import _pyplot

    plt = _pyplot()
    labels = [r["label"] for r in rows]
    names = list(rows[0]["engines"])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    x = range(len(rows))
    ax = axes[0][0]
    ax.bar(x, [r["goodput_rps"] for r in rows], color="tab:green")
    cap = rows[0]["capacity_rps"]
    if cap:
        ax.axhline(cap, color="black", linestyle=":", label=f"fleet capacity {cap:.2f}/s")
        ax.legend(loc="lower right", fontsize="small")
    ax.set_ylabel("goodput (req/s)")
    ax = axes[0][1]
    width = 0.4
    ax.bar([i - width / 2 for i in x], [r["ok_p50_s"] or 0 for r in rows], width, label="p50")
    ax.bar([i + width / 2 for i in x], [r["ok_p99_s"] or 0 for r in rows], width, label="p99")
    ax.set_ylabel("latency of successes (s)")
    ax.legend(fontsize="small")
    ax = axes[1][0]
    bottom = [0.0] * len(rows)
    for name in names:
        shares = [100 * (r["engines"][name]["share"] or 0) for r in rows]
        ax.bar(x, shares, bottom=bottom, label=name)
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    ax.set_ylabel("share of the tokens generated (%)")
    ax.legend(fontsize="small", loc="lower right")
    ax = axes[1][1]
    for i, name in enumerate(names):
        ax.bar(
            [j + (i - len(names) / 2 + 0.5) * 0.8 / len(names) for j in x],
            [r["engines"][name]["max_waiting"] or 0 for r in rows],
            0.8 / len(names),
            label=name,
        )
    ax.set_ylabel("engine's largest waiting queue")
    ax.legend(fontsize="small")
    for row in axes:
        for a in row:
            a.set_xticks(list(x))
            a.set_xticklabels(labels, rotation=20, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_engines(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Per arm: each engine's answers per second and its waiting queue over time (a kill marked)."""
    from sluice.bench.report import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 2.6 * len(results)), squeeze=False, sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, result in zip(axes, results, strict=True):
        fleet = result["fleet"]
        samples = fleet["samples"]
        for i, name in enumerate(fleet["engines"]):
            pts = [(s["t"], s[name]) for s in samples if name in s]
            color = colors[i % len(colors)]
            rate = [
                (t1, max(0.0, (b["finished"] - a["finished"]) / (t1 - t0)))
                for (t0, a), (t1, b) in itertools.pairwise(pts)
                if t1 > t0 and "finished" in a and "finished" in b
            ]
            smooth = [
                (t, sum(v for _, v in rate[max(0, j - 7) : j + 1]) / len(rate[max(0, j - 7) : j + 1]))
                for j, (t, _) in enumerate(rate)
            ]
            if smooth:
                row[0].plot(*zip(*smooth, strict=True), color=color, label=name)
            waits = [(t, v["waiting"]) for t, v in pts if "waiting" in v]
            if waits:
                row[1].plot(*zip(*waits, strict=True), color=color, label=name)
        for ax in row:
            if fleet.get("killed_at_s") is not None:
                ax.axvline(
                    fleet["killed_at_s"], color="black", linestyle=":", label=f"{fleet['killed']} killed"
                )
            ax.legend(fontsize="x-small", loc="upper right")
        row[0].set_ylabel(f"{result['label']}\nanswers/s (2 s mean)")
        row[1].set_ylabel("engine's waiting queue")
    axes[-1][0].set_xlabel("time since start (s)")
    axes[-1][1].set_xlabel("time since start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_limits(results: Sequence[dict[str, Any]], path: Path) -> None:
    """The Sluice arms' in-flight limit, summed over the fleet, over time, against the batch sizes."""
    from sluice.bench.report import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    batches = None
    for result in results:
        points = [(s["t"], s["slots"]) for s in result["fleet"]["samples"] if "slots" in s]
        if points:
            ax.plot(*zip(*points, strict=True), label=result["label"])
        batches = sum(e["batch"] for e in result["fleet"]["engines"].values())
    if batches:
        ax.axhline(batches, color="black", linestyle=":", label=f"sum of the batch sizes ({batches})")
    ax.set_ylabel("Sluice's in-flight limit,\nsummed over the engines")
    ax.set_xlabel("time since start (s)")
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
