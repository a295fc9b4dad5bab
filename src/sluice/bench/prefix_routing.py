"""Prefix-cache affinity against least-loaded routing: ``python -m sluice.bench.prefix_routing``.

A shared-prefix workload: a few long system prompts, and many users who each chat with one of them
about a document of their own (the first message), one turn after another, each turn resending the
whole conversation as chat clients do. The engines are real ``sluice sim`` processes with the
prefix cache on (``--prefix-cache-tokens``), behind a real ``sluice serve`` process, once per
routing mode, each mode with fresh engines (empty caches) and the same seeded arrivals:

* ``least-loaded``: ``routing = "least_loaded"``, ``prefix_affinity = false``: the most free room;
* ``predicted``: ``routing = "predicted"``, no affinity: the soonest predicted completion;
* ``affinity``: ``routing = "predicted"``, ``prefix_affinity = true``: a conversation's prefix
  (its system prompt and first message) has a home engine while its load allows.

A gateway whose configuration has no ``routing`` setting yet is run as ``least-loaded`` only
(``[[backends]]``). Each mode reports the engines' prefix-cache hit rate (their
``vllm:prefix_cache_hits_total / _queries_total``), TTFT p50/p90 (streamed, at the client),
end-to-end p50/p90 and goodput: answers whose first token came within ``--ttft-slo`` and that
finished, per second from the first request to the last answer. The report goes to stdout and
``--out`` as JSON; docs/routing.md has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["MODES", "Workload", "conversation_plan", "main", "run_bench", "run_mode"]

#: mode -> the gateway settings it sets (None: the gateway default for that setting)
MODES: dict[str, dict[str, Any]] = {
    "least-loaded": {"routing": "least_loaded", "prefix_affinity": False},
    "predicted": {"routing": "predicted", "prefix_affinity": False},
    "affinity": {"routing": "predicted", "prefix_affinity": True},
}

_WORDS = (
    "policy",
    "claim",
    "account",
    "refund",
    "invoice",
    "shipment",
    "warranty",
    "contract",
    "renewal",
    "clause",
    "audit",
    "ledger",
    "tariff",
    "region",
    "quota",
    "incident",
    "outage",
    "backlog",
    "release",
    "rollout",
    "schema",
    "index",
    "replica",
    "shard",
    "latency",
    "budget",
    "forecast",
    "margin",
    "vendor",
    "supplier",
    "order",
    "return",
    "credit",
    "balance",
    "statement",
)


@dataclass(frozen=True, slots=True)
class Workload:
    """The shared-prefix workload, seeded.

    Attributes:
        systems: distinct system prompts.
        system_tokens: estimated tokens of each system prompt.
        doc_tokens: estimated tokens of the document in each conversation's first message.
        turn_tokens: estimated tokens of each later user message.
        turns: turns of each conversation.
        conversations: conversations in the run.
        rate: conversations started per second (Poisson arrivals).
        think_s: mean pause (exponential) between an answer and the user's next turn.
        max_tokens: answer length of every turn.
        seed: the seed of every random draw (the same arrivals in every mode).
    """

    systems: int = 8
    system_tokens: int = 1000
    doc_tokens: int = 500
    turn_tokens: int = 60
    turns: int = 4
    conversations: int = 120
    rate: float = 1.5
    think_s: float = 1.0
    max_tokens: int = 32
    seed: int = 1


def _text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of words (the estimate's four characters a token)."""
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


@dataclass(slots=True)
class Conversation:
    """One user's chat: when it starts, its system prompt, its messages' texts and its pauses."""

    index: int
    start_s: float
    system: int
    first: str
    later: list[str]
    pauses: list[float]


