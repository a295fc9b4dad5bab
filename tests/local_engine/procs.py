"""Process checks shared by the local engine's tests."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting to be reaped."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status
