"""Which engine takes a job: the one where it will finish soonest, or its prompt prefix's home.

Two rules, one per kind of job:

* **Soonest predicted completion.** A job's completion on an engine is its wait for a free
  sequence (none while the engine is under its in-flight limit), its prefill (the engine's recent
  time to first token) and its decode: the output tokens times the engine's seconds per token at
  the load it will have once the job is added (:func:`predicted_completion`). An engine whose
  speed is not measured yet is taken to be as fast as the median measured one; when none is
  measured, the rule is the free fraction of each engine's limit (least loaded). Predictions
  within :data:`PREDICTION_TIE` of the soonest are a tie, broken by that same rule: the
  measurements are noisier than that (docs/routing.md). A job with a prefix key is predicted
  with no prefill on the engine its prefix's last job went to (that engine's prefix cache holds
  it), and that engine wins a tie it is in, while the job keeps it within affinity's bound.
* **Prefix affinity.** Requests that share a prompt prefix (a system prompt, a conversation, the
  client's ``prompt_cache_key`` or ``user``: :func:`prefix_key`) should land on the same engine,
  whose prefix cache then skips their shared prefill. That is consistent hashing with bounded
  loads (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018; what
  HAProxy's ``hash-balance-factor`` does for Vimeo): every engine has many points on a hash ring,
  a key's home is the first engine clockwise from the key's point that has room, where room is a
  load (in flight, plus this job) of at most ``ceil(load_factor x average load)``. A popular
  prefix therefore spills to the next engine on the ring, never piles up on one, and when an
  engine joins or leaves only the keys on its arcs move (about 1/n of them). A prefix that spilled
stays where it spilled to while that engine is within its bound (its cache is there now): the
router remembers each prefix's last engine (an LRU of ``remember`` prefixes).

Engines of different sizes: the "average load" an engine is held to is its share of the total,
in proportion to its in-flight limit times its health weight, so that a 64-sequence engine takes
its 64-sequence share of the prefixes; with equal limits and weights this is exactly the plain
average of the paper. The ring is deterministic (blake2b, never Python's salted ``hash``): every
gateway process sends one prefix to the same engine. The module does no I/O; a :class:`Router`'s
only state is its cache of rings and its memory of where each prefix last went, so the same calls
give the same picks.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.core.c_json import c_encoder

__all__ = [
    "Candidate",
    "HashRing",
    "Router",
    "predicted_completion",
    "prefix_key",
]

#: Characters of a completions prompt (or items of a token prompt) that identify its prefix.
PROMPT_PREFIX_CHARS = 512
#: Points each engine has on the ring: enough that n engines split the ring within a few percent.
VIRTUAL_NODES = 100
#: How much slower a job runs on a full engine than alone, decode and prefill alike: every
#: sequence admitted stalls the batch for its prefill, and the step grows with the batch. A round
#: guess (a full engine twice as slow), strong enough that the load Sluice has in flight, which
#: is fresh, weighs as much as the measured figures, which lag; the prefill-heavy bench of
#: docs/routing.md could not tell it from 0.5 on decode only.
LOAD_SENSITIVITY = 1.0
#: Predicted completions within this share of the soonest are a tie, broken by the free fraction of
#: the limit (least loaded).
PREDICTION_TIE = 0.25
#: Rings remembered, one per set of engine names (membership changes rarely).
RING_CACHE = 32
#: :class:`Router`'s bound on an engine's share of the load before a prefix spills (the
#: ``prefix_load_factor`` setting reads it).
DEFAULT_LOAD_FACTOR = 1.25
#: :class:`Router`'s prefixes whose last engine is remembered (the ``prefix_remember`` setting).
DEFAULT_REMEMBER = 65_536


@dataclass(frozen=True, slots=True)
class Candidate:
    """One engine that could take a job.

    Attributes:
        name: the engine's name (stable across calls: the ring is built from it).
        inflight: sequences Sluice has in flight there.
        limit: its current in-flight limit.
        seconds_per_token: measured decode seconds per token per sequence at its current load
            (None: unknown).
        ttft_s: measured recent time to first token, seconds (None: unknown).
        weight: health weight 0..1 (1 healthy; less when slower than its peers); 0 or less takes
            no work.
    """

    name: str
    inflight: int
    limit: int
    seconds_per_token: float | None
    ttft_s: float | None
    weight: float = 1.0

    @property
    def has_room(self) -> bool:
        return self.inflight < self.limit and self.weight > 0


def _least_loaded(c: Candidate) -> tuple[float, int, str]:
    """Least-loaded's order, which also breaks the soonest completion's ties: the largest free
    fraction of the limit (scaled by weight), then fewest in flight, then name."""
    return (-(c.limit - c.inflight) / c.limit * c.weight, c.inflight, c.name)


def _digest(text: str) -> int:
    """A stable 64-bit hash of ``text`` (the same in every process and on every run)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