def conversation_plan(w: Workload) -> tuple[list[str], list[Conversation]]:
    """The system prompts and the conversations, all drawn from ``w.seed``."""
    rng = random.Random(w.seed)
    systems = [
        f"System prompt {i}: you are the assistant of department {i}. " + _text(rng, w.system_tokens)
        for i in range(w.systems)
    ]
    t = 0.0
    plan = []
    for i in range(w.conversations):
        t += rng.expovariate(w.rate)
        plan.append(
            Conversation(
                index=i,
                start_s=t,
                system=rng.randrange(w.systems),
                first=f"User {i} shares a document. " + _text(rng, w.doc_tokens),
                later=[_text(rng, w.turn_tokens) for _ in range(w.turns - 1)],
                pauses=[rng.expovariate(1 / w.think_s) if w.think_s > 0 else 0.0 for _ in range(w.turns)],
            )
        )
    return systems, plan


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it."""

    conversation: int
    turn: int
    status: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None


async def _one_turn(
    http: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]], w: Workload
) -> tuple[Outcome, str]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": w.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    out = Outcome(-1, -1, 0)
    text: list[str] = []
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
            out.status = response.status_code
            if response.status_code != 200:
                out.error = (await response.aread()).decode(errors="replace")[:200]
                return out, ""
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if out.ttft_s is None:
                            out.ttft_s = time.monotonic() - t0
                        text.append(piece)
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens")
                    out.prompt_tokens = usage.get("prompt_tokens")
        out.e2e_s = time.monotonic() - t0
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out, "".join(text)


async def _conversation(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    system: str,
    c: Conversation,
    w: Workload,
    t0: float,
    outcomes: list[Outcome],
) -> None:
    await asyncio.sleep(max(0.0, t0 + c.start_s - time.monotonic()))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": c.first}]
    for turn in range(w.turns):
        out, answer = await _one_turn(http, url, model, messages, w)
        out.conversation, out.turn = c.index, turn
        outcomes.append(out)
        if out.status != 200 or turn + 1 >= w.turns:
            return  # a failed turn ends the conversation (the user gives up)
        messages = [*messages, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": c.later[turn]})
        await asyncio.sleep(c.pauses[turn])


async def drive(url: str, model: str, w: Workload, timeout_s: float) -> tuple[list[Outcome], float]:
    """Run the workload against ``url``; the outcomes and the seconds from first request to last
    answer."""
    systems, plan = conversation_plan(w)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10), limits=limits) as http:
        t0 = time.monotonic()
        tasks = [
            asyncio.create_task(_conversation(http, url, model, systems[c.system], c, w, t0, outcomes))
            for c in plan
        ]
        try:
            async with asyncio.timeout(timeout_s + plan[-1].start_s + w.turns * (w.think_s * 5 + 1)):
                await asyncio.gather(*tasks)
        except TimeoutError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return outcomes, time.monotonic() - t0


# -- processes -----------------------------------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the process serving {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up within {timeout:g} s")


def _cli(*args: str, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen[bytes]:
    sink = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", *args],
        env={**os.environ, **(env or {})},
        stdout=sink,
        stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
    )


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def gateway_settings() -> set[str]:
    """The settings this gateway knows (the routing ones arrive with the fleet)."""
    from sluice.config import Settings

    return set(Settings.model_fields)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


def gateway_config(mode: str, engines: list[str], slots: int, model: str) -> str:
    """The TOML of ``sluice serve`` for one mode: the engines as ``[[backends]]`` of a fixed limit,
    and the mode's routing settings where the gateway has them."""
    known = gateway_settings()
    lines = ["default_timeout_s = 120", "max_timeout_s = 120"]
    for key, value in MODES[mode].items():
        if key in known:
            lines.append(f"{key} = {_toml(value)}")
    # [[backends]] with a fixed limit each, in every mode, so that only the routing differs.
    for i, url in enumerate(engines):
        lines += ["", "[[backends]]", f'name = "sim{i}"', f"url = {_toml(url)}"]
        lines += [f"models = [{_toml(model)}]", f"max_concurrency = {slots}"]
    return "\n".join(lines) + "\n"


def modes_available() -> list[str]:
    """The modes this gateway can run: all of them once it has the routing settings."""
    known = gateway_settings()
    if {"routing", "prefix_affinity"} <= known:
        return list(MODES)
    return ["least-loaded"]


