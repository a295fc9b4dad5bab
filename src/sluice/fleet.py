"""The fleet: pools of engines, who is in them now, and which engine model a public name means.

A pool (``[[pools]]``) is a set of engines that serve the same models, given by address: an
``http://HOST:PORT`` URL is one engine for good; a ``dns://NAME:PORT`` name is as many engines as
it has A/AAAA records, and is resolved again every ``dns_refresh_s`` (a Kubernetes headless
Service gives one record per ready pod), so engines join and leave without a restart. An engine
whose address vanishes is *leaving*: it takes no new work, its running work finishes (or fails
over by retry if the engine is gone), and it is dropped once idle. A name that fails to resolve
keeps the members it had (a DNS hiccup is not a fleet that vanished).

Each engine here carries its own bookkeeping (:class:`Engine`): the sequences and tokens Sluice
has in flight on it, its in-flight limit (a :class:`~sluice.core.concurrency.ConcurrencyLimit`,
learned or fixed), its health (:class:`~sluice.core.health.EngineHealth`), whether an operator
drains it, and its measured time to first token. Each ``[[backends]]`` entry is a pool of one,
with today's fixed limit unless it sets ``adaptive``.

Aliases (``[[aliases]]``) map a public model name to engine model names with weights (a canary);
the choice is a weighted random draw among the targets some engine serves, with an injectable
``rng``. The queue is per public name (what the client asked for), the capacity Sluice registers
is per public name too (engine model names and aliases), and the body sent to the engine names
the engine model.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from sluice.backends.base import Backend, public_name
from sluice.core.concurrency import ConcurrencyLimit
from sluice.core.health import EngineHealth
from sluice.core.job import Job

log = logging.getLogger("sluice.fleet")

#: ``(host, port) -> addresses``: what a ``dns://`` engine name resolves to now (raises OSError)
Resolver = Callable[[str, int], Awaitable[list[str]]]

#: the connection pool size of an adaptive engine with no ceiling (its backend needs one)
UNBOUNDED_CONNECTIONS = 64


async def resolve_system(host: str, port: int) -> list[str]:
    """Every address ``host`` has now (A and AAAA), through the event loop's resolver."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


@dataclass(frozen=True)
class PoolSpec:
    """A pool as the fleet builds its engines.

    Attributes:
        name: the pool's name (an engine's name is ``POOL/HOST:PORT``).
        addresses: ``http(s)://`` URLs and ``dns://NAME:PORT`` names of its engines.
        models: engine model names its engines serve; empty: each engine's ``/v1/models``.
        max_concurrency: the ceiling of a learned limit (None: none), or the fixed limit.
        adaptive: learn each engine's limit; False: ``max_concurrency`` is the limit.
        tpot_objective_s: the time per output token a learned limit keeps streams within.
        max_inflight_tokens: an engine's budget of in-flight cost (None: none).
        priority: class -> the ``priority`` value sent to its engines (None: none sent).
        api_key: the bearer token its engines need, if any.
    """

    name: str
    addresses: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    max_concurrency: int | None = None
    adaptive: bool = True
    tpot_objective_s: float | None = None
    max_inflight_tokens: int | None = None
    priority: Mapping[str, int] | None = None
    api_key: str | None = None

    def limiter(self) -> ConcurrencyLimit:
        """A fresh in-flight limit for one of its engines."""
        return ConcurrencyLimit(
            ceiling=self.max_concurrency, adaptive=self.adaptive, tpot_objective_s=self.tpot_objective_s
        )

    @property
    def connections(self) -> int:
        """What its engines' backends are told of their concurrency (their connection pools)."""
        return self.max_concurrency or UNBOUNDED_CONNECTIONS


#: ``(pool, url, name) -> Backend``: builds the adapter of an engine that joins
BackendFactory = Callable[[PoolSpec, str, str], Backend]

#: the smoothing of an engine's measured time to first token (weight of the newest sample)
TTFT_SMOOTHING = 0.2


