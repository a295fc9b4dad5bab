"""A worker process never loads the web framework: not on import, not while it runs."""

from __future__ import annotations

import subprocess
import sys

WEB = ("fastapi", "starlette", "sse_starlette", "uvicorn")

RUN_A_WORKER = (
    f"WEB = {WEB!r}\n"
    + """
import asyncio, sys
from sluice import runtime
from sluice.config import load_settings
from sluice.roles import worker  # noqa: F401  (the role's own module)

async def main():
    settings = load_settings(
        overrides={"backends": [{"url": "http://127.0.0.1:9", "models": ["m"]}]}, environ={}
    )
    async with runtime.running_worker(settings) as running:
        assert running.dispatcher.models() == ["m"]

asyncio.run(main())
print(sorted(m for m in sys.modules if m.split(".")[0] in WEB))
"""
)


def loaded_after(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_importing_the_dispatcher_loads_no_web_framework() -> None:
    code = (
        f"import sys, sluice.dispatcher; print(sorted(m for m in sys.modules if m.split('.')[0] in {WEB!r}))"
    )
    assert loaded_after(code) == "[]"


def test_a_running_worker_loads_no_web_framework() -> None:
    assert loaded_after(RUN_A_WORKER) == "[]"