def _metric_sums(text: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    return sums


@dataclass(slots=True)
class EngineArgs:
    """How each simulated engine runs (``sluice sim`` flags)."""

    engines: int = 3
    preset: str = "article"
    slots: int = 8
    prefill_ms_per_token: float = 0.3
    prefix_cache_tokens: int = 16_384
    extra: list[str] = field(default_factory=list)


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def summarise(
    mode: str, outcomes: list[Outcome], elapsed: float, engines: list[dict[str, Any]], ttft_slo: float
) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == 200 and o.e2e_s is not None and o.ttft_s is not None]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    e2e = [o.e2e_s for o in ok if o.e2e_s is not None]
    good = [o for o in ok if o.ttft_s is not None and o.ttft_s <= ttft_slo]
    queries = sum(e["prefix_cache_queries"] for e in engines)
    hits = sum(e["prefix_cache_hits"] for e in engines)
    statuses: dict[str, int] = {}
    for o in outcomes:
        key = str(o.status) if o.status else "error"
        statuses[key] = statuses.get(key, 0) + 1

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    # Per turn, from the answers' usage.prompt_tokens_details.cached_tokens (where the gateway
    # passes it on): the first turn can hit only the system prompt, later ones the conversation.
    by_turn: dict[str, float] = {}
    for turn in sorted({o.turn for o in ok}):
        rows = [o for o in ok if o.turn == turn and o.cached_tokens is not None and o.prompt_tokens]
        if rows:
            cached = sum(o.cached_tokens or 0 for o in rows)
            by_turn[str(turn + 1)] = round(cached / sum(o.prompt_tokens or 0 for o in rows), 4)

    return {
        "mode": mode,
        "requests": len(outcomes),
        "ok": len(ok),
        "statuses": statuses,
        "errors": sorted({o.error for o in outcomes if o.error})[:3],
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        "prefix_cache_hits": int(hits),
        "prefix_cache_queries": int(queries),
        "hit_rate_by_turn": by_turn,
        "ttft_p50_s": r(_quantile(ttft, 0.5)),
        "ttft_p90_s": r(_quantile(ttft, 0.9)),
        "e2e_p50_s": r(_quantile(e2e, 0.5)),
        "e2e_p90_s": r(_quantile(e2e, 0.9)),
        "ttft_slo_s": ttft_slo,
        "good": len(good),
        "goodput_rps": round(len(good) / elapsed, 4) if elapsed > 0 else 0.0,
        "elapsed_s": round(elapsed, 2),
        "engines": engines,
    }


def run_mode(
    mode: str,
    w: Workload,
    e: EngineArgs,
    *,
    ttft_slo: float = 2.0,
    timeout_s: float = 120.0,
    logs: Path | None = None,
) -> dict[str, Any]:
    """Fresh engines and a fresh gateway, the workload through it, the report of one mode."""
    model = "sim"
    procs: list[subprocess.Popen[bytes]] = []
    workdir = Path(tempfile.mkdtemp(prefix="sluice-prefix-bench-"))
    try:
        engines = []
        for i in range(e.engines):
            port = _port()
            url = f"http://127.0.0.1:{port}"
            args = ["sim", "--preset", e.preset, "--port", str(port), "--model", model]
            args += ["--max-num-seqs", str(e.slots), "--prefill-ms-per-token", str(e.prefill_ms_per_token)]
            args += ["--prefix-cache-tokens", str(e.prefix_cache_tokens), *e.extra]
            proc = _cli(*args, log=logs / f"{mode}-sim{i}.log" if logs else None)
            procs.append(proc)
            engines.append((url, proc))
        for url, proc in engines:
            _wait(url + "/v1/models", proc)
        config = workdir / "sluice.toml"
        config.write_text(gateway_config(mode, [u for u, _ in engines], e.slots, model))
        port = _port()
        gateway = f"http://127.0.0.1:{port}"
        env = {"SLUICE_LOG_LEVEL": "warning", "SLUICE_FILES_DIR": str(workdir / "files")}
        serve = _cli(
            "serve", "--config", str(config), "--port", str(port), env=env,
            log=logs / f"{mode}-serve.log" if logs else None,
        )  # fmt: skip
        procs.append(serve)
        _wait(gateway + "/readyz", serve)
        outcomes, elapsed = asyncio.run(drive(gateway, model, w, timeout_s))
        per_engine = []
        for i, (url, _) in enumerate(engines):
            sums = _metric_sums(httpx.get(url + "/metrics", timeout=10).text)
            per_engine.append(
                {
                    "engine": f"sim{i}",
                    "requests": sums.get("vllm:request_success_total", 0.0),
                    "prefix_cache_queries": sums.get("vllm:prefix_cache_queries_total", 0.0),
                    "prefix_cache_hits": sums.get("vllm:prefix_cache_hits_total", 0.0),
                    "prompt_tokens": sums.get("vllm:prompt_tokens_total", 0.0),
                }
            )
        return summarise(mode, outcomes, elapsed, per_engine, ttft_slo)
    finally:
        _stop(procs)