#: the prefix's canonical text; made once, since ``json.dumps`` with any argument of its own builds a
#: new encoder on every call, and this runs on every attempt's pick of an engine
_canonical = json.JSONEncoder(sort_keys=True, ensure_ascii=False, default=str).encode


# _canonical's C encoder itself, made once (c_json), with the same options; None where json has
# none: _canonical then.
_CANONICAL = c_encoder(ascii=False, item_sep=", ", key_sep=": ", allow_nan=True, sort_keys=True, default=str)


def _hex(value: Any) -> str:
    blob = _canonical(value) if _CANONICAL is None else "".join(_CANONICAL(value, 0))
    return hashlib.blake2b(blob.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


def prefix_key(body: Mapping[str, Any]) -> str | None:
    """What identifies the request's reusable prompt prefix, or None if nothing does.

    In order: the client's ``prompt_cache_key`` (OpenAI's field for exactly this), its ``user``,
    else a hash of what every request of one conversation or one application starts with: a chat's
    system (or developer) messages and its first other message, a Responses request's
    ``instructions`` and first input item, a completion's first :data:`PROMPT_PREFIX_CHARS`
    characters. The model is part of the key when given (one prefix on two models is two caches).
    """
    model = body.get("model")
    tag = f"{model}|" if isinstance(model, str) else ""
    for field in ("prompt_cache_key", "user"):
        value = body.get(field)
        if isinstance(value, str) and value:
            return f"{tag}{field}:{value}"
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        head: list[Any] = []
        for message in messages:
            # A dict answered by its type first (a parsed body's): isinstance(message, Mapping)
            # alone is three calls, the ABC's check and its cache's.
            if isinstance(message, (dict, Mapping)):
                role = message.get("role")
                head.append(message.get("content"))
            else:
                role = None
                head.append(message)
            if role not in ("system", "developer"):
                break
        return f"{tag}chat:{_hex(head)}"
    if "input" in body or "instructions" in body:
        items = body.get("input")
        first = items[0] if isinstance(items, list) and items else items
        if isinstance(first, str):
            first = first[:PROMPT_PREFIX_CHARS]
        head_r = [body.get("instructions"), first]
        if head_r == [None, None]:
            return None
        return f"{tag}responses:{_hex(head_r)}"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: the first one's prefix
    if isinstance(prompt, str) and prompt:
        return f"{tag}prompt:{_hex(prompt[:PROMPT_PREFIX_CHARS])}"
    if isinstance(prompt, list) and prompt:
        return f"{tag}prompt:{_hex(prompt[:PROMPT_PREFIX_CHARS])}"
    return None


def predicted_completion(
    c: Candidate,
    *,
    prompt_tokens: int,
    output_tokens: int,
    seconds_per_token: float | None = None,
    cached: bool = False,
) -> float | None:
    """Seconds until a job sent to ``c`` now would finish, or None if its speed is unknown.

    ``seconds_per_token`` stands in for the engine's own when that is None (a presumed speed).
    ``cached``: the engine holds the job's prompt prefix in its cache (its prefix's last job went
    there), so the prefill is skipped and only the decode is predicted. The queueing part: none
    while the engine is under its limit; beyond it, the job waits for the sequences ahead of it
    to finish, one of the engine's job times per ``limit`` of them.
    The result is divided by the health weight (a slow-flagged engine looks that much later).
    """
    spt = c.seconds_per_token if c.seconds_per_token is not None else seconds_per_token
    if spt is None:
        return None
    limit = max(c.limit, 1)
    # The load after adding the job, as a fraction of the limit, slows it: alone it runs at the
    # measured speed, on a full engine (1 + LOAD_SENSITIVITY) times slower. (Monotone in the
    # load, so of two engines of one speed the idler one wins.)
    fill = min(c.inflight + 1, limit) / limit
    spt_after = spt * (1 + LOAD_SENSITIVITY * fill)
    # The engine's prefills share its steps too: every sequence admitted stalls the batch. On the
    # engine that caches the job's prefix, the prefill is skipped (all but the few tokens added
    # since its last job there). Elsewhere the engine's recent TTFT is the best estimate Sluice
    # has; prompt_tokens is not used beyond it. On chat traffic that TTFT is mostly how much of
    # recent prompts missed a cache: without the prefix, following it scattered conversations
    # (docs/routing.md, "Where predicted completion lost").
    del prompt_tokens
    prefill = 0.0 if cached or c.ttft_s is None else c.ttft_s * (1 + LOAD_SENSITIVITY * fill)
    service = prefill + max(output_tokens, 1) * spt_after
    ahead = c.inflight - limit + 1
    queueing = ahead * service / limit if ahead > 0 else 0.0
    return (queueing + service) / max(c.weight, 1e-6)


class HashRing:
    """Consistent-hash ring over engine names, :data:`VIRTUAL_NODES` points each (blake2b)."""

    def __init__(self, names: Sequence[str], vnodes: int = VIRTUAL_NODES) -> None:
        points = sorted((_digest(f"{name}#{i}"), name) for name in sorted(set(names)) for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._names = [n for _, n in points]
        self._count = len(set(names))

    def walk(self, key: str) -> list[str]:
        """Every engine once, in ring order clockwise from ``key``'s point."""
        if not self._names:
            return []
        start = bisect_left(self._hashes, _digest(key))
        seen: list[str] = []
        total = len(self._names)
        for i in range(total):
            name = self._names[(start + i) % total]
            if name not in seen:
                seen.append(name)
                if len(seen) == self._count:
                    break
        return seen

    def home(self, key: str) -> str | None:
        """The key's engine ignoring load (the first clockwise)."""
        if not self._names:
            return None
        i = bisect_left(self._hashes, _digest(key)) % len(self._names)
        return self._names[i]


class Router:
    """Picks an engine for each job (pure: the caller passes the engines' state every time).

    Args:
        affinity: send jobs with a prefix to the prefix's home engine (bounded loads); off, every
            job goes to the soonest predicted completion (which counts the cache hit on a
            prefix's last engine).
        load_factor: the bound, c >= 1 in the paper: an engine may hold at most
            ``ceil(load_factor x its share of the load)`` (with this job) before a prefix homed on
            it spills to the next engine on the ring. 1.25 keeps most keys home (the paper's
            moves-per-change bound grows as 1/(c-1)^2) while no engine runs more than 25 % over.
        quiet_fraction: an engine filled to at most this fraction of its limit (this job
            included) is within its bound whatever the average. At light load the paper's bound
            is tiny (one job in flight in a fleet of three: a bound of 1), and would send two
            simultaneous turns of one conversation to two engines, paying the whole prefill
            twice, though a half-empty continuous batch runs one more sequence at almost no cost.
            0 (the default): the paper's bound alone. On the chat bench (docs/routing.md) 0.5
            kept the hit rate where it was (the load there is past the quiet zone), so the
            default stays the paper's.
        remember: prefixes whose last engine is remembered (LRU; 0: none). A prefix that
            spilled once has its cache on the engine it spilled to, not on its ring home: its
            next job goes there while that engine is within its bound, and only otherwise
            walks the ring. Without it, a conversation whose first turn spilled pays the whole
            prefill again on its second, at home. With affinity or without, the soonest
            predicted completion takes that engine to skip the job's prefill (with 0, it knows
            of no engine that would).
    """

    def __init__(
        self,
        *,
        affinity: bool = True,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        quiet_fraction: float = 0.0,
        remember: int = DEFAULT_REMEMBER,
    ) -> None:
        if load_factor < 1:
            raise ValueError("load_factor must be at least 1")
        if not 0 <= quiet_fraction <= 1:
            raise ValueError("quiet_fraction must be between 0 and 1")
        if remember < 0:
            raise ValueError("remember must be at least 0")
        self.affinity = affinity
        self.load_factor = load_factor
        self.quiet_fraction = quiet_fraction
        self.remember = remember
        #: prefix -> the engine its last job was sent to (the engine that now caches it)
        self._last: OrderedDict[str, str] = OrderedDict()
        self._rings: OrderedDict[tuple[str, ...], HashRing] = OrderedDict()

    def ring(self, names: Sequence[str]) -> HashRing:
        """The ring of these engines (cached by the set of names)."""
        key = tuple(sorted(set(names)))
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = HashRing(key)
            if len(self._rings) > RING_CACHE:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(key)
        return ring

    def bounds(self, candidates: Sequence[Candidate]) -> dict[str, int]:
        """Each engine's most in-flight sequences (this job included) before prefixes spill:
        ``ceil(load_factor x share)``, where the total (everything in flight plus this job) is
        shared in proportion to limit x weight, and never less than ``quiet_fraction`` of the
        engine's own limit x weight."""
        usable = [c for c in candidates if c.weight > 0 and c.limit > 0]
        total = sum(max(c.inflight, 0) for c in usable) + 1
        capacity = sum(c.limit * min(c.weight, 1.0) for c in usable)
        if capacity <= 0:
            return {c.name: 0 for c in candidates}
        out = {c.name: 0 for c in candidates}
        for c in usable:
            share = total * c.limit * min(c.weight, 1.0) / capacity
            # A tiny epsilon keeps an exact product (1.25 x 4 = 5) from rounding up a whole step.
            bound = math.ceil(self.load_factor * share - 1e-9)
            quiet = math.floor(self.quiet_fraction * c.limit * min(c.weight, 1.0) + 1e-9)
            out[c.name] = max(bound, quiet)
        return out

    def pick(
        self,
        candidates: Sequence[Candidate],
        *,
        prompt_tokens: int,
        output_tokens: int,
        prefix: str | None,
    ) -> str | None:
        """The engine to send the job to, or None when no candidate has room
        (``inflight >= limit`` for all, or none has a positive weight). ``prefix``: the job's
        prompt prefix key (:func:`prefix_key`), None if it has none: with affinity, its home;
        either way, the engine its last job went to caches it, which the soonest predicted
        completion counts (and the engine chosen is remembered)."""
        open_ = [c for c in candidates if c.has_room]
        if not open_:
            return None
        if len(open_) == 1:
            # The one engine with room is every rule's answer (the home, the soonest completion:
            # each chooses among engines with room), without their bounds and predictions; the
            # prefix still remembers it.
            name: str | None = open_[0].name
        elif prefix is None:
            return self.soonest(open_, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
        else:
            by_name = {c.name: c for c in candidates}
            bounds = self.bounds(candidates)
            # The prefix's last engine counts as caching it only within its bound, as affinity
            # holds it: a key that many requests share (one ``user`` for a whole application)
            # caches little beyond its head, and would otherwise pile onto one engine.
            cached = self._remembered(by_name, bounds, prefix)
            name = self._home(by_name, bounds, prefix) if self.affinity else None
            if name is None:
                name = self.soonest(
                    open_, prompt_tokens=prompt_tokens, output_tokens=output_tokens, cached=cached
                )
        if prefix is not None and name is not None and self.remember > 0:
            self._last[prefix] = name
            self._last.move_to_end(prefix)
            if len(self._last) > self.remember:
                self._last.popitem(last=False)
        return name

    def home(self, candidates: Sequence[Candidate], prefix: str) -> str | None:
        """The prefix's engine under bounded loads: the engine its last job went to, if it is
        within its bound, else the first on the ring, clockwise from the prefix, that has room
        and whose load with this job is within its bound (None if none)."""
        return self._home({c.name: c for c in candidates}, self.bounds(candidates), prefix)

    def _remembered(
        self, by_name: Mapping[str, Candidate], bounds: Mapping[str, int], prefix: str
    ) -> str | None:
        """The engine the prefix's last job went to, if it has room and stays within its bound
        with this job (None otherwise, or if none is remembered)."""
        last = self._last.get(prefix)
        if last is None or last not in by_name:
            return None
        c = by_name[last]
        return last if c.has_room and c.inflight + 1 <= bounds[last] else None

    def _home(self, by_name: Mapping[str, Candidate], bounds: Mapping[str, int], prefix: str) -> str | None:
        last = self._remembered(by_name, bounds, prefix)
        if last is not None:
            return last
        for name in self.ring(list(by_name)).walk(prefix):
            c = by_name[name]
            if c.has_room and c.inflight + 1 <= bounds[name]:
                return name
        return None

    def soonest(
        self,
        candidates: Sequence[Candidate],
        *,
        prompt_tokens: int,
        output_tokens: int,
        cached: str | None = None,
    ) -> str | None:
        """The candidate with room where the job is predicted to finish first; predictions within
        :data:`PREDICTION_TIE` of the soonest are a tie, broken as least-loaded breaks it: the
        largest free fraction of the limit (scaled by weight), then fewest in flight, then name;
        but ``cached``, the engine holding the job's prefix in its cache (:meth:`pick` names it
        only within its bound), wins a tie it is in (and is predicted without prefill). With no
        speed measured anywhere, least-loaded's rule alone."""
        open_ = [c for c in candidates if c.has_room]
        if not open_:
            return None
        known = [c.seconds_per_token for c in open_ if c.seconds_per_token is not None]
        if not known:
            return min(open_, key=_least_loaded).name
        presumed = statistics.median(known)

        def when(c: Candidate) -> float:
            t = predicted_completion(
                c,
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                seconds_per_token=presumed,
                cached=c.name == cached,
            )
            return t if t is not None else math.inf

        times = {c.name: when(c) for c in open_}
        soonest = min(times.values())
        # Predictions within PREDICTION_TIE of the soonest are a tie, broken by the free fraction
        # of the limit: the measured figures they rest on are noisy (a TTFT doubles when two
        # prefills share a step), and following a difference smaller than the noise piles work
        # on whichever engine the noise said was fast.
        tied = [c for c in open_ if times[c.name] <= soonest * (1 + PREDICTION_TIE)]
        # Of engines in the tie, the one caching the prefix does the job with the least work (no
        # prefill), and choosing it follows no noise: the prefix names it, not a measurement.
        if cached is not None and any(c.name == cached for c in tied):
            return cached
        return min(tied, key=_least_loaded).name
