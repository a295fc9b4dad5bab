"""The queue policies over the seeded engine family at a glance: one figure and one table.

    python -m sluice.bench.family_figure                       # seeds 0-159, every policy
    python -m sluice.bench.family_figure --seeds 20 --first-seed 100 --out /tmp/family.png

Runs each policy on each engine of the family (:func:`sluice.bench.engine_family.draw_engine`,
virtual time, deterministic) under policy_model's two loads, scaled to the engine's capacity
(:func:`sluice.bench.policy_model.loads`): the article's spike with 10 % of the refused clients
retrying once, the same spike with every refused client retrying once (the retry wave), and the
standing 1.8x overload. Every run is policy_model's own :func:`sluice.bench.policy_model.run` with
its defaults, so each median here is the one ``python -m sluice.bench.policy_model --engine family``
prints for the same seeds.

It writes one PNG (``--out``; matplotlib from the ``bench`` extra, imported only here) with a
panel per figure, each engine one point, the seeds the defaults were chosen on (0-19, 40-99) drawn
apart from the held-out ones (20-39, 100-159), and prints the same figures as a markdown table
(median, worst, engines meeting the target), so that the docs' table and figure come from one run.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.bench.engine_family import draw_engine, saturated
from sluice.bench.policy_model import loads, run
from sluice.core.policy import POLICIES, make_policy

#: The seeds the defaults were chosen on; every other seed of 0-159 was held out (20-39, 100-159).
CHOSEN_ON = frozenset(range(0, 20)) | frozenset(range(40, 100))

#: The targets (issue 18): the spike's goodput in % of capacity, its waste, the standing
#: overload's ok p99 and goodput, and the share of retries served when every refused client retries.
SPIKE_TARGET = 73.0
WASTE_TARGET = 2.0
P99_TARGET = 5.0
STEADY_TARGET = 98.0
RETRY_TARGET = 90.0


@dataclass(frozen=True)
class EngineFigures:
    """One policy on one engine of the family. Goodput in % of the engine's capacity; the
    retries' shares are ``nan`` where no client was refused."""

    seed: int
    policy: str
    slots: int
    spike_pct: float
    spike_waste: float
    spike_broken: int
    spike_admitted: int
    steady_p99: float
    steady_pct: float
    p99_possible: bool  # one job's p99 in a full batch is within 5 s: an ok p99 of 5 s can be had
    retries_10: int
    retries_ok_10: int
    retries_all: int
    retries_ok_all: int

    @property
    def held_out(self) -> bool:
        return self.seed not in CHOSEN_ON

    @property
    def retry_10_pct(self) -> float:
        return 100 * self.retries_ok_10 / self.retries_10 if self.retries_10 else math.nan

    @property
    def retry_all_pct(self) -> float:
        return 100 * self.retries_ok_all / self.retries_all if self.retries_all else math.nan


def measure(
    seeds: Iterable[int],
    policies: Sequence[str],
    progress: Callable[[str], None] | None = None,
) -> list[EngineFigures]:
    """Every policy on every seed's engine: three runs each (spike at 10 % and 100 % retriers,
    standing overload at 10 %), with policy_model's defaults."""
    seeds = list(seeds)
    out: list[EngineFigures] = []
    for i, seed in enumerate(seeds):
        engine = draw_engine(seed)
        cap, one_p99, full_rate = saturated(engine)
        load = loads(cap)
        steady, spike = load["steady 1.8x"], load["spike 0.55x-5.5x"]
        for name in policies:
            sp = run(make_policy(name), spike, seed, engine=engine, retriers=0.1, full_rate=full_rate)
            wave = run(make_policy(name), spike, seed, engine=engine, retriers=1.0, full_rate=full_rate)
            st = run(make_policy(name), steady, seed, engine=engine, retriers=0.1, full_rate=full_rate)
            out.append(
                EngineFigures(
                    seed=seed,
                    policy=name,
                    slots=engine.slots,
                    spike_pct=100 * sp.goodput / cap,
                    spike_waste=100 * sp.wasted_share,
                    spike_broken=sp.broken,
                    spike_admitted=sp.admitted,
                    steady_p99=st.ok_p99,
                    steady_pct=100 * st.goodput_steady / cap,
                    p99_possible=one_p99 <= P99_TARGET,
                    retries_10=sp.retries,
                    retries_ok_10=sp.retries_ok,
                    retries_all=wave.retries,
                    retries_ok_all=wave.retries_ok,
                )
            )
        if progress:
            progress(f"seed {seed} ({engine.slots} slots): {i + 1} of {len(seeds)}")
    return out


#: The table's and the figure's measures: (title, value, target, higher is better, unit).
MEASURES: list[tuple[str, Callable[[EngineFigures], float], float, bool, str]] = [
    ("spike goodput, % of capacity", lambda f: f.spike_pct, SPIKE_TARGET, True, " %"),
    ("spike waste, % of tokens", lambda f: f.spike_waste, WASTE_TARGET, False, " %"),
    ("standing 1.8x: ok p99", lambda f: f.steady_p99, P99_TARGET, False, " s"),
    ("standing 1.8x: goodput, % of capacity", lambda f: f.steady_pct, STEADY_TARGET, True, " %"),
    ("spike, 10 % retry: retries served", lambda f: f.retry_10_pct, RETRY_TARGET, True, " %"),
    ("spike, all retry: retries served", lambda f: f.retry_all_pct, RETRY_TARGET, True, " %"),
]


