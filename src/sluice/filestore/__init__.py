"""Where the Batch API keeps files and batches: on the local disk, or in the broker's Redis."""

from __future__ import annotations

from pathlib import Path

from sluice.broker.redis_topology import SCHEMES
from sluice.filestore.base import BatchStore, FileMeta, Page

__all__ = ["BatchStore", "FileMeta", "Page", "create_store"]


def create_store(broker_url: str, files_dir: str | Path) -> BatchStore:
    """The broker's Redis when the broker is one (every gateway shares it), else ``files_dir`` on the
    local disk (one process, ``sluice serve``)."""
    if broker_url.startswith(SCHEMES):
        from sluice.filestore.redis import RedisStore

        return RedisStore(broker_url)
    from sluice.filestore.disk import DiskStore

    return DiskStore(files_dir)
