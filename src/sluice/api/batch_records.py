"""A batch's record and OpenAI's Batch object made from it: what the routes (:mod:`sluice.api.batches`)
write and show, and the batch runner (:mod:`sluice.batches`) reads.

The runner itself stands above the API (it turns lines into jobs through the gateway); the routes
need of it only what :class:`BatchRunning` names, so they do not import it.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from sluice.api.auth import Caller
from sluice.core.job import Endpoint
from sluice.filestore.base import TERMINAL_BATCH_STATUSES, BatchStore


class BatchRunning(Protocol):
    """What the routes need of the batch runner (``app.state.batches``): the store that holds files
    and batches, and a poke when a batch was created or cancelled, so it looks at once."""

    @property
    def store(self) -> BatchStore: ...

    def poke(self) -> None: ...


#: the batch endpoints and the job endpoint each one's lines become
ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": Endpoint.CHAT,
    "/v1/completions": Endpoint.COMPLETIONS,
}

_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smh])$")


def window_seconds(window: str) -> float | None:
    """A completion window (``24h``, ``90m``, ``30s``) in seconds; None when it is not one."""
    m = _WINDOW.match(window)
    if m is None:
        return None
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def new_batch(
    batch_id: str,
    caller: Caller,
    *,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    window_s: float,
    metadata: dict[str, str] | None,
    now: float,
) -> dict[str, Any]:
    """A batch's record as it is created: OpenAI's Batch object, and Sluice's own fields under
    ``_sluice`` (the tenant, the key it runs as, its deadline and creation in seconds since the
    epoch, the latter for the listing's order)."""
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": endpoint,
        "model": None,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": completion_window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": int(now),
        "in_progress_at": None,
        "expires_at": int(now + window_s),
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "usage": None,
        "metadata": metadata,
        "_sluice": {
            "tenant": caller.tenant,
            "key_sha256": caller.key_sha256,
            "keyed": caller.keyed,
            "deadline": now + window_s,
            "created": now,
        },
    }


async def batch_object(store: BatchStore, record: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's Batch object for a record: its live counts, and ``cancelling`` as soon as a cancel
    was asked (the runner writes the record itself a moment later)."""
    out = {k: v for k, v in record.items() if k != "_sluice"}
    status = out["status"]
    if status not in TERMINAL_BATCH_STATUSES:
        if status == "in_progress":
            completed, failed = await store.result_counts(record["id"])
            out["request_counts"] = {**out["request_counts"], "completed": completed, "failed": failed}
        asked = await store.cancel_requested(record["id"])
        if asked is not None and status != "cancelling":
            out["status"] = "cancelling"
            out["cancelling_at"] = int(asked)
    return out
