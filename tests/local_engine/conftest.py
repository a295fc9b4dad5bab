from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.local_engine.procs import alive


@pytest.fixture(autouse=True)
def _no_leftover_children() -> Iterator[None]:
    # Every engine or build a test started must be gone when the test ends. A child that was
    # there before the test is another test's (a server still shutting down on a loaded machine
    # once failed all of this package's tests), and is that test's to answer for.
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    before = set(_pids(children))
    yield
    started = [p for p in _pids(children) if p not in before]
    assert not [p for p in started if alive(p)], f"leftover child processes: {started}"


def _pids(children: Path) -> list[int]:
    """This process's children now (none where the kernel does not list them)."""
    return [int(p) for p in children.read_text().split()] if children.exists() else []
