"""A what-if of the policy model (issue 18, "an admission is a promise"): a drain rate that learns
how the engine weighs a prompt token against a ``max_tokens`` one, and promises the wait behind a
queue at that queue's own prompt/output mix (``python -m sluice.bench.policy_model --prompt-mix``).

The drain rate counts a job in its cost, prompt tokens + ``max_tokens``, and learns cost units a
second on the mix of jobs that finished. Near a deadline, admission lets in the short prompts, and
where a prompt token costs the engine next to nothing (prefill cheap against decoding) a queue of
short prompts drains fewer cost units a second than the mix the rate was measured on: the wait it
is promised is too short (seed 97 of the family: 5 slots, prompts ~279 tokens, answers stopping
early). Where prefill is dear the opposite holds, so the mix's sign must be learnt, not assumed.

What a prompt token costs, learnt from the finishes (not told by the engine model): a job's service
seconds fitted, without intercept, on its generated tokens ``g``, ``g`` times its fill ``u`` (the
batch slows as it fills) and its prompt tokens ``p``: ``s ≈ b0·g + b1·g·u + c·p``. A job's own
prefill stalls the whole batch, so the fit reads ``c`` as one slot's share of a prompt token's cost
(the per-job fit of the last what-if, ``PromptWeightFit``, read that share as the whole); a full
batch of ``n`` pays ``c·n`` slot-seconds for it. ``b0 + b1`` is a generated token's time in a full
batch, which holds the stalls of the mean prompt mix too (``c·n·p̄ / ḡ`` a token); less those, and
times the share of ``max_tokens`` the answers used (``ḡ / m̄``), it is what a ``max_tokens`` one
costs. Their ratio is the prompt weight ``w``; a queue whose prompts make a share ``x`` of its cost
then takes ``(w·x + 1 - x) / (w·x̄ + 1 - x̄)`` times as long per cost unit as the mix ``x̄`` the
rate was measured on (:meth:`PromptMixDrain.mix_factor`). Only the deadline check's promised
wait reads it (codel's view of the queue, Retry-After and the job's own time stay as they are).

:class:`PromptWeightFit` is the per-job fit of the round before (``--prompt-weight fit``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sluice.core.capacity import DrainRate

#: Weight of the newest finished job in the fit's moving averages (a running mean before
#: ``1 / MIX_ALPHA`` jobs have finished).
MIX_ALPHA = 0.02
#: Finished jobs before the fit is read (before: the mix is not judged, the factor is 1).
MIX_MIN_SAMPLES = 20
#: The most the mix lengthens (or, both ways, shortens by its inverse) a promised wait.
MIX_MAX_FACTOR = 2.0


#: Weight of the newest finished job in :class:`PromptWeightFit`'s moving averages.
FIT_ALPHA = 0.01
#: Finished jobs before :class:`PromptWeightFit` reads its weight (before: the weight given).
FIT_MIN_SAMPLES = 20


@dataclass
class PromptWeightFit:
    """A least-squares fit, without intercept, of a finished job's service seconds on its prompt
    tokens and its ``max_tokens`` (``s ≈ a·prompt + b·max_tokens``, over moving averages of the
    products, weight :data:`FIT_ALPHA`): the prompt weight is ``a / b``, within [0, 1]. Where the
    prompts hardly vary (or every job asks for the same ``max_tokens`` and the fit has too little
    spread in the prompts to draw the line) the weight stays what it was.

    Attributes:
        pp, pm, mm: the moving averages of prompt², prompt · max_tokens and max_tokens².
        ps, ms: the moving averages of prompt · service seconds and max_tokens · service seconds.
        samples: the finished jobs fitted (the weight is read from the :data:`FIT_MIN_SAMPLES`-th on).
    """

    pp: float = 0.0
    pm: float = 0.0
    mm: float = 0.0
    ps: float = 0.0
    ms: float = 0.0
    samples: int = 0

    def observe(self, prompt: int, max_tokens: int, service_s: float, weight: float) -> float:
        """One finished job into the fit; the weight then (``weight``: the one before)."""
        a = FIT_ALPHA if self.samples else 1.0
        p, m, s = float(prompt), float(max_tokens), service_s
        self.pp += a * (p * p - self.pp)
        self.pm += a * (p * m - self.pm)
        self.mm += a * (m * m - self.mm)
        self.ps += a * (p * s - self.ps)
        self.ms += a * (m * s - self.ms)
        self.samples += 1
        det = self.pp * self.mm - self.pm * self.pm
        if self.samples < FIT_MIN_SAMPLES or det <= 0.01 * self.pp * self.mm:  # prompts spread by < 10 %
            return weight
        on_prompt = (self.ps * self.mm - self.pm * self.ms) / det
        on_max = (self.pp * self.ms - self.pm * self.ps) / det
        if on_max <= 0:
            return weight
        return min(max(on_prompt / on_max, 0.0), 1.0)


def _solve3(a: list[list[float]], y: list[float]) -> list[float] | None:
    """``a · x = y`` for a 3-by-3 ``a`` by Cramer's rule; None where it is (nearly) singular."""

    def det(m: list[list[float]]) -> float:
        return (
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        )

    d = det(a)
    scale = a[0][0] * a[1][1] * a[2][2]
    if scale <= 0 or abs(d) < 1e-9 * scale:
        return None
    out = []
    for k in range(3):
        m = [row[:] for row in a]
        for i in range(3):
            m[i][k] = y[i]
        out.append(det(m) / d)
    return out


