"""The rows of :mod:`sluice.bench.overhead` and their report: one :class:`Row` per measured window,
the Markdown tables (one per group) with the figures derived from several rows (CPU per extra
streamed token, per refusal), and the plot.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sluice.bench.overhead_load import Load, Window

GROUPS = ("closed", "stream", "flood", "scaling", "clients")


def _quantile_ms(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


@dataclass(frozen=True, slots=True)
class Row:
    """One measured window, in the units the tables print.

    ``group`` and ``name``: which table and which line. ``command``: what served the requests.
    ``connections``, ``max_tokens``, ``stream``: the load. ``seconds``: the window's length.
    ``answers``, ``refusals``, ``errors``, ``tokens``: counts inside the window. ``p50_ms``,
    ``p99_ms``: latency of the answers; ``ttft_p50_ms``: their time to the first token;
    ``refusal_p50_ms``, ``refusal_p99_ms``: latency of the refusals. ``cpu_s``: CPU seconds per
    role (``gateway``: the process or processes in front of the engine; ``workers``; ``redis``;
    ``engine``; ``load``: the load generator), None where it could not be read. ``load_average``:
    the machine's 1, 5 and 15 minute load averages as the window began.
    ``syscalls_per_response``: with ``--syscalls``, each counted system call's calls per response
    (over the warm-up and the window, the responses of both taken at the window's rate); None where
    none were counted.
    """

    group: str
    name: str
    command: str
    connections: int
    max_tokens: int
    stream: bool
    seconds: float
    answers: int
    refusals: int
    errors: int
    tokens: int
    p50_ms: float | None
    p99_ms: float | None
    ttft_p50_ms: float | None
    refusal_p50_ms: float | None
    refusal_p99_ms: float | None
    cpu_s: dict[str, float | None]
    load_average: tuple[float, float, float]
    syscalls_per_response: dict[str, float] | None = None

    @property
    def answers_per_s(self) -> float:
        return self.answers / self.seconds

    @property
    def refusals_per_s(self) -> float:
        return self.refusals / self.seconds

    def cpu_ms_per_request(self, role: str) -> float | None:
        """CPU of ``role`` per answer or refusal, in milliseconds."""
        cpu, done = self.cpu_s.get(role), self.answers + self.refusals
        return None if cpu is None or not done else cpu / done * 1000

    def cpu_us_per_token(self, role: str) -> float | None:
        cpu = self.cpu_s.get(role)
        return None if cpu is None or not self.tokens else cpu / self.tokens * 1e6

    def cores(self, role: str) -> float | None:
        """How many cores ``role`` kept busy on average (1.0: one core all the time)."""
        cpu = self.cpu_s.get(role)
        return None if cpu is None else cpu / self.seconds

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        roles = list(self.cpu_s)
        data["answers_per_s"] = self.answers_per_s
        data["refusals_per_s"] = self.refusals_per_s
        data["cpu_ms_per_request"] = {r: self.cpu_ms_per_request(r) for r in roles}
        data["cpu_us_per_token"] = {r: self.cpu_us_per_token(r) for r in roles}
        data["cores"] = {r: self.cores(r) for r in roles}
        return data


def make_row(group: str, name: str, command: str, load: Load, window: Window) -> Row:
    tally = window.tally
    cpu: dict[str, float | None] = {}
    for role, after in window.cpu_after.items():
        before = window.cpu_before.get(role)
        cpu[role] = None if after is None or before is None else after - before
    return Row(
        group=group,
        name=name,
        command=command,
        connections=load.connections,
        max_tokens=load.max_tokens,
        stream=load.stream,
        seconds=window.seconds,
        answers=len(tally.answered),
        refusals=len(tally.refused),
        errors=tally.errors,
        tokens=tally.tokens,
        p50_ms=_quantile_ms(tally.answered, 0.5),
        p99_ms=_quantile_ms(tally.answered, 0.99),
        ttft_p50_ms=_quantile_ms(tally.ttft, 0.5),
        refusal_p50_ms=_quantile_ms(tally.refused, 0.5),
        refusal_p99_ms=_quantile_ms(tally.refused, 0.99),
        cpu_s=cpu,
        load_average=os.getloadavg(),
    )


def _f(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _pair(a: float | None, b: float | None, digits: int = 1) -> str:
    return f"{_f(a, digits)} / {_f(b, digits)}"


def _load_average(row: Row) -> str:
    return " ".join(f"{x:.1f}" for x in row.load_average)


Column = tuple[str, Callable[[Row], str]]

COLUMNS: dict[str, list[Column]] = {
    "closed": [
        ("answers/s", lambda r: _f(r.answers_per_s, 0)),
        ("p50 / p99 ms", lambda r: _pair(r.p50_ms, r.p99_ms)),
        ("gateway CPU ms/req", lambda r: _f(r.cpu_ms_per_request("gateway"))),
        ("engine CPU ms/req", lambda r: _f(r.cpu_ms_per_request("engine"))),
        ("load gen CPU ms/req", lambda r: _f(r.cpu_ms_per_request("load"))),
        ("gateway cores", lambda r: _f(r.cores("gateway"))),
        ("errors", lambda r: str(r.errors)),
        ("load avg", _load_average),
    ],
    "stream": [
        ("answers/s", lambda r: _f(r.answers_per_s, 0)),
        ("tokens/s", lambda r: _f(r.tokens / r.seconds, 0)),
        ("TTFT p50 ms", lambda r: _f(r.ttft_p50_ms)),
        ("p50 / p99 ms", lambda r: _pair(r.p50_ms, r.p99_ms)),
        ("gateway CPU ms/req", lambda r: _f(r.cpu_ms_per_request("gateway"))),
        ("gateway CPU µs/token", lambda r: _f(r.cpu_us_per_token("gateway"), 0)),
        ("engine CPU ms/req", lambda r: _f(r.cpu_ms_per_request("engine"))),
        ("gateway cores", lambda r: _f(r.cores("gateway"))),
        ("load avg", _load_average),
    ],
    "flood": [
        ("answers/s", lambda r: _f(r.answers_per_s, 0)),
        ("refusals/s", lambda r: _f(r.refusals_per_s, 0)),
        ("answer p50 / p99 ms", lambda r: _pair(r.p50_ms, r.p99_ms, 0)),
        ("refusal p50 / p99 ms", lambda r: _pair(r.refusal_p50_ms, r.refusal_p99_ms)),
        ("gateway CPU ms/response", lambda r: _f(r.cpu_ms_per_request("gateway"))),
        ("gateway cores", lambda r: _f(r.cores("gateway"))),
        ("workers cores", lambda r: _f(r.cores("workers"))),
        ("errors", lambda r: str(r.errors)),
        ("load avg", _load_average),
    ],
    "scaling": [
        ("answers/s", lambda r: _f(r.answers_per_s, 0)),
        ("p50 / p99 ms", lambda r: _pair(r.p50_ms, r.p99_ms)),
        ("gateways CPU ms/req", lambda r: _f(r.cpu_ms_per_request("gateway"))),
        ("workers CPU ms/req", lambda r: _f(r.cpu_ms_per_request("workers"))),
        ("redis CPU ms/req", lambda r: _f(r.cpu_ms_per_request("redis"))),
        ("engine CPU ms/req", lambda r: _f(r.cpu_ms_per_request("engine"))),
        ("gateways + workers cores", lambda r: _f((r.cores("gateway") or 0) + (r.cores("workers") or 0))),
        ("answers/s per gateway core", lambda r: _f(per_gateway_core(r), 0)),
        ("errors", lambda r: str(r.errors)),
        ("load avg", _load_average),
    ],
}

COLUMNS["clients"] = [
    ("answers/s", lambda r: _f(r.answers_per_s, 0)),
    ("p50 / p99 ms", lambda r: _pair(r.p50_ms, r.p99_ms)),
    ("client CPU ms/req", lambda r: _f(r.cpu_ms_per_request("load"))),
    ("engine CPU ms/req", lambda r: _f(r.cpu_ms_per_request("engine"))),
    ("client cores", lambda r: _f(r.cores("load"))),
    ("errors", lambda r: str(r.errors)),
    ("load avg", _load_average),
]

TITLES = {
    "closed": "Closed loop, short non-streaming requests",
    "stream": "Streamed",
    "flood": "Flood: in front of a saturated 16-sequence engine",
    "scaling": "Gateways on Redis",
    "clients": "The HTTP client to the engine alone",
}


def per_gateway_core(row: Row) -> float | None:
    """Answers per second for each core the gateways kept busy: what one gateway process would
    pass with a core to itself, at the CPU per request it was measured at (None: no CPU read)."""
    cores = row.cores("gateway")
    return row.answers_per_s / cores if cores else None


def scaling_curve(rows: Sequence[Row]) -> dict[str, dict[str, float]]:
    """Per ``scaling`` row (N gateways on one Redis): answers/s per gateway core, that figure
    against the single gateway's (1.0: each core passes as much as the one gateway's did; below:
    the gateways cost more per request as they are added, from the Redis they share or from the
    machine), and how many answers/s Redis's own CPU per request leaves room for on one core
    (the ceiling shared by any number of gateways)."""
    found: dict[str, dict[str, float]] = {}
    first: float | None = None
    for row in rows:
        rate = per_gateway_core(row) if row.group == "scaling" else None
        if rate is None:
            continue
        first = rate if first is None else first
        point = {"per_gateway_core": rate, "against_one": rate / first}
        redis = row.cpu_ms_per_request("redis")
        if redis:
            point["redis_ceiling"] = 1000 / redis
        found[row.name] = point
    return found


def per_token_us(rows: Sequence[Row]) -> dict[str, float]:
    """Per target: gateway CPU per extra streamed token (µs), from its two streamed rows."""
    found: dict[str, float] = {}
    by_target: dict[str, list[Row]] = {}
    for row in rows:
        if row.group == "stream":
            by_target.setdefault(row.name.split(" streamed ")[0], []).append(row)
    for target, pair in by_target.items():
        if len(pair) != 2:
            continue
        short, long = sorted(pair, key=lambda r: r.max_tokens)
        a, b = short.cpu_ms_per_request("gateway"), long.cpu_ms_per_request("gateway")
        if a is not None and b is not None and long.max_tokens > short.max_tokens:
            found[target] = (b - a) / (long.max_tokens - short.max_tokens) * 1000
    return found


def refusal_ms(rows: Sequence[Row]) -> dict[str, float]:
    """Per flooded gateway: CPU per refusal (ms), its answers' share taken out at their closed-loop cost."""
    closed = {r.name: r for r in rows if r.group == "closed"}
    found: dict[str, float] = {}
    for row in rows:
        target = row.name.removesuffix(" flooded")
        cpu = row.cpu_s.get("gateway")
        if row.group != "flood" or cpu is None or not row.refusals or target not in closed:
            continue
        per_answer = closed[target].cpu_ms_per_request("gateway")
        if per_answer is not None:
            found[target] = (cpu * 1000 - row.answers * per_answer) / row.refusals
    return found


