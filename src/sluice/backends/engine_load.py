"""What an engine says of its own load: its ``/metrics`` (vLLM, SGLang, TGI, llama-server, the
simulator) or llama-server's ``/slots``, read into an :class:`~sluice.core.concurrency.EngineLoad`.

The engine's kind is found once, on the first read: the first of ``/metrics`` (by the names it
exports) and ``/slots`` that answers in a known shape. An engine that answered neither is
remembered as having nothing to say, so polling it costs nothing after that first read; one that
could not be reached is asked again next time (it may be starting).

Names read, per engine (a name summed over its label sets, as a data-parallel vLLM labels each
engine; KV use is the fullest one's), as running / waiting / KV use / preemptions:

- vLLM and ``sluice sim``: ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` /
  ``vllm:kv_cache_usage_perc`` (older: ``gpu_cache_usage_perc``; a fraction despite the name) /
  ``vllm:num_preemptions_total``.
- SGLang: ``sglang:num_running_reqs`` / ``sglang:num_queue_reqs`` / ``sglang:token_usage`` / --.
- TGI: ``tgi_batch_current_size`` / ``tgi_queue_size`` / -- / --.
- llama-server with ``--metrics``: ``llamacpp:requests_processing`` / ``llamacpp:requests_deferred``
  / ``llamacpp:kv_cache_usage_ratio`` (older builds) / --; the slot count from ``/slots``, once.
- llama-server's ``/slots`` alone: the slots with ``is_processing`` (older: ``state`` != 0) / -- /
  -- / --; the slot count.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sluice.backends.http import EngineUnreachable
from sluice.core.concurrency import EngineLoad

__all__ = [
    "EngineKind",
    "EngineLoadReader",
    "Get",
    "detect_kind",
    "load_from_metrics",
    "load_from_slots",
    "parse_prometheus",
]


class EngineKind(StrEnum):
    """Which engine's report a reader parses; ``none``: the engine reports nothing Sluice reads."""

    VLLM = "vllm"
    SGLANG = "sglang"
    TGI = "tgi"
    LLAMA_CPP = "llama.cpp"
    LLAMA_SLOTS = "llama.cpp-slots"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class _Names:
    """The metric names one engine kind exports for each field (first found wins)."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]
    preemptions: tuple[str, ...]


_NAMES: Mapping[EngineKind, _Names] = {
    EngineKind.VLLM: _Names(
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        preemptions=("vllm:num_preemptions_total", "vllm:num_preemptions"),
    ),
    EngineKind.SGLANG: _Names(
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_usage=("sglang:token_usage",),
        preemptions=(),
    ),
    EngineKind.TGI: _Names(
        running=("tgi_batch_current_size",),
        waiting=("tgi_queue_size",),
        kv_usage=(),
        preemptions=(),
    ),
    EngineKind.LLAMA_CPP: _Names(
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
        preemptions=(),
    ),
}


def parse_prometheus(text: str, names: Collection[str] | None = None) -> dict[str, list[float]]:
    """Every sample of a Prometheus text exposition, by metric name (one value per label set);
    with ``names``, those of these names alone (the same values), the other lines passed over
    before their labels are read: an engine's exposition grows with what it served (histogram
    buckets), and a known kind reads a few of its names on every poll.

    Tolerant: a line it cannot read is skipped, not an error (an engine's report is a hint, and
    one odd line must not hide the rest); comments, timestamps and exemplars are ignored.
    """
    out: dict[str, list[float]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _NAME.match(line)
        if match is None:
            continue
        name = match.group(0)
        if names is not None and name not in names:
            continue
        rest = line[match.end() :]
        if rest.startswith("{"):
            end = _labels_end(rest)
            if end is None:
                continue
            rest = rest[end:]
        # The value, then an optional timestamp, then an optional exemplar after '#'.
        parts = rest.split("#", 1)[0].split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        out.setdefault(name, []).append(value)
    return out


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")

#: Every metric name a kind's load is read from (see :func:`load_from_metrics`)
_WANTED: Mapping[EngineKind, frozenset[str]] = {
    kind: frozenset((*n.running, *n.waiting, *n.kv_usage, *n.preemptions)) for kind, n in _NAMES.items()
}


def _labels_end(rest: str) -> int | None:
    """Where a label set that ``rest`` opens with ends (just past its ``}``), reading quoted values
    (which may hold braces, spaces and escaped quotes) whole; None if it never closes."""
    quoted = escaped = False
    for i, ch in enumerate(rest):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = quoted
        elif ch == '"':
            quoted = not quoted
        elif ch == "}" and not quoted:
            return i + 1
    return None


def detect_kind(metrics: Mapping[str, list[float]]) -> EngineKind | None:
    """The engine kind whose running-count metric the exposition holds; None: none known."""
    for kind, names in _NAMES.items():
        if any(n in metrics for n in names.running):
            return kind
    return None


def _first(metrics: Mapping[str, list[float]], names: tuple[str, ...]) -> list[float] | None:
    for n in names:
        found = metrics.get(n)
        if found:
            return found
    return None


def _count(values: list[float] | None) -> int | None:
    if values is None:
        return None
    total = sum(v for v in values if math.isfinite(v))
    return max(0, round(total))


def load_from_metrics(
    kind: EngineKind, metrics: Mapping[str, list[float]], *, slots: int | None = None
) -> EngineLoad | None:
    """The load an exposition of ``kind`` reports; None for a kind with no metric names."""
    names = _NAMES.get(kind)
    if names is None:
        return None
    kv = _first(metrics, names.kv_usage)
    kv_usage = None
    if kv is not None:
        finite = [v for v in kv if math.isfinite(v)]
        # A fraction in vLLM and SGLang despite the name "perc"; a percent from some exporter
        # would read above 1, and is scaled back.
        kv_usage = max(finite) if finite else None
        if kv_usage is not None:
            kv_usage = min(1.0, max(0.0, kv_usage / 100 if kv_usage > 1.0 else kv_usage))
    return EngineLoad(
        running=_count(_first(metrics, names.running)),
        waiting=_count(_first(metrics, names.waiting)),
        kv_usage=kv_usage,
        preemptions=_count(_first(metrics, names.preemptions)),
        slots=slots,
    )


def load_from_slots(payload: Any) -> EngineLoad | None:
    """The load llama-server's ``/slots`` shows: busy slots of all; None if it is not that shape."""
    if not isinstance(payload, list) or not payload or not all(isinstance(s, dict) for s in payload):
        return None
    busy = 0
    for slot in payload:
        if "is_processing" in slot:
            busy += bool(slot["is_processing"])
        elif "state" in slot:
            busy += slot["state"] not in (0, False, None)
        else:
            return None
    return EngineLoad(running=busy, waiting=None, kv_usage=None, preemptions=None, slots=len(payload))