@dataclass
class PromptMixDrain(DrainRate):
    """:class:`DrainRate`, with the prompt weight learnt from the finishes and the promised wait
    judged at the queue's mix (the module's doc).

    Attributes:
        mix_both: the factor both ways (a queue of prompts dearer than the mix promised a shorter
            wait too); else only ever longer.
        mix_share: the factor's exponent (1: all the way; 0.5: half, on a log scale).
        mix_ridge: the fit's prompt term shrunk toward 0 (no mix effect) by this share of the
            prompts' variance.
        mix_own: the job's own time promised at its own mix too (:meth:`slow_service_s`).
        ahead_prompt, ahead_cost: the queue ahead's prompt tokens and cost, told by the caller
            before each admission; own_prompt, own_cost: the job's own (``mix_own``).
        mix_samples: the finished jobs fitted (:meth:`observe_mix`; the weight is read from the
            :data:`MIX_MIN_SAMPLES`-th on).
        zz, zs: the moving averages (:data:`MIX_ALPHA`) of z zᵀ's six entries (upper triangle, row
            by row) and of z · s, for z = (g, g·u, p) and s the job's service seconds.
        mean_p, mean_g, mean_m: the moving averages (:data:`MIX_ALPHA`) of a finished job's prompt
            tokens, generated tokens and ``max_tokens``.
        rate_prompt, rate_cost: the moving averages, at the rate's own weight (:attr:`weight`), of
            a finished job's prompt tokens and its cost (prompt + ``max_tokens``): the mix the
            drain rate was measured on.
    """

    mix_both: bool = False
    mix_own: bool = False
    own_prompt: int = 0
    own_cost: int = 0
    mix_ridge: float = 0.5
    mix_share: float = 1.0
    mix_samples: int = 0
    zz: tuple[float, ...] = (0.0,) * 6
    zs: tuple[float, ...] = (0.0,) * 3
    mean_p: float = 0.0
    mean_g: float = 0.0
    mean_m: float = 0.0
    rate_prompt: float = 0.0
    rate_cost: float = 0.0
    ahead_prompt: int = 0
    ahead_cost: int = 0

    def observe_mix(
        self, prompt: int, max_tokens: int, generated: int, service_s: float, running: float
    ) -> None:
        """One finished job (after :meth:`observe`): its prompt and ``max_tokens``, the tokens it
        generated, its service seconds and the jobs running beside it (as :meth:`observe`)."""
        if service_s <= 0 or generated <= 0:
            return
        u = min(running / max(self.slots, 1), 1.0) if running > 0 else self.fill
        g, p, m = float(generated), float(prompt), float(max_tokens)
        z = (g, g * u, p)
        self.mix_samples += 1
        a = max(MIX_ALPHA, 1.0 / self.mix_samples)
        pairs = [z[i] * z[j] for i in range(3) for j in range(i, 3)]
        self.zz = tuple(old + a * (new - old) for old, new in zip(self.zz, pairs, strict=True))
        self.zs = tuple(old + a * (zi * service_s - old) for old, zi in zip(self.zs, z, strict=True))
        self.mean_p += a * (p - self.mean_p)
        self.mean_g += a * (g - self.mean_g)
        self.mean_m += a * (m - self.mean_m)
        r = self.weight if self.mix_samples > 1 else 1.0
        self.rate_prompt += r * (p - self.rate_prompt)
        self.rate_cost += r * (p + m - self.rate_cost)

    @property
    def prompt_weight(self) -> float | None:
        """What a prompt token costs a full batch against a ``max_tokens`` one (None: not yet
        learnt, or the fit has no answer)."""
        if self.mix_samples < MIX_MIN_SAMPLES or self.mean_g <= 0 or self.mean_m <= 0:
            return None
        gg, ggu, gp, gugu, gup, pp = self.zz
        var_p = pp - self.mean_p * self.mean_p
        ridge = self.mix_ridge * (var_p if var_p > 0 else 0.0)
        fit = _solve3([[gg, ggu, gp], [ggu, gugu, gup], [gp, gup, pp + ridge]], list(self.zs))
        if fit is None:
            return None
        b0, b1, c = fit
        c = c if c > 0 else 0.0
        n = self.slots if self.slots > 1 else 1
        per_token = b0 + b1  # a generated token's slot-seconds in a full batch, stalls included
        if per_token <= 0:
            return None
        pure = per_token - c * n * self.mean_p / self.mean_g
        pure = pure if pure > 0.2 * per_token else 0.2 * per_token
        return c * n / (pure * self.mean_g / self.mean_m)

    def mix_factor(self, own: bool = False) -> float:
        """How much longer per cost unit the queue ahead (:attr:`ahead_prompt`, :attr:`ahead_cost`;
        ``own``: the job itself, :attr:`own_prompt`, :attr:`own_cost`) drains than the mix the rate
        was measured on: 1 before the weight is learnt."""
        w = self.prompt_weight
        prompt, cost = (self.own_prompt, self.own_cost) if own else (self.ahead_prompt, self.ahead_cost)
        if w is None or cost <= 0 or self.rate_cost <= 0:
            return 1.0
        x_q = prompt / cost
        x_r = self.rate_prompt / self.rate_cost
        factor = math.pow((w * x_q + 1.0 - x_q) / (w * x_r + 1.0 - x_r), self.mix_share)
        if not math.isfinite(factor):
            return 1.0
        low = 1.0 / MIX_MAX_FACTOR if self.mix_both else 1.0
        return min(max(factor, low), MIX_MAX_FACTOR)

    def promised_wait_s(
        self, tokens_ahead: int, jobs_ahead: int = 0, *, slowdown: float | None = None
    ) -> float:
        return super().promised_wait_s(tokens_ahead, jobs_ahead, slowdown=slowdown) * self.mix_factor()

    def slow_service_s(self, cost: int, *, behind_queue: bool = True, slowdown: float | None = None) -> float:
        own = super().slow_service_s(cost, behind_queue=behind_queue, slowdown=slowdown)
        return own * self.mix_factor(own=True) if self.mix_own and cost == self.own_cost else own