def table(rows: Sequence[Row]) -> str:
    """The rows as Markdown tables, one per group, with the derived figures below them."""
    out: list[str] = []
    for group in GROUPS:
        chosen = [r for r in rows if r.group == group]
        if not chosen:
            continue
        columns = COLUMNS[group]
        load = chosen[0]
        out.append(f"{TITLES[group]} ({load.connections} connections, {load.seconds:.0f} s each)\n")
        out.append("| row | " + " | ".join(h for h, _ in columns) + " |")
        out.append("|---" * (len(columns) + 1) + "|")
        out.extend("| " + r.name + " | " + " | ".join(fn(r) for _, fn in columns) + " |" for r in chosen)
        if group == "stream":
            for target, us in per_token_us(rows).items():
                out.append(f"\n{target}: {us:,.0f} µs of gateway CPU per extra streamed token")
        if group == "flood":
            for target, ms in refusal_ms(rows).items():
                out.append(f"\n{target}: {ms:.2f} ms of gateway CPU per refusal (answers' share taken out)")
        if group == "scaling":
            for name, point in scaling_curve(rows).items():
                ceiling = point.get("redis_ceiling")
                out.append(
                    f"\n{name}: {point['per_gateway_core']:,.0f} answers/s per gateway core, "
                    f"{point['against_one']:.2f} of the first row's"
                    + (f"; Redis's CPU leaves room for {ceiling:,.0f}/s on its one core" if ceiling else "")
                )
        out.append("")
    return "\n".join(out)