def smoothed_ttft(previous: float | None, sample: float, weight: float = TTFT_SMOOTHING) -> float:
    """An engine's smoothed time to first token once ``sample`` is folded in (``previous``: the
    smoothed value so far, None before the first sample; ``weight``: the newest sample's). The
    one rule for the dispatcher's engines (:meth:`Engine.observe_ttft`) and the routing model's."""
    return sample if previous is None else previous + weight * (sample - previous)


#: what an engine's limit is: ``configured`` (a fixed ``max_concurrency``) or ``learned`` (its
#: adaptive ConcurrencyLimit, under its ceiling if one is set)
LIMIT_CONFIGURED = "configured"
LIMIT_LEARNED = "learned"


@dataclass(eq=False)
class Engine:
    """One engine and what Sluice keeps of it.

    Attributes:
        backend: its adapter.
        pool: the pool it belongs to (its own name for a ``[[backends]]`` entry).
        label: what clients may be told of it (its name, or ``backend N`` when that is an address).
        limiter: its in-flight limit, learned or fixed.
        health: its ejection state (errors and timeouts eject it; a half-open probe brings it back).
        source: the ``dns://`` address it came from, None if configured by URL (or given built).
        inflight: sequences Sluice has in flight on it.
        inflight_tokens: their cost (prompt + max_tokens).
        draining: an operator drains it (or its pool): no new work.
        leaving: its address left the pool: no new work, dropped once idle.
        described: whether its model list was read (``backend.model_info`` holds what it said).
        ttft_s: its recent time to first token, smoothed (None: none measured yet).
        failures: its failures in a row (errors worth a retry), until one succeeds; kept through
            an ejection (the health's own count restarts with each ejection).
    """

    backend: Backend
    pool: str
    label: str
    limiter: ConcurrencyLimit
    health: EngineHealth = field(default_factory=EngineHealth)
    source: str | None = None
    inflight: int = 0
    inflight_tokens: int = 0
    draining: bool = False
    leaving: bool = False
    described: bool = False
    ttft_s: float | None = None
    failures: int = 0

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def limit(self) -> int:
        # At least 1 without a max(): a ConcurrencyLimit's floor is (it refuses a lower one).
        return self.limiter.limit

    def ejected_for(self, now: float) -> float:
        """Seconds until its health lets it take work again (0: it may now)."""
        if self.health.available(now):
            return 0.0
        remaining = self.health.snapshot(now).get("ejected_for_s", 0.0)
        return float(remaining) if isinstance(remaining, int | float) else 0.0

    def open_for_work(self, now: float) -> bool:
        """Neither drained, leaving nor ejected (room aside)."""
        return not self.draining and not self.leaving and self.health.available(now)

    def available(self, now: float) -> bool:
        return self.open_for_work(now) and self.inflight < self.limit

    def width(self, job: Job) -> int:
        """The slots ``job`` takes here: one per sequence the engine runs for it, at most all of
        the engine's. A job wider than the limit takes it whole (the engine queues the rest of its
        sequences): it runs alone there rather than never."""
        return max(1, min(job.sequences, self.limit))

    def has_slots_for(self, job: Job) -> bool:
        return self.inflight + self.width(job) <= self.limit

    def has_room(self) -> bool:
        """Whether the token budget has any room left (a claim is worth making for it)."""
        budget = self.backend.max_inflight_tokens
        return budget is None or self.inflight == 0 or self.inflight_tokens < budget

    def fits(self, cost: int) -> bool:
        budget = self.backend.max_inflight_tokens
        # An idle engine takes any job, or a job larger than the budget would wait forever.
        return budget is None or self.inflight == 0 or self.inflight_tokens + cost <= budget

    @property
    def free_fraction(self) -> float:
        return 1.0 - self.inflight / self.limit

    def row(self, now: float) -> dict[str, Any]:
        """The engine as ``/admin`` and the dashboard show it (``now``: monotonic seconds).

        Fields: ``name``; ``models``; ``pool``; ``limit``, the sequences it may run at once now,
        ``limit_source`` (LIMIT_CONFIGURED or LIMIT_LEARNED) and ``ceiling``, the configured
        ``max_concurrency`` a learned limit stays under (None: none); ``inflight`` and
        ``inflight_tokens``, its work now; ``max_inflight_tokens``, its token budget or None;
        ``failures``, errors in a row; ``health``, ``healthy``, ``ejected`` or ``probing``;
        ``cooldown_s``, how long it still sits out an ejection; ``draining``; ``leaving``, its
        address left its pool's DNS records; ``ttft_s``, its recent time to first token.
        """
        return {
            "name": self.name,
            "models": list(self.backend.models),
            "pool": self.pool,
            "limit": self.limit,
            "limit_source": LIMIT_LEARNED if self.limiter.adaptive else LIMIT_CONFIGURED,
            "ceiling": self.limiter.ceiling,
            "inflight": self.inflight,
            "inflight_tokens": self.inflight_tokens,
            "max_inflight_tokens": self.backend.max_inflight_tokens,
            "failures": self.failures,
            "health": self.health.state(now).value,
            "cooldown_s": round(self.ejected_for(now), 3),
            "draining": self.draining,
            "leaving": self.leaving,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
        }

    def observe_ttft(self, ttft_s: float) -> None:
        self.ttft_s = smoothed_ttft(self.ttft_s, ttft_s)


