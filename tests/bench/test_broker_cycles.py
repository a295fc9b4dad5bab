"""The broker benchmark's throw-away redis-server: it yields once the server answers PING, and a
server that exits before answering is an error, not a wait until the bound; and a small run
reports what it counted."""

from __future__ import annotations

import subprocess
import sys

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
    least one command, and Redis's system time is a part of its CPU."""
    with redis_server() as url:
        run = run_redis(url, 200, 1, 2, 4)
    assert run.calls >= 3.0
    assert run.depth >= 1.0
    assert 0.0 <= run.redis_sys_us <= run.redis_cpu_us
