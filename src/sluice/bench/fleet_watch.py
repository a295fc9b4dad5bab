"""``sluice bench fleet``: what the engines say of themselves during one arm's run (their
``/metrics``, sampled), and the engine killed mid-run when asked."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from sluice.bench.fleet_engines import EngineSpec
from sluice.bench.load import parse_prometheus

# The engines' metrics are read this often: a queue that lasts less than this may go unseen.
SAMPLE_S = 0.5


@dataclass
class Member:
    """A running engine of the fleet: its spec, URL, and process (None for llama-server, which
    :class:`~sluice.local_engine.server.LocalEngine` supervises)."""

    spec: EngineSpec
    url: str
    proc: asyncio.subprocess.Process | None = None
    engine: Any = None

    @property
    def pid(self) -> int | None:
        if self.proc is not None:
            return self.proc.pid if self.proc.returncode is None else None
        return self.engine.pid if self.engine is not None else None


# -- the engines' side of a run ------------------------------------------------------------------


def _engine_values(values: dict[str, float]) -> dict[str, float]:
    """What the bench reads of one engine's metrics, whichever engine it is (sim, vLLM, llama-server);
    a figure the engine does not report is absent (llama-server counts no finished requests and no
    wasted tokens)."""
    names = {
        "running": ("vllm:num_requests_running", "llamacpp:requests_processing"),
        "waiting": ("vllm:num_requests_waiting", "llamacpp:requests_deferred"),
        "finished": ("vllm:request_success_total",),
        "generated": ("vllm:generation_tokens_total", "llamacpp:tokens_predicted_total"),
        "wasted": ("sim:wasted_generation_tokens_total",),
    }
    out: dict[str, float] = {}
    for key, candidates in names.items():
        found = next((values[n] for n in candidates if n in values), None)
        if found is not None and math.isfinite(found):
            out[key] = found
    return out


@dataclass
class FleetWatcher:
    """Samples every engine's ``/metrics`` during a run, and SIGKILLs one at ``kill_at`` if asked.

    ``samples`` holds, per sample, ``t`` (seconds from the run's origin) and per engine name the
    values of :func:`_engine_values` (absent once the engine stops answering); ``first`` and
    ``last`` each engine's values before the load and at its last answer; ``killed_at`` when the
    kill was sent (None: no kill). With ``gateway_metrics`` (a Sluice arm), each sample also has
    ``slots``: the gateway's ``sluice_slots``, the sum of its engines' in-flight limits (learned or
    fixed) at that moment.
    """

    http: httpx.AsyncClient
    members: Sequence[Member]
    kill: str | None = None
    kill_at: float | None = None
    gateway_metrics: str | None = None
    origin: float = 0.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    first: dict[str, dict[str, float]] = field(default_factory=dict)
    last: dict[str, dict[str, float]] = field(default_factory=dict)
    killed_at: float | None = None
    _task: asyncio.Task[None] | None = None

    async def scrape(self) -> dict[str, dict[str, float]]:
        async def one(member: Member) -> tuple[str, dict[str, float] | None]:
            with contextlib.suppress(httpx.HTTPError):
                response = await self.http.get(f"{member.url}/metrics", timeout=2.0)
                if response.status_code == 200:
                    return member.spec.name, _engine_values(parse_prometheus(response.text))
            return member.spec.name, None

        got = await asyncio.gather(*(one(m) for m in self.members))
        values = {name: v for name, v in got if v is not None}
        self.last.update(values)
        return values

    async def prime(self) -> None:
        self.first = await self.scrape()

    def start(self, origin: float) -> None:
        self.origin = origin
        self._task = asyncio.create_task(self._run(), name="fleet-watcher")

    async def _run(self) -> None:
        while True:
            started = time.perf_counter()
            due = self.kill_at is not None and started - self.origin >= self.kill_at
            if self.kill and due and self.killed_at is None:
                self._kill()
            values: dict[str, Any] = dict(await self.scrape())
            if self.gateway_metrics is not None:
                with contextlib.suppress(httpx.HTTPError):
                    response = await self.http.get(self.gateway_metrics, timeout=2.0)
                    slots = parse_prometheus(response.text).get("sluice_slots")
                    if slots is not None:
                        values["slots"] = slots
            self.samples.append({"t": started - self.origin, **values})
            await asyncio.sleep(max(0.0, SAMPLE_S - (time.perf_counter() - started)))

    def _kill(self) -> None:
        member = next(m for m in self.members if m.spec.name == self.kill)
        if member.proc is not None and member.proc.returncode is None:
            member.proc.kill()  # SIGKILL: no goodbye, its connections just break
        elif member.engine is not None and member.engine.pid is not None:
            import os
            import signal

            os.kill(member.engine.pid, signal.SIGKILL)
        self.killed_at = time.perf_counter() - self.origin

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def settle(self, grace_s: float) -> int | None:
        """Requests still running or waiting at the live engines after up to ``grace_s``."""
        deadline = time.monotonic() + grace_s
        while True:
            values = await self.scrape()
            left = sum(v.get("running", 0.0) + v.get("waiting", 0.0) for v in values.values())
            if not left or time.monotonic() > deadline:
                return round(left)
            await asyncio.sleep(0.2)

    def report(self) -> dict[str, Any]:
        """Per engine: what it finished and generated during the run, its share, its largest queue."""
        engines: dict[str, dict[str, Any]] = {}
        for m in self.members:
            name = m.spec.name
            before, after = self.first.get(name, {}), self.last.get(name, {})

            def delta(
                key: str, before: dict[str, float] = before, after: dict[str, float] = after
            ) -> float | None:
                a, b = after.get(key), before.get(key)
                return None if a is None or b is None else a - b

            waits = [s[name]["waiting"] for s in self.samples if name in s and "waiting" in s[name]]
            runs = [s[name]["running"] for s in self.samples if name in s and "running" in s[name]]
            engines[name] = {
                "describe": m.spec.describe(),
                "batch": m.spec.batch,
                "finished": delta("finished"),
                "generated_tokens": delta("generated"),
                "wasted_tokens": delta("wasted"),
                "max_waiting": max(waits, default=None),
                "max_running": max(runs, default=None),
                "killed": name == self.kill and self.killed_at is not None,
            }
        generated = sum(e["generated_tokens"] or 0 for e in engines.values())
        for e in engines.values():
            e["share"] = (e["generated_tokens"] or 0) / generated if generated else None
        wasted = [e["wasted_tokens"] for e in engines.values()]
        return {
            "engines": engines,
            "generated_tokens": generated,
            "wasted_tokens": None if None in wasted else sum(w or 0 for w in wasted),
            "max_waiting": max((e["max_waiting"] or 0 for e in engines.values()), default=None),
            "killed": self.kill if self.killed_at is not None else None,
            "killed_at_s": self.killed_at,
            "samples": self.samples,
        }
