"""Real Sluice processes for failure tests: gateways and workers that can be SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import httpx

from tests.helpers import free_port, wait_until


class Proc:
    """``python -m sluice.cli ARGS`` in its own session, its output in a log file."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.log = Path(tempfile.mkstemp(prefix="sluice-proc-", suffix=".log")[1])
        self.args = list(args)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", *self.args],
            env={**os.environ, "SLUICE_LOG_LEVEL": "warning", **(env or {})},
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: no goodbye, no cleanup — what a crash looks like."""
        if self.alive:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)

    def stop(self) -> None:
        if self.alive:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.unlink(missing_ok=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


async def wait_answering(proc: Proc, ready: Callable[[], Awaitable[bool]], timeout: float = 30) -> None:
    """Wait until ``ready()`` says the process answers; fails at once, with its log, if it died,
    and counts a connection that is refused (not listening yet) as not ready."""

    async def up() -> bool:
        assert proc.alive, proc.output()
        try:
            return await ready()
        except httpx.HTTPError:
            return False

    await wait_until(up, timeout=timeout)


async def answers(url: str) -> bool:
    """Whether ``url`` answers 200."""
    async with httpx.AsyncClient() as c:
        return (await c.get(url, timeout=1)).status_code == 200


async def start_gateway(broker: str, env: dict[str, str] | None = None) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(["gateway", "--broker", broker, "--port", str(port)], env)
    url = f"http://127.0.0.1:{port}"
    await wait_answering(proc, lambda: answers(url + "/healthz"))
    return proc, url


def start_worker(broker: str, backend: str, concurrency: int = 4, env: dict[str, str] | None = None) -> Proc:
    return Proc(
        ["worker", "--broker", broker, "--backend", backend, "--max-concurrency", str(concurrency)], env
    )


async def served(gateway_url: str, model: str = "sim") -> bool:
    async with httpx.AsyncClient() as c:
        r = await c.get(gateway_url + "/v1/models", timeout=2)
        return r.status_code == 200 and model in [m["id"] for m in r.json()["data"]]
