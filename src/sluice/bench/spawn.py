"""The servers a bench run spawns (simulators, gateways, peer routers) as child processes, and
the ports they take: shared by ``sluice bench`` (:mod:`sluice.bench.cli`), ``sluice bench
fleet`` (:mod:`sluice.bench.fleet`) and the other benchmarks, so none of them imports another's
command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

__all__ = [
    "Targets",
    "choose_port",
    "free_port",
    "log_file",
    "port_number",
    "spawn_gateway",
    "spawn_listener",
    "spawn_sim",
    "spawn_sluice",
    "stop",
    "stop_process",
]


@dataclass
class Targets:
    """Where the load goes and what to read alongside it."""

    target: str
    mode: str
    engine_metrics: str | None = None
    gateway_metrics: str | None = None
    capacity: float | None = None
    capacity_source: str | None = None
    processes: list[asyncio.subprocess.Process] = field(default_factory=list)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a child process to bind)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_number(text: str) -> int:
    """A port number from the command line, 1 to 65535 (argparse ``type``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535, not {value}")
    return value


def choose_port(requested: int | None) -> int:
    """``requested`` if nothing listens on it on 127.0.0.1, else ValueError; a free one if None.

    Checked before a child is started on it: a server already there would answer the readiness
    probe in the child's place, and the run would measure the wrong server. SO_REUSEADDR, as the
    servers bind, so that the connections a previous run's server left in TIME_WAIT do not count.
    """
    if requested is None:
        return free_port()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", requested))
        except OSError as exc:
            raise ValueError(f"port {requested} on 127.0.0.1 is taken ({exc.strerror or exc})") from None
    return requested


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        proc.kill()
        await proc.wait()


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """:func:`stop` for a process started without asyncio: SIGTERM, then SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


async def spawn_listener(
    argv: list[str], log: IO[bytes], what: str
) -> tuple[asyncio.subprocess.Process, str]:
    """Start ``python ARGV``, a server that binds its own port and prints ``listening on URL`` first."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdout=asyncio.subprocess.PIPE, stderr=log
    )
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    except TimeoutError:
        line = ""
    if "listening on " not in line:
        await stop(proc)
        raise RuntimeError(f"the {what} did not start (see {log.name})")
    return proc, line.split("listening on ")[1].split()[0]


async def spawn_sim(
    preset_name: str, log: IO[bytes], port: int | None = None, extra: list[str] | None = None
) -> tuple[asyncio.subprocess.Process, str]:
    """``sluice sim --preset PRESET`` with ``extra`` flags (they override the preset's); its URL."""
    # Without a chosen port the simulator binds port 0 itself: no window for another to take it.
    listen = "0" if port is None else str(choose_port(port))
    argv = ["-m", "sluice.cli", "sim", "--preset", preset_name, "--port", listen, *(extra or [])]
    return await spawn_listener(argv, log, "simulator")


async def spawn_sluice(
    backend: str, concurrency: int, extra: list[str], log: IO[bytes], port: int | None = None
) -> tuple[asyncio.subprocess.Process, str]:
    args = ["--backend", backend, "--max-concurrency", str(concurrency), *extra]
    return await spawn_gateway(args, log, port)


async def spawn_gateway(
    serve_args: list[str], log: IO[bytes], port: int | None = None
) -> tuple[asyncio.subprocess.Process, str]:
    """``sluice serve SERVE_ARGS`` on ``port`` (a free one if None), once ``/readyz`` answers 200."""
    port = choose_port(port)
    # Flags given later win: the caller's may override the log level.
    args = ["--port", str(port), "--log-level", "warning", *serve_args]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sluice.cli", "serve", *args, stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=2.0) as http:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.returncode is None:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"{url}/readyz")).status_code == 200:
                    return proc, url
            await asyncio.sleep(0.1)
    await stop(proc)
    raise RuntimeError(f"the gateway did not become ready (see {log.name})")


def log_file(path: Path) -> IO[bytes]:
    # Children write their logs straight into the file, so the bench never has to drain a pipe.
    return open(path, "wb")
