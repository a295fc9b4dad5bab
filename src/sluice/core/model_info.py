"""What the workers know of a model they serve: the engine's own account of it, and what they learn.

A worker fills one :class:`ModelInfo` per model from its engines' model lists (``/v1/models``) and
from the jobs it finishes, and keeps it in the broker beside its registration; the gateway reads it
for ``/v1/models`` and to estimate what a request without a length limit costs
(:func:`sluice.core.request.plan_job`). Several workers may describe one model: :func:`merge`
makes one account of theirs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ModelInfo", "merge"]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One model, as the workers that serve it know it.

    Attributes:
        created: when the model was created, in seconds since the epoch: the engine's ``created``
            when it gives one, else when the worker first listed the model; 0 when unknown.
        context_window: the most tokens a sequence may hold, prompt and completion together: the
            engine's ``max_model_len`` (vLLM), or llama-server's context per slot; None when the
            engine does not say.
        output_tokens: how many tokens one sequence of the model generates when the engine decides
            the length (a request that sets no limit), as learned from finished jobs
            (:class:`sluice.core.output_lengths.OutputLengths`); None until enough have finished.
        output_samples: how many finished jobs ``output_tokens`` was learned from.
    """

    created: int = 0
    context_window: int | None = None
    output_tokens: int | None = None
    output_samples: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelInfo:
        """The record :meth:`to_dict` wrote; fields it does not know (a newer worker's) are left out."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def merge(accounts: Iterable[ModelInfo]) -> ModelInfo:
    """One account of a model from several workers': the earliest creation time, the smallest
    context window (a request must fit whichever engine runs it), and the output length learned
    from the most jobs."""
    infos = list(accounts)
    if not infos:
        return ModelInfo()
    created = [i.created for i in infos if i.created > 0]
    windows = [i.context_window for i in infos if i.context_window is not None]
    learned = max(infos, key=lambda i: i.output_samples)
    return ModelInfo(
        created=min(created) if created else 0,
        context_window=min(windows) if windows else None,
        output_tokens=learned.output_tokens,
        output_samples=learned.output_samples,
    )
