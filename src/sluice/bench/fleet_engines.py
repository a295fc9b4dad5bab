"""The engines a ``sluice bench fleet`` run is made of: each one's spec (a ``sluice sim`` preset
with flags, or the real llama-server), parsed from ``NAME=PRESET[,FLAG=VALUE...]``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.bench.load import PROMPT

__all__ = ["DEFAULT_FLEET", "LLAMA_SLOTS", "SIM_FLAGS", "EngineSpec", "parse_engine"]

# Batch sizes 4, 16 and 64 with different step times: a CPU llama-server, the article's vLLM, and a
# big batch whose steps are slow (about 6.9 req/s, 5.2 s per lone 128-token answer).
DEFAULT_FLEET = (
    "s4=llama-cpu",
    "s16=article",
    "s64=article,max-num-seqs=64,base-step-ms=40,per-seq-ms=0.5",
)

# `sluice sim` flags an engine spec may set, and the SimParams field each one is, with its scale.
SIM_FLAGS = {
    "max-num-seqs": ("max_num_seqs", 1.0),
    "base-step-ms": ("base_step_s", 0.001),
    "per-seq-ms": ("per_seq_s", 0.001),
    "prefill-ms-per-token": ("prefill_s_per_token", 0.001),
    "kv-cache-tokens": ("kv_cache_tokens", 1.0),
}
# llama-server's slots when --with-llama starts it (as `sluice serve` starts it by default).
LLAMA_SLOTS = 4


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine of the fleet.

    ``name`` names it in configs, tables and plots; ``preset`` is the ``sluice sim`` preset and
    ``flags`` the sim flags (``SIM_FLAGS``) that override it, as given (``{"max-num-seqs": "64"}``);
    ``llama``: the real llama-server instead of a simulator (``preset`` and ``flags`` then unused;
    its figures are estimated from the ``llama-cpu`` preset, which models it).
    """

    name: str
    preset: str = "article"
    flags: tuple[tuple[str, str], ...] = ()
    llama: bool = False

    def params(self) -> Any:
        """The simulator's :class:`~sluice.sim.model.SimParams` (for llama-server: its model's)."""
        from sluice.sim.model import preset

        if self.llama:
            return preset("llama-cpu", max_num_seqs=LLAMA_SLOTS)
        overrides: dict[str, Any] = {}
        for flag, value in self.flags:
            name, scale = SIM_FLAGS[flag]
            overrides[name] = int(value) if scale == 1.0 else float(value) * scale
        return preset(self.preset, **overrides)

    @property
    def batch(self) -> int:
        """The engine's batch size: the hand-set limit a fixed configuration starts from."""
        return int(self.params().max_num_seqs)

    def capacity(self, max_tokens: int) -> float:
        """Requests per second it finishes with every slot busy, by the simulator's formula."""
        from sluice.sim.model import capacity_rps, estimate_chat_tokens

        return float(capacity_rps(self.params(), max_tokens, estimate_chat_tokens([PROMPT])))

    def sim_args(self) -> list[str]:
        return [arg for flag, value in self.flags for arg in (f"--{flag}", value)]

    def describe(self) -> str:
        if self.llama:
            return f"llama-server, {LLAMA_SLOTS} slots"
        p = self.params()
        return (
            f"sim {self.preset}: batch {p.max_num_seqs}, step {1000 * p.base_step_s:g} ms "
            f"+ {1000 * p.per_seq_s:g} ms per sequence"
        )


def parse_engine(text: str) -> EngineSpec:
    """``NAME=PRESET[,FLAG=VALUE...]``, e.g. ``s64=article,max-num-seqs=64,base-step-ms=40``."""
    from sluice.sim.model import PRESETS

    name, sep, rest = text.partition("=")
    parts = [p.strip() for p in rest.split(",")]
    if not sep or not name or not parts[0]:
        raise ValueError(f"an engine is NAME=PRESET[,FLAG=VALUE...] (got {text!r})")
    if parts[0] not in PRESETS:
        raise ValueError(f"engine {name}: unknown preset {parts[0]!r}; known: {', '.join(PRESETS)}")
    flags: list[tuple[str, str]] = []
    for part in parts[1:]:
        flag, eq, value = part.partition("=")
        if not eq or flag not in SIM_FLAGS:
            raise ValueError(
                f"engine {name}: {part!r} is not one of {', '.join(f + '=N' for f in SIM_FLAGS)}"
            )
        try:
            float(value)
        except ValueError:
            raise ValueError(f"engine {name}: {flag} takes a number, not {value!r}") from None
        flags.append((flag, value))
    spec = EngineSpec(name=name, preset=parts[0], flags=tuple(flags))
    spec.params()  # an impossible engine (SimParams says why) fails here, before anything starts
    return spec
