from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.local_engine.procs import alive


@pytest.fixture(autouse=True)
def _no_leftover_children() -> Iterator[None]:
    yield
    # Every engine or build a test started must be gone when the test ends.
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    if children.exists():
        pids = [int(p) for p in children.read_text().split()]
        assert not [p for p in pids if alive(p)], f"leftover child processes: {pids}"
