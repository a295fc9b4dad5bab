"""The memory broker's workers: their registrations, the kept sum of their slots, and what each
knows of its models. Moved out of memory.py as one concept; :class:`MemoryBroker` holds one."""

from __future__ import annotations

import math
from collections.abc import Mapping

from sluice.core.model_info import ModelInfo, merge


class Workers:
    """Worker id → (slots per model, registration expiry), with the live sum kept between changes."""

    __slots__ = ("live_slots", "model_info", "registrations")

    def __init__(self) -> None:
        self.registrations: dict[str, tuple[dict[str, int], float]] = {}
        #: :meth:`slots`' sum, kept with the span of clock times it holds for: (sum, from, to)
        self.live_slots: tuple[dict[str, int], float, float] | None = None
        #: what each worker knows of its models (``describe_models``)
        self.model_info: dict[str, dict[str, ModelInfo]] = {}

    def register(self, worker_id: str, slots: Mapping[str, int], expires: float) -> None:
        self.registrations[worker_id] = (dict(slots), expires)
        self.live_slots = None

    def unregister(self, worker_id: str) -> None:
        self.registrations.pop(worker_id, None)
        self.live_slots = None
        self.model_info.pop(worker_id, None)

    def slots(self, now: float) -> dict[str, int]:
        """Model -> the slots of the workers whose registration has not lapsed at ``now``; the
        caller must not change it. Summed again only when it may differ: no registration changed,
        and ``now`` lies between the time of the last sum and the first expiry of a registration it
        counted, have the same workers live as then (one lapsed before that sum stays lapsed; a
        clock stepped back sums again). Three reads a job."""
        kept = self.live_slots
        if kept is not None and kept[1] <= now <= kept[2]:
            return kept[0]
        total: dict[str, int] = {}
        until = math.inf
        for slots, expires in self.registrations.values():
            if expires >= now:
                if expires < until:
                    until = expires
                for model, n in slots.items():
                    total[model] = total.get(model, 0) + n
        self.live_slots = (total, now, until)
        return total

    def describe(self, worker_id: str, models: Mapping[str, ModelInfo]) -> None:
        self.model_info[worker_id] = dict(models)

    def merged_info(self, now: float) -> dict[str, ModelInfo]:
        """Per model, what the workers still registered at ``now`` know of it, merged."""
        accounts: dict[str, list[ModelInfo]] = {}
        for worker_id, models in self.model_info.items():
            registered = self.registrations.get(worker_id)
            if registered is None or registered[1] < now:
                continue
            for model, info in models.items():
                accounts.setdefault(model, []).append(info)
        return {model: merge(infos) for model, infos in accounts.items()}