@dataclass(frozen=True)
class Membership:
    """What a refresh changed: engines that joined, and engines that began to leave."""

    joined: list[Engine]
    leaving: list[Engine]


def _host_port(host: str, port: int) -> str:
    """``host:port``, the host bracketed when it is an IPv6 address."""
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def _dns_target(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("dns://").rpartition(":")
    return host, int(port)


def _url_key(url: str) -> str:
    """What names an engine given by URL inside its pool: its host and port."""
    parts = urlsplit(url)
    return parts.netloc or url


class Fleet:
    """The engines of every pool, and the aliases.

    Args:
        pools: the pools whose engines are built by ``factory`` (URLs now, DNS names at
            :meth:`refresh`).
        engines: engines given already built (``[[backends]]`` entries, tests' fakes), with the
            pool spec each belongs to.
        factory: builds an engine's backend; needed when ``pools`` is not empty.
        aliases: public name -> ``[(engine model, weight), ...]``.
        resolver: resolves a ``dns://`` name (:func:`resolve_system` by default).
        rng: draws the alias targets (seed it for a reproducible split).
    """

    def __init__(
        self,
        pools: Sequence[PoolSpec] = (),
        *,
        engines: Sequence[tuple[Backend, PoolSpec]] = (),
        factory: BackendFactory | None = None,
        aliases: Mapping[str, Sequence[tuple[str, float]]] | None = None,
        resolver: Resolver = resolve_system,
        rng: random.Random | None = None,
    ) -> None:
        if pools and factory is None:
            raise ValueError("pools need a backend factory")
        self.pools = list(pools)
        self.factory = factory
        self.aliases = {name: list(targets) for name, targets in (aliases or {}).items()}
        self.resolver = resolver
        self.rng = rng or random.Random()
        self.engines: list[Engine] = []
        self._labels = 0
        #: per engine: its public names (:meth:`public_names`), with the model list (a copy) and
        #: the aliases they were made from
        self._names: dict[Engine, tuple[list[str], object, frozenset[str]]] = {}
        for backend, spec in engines:
            self.adopt(backend, spec)
        for spec in self.pools:
            for address in spec.addresses:
                if not address.startswith("dns://"):
                    self._join(spec, address.rstrip("/"), _url_key(address), None)

    # --- membership ---------------------------------------------------------------------------

    @property
    def dynamic(self) -> bool:
        """Whether any pool has a DNS name (then :meth:`refresh` is worth calling)."""
        return any(a.startswith("dns://") for spec in self.pools for a in spec.addresses)

    def adopt(self, backend: Backend, spec: PoolSpec) -> Engine:
        """Add an engine given built (a ``[[backends]]`` entry), a member for good."""
        return self._add(backend, spec, None)

    def _add(self, backend: Backend, spec: PoolSpec, source: str | None) -> Engine:
        engine = Engine(
            backend=backend,
            pool=spec.name,
            label=public_name(backend.name, self._labels),
            limiter=spec.limiter(),
            source=source,
        )
        self._labels += 1
        self.engines.append(engine)
        return engine

    def _join(self, spec: PoolSpec, url: str, key: str, source: str | None) -> Engine:
        assert self.factory is not None
        return self._add(self.factory(spec, url, f"{spec.name}/{key}"), spec, source)

    async def refresh(self) -> Membership:
        """Resolve every ``dns://`` address again: new addresses join, vanished ones begin to
        leave (a leaving engine whose address comes back stays)."""
        joined: list[Engine] = []
        leaving: list[Engine] = []
        for spec in self.pools:
            for address in spec.addresses:
                if not address.startswith("dns://"):
                    continue
                host, port = _dns_target(address)
                try:
                    found = await self.resolver(host, port)
                except (OSError, UnicodeError) as exc:
                    log.warning("pool %s: cannot resolve %s (%s); keeping its engines", spec.name, host, exc)
                    continue
                wanted = {_host_port(ip, port) for ip in found}
                present = {
                    e.name.removeprefix(f"{spec.name}/"): e
                    for e in self.engines
                    if e.pool == spec.name and e.source == address
                }
                for key, engine in present.items():
                    if key not in wanted and not engine.leaving:
                        engine.leaving = True
                        leaving.append(engine)
                    elif key in wanted and engine.leaving:
                        engine.leaving = False
                for key in sorted(wanted - set(present)):
                    joined.append(self._join(spec, f"http://{key}", key, address))
        for engine in joined:
            log.info("pool %s: engine %s joined", engine.pool, engine.name)
        for engine in leaving:
            log.info("pool %s: engine %s is leaving", engine.pool, engine.name)
        return Membership(joined, leaving)

    def departed(self) -> list[Engine]:
        """Leaving engines with nothing in flight, removed from the fleet (their backends are the
        caller's to close)."""
        gone = [e for e in self.engines if e.leaving and e.inflight == 0]
        self.engines = [e for e in self.engines if e not in gone]
        for engine in gone:
            self._names.pop(engine, None)
        return gone

    # --- models -------------------------------------------------------------------------------

    def serving(self, model: str) -> list[Engine]:
        """The engines (not leaving) that serve engine model ``model``."""
        return [e for e in self.engines if not e.leaving and model in e.backend.models]

    def targets(self, public: str) -> list[tuple[str, float]]:
        """The engine models a public name goes to, with weights (itself, unless an alias)."""
        return self.aliases.get(public) or [(public, 1.0)]

    def choose(self, public: str) -> str:
        """The engine model for one request for ``public``: a weighted draw among the targets some
        engine serves (all of them when none is served yet)."""
        targets = self.targets(public)
        if len(targets) == 1:
            return targets[0][0]
        served = [t for t in targets if self.serving(t[0])] or targets
        models = [m for m, _ in served]
        return self.rng.choices(models, weights=[w for _, w in served])[0]

    def public_names(self, engine: Engine) -> frozenset[str]:
        """The public names whose requests may run on ``engine``: its models and their aliases.

        Read for every claim and every pick, so kept per engine and made again only when its model
        list changes (compared with a copy: a poll may replace it or change it in place) or the
        aliases do (compared by identity: replaced whole, never changed in place)."""
        models, aliases = engine.backend.models, self.aliases
        kept = self._names.get(engine)
        if kept is not None and kept[1] is aliases and kept[0] == models:
            return kept[2]
        present = set(models)
        # An alias shadows an engine model of the same name (an alias "llama" over "llama" 95 and
        # "llama-next" 5 is the usual canary).
        names = {m for m in present if m not in aliases}
        names |= {a for a, targets in aliases.items() if any(m in present for m, _ in targets)}
        made = frozenset(names)
        self._names[engine] = (list(models), aliases, made)
        return made

    def capacity(self) -> dict[str, int]:
        """Public name -> the sum of the current limits of the engines (not leaving) that may run
        its requests."""
        out: dict[str, int] = {}
        for engine in self.engines:
            if engine.leaving:
                continue
            for name in self.public_names(engine):
                out[name] = out.get(name, 0) + engine.limit
        return out
