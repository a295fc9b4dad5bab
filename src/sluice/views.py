"""How a job is shown to clients: the one JSON view of ``GET /v1/jobs/{id}``, the terminal events,
the admin API's dead letters and the webhooks' payloads."""

from __future__ import annotations

from typing import Any

from sluice.core.job import Job


def job_view(job: Job) -> dict[str, Any]:
    """The public JSON view of a job (``GET /v1/jobs/{id}`` and the terminal events)."""
    return {
        "id": job.id,
        "object": "job",
        "model": job.model,
        "status": job.state.value,
        "priority": job.priority,
        "created_at": job.created_at,
        "timings": job.timings(),
        "attempts": job.attempts,
        "result": job.result,
        "usage": job.usage,
        "error": job.error.to_dict() if job.error else None,
        "callback_url": job.callback_url,
        "deliveries": job.extra.get("deliveries", []),
    }