def _met(value: float, target: float, higher: bool) -> bool:
    return value >= target if higher else value <= target


def table(figures: Sequence[EngineFigures]) -> str:
    """The markdown table: per policy and measure, the median over the engines, the worst, and
    how many engines meet the target (of them, held out); the retries' rows also the share over
    all the engines' retries pooled (policy_model's figure)."""
    lines = [
        "| policy | measure (target) | median | worst | engines at target | held out at target |",
        "|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(f.policy for f in figures):
        own = [f for f in figures if f.policy == name]
        for title, value, target, higher, unit in MEASURES:
            pairs = [(f, value(f)) for f in own if not math.isnan(value(f))]
            if not pairs:
                continue
            values = [v for _, v in pairs]
            worst = min(values) if higher else max(values)
            held = [(f, v) for f, v in pairs if f.held_out]
            met = sum(1 for v in values if _met(v, target, higher))
            held_met = sum(1 for _, v in held if _met(v, target, higher))
            mark = "≥" if higher else "≤"
            extra = ""
            if title.startswith("standing 1.8x: ok p99"):
                possible = [(f, v) for f, v in pairs if f.p99_possible]
                extra = f" ({sum(1 for _, v in possible if v <= target)} of {len(possible)} where it can be)"
            elif "retries served" in title:
                attr = "10" if "10 %" in title else "all"
                tried = sum(getattr(f, f"retries_{attr}") for f in own)
                ok = sum(getattr(f, f"retries_ok_{attr}") for f in own)
                extra = f" (pooled {100 * ok / tried:.1f} % of {tried:,})" if tried else ""
            lines.append(
                f"| {name} | {title} ({mark} {target:g}{unit}) "
                f"| {statistics.median(values):.1f}{unit} | {worst:.1f}{unit} "
                f"| {met} of {len(values)}{extra} | {f'{held_met} of {len(held)}' if held else '-'} |"
            )
        broken = sum(f.spike_broken for f in own)
        admitted = sum(f.spike_admitted for f in own)
        lines.append(f"| {name} | spike: broken promises (0) | | | {broken:,} of {admitted:,} admitted | |")
    return "\n".join(lines)


#: The panels' y range where a few engines lie far off (the rest would be squeezed): points beyond
#: it are drawn at its edge as triangles, and counted in the panel's corner.
_YLIM: dict[str, tuple[float, float]] = {"standing 1.8x: goodput, % of capacity": (78.0, 142.0)}


def _target_line(ax: Any, target: float, label: str, right: float) -> None:
    """The target as a dashed line, labelled in the margin right of the last policy's points."""
    ax.axhline(target, color="tab:red", linestyle="--", linewidth=1.2, zorder=2)
    ax.annotate(
        label,
        xy=(right, target),
        xytext=(0, 3),
        textcoords="offset points",
        ha="right",
        color="tab:red",
        fontsize=9,
    )


def _strip(
    ax: Any,
    x: float,
    points: Sequence[tuple[bool, float]],
    colour: str,
    width: float,
    jitter: random.Random,
    ylim: tuple[float, float] | None,
) -> list[float]:
    """One box of values at ``x`` and each engine's point (held out filled, chosen on hollow);
    the points beyond ``ylim`` drawn at its edge. Returns their values."""
    ax.boxplot(
        [v for _, v in points],
        positions=[x],
        widths=width,
        showfliers=False,
        medianprops={"color": "black", "linewidth": 1.5},
        boxprops={"color": colour},
        whiskerprops={"color": colour},
        capprops={"color": colour},
    )
    beyond: list[float] = []
    for held in (False, True):
        style = {"c": colour} if held else {"facecolors": "none", "edgecolors": colour}
        vals = [v for h, v in points if h == held]
        inside = [v for v in vals if ylim is None or ylim[0] <= v <= ylim[1]]
        xs = [x + jitter.uniform(-width / 2.4, width / 2.4) for _ in inside]
        ax.scatter(xs, inside, s=10, alpha=0.7, linewidths=0.8, zorder=3, **style)
        if ylim is not None:
            far = [v for v in vals if not ylim[0] <= v <= ylim[1]]
            beyond += far
            out = [min(max(v, ylim[0]), ylim[1]) for v in far]
            ax.scatter(
                [x] * len(out),
                out,
                s=30,
                marker="^" if out and out[0] >= ylim[1] else "v",
                zorder=3,
                clip_on=False,
                **style,
            )
    return beyond


def plot(figures: Sequence[EngineFigures], path: Path, title: str = "") -> None:
    """The figure: one panel per measure, a box and each engine's point per policy (held-out
    seeds filled, the seeds the defaults were chosen on hollow), the target as a labelled line.
    Saved as a PNG of at most 256 colours (the points' blending would make it a few times larger)."""
    import io

    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from PIL import Image

    names = list(dict.fromkeys(f.policy for f in figures))
    right = len(names) - 1 + 0.9  # the margin right of the last policy holds the targets' labels
    fig, axes = plt.subplots(2, 3, figsize=(15, 9), dpi=100)
    jitter = random.Random(0)
    for ax, (label, value, target, higher, unit) in zip(axes.flat, MEASURES[:4], strict=False):
        ylim = _YLIM.get(label)
        beyond: list[float] = []
        for i, name in enumerate(names):
            own = [(f.held_out, value(f)) for f in figures if f.policy == name and not math.isnan(value(f))]
            beyond += _strip(ax, i, own, "tab:blue", 0.55, jitter, ylim)
        if ylim is not None:
            ax.set_ylim(*ylim)
            if beyond:
                ax.text(
                    0.99,
                    0.01,
                    f"{len(beyond)} beyond the axis ({', '.join(f'{v:.0f}' for v in sorted(beyond))}{unit}), "
                    "drawn at its edge",
                    transform=ax.transAxes,
                    ha="right",
                    va="bottom",
                    fontsize=8,
                    color="0.3",
                )
        _target_line(ax, target, f"{'≥' if higher else '≤'} {target:g}{unit}", right)
        ax.set_xlim(-0.6, right)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(label, fontsize=11)
        ax.set_ylabel(unit.strip())
        ax.grid(axis="y", alpha=0.3)

    # The retry wave: each policy's engines with 10 % of the refused clients retrying beside all.
    ax = axes.flat[4]
    for i, name in enumerate(names):
        mine = [f for f in figures if f.policy == name]
        for dx, value, colour in ((-0.2, MEASURES[4][1], "tab:green"), (0.2, MEASURES[5][1], "tab:purple")):
            _strip(
                ax,
                i + dx,
                [(f.held_out, value(f)) for f in mine if not math.isnan(value(f))],
                colour,
                0.32,
                jitter,
                None,
            )
    _target_line(ax, RETRY_TARGET, f"≥ {RETRY_TARGET:g} %", right)
    ax.set_xlim(-0.6, right)
    ax.set_xticks(range(len(names)), names)
    ax.set_title("spike: retries served, 10 % retry beside all retry", fontsize=11)
    ax.set_ylabel("%")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(
        handles=[
            Line2D(
                [], [], color="tab:green", lw=6, alpha=0.6, label="10 % of the refused clients retry once"
            ),
            Line2D([], [], color="tab:purple", lw=6, alpha=0.6, label="every refused client retries once"),
        ],
        loc="lower right",
        fontsize=8,
    )

    # The key, and what a point is.
    key = axes.flat[5]
    key.axis("off")
    seeds = sorted({f.seed for f in figures})
    n_held = sum(1 for s in seeds if s not in CHOSEN_ON)
    key.legend(
        handles=[
            Line2D(
                [],
                [],
                marker="o",
                ls="",
                mfc="none",
                mec="tab:blue",
                label="an engine the defaults were chosen on",
            ),
            Line2D([], [], marker="o", ls="", color="tab:blue", label="a held-out engine"),
            Line2D([], [], color="tab:red", ls="--", label="the target (issue 18)"),
            Line2D([], [], color="black", label="median; box: quartiles; whiskers: 1.5 IQR"),
        ],
        loc="upper left",
        fontsize=10,
        frameon=False,
    )
    key.text(
        0.0,
        0.42,
        f"One point per engine and policy: {len(seeds)} engines\n"
        f"(seeds {seeds[0]}-{seeds[-1]}, {n_held} of them held out), virtual time\n"
        "(policy_model), the loads scaled to each engine's capacity.\n"
        "Defaults chosen on seeds 0-19 and 40-99; held out: 20-39, 100-159.\n"
        "Spike and standing overload with 10 % of the refused clients\nretrying once; the retry panel's "
        "purple: every refused client.",
        fontsize=9,
        va="top",
        transform=key.transAxes,
    )
    if title:
        fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format="png")
    plt.close(fig)
    buf.seek(0)
    with Image.open(buf) as image:
        image.convert("RGB").quantize(colors=256).save(path, optimize=True)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m sluice.bench.family_figure",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--seeds", type=int, default=160, help="engines of the family (160)")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds FIRST .. FIRST+N-1 (0)")
    ap.add_argument("--policy", action="append", choices=sorted(POLICIES), help="repeatable (all)")
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("docs/benchmarks/img/family-policies.png"),
        help="the PNG (docs/benchmarks/img/family-policies.png)",
    )
    ap.add_argument("--no-plot", action="store_true", help="the table only (no matplotlib needed)")
    args = ap.parse_args(argv)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    policies = args.policy or list(POLICIES)
    figures = measure(seeds, policies, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"Seeds {seeds.start}..{seeds.stop - 1}, each engine once per policy and load (virtual time).\n")
    print(table(figures))
    if not args.no_plot:
        plot(
            figures,
            args.out,
            title=f"The queue policies over the engine family (seeds {seeds.start}-{seeds.stop - 1})",
        )
        print(f"\nWrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
