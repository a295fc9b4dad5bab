"""The embedded store: one directory on the local disk (``files_dir``), for ``sluice serve``.

Layout under the directory::

    files/<id>.json          a file's record            (written whole, then renamed into place)
    files/<id>.data          its content                (the same; written before the record)
    batches/<id>.json        a batch's record           (the same)
    batches/<id>.cancel      when a cancel was asked    (the same)
    batches/<id>.jobs        custom_id → job id, one JSON line each, appended and fsynced
    batches/<id>.results     one JSON line per result, appended and fsynced; the first of a
                             custom_id counts, and a torn last line (a crash mid-write) is skipped

Every write is fsynced before it is acknowledged, so what a batch reported survives a crash of the
process or the machine. One process owns the directory (a lock file says which): the leases are
that process's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

from sluice.filestore.base import TERMINAL_BATCH_STATUSES, BatchStore, FileMeta, Page, page_after

log = logging.getLogger("sluice.batches")


# The longest id that becomes a file name here. The store's own ids are far shorter; a longer one,
# sent by a client, names nothing, and must not reach the file system, which would refuse a name
# over 255 bytes with an OSError instead of "no such file".
MAX_ID_BYTES = 200


def _check_name(item_id: str, what: str) -> None:
    """Raise ValueError for an id that cannot be one of this store's file names: a path separator,
    a leading dot, a NUL, or more than MAX_ID_BYTES bytes. Callers read ValueError as not found."""
    if "/" in item_id or "\0" in item_id or item_id.startswith("."):
        raise ValueError(f"bad {what} id")
    if len(item_id.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise ValueError(f"{what} id too long")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _sync_dir(path.parent)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _append(path: Path, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of an append-only log; a torn or unreadable line is skipped."""
    out: list[dict[str, Any]] = []
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return out
    for raw in text.split("\n"):
        if not raw:
            continue
        try:
            item = json.loads(raw)
        except ValueError:
            continue
        if isinstance(item, dict):
            out.append(item)
    return out


