"""How far the local engine is from serving, while ``sluice serve`` already answers.

The first ``sluice serve`` on a machine compiles llama-server (minutes). The gateway listens from
the first second: ``/readyz`` and every request that needs the engine say what it is doing, how far
along it is, and when to come back. The build writes progress from its thread; the gateway reads it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

# What the engine needs after the build: the model download and llama-server's own start (seconds).
START_ALLOWANCE_S = 10.0


class StartupPhase(StrEnum):
    """What the local engine is doing."""

    #: looking for a cached build and model
    PREPARING = "preparing"
    #: compiling llama-server (the first time on this machine)
    BUILDING = "building"
    #: the build is there; fetching the model or starting the server
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"


@dataclass
class EngineStartup:
    """The local engine's progress towards serving.

    Attributes:
        phase: what it is doing now.
        done: build steps finished (``BUILDING`` only).
        total: build steps in all (``BUILDING`` only; 0 until the build tool says).
        error: why it failed (``FAILED`` only).
        clock: monotonic seconds; injected so tests can move time.
        began_at: when the current phase began, on ``clock``.
        first_step_at: when the first build step was reported, and ``first_step_done`` how many
            were done then: the build's rate is measured from there.
    """

    phase: StartupPhase = StartupPhase.PREPARING
    done: int = 0
    total: int = 0
    error: str | None = None
    clock: Callable[[], float] = time.monotonic
    began_at: float = field(default=-1.0)
    first_step_at: float | None = None
    first_step_done: int = 0

    def __post_init__(self) -> None:
        if self.began_at < 0:
            self.began_at = self.clock()

    def enter(self, phase: StartupPhase, error: str | None = None) -> None:
        self.phase, self.error, self.began_at = phase, error, self.clock()

    def build_progress(self, done: int, total: int) -> None:
        """Called by the build (from its thread) at each step."""
        if self.phase is not StartupPhase.BUILDING:
            self.enter(StartupPhase.BUILDING)
        if self.first_step_at is None:
            self.first_step_at, self.first_step_done = self.clock(), done
        self.done, self.total = done, total

    @property
    def ready(self) -> bool:
        return self.phase is StartupPhase.READY

    def eta_s(self) -> float | None:
        """Seconds until the engine is expected to serve; None when failed or not known yet."""
        if self.phase is StartupPhase.READY:
            return 0.0
        if self.phase is StartupPhase.FAILED:
            return None
        if self.phase is not StartupPhase.BUILDING:
            return START_ALLOWANCE_S
        if self.first_step_at is None or self.total <= 0 or self.done <= self.first_step_done:
            return None
        rate = (self.done - self.first_step_done) / max(self.clock() - self.first_step_at, 1e-6)
        return (self.total - self.done) / rate + START_ALLOWANCE_S

    def describe(self) -> str:
        """One sentence for people: what the engine is doing, how far along, when it should serve."""
        if self.phase is StartupPhase.FAILED:
            return f"the local engine failed to start: {self.error}"
        if self.phase is StartupPhase.READY:
            return "the local engine is serving"
        if self.phase is StartupPhase.BUILDING:
            what = "the local engine (llama-server) is being built, once for this machine"
            if self.total:
                what += f": step {self.done} of {self.total} ({self.done * 100 // self.total}%)"
        elif self.phase is StartupPhase.STARTING:
            what = "the local engine is starting"
        else:
            what = "the local engine is being prepared"
        eta = self.eta_s()
        if eta is not None and math.isfinite(eta):
            what += f"; ready in about {_duration(eta)}"
        return what

    def view(self) -> dict[str, object]:
        """What ``/readyz`` shows."""
        eta = self.eta_s()
        return {
            "phase": self.phase.value,
            "done": self.done,
            "total": self.total,
            "eta_s": round(eta, 1) if eta is not None else None,
            "message": self.describe(),
        }


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(round(seconds), 1)} s"
    return f"{round(seconds / 60)} min"
