"""The errors a job can end with that Sluice itself decides (not the engine): one constructor each.

Clients read these records (``error`` in a job's view and terminal event), so their messages and
codes are part of the API. Both brokers and the dispatcher build them here. The Redis scripts settle
jobs without calling back into Python, so the Redis broker hands them the record as JSON; where the
message carries a number that only the script knows, it passes a placeholder in its place
(``UNFINISHABLE_LEFT``, ``WORKER_LOST_ATTEMPTS``) that the script fills in.
"""

from __future__ import annotations

from sluice.core.job import JobError

#: What the Redis scripts replace with the seconds that were left (formatted ``%.1f``).
UNFINISHABLE_LEFT = "{left}"
#: What the Redis scripts replace with the number of attempts.
WORKER_LOST_ATTEMPTS = "{attempts}"


def deadline_error() -> JobError:
    """Why a job expired: its deadline passed, queued or running."""
    return JobError("The job's deadline passed before it could finish.", "server_error", "deadline_exceeded")


def unfinishable_error(left_s: float | str) -> JobError:
    """Why a job expired at dispatch: ``left_s`` seconds were left, less than its generation needs at
    the measured rate (it would be aborted half-way). A string is put in as it is (a placeholder)."""
    left = left_s if isinstance(left_s, str) else f"{left_s:.1f}"
    return JobError(
        f"Dropped before dispatch: {left} s were left before the deadline, less than the generation needs.",
        "server_error",
        "deadline_exceeded",
    )


def cancelled_error() -> JobError:
    """Why a job was cancelled: its client asked (explicitly, or by hanging up a synchronous call)."""
    return JobError("The job was cancelled.", "invalid_request_error", "cancelled")


def internal_error() -> JobError:
    """Why a job failed for good on a fault of Sluice's or of a backend adapter (an exception that
    is no engine's answer): another attempt would fail the same way."""
    return JobError("The job failed on an internal error.", "server_error", "internal_error")


def worker_lost_error(attempts: int | str) -> JobError:
    """Why a job failed for good: the worker running it was lost (its lease ran out) ``attempts``
    times, its ``max_attempts``. A string is put in as it is (a placeholder)."""
    return JobError(
        f"The worker running the job was lost {attempts} times; giving up.",
        "server_error",
        "attempts_exhausted",
    )


def evicted_error() -> JobError:
    """Why a queued job failed: a bound of its queue was reached, and as the newest job of the
    tenant with the most queued it gave way to another tenant's (``admission.check_bounds``)."""
    return JobError(
        "Evicted from the full queue: this tenant had the most jobs waiting, and its newest gave way "
        "to another tenant's request; retry later.",
        "server_error",
        "evicted",
    )