class DiskStore(BatchStore):
    """Files and batches under ``root`` (created if missing)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._files = self.root / "files"
        self._batches = self.root / "batches"
        self._lock: IO[bytes] | None = None
        #: per batch: custom_id → (ok, line), read from disk once
        self._results: dict[str, dict[str, tuple[bool, str]]] = {}
        self._jobs: dict[str, dict[str, str]] = {}
        self._leases: dict[str, tuple[str, float]] = {}
        #: one writer at a time per log, so that lines never interleave
        self._io = asyncio.Lock()

    async def start(self) -> None:
        """Take the directory, unless another process holds it: then this process serves no Batch
        API (its routes answer 503, ``unavailable`` says why) and everything else as usual."""
        try:
            self._files.mkdir(parents=True, exist_ok=True)
            self._batches.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / "lock", "ab")  # noqa: SIM115, ASYNC230 (held until close; instant)
        except OSError as exc:
            self.unavailable = f"the files directory {self.root} cannot be used: {exc.strerror}"
            log.warning("Batch API off: %s", self.unavailable)
            return
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            self.unavailable = f"another Sluice process uses the files directory {self.root}"
            log.warning("Batch API off: %s (set files_dir)", self.unavailable)
            return
        self._lock = lock
        self.unavailable = None

    async def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # --- files ---------------------------------------------------------------------------------

    def _file_paths(self, file_id: str) -> tuple[Path, Path]:
        _check_name(file_id, "file")
        return self._files / f"{file_id}.json", self._files / f"{file_id}.data"

    async def put_file(self, meta: FileMeta, content: bytes) -> None:
        record, data = self._file_paths(meta.id)

        def write() -> None:
            _write_atomic(data, content)
            _write_atomic(record, json.dumps(meta.to_dict()).encode())

        await asyncio.to_thread(write)

    async def get_file(self, file_id: str) -> FileMeta | None:
        try:
            record, _ = self._file_paths(file_id)
            return FileMeta.from_dict(json.loads(record.read_bytes()))
        except (FileNotFoundError, ValueError):
            return None

    async def file_content(self, file_id: str) -> bytes | None:
        try:
            record, data = self._file_paths(file_id)
        except ValueError:
            return None
        if not record.exists():
            return None
        try:
            return await asyncio.to_thread(data.read_bytes)
        except FileNotFoundError:
            return None

    async def delete_file(self, file_id: str) -> bool:
        try:
            record, data = self._file_paths(file_id)
        except ValueError:
            return False
        if not record.exists():
            return False
        record.unlink(missing_ok=True)  # the record first: a listed file always has its content
        data.unlink(missing_ok=True)
        return True

    async def list_files(
        self, tenant: str, *, purpose: str | None, limit: int, after: str | None, ascending: bool
    ) -> Page:
        def read() -> list[dict[str, Any]]:
            out = []
            for path in self._files.glob("*.json"):
                with contextlib.suppress(ValueError, OSError):
                    out.append(json.loads(path.read_bytes()))
            return out

        items = [
            f
            for f in await asyncio.to_thread(read)
            if f.get("tenant") == tenant and (purpose is None or f.get("purpose") == purpose)
        ]
        items.sort(key=lambda f: (f["created_at"], f["id"]), reverse=not ascending)
        return page_after(items, limit, after)

    # --- batches -------------------------------------------------------------------------------

    def _batch_path(self, batch_id: str, suffix: str) -> Path:
        _check_name(batch_id, "batch")
        return self._batches / f"{batch_id}.{suffix}"

    async def put_batch(self, batch: dict[str, Any]) -> None:
        path = self._batch_path(batch["id"], "json")
        await asyncio.to_thread(_write_atomic, path, json.dumps(batch).encode())

    async def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self._batch_path(batch_id, "json").read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        return data

    def _all_batches(self) -> list[dict[str, Any]]:
        out = []
        for path in self._batches.glob("*.json"):
            with contextlib.suppress(ValueError, OSError):
                out.append(json.loads(path.read_bytes()))
        return out

    async def list_batches(self, tenant: str, *, limit: int, after: str | None) -> Page:
        items = [
            b
            for b in await asyncio.to_thread(self._all_batches)
            if b.get("_sluice", {}).get("tenant") == tenant
        ]
        items.sort(key=lambda b: (b["_sluice"].get("created", b["created_at"]), b["id"]), reverse=True)
        return page_after(items, limit, after)

    async def active_batches(self) -> list[str]:
        batches = await asyncio.to_thread(self._all_batches)
        return [b["id"] for b in batches if b.get("status") not in TERMINAL_BATCH_STATUSES]

    async def request_cancel(self, batch_id: str, at: float) -> float:
        earlier = await self.cancel_requested(batch_id)
        if earlier is not None:
            return earlier
        await asyncio.to_thread(_write_atomic, self._batch_path(batch_id, "cancel"), repr(at).encode())
        return at

    async def cancel_requested(self, batch_id: str) -> float | None:
        try:
            return float(self._batch_path(batch_id, "cancel").read_text())
        except (FileNotFoundError, ValueError):
            return None

    # --- progress ------------------------------------------------------------------------------

    async def set_job(self, batch_id: str, custom_id: str, job_id: str) -> None:
        jobs = await self.jobs(batch_id)
        async with self._io:
            line = json.dumps({"custom_id": custom_id, "job_id": job_id})
            await asyncio.to_thread(_append, self._batch_path(batch_id, "jobs"), line)
        jobs[custom_id] = job_id

    async def jobs(self, batch_id: str) -> dict[str, str]:
        jobs = self._jobs.get(batch_id)
        if jobs is None:
            lines = await asyncio.to_thread(_read_lines, self._batch_path(batch_id, "jobs"))
            jobs = self._jobs[batch_id] = {str(x["custom_id"]): str(x["job_id"]) for x in lines}
        return jobs

    async def _loaded_results(self, batch_id: str) -> dict[str, tuple[bool, str]]:
        results = self._results.get(batch_id)
        if results is None:
            results = {}
            for x in await asyncio.to_thread(_read_lines, self._batch_path(batch_id, "results")):
                results.setdefault(str(x["custom_id"]), (bool(x["ok"]), str(x["line"])))
            self._results[batch_id] = results
        return results

    async def add_result(self, batch_id: str, custom_id: str, ok: bool, line: str) -> bool:
        results = await self._loaded_results(batch_id)
        async with self._io:
            if custom_id in results:
                return False
            record = json.dumps({"custom_id": custom_id, "ok": ok, "line": line})
            await asyncio.to_thread(_append, self._batch_path(batch_id, "results"), record)
            results[custom_id] = (ok, line)
        return True

    async def results(self, batch_id: str) -> dict[str, tuple[bool, str]]:
        return dict(await self._loaded_results(batch_id))

    async def result_counts(self, batch_id: str) -> tuple[int, int]:
        results = await self._loaded_results(batch_id)
        ok = sum(1 for good, _ in results.values() if good)
        return ok, len(results) - ok

    # --- leases (this process's own: it alone uses the directory) ------------------------------

    async def take_lease(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        now = time.monotonic()
        held = self._leases.get(batch_id)
        if held is not None and held[0] != owner and held[1] > now:
            return False
        self._leases[batch_id] = (owner, now + ttl_s)
        return True

    async def release_lease(self, batch_id: str, owner: str) -> None:
        held = self._leases.get(batch_id)
        if held is not None and held[0] == owner:
            del self._leases[batch_id]
