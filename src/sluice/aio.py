"""The event loop every Sluice process runs on: uvloop where it is installed, else asyncio's own.

uvloop (libuv) wakes a waiting task in about half the time of the default selector loop; on a
gateway that answers refusals in a few milliseconds, that half is most of the budget.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop when it is available."""
    try:
        import uvloop
    except ImportError:  # e.g. Windows, where uvloop does not exist
        return asyncio.run(main)
    return uvloop.run(main)
