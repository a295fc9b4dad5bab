"""What the Batch API keeps: uploaded files, batches, and each batch's progress line by line.

Two stores implement :class:`BatchStore` (docs/batches.md says why these two):

- :class:`sluice.filestore.disk.DiskStore`, the embedded default: one directory on the local disk,
  every write renamed into place or appended and fsynced, for ``sluice serve`` on one machine;
- :class:`sluice.filestore.redis.RedisStore`, the distributed mode: the Redis the broker already
  uses, so that every gateway sees every batch and one takes over a batch whose gateway died.

A batch's progress is two maps keyed by the line's ``custom_id``: the job each line was submitted
as, and the line's result. A result is written once: the first write of a ``custom_id`` wins and a
repeat is ignored, so a line run twice (a runner that died between the job's end and its record)
still appears once in the output.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

#: The statuses after which a batch never changes again.
TERMINAL_BATCH_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})


def new_file_id() -> str:
    return "file-" + secrets.token_urlsafe(18).replace("_", "x").replace("-", "y")


def new_batch_id() -> str:
    return "batch_" + secrets.token_urlsafe(18).replace("_", "x").replace("-", "y")


@dataclass(frozen=True)
class FileMeta:
    """An uploaded (or generated) file, without its content.

    Attributes:
        id: ``file-…``, unguessable.
        tenant: whose it is; only the tenant's keys see it.
        filename: the name it was uploaded under.
        purpose: ``batch`` for an input file, ``batch_output`` for a batch's output and error files.
        bytes: its size.
        created_at: when it was stored (seconds since the epoch).
    """

    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tenant": self.tenant,
            "filename": self.filename,
            "purpose": self.purpose,
            "bytes": self.bytes,
            "created_at": self.created_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FileMeta:
        return cls(
            id=str(data["id"]),
            tenant=str(data["tenant"]),
            filename=str(data["filename"]),
            purpose=str(data["purpose"]),
            bytes=int(data["bytes"]),
            created_at=float(data["created_at"]),
        )


@dataclass(frozen=True)
class Page:
    """One page of a listing: its items (dicts as stored) and whether more follow."""

    items: list[dict[str, Any]]
    has_more: bool


class BatchStore(ABC):
    """Files, batch records and batch progress. Batch records are JSON objects (the Batch
    object's fields, and Sluice's own under ``_sluice``); only the process holding a batch's lease
    writes its record, so that writes never cross (a cancel is a flag of its own)."""

    #: why the store cannot be used (None: it can); the Batch API answers 503 while it is set
    unavailable: str | None = "not started"

    async def start(self) -> None:
        """Open connections or directories."""
        self.unavailable = None

    async def close(self) -> None:
        """Release them."""

    # --- files ---------------------------------------------------------------------------------

    @abstractmethod
    async def put_file(self, meta: FileMeta, content: bytes) -> None:
        """Store a file whole (content first: a listed file always has its content)."""

    @abstractmethod
    async def get_file(self, file_id: str) -> FileMeta | None:
        """The file's record, None if there is none."""

    @abstractmethod
    async def file_content(self, file_id: str) -> bytes | None:
        """The file's bytes, None if there is none."""

    @abstractmethod
    async def delete_file(self, file_id: str) -> bool:
        """Forget a file; False if there was none."""

    @abstractmethod
    async def list_files(
        self, tenant: str, *, purpose: str | None, limit: int, after: str | None, ascending: bool
    ) -> Page:
        """The tenant's files by creation time (newest first unless ``ascending``), of ``purpose``
        when given, at most ``limit``, starting after the file ``after``."""

    # --- batches -------------------------------------------------------------------------------

    @abstractmethod
    async def put_batch(self, batch: dict[str, Any]) -> None:
        """Store (or replace) a batch record; a record whose status is not terminal is active."""

    @abstractmethod
    async def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        """The batch's record, None if there is none."""

    @abstractmethod
    async def list_batches(self, tenant: str, *, limit: int, after: str | None) -> Page:
        """The tenant's batches, newest first, at most ``limit``, starting after the batch ``after``."""

    @abstractmethod
    async def active_batches(self) -> list[str]:
        """Ids of the batches whose status is not terminal."""

    @abstractmethod
    async def request_cancel(self, batch_id: str, at: float) -> float:
        """Mark the batch for cancelling (once: the first time is kept); returns when it was asked."""

    @abstractmethod
    async def cancel_requested(self, batch_id: str) -> float | None:
        """When a cancel was asked for the batch, None if never."""

    # --- progress ------------------------------------------------------------------------------

    @abstractmethod
    async def set_job(self, batch_id: str, custom_id: str, job_id: str) -> None:
        """Remember the job a line was submitted as."""

    @abstractmethod
    async def jobs(self, batch_id: str) -> dict[str, str]:
        """The jobs the batch's lines were submitted as: custom_id → job id."""

    @abstractmethod
    async def add_result(self, batch_id: str, custom_id: str, ok: bool, line: str) -> bool:
        """Record a line's result (``ok``: for the output file, else the error file) unless the line
        has one already; True when this one was recorded."""

    @abstractmethod
    async def results(self, batch_id: str) -> dict[str, tuple[bool, str]]:
        """Every recorded result: custom_id → (ok, line)."""

    @abstractmethod
    async def result_counts(self, batch_id: str) -> tuple[int, int]:
        """How many results are recorded: (ok, failed)."""

    # --- who drives a batch --------------------------------------------------------------------

    @abstractmethod
    async def take_lease(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        """Hold (or renew) the batch's lease for ``owner`` for ``ttl_s`` seconds; False when another
        owner holds it."""

    @abstractmethod
    async def release_lease(self, batch_id: str, owner: str) -> None:
        """Give the lease back, if ``owner`` holds it."""


def page_after(items: list[dict[str, Any]], limit: int, after: str | None) -> Page:
    """The page of ``items`` (already in order) after the item with id ``after``; an ``after`` not
    among them gives an empty page."""
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            return Page([], False)
        start = ids.index(after) + 1
    chunk = items[start : start + limit]
    return Page(chunk, start + limit < len(items))