#: A GET of a path of the engine's (no ``/v1``) within a timeout in seconds: its status and body.
#: Raises :class:`~sluice.backends.http.EngineUnreachable` when the engine cannot be reached
#: (:meth:`sluice.backends.http.EngineHTTP.get`).
Get = Callable[[str, float], Awaitable[tuple[int, bytes]]]


class EngineLoadReader:
    """Reads one engine's load over its HTTP connection, finding the engine's kind on the first read.

    Args:
        get: the backend's GET (:data:`Get`).
        timeout_s: for each read: a slow report is dropped rather than waited for.

    Attributes:
        kind: what the engine was found to be; None until a read reached it.
    """

    def __init__(self, get: Get, *, timeout_s: float = 2.0) -> None:
        self._get = get
        self._timeout_s = timeout_s
        self.kind: EngineKind | None = None
        self._slots: int | None = None

    async def read(self) -> EngineLoad | None:
        """The engine's load now; None when it reports nothing or could not be read this time."""
        try:
            if self.kind is None:
                return await self._detect()
            if self.kind is EngineKind.NONE:
                return None
            if self.kind is EngineKind.LLAMA_SLOTS:
                return load_from_slots(await self._json("/slots"))
            text = await self._text("/metrics")
            return (
                None
                if text is None
                else load_from_metrics(
                    self.kind, parse_prometheus(text, _WANTED.get(self.kind)), slots=self._slots
                )
            )
        except (EngineUnreachable, ValueError):
            return None

    async def _detect(self) -> EngineLoad | None:
        # Transport errors propagate to read(): the kind stays unknown and is sought again.
        text = await self._text("/metrics")
        if text is not None:
            metrics = parse_prometheus(text)
            kind = detect_kind(metrics)
            if kind is not None:
                if kind is EngineKind.LLAMA_CPP:
                    # The slot count is fixed at start (-np): read once, it is the engine's capacity.
                    slots = load_from_slots(await self._json("/slots"))
                    self._slots = slots.slots if slots is not None else None
                self.kind = kind
                return load_from_metrics(kind, metrics, slots=self._slots)
        load = load_from_slots(await self._json("/slots"))
        self.kind = EngineKind.LLAMA_SLOTS if load is not None else EngineKind.NONE
        return load

    async def _text(self, path: str) -> str | None:
        status, raw = await self._get(path, self._timeout_s)
        return raw.decode("utf-8", "replace") if status == 200 else None

    async def _json(self, path: str) -> Any:
        status, raw = await self._get(path, self._timeout_s)
        if status != 200:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None