def plot(rows: Sequence[Row], path: Path) -> None:
    """Answers/s and gateway CPU per request of the closed-loop rows, and the scaling curve."""
    from sluice.bench.report import _pyplot

    plt = _pyplot()
    closed = [r for r in rows if r.group == "closed"]
    scaling = [r for r in rows if r.group == "scaling"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = [r.name for r in closed]
    axes[0].bar(names, [r.answers_per_s for r in closed], color="tab:blue")
    axes[0].set_title("answers/s, closed loop")
    axes[1].bar(names, [r.cpu_ms_per_request("gateway") or 0 for r in closed], color="tab:orange")
    axes[1].set_title("gateway CPU ms per request")
    # A scaling row's name starts with its gateway count ("2 gateways on Redis").
    counts = [int(r.name.split()[0]) for r in scaling]
    axes[2].plot(counts, [r.answers_per_s for r in scaling], marker="o", label="answers/s")
    per_core = [per_gateway_core(r) or 0 for r in scaling]
    axes[2].plot(counts, per_core, marker="s", label="answers/s per gateway core")
    axes[2].legend()
    axes[2].set_ylim(bottom=0)
    axes[2].set_xticks(counts)
    axes[2].set_title("gateways on Redis")
    axes[2].set_xlabel("gateways (+ as many workers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
