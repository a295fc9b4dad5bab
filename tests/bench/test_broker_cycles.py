"""The broker benchmark's throw-away redis-server: it yields once the server answers PING, and a
server that exits before answering is an error, not a wait until the bound; and a small run
reports what it counted."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis import Redis

from sluice.bench.broker_cycles import _wait_for_ping, redis_server, run_redis
from sluice.bench.cli import free_port


def test_the_server_answers_once_yielded() -> None:
    with redis_server() as url:
        client = Redis.from_url(url)
        try:
            assert client.ping()
        finally:
            client.close()


def test_a_server_that_exits_first_is_an_error() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(timeout=30)
    with pytest.raises(RuntimeError, match="exited with 3"):
        url = f"redis://127.0.0.1:{free_port()}/0"
        _wait_for_ping(proc, url, within_s=30, socket_timeout_s=0.5, poll_s=0.01)


def test_a_run_counts_its_calls_and_the_pipelines_depth() -> None:
    """Every cycle makes at least its three calls (admit, claim, finish), every pipeline carries at
    least one command, and Redis's system time is a part of its CPU; and the run leaves no process
    behind (a spawn context's resource tracker once lived on until pytest exited)."""
    before = set(_children())
    with redis_server() as url:
        run = run_redis(url, 200, 1, 2, 4)
    assert run.calls >= 3.0
    assert run.depth >= 1.0
    assert 0.0 <= run.redis_sys_us <= run.redis_cpu_us
    # Bounded: a child may still be exiting on a loaded machine. Those alive before are not ours.
    deadline = time.monotonic() + 30
    while left := [p for p in _children() if p not in before]:
        assert time.monotonic() < deadline, f"child processes left alive: {[_cmdline(p) for p in left]}"
        time.sleep(0.05)


def _children() -> list[int]:
    """This process's live children (a zombie not yet reaped is gone as far as this counts)."""
    listed = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    pids = [int(p) for p in listed.read_text().split()] if listed.exists() else []
    return [p for p in pids if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid} (gone)"