def run_bench(
    modes: Sequence[str], w: Workload, e: EngineArgs, *, ttft_slo: float, timeout_s: float, logs: Path | None
) -> dict[str, Any]:
    rows = []
    for mode in modes:
        row = run_mode(mode, w, e, ttft_slo=ttft_slo, timeout_s=timeout_s, logs=logs)
        print(json.dumps({k: v for k, v in row.items() if k != "engines"}), flush=True)
        rows.append(row)
    return {"workload": asdict(w), "engines": asdict(e), "modes": rows}


def table(report: dict[str, Any]) -> str:
    """The report as a Markdown table."""
    head = (
        "| mode | hit rate | TTFT p50 | TTFT p90 | e2e p50 | e2e p90 | goodput (req/s) | ok / sent |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |"
    )

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    rows = [
        f"| {r['mode']} | {r['hit_rate']:.1%} | {s(r['ttft_p50_s'])} | {s(r['ttft_p90_s'])} | "
        f"{s(r['e2e_p50_s'])} | {s(r['e2e_p90_s'])} | {r['goodput_rps']:.2f} | {r['ok']} / {r['requests']} |"
        for r in report["modes"]
    ]
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d, de = Workload(), EngineArgs()
    p.add_argument("--modes", default="all", help="comma-separated modes (%(default)s: every available)")
    p.add_argument("--engines", type=int, default=de.engines)
    p.add_argument("--preset", default=de.preset)
    p.add_argument("--slots", type=int, default=de.slots, help="each engine's max_num_seqs and fixed limit")
    p.add_argument("--prefill-ms-per-token", type=float, default=de.prefill_ms_per_token)
    p.add_argument("--prefix-cache-tokens", type=int, default=de.prefix_cache_tokens)
    p.add_argument("--systems", type=int, default=d.systems)
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--doc-tokens", type=int, default=d.doc_tokens)
    p.add_argument("--turn-tokens", type=int, default=d.turn_tokens)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--rate", type=float, default=d.rate, help="conversations started per second")
    p.add_argument("--think-s", type=float, default=d.think_s)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--ttft-slo", type=float, default=2.0, help="goodput counts answers with TTFT within it")
    p.add_argument("--timeout", type=float, default=120.0, help="client timeout of one request (s)")
    p.add_argument("--out", default=".bench-out/prefix-routing.json")
    p.add_argument("--logs", help="a folder for the processes' logs (default: discarded)")
    a = p.parse_args(argv)
    available = modes_available()
    modes = available if a.modes == "all" else a.modes.split(",")
    unknown = [m for m in modes if m not in available]
    if unknown:
        p.error(f"modes not available with this gateway: {', '.join(unknown)} (available: {available})")
    w = Workload(
        systems=a.systems, system_tokens=a.system_tokens, doc_tokens=a.doc_tokens,
        turn_tokens=a.turn_tokens, turns=a.turns, conversations=a.conversations, rate=a.rate,
        think_s=a.think_s, max_tokens=a.max_tokens, seed=a.seed,
    )  # fmt: skip
    e = EngineArgs(
        engines=a.engines, preset=a.preset, slots=a.slots,
        prefill_ms_per_token=a.prefill_ms_per_token, prefix_cache_tokens=a.prefix_cache_tokens,
    )  # fmt: skip
    logs = Path(a.logs) if a.logs else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    report = run_bench(modes, w, e, ttft_slo=a.ttft_slo, timeout_s=a.timeout, logs=logs)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
