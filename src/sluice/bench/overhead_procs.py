"""The processes of :mod:`sluice.bench.overhead`: the simulated engine, the gateways in front of it
(the raw pass-through, ``sluice serve``, LiteLLM's proxy, gateways and workers on Redis), each its
own process logging to its own file, started, waited on until they answer, and stopped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx

from sluice.bench.broker_cycles import redis_server
from sluice.bench.cli import free_port
from sluice.bench.overhead_load import MODEL
from sluice.bench.spawn import stop_process

#: Where a group says what it left out (no redis-server, no LiteLLM).
Note = Callable[[str], None]


class Spawner:
    """Starts the benchmark's processes, each logging to its own file, and stops them all at the end."""

    def __init__(self, logs: Path) -> None:
        self._logs = logs
        self._procs: list[subprocess.Popen[bytes]] = []
        self._files: list[IO[bytes]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self._logs / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop_all)
        self._files.append(log)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self._procs.append(proc)
        return proc

    def sluice(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        return self.start(name, [sys.executable, "-m", "sluice.cli", *args])

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        stop_process(proc)

    def stop_all(self) -> None:
        for proc in reversed(self._procs):
            self.stop(proc)
        for log in self._files:
            log.close()


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """Poll ``url`` (GET) until it answers 200, at most ``timeout_s``; fails if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} (see its log)")
            with contextlib.suppress(httpx.HTTPError):
                if http.get(url).status_code == 200:
                    return
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def wait_answer(url: str, timeout_s: float = 60.0) -> None:
    """Send one short chat completion until it is answered 200 (a worker may still be starting)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout_s
    last = ""
    with httpx.Client(timeout=10.0) as http:
        while time.monotonic() < deadline:
            try:
                answer = http.post(f"{url}/v1/chat/completions", json=body)
                if answer.status_code == 200:
                    return
                last = f"{answer.status_code} {answer.text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.2)
    raise RuntimeError(f"{url} answered no chat completion within {timeout_s:.0f} s: {last}")


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def start_engine(spawner: Spawner, name: str, flags: list[str]) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    proc = spawner.sluice(name, "sim", "--model", MODEL, "--port", str(port), *flags)
    wait_ready(_url(port) + "/health", proc)
    return _url(port), proc


def start_gateway(
    spawner: Spawner, target: str, engine: str, slots: int, *, litellm_python: str | None, out: Path
) -> tuple[str, subprocess.Popen[bytes], str]:
    """Start ``target`` in front of ``engine``; its URL, its process, and the command, for the table.
    LiteLLM runs on ``litellm_python`` with its config written into ``out``."""
    port = free_port()
    if target == "passthrough":
        argv = [sys.executable, "-m", "sluice.bench.passthrough", "--upstream", engine, "--port", str(port)]
        proc, ready = spawner.start(target, argv), "/health"
        command = "python -m sluice.bench.passthrough --upstream ENGINE"
    elif target == "sluice":
        args = ["serve", "--backend", engine, "--max-concurrency", str(slots), "--port", str(port)]
        proc, ready = spawner.sluice(target, *args, "--log-level", "warning"), "/readyz"
        command = f"sluice serve --backend ENGINE --max-concurrency {slots}"
    elif target == "litellm":
        assert litellm_python is not None
        config = out / "litellm.yaml"
        model = {"model": f"openai/{MODEL}", "api_base": f"{engine}/v1", "api_key": "none"}
        # Open, as Sluice is on loopback without keys: no master key, so no key check on a request.
        general = {"dangerously_permit_weak_or_unset_master_key": True}
        litellm_config = {
            "model_list": [{"model_name": MODEL, "litellm_params": model}],
            "general_settings": general,
        }
        config.write_text(json.dumps(litellm_config))  # JSON is YAML: no YAML writer needed here
        code = "import sys; from litellm import run_server; sys.exit(run_server())"
        argv = [litellm_python, "-c", code, "--config", str(config), "--port", str(port)]
        # Its own copy of the model price list, not one fetched from GitHub at start-up.
        offline = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        proc, ready = spawner.start(target, argv, offline), "/health/liveliness"
        command = "litellm --config litellm.yaml (openai/sim at ENGINE)"
    else:
        raise ValueError(f"unknown target {target!r}")
    wait_ready(_url(port) + ready, proc, timeout_s=120)
    wait_answer(_url(port))
    return _url(port), proc, command


def litellm_python(requested: str | None) -> str | None:
    """A Python that runs LiteLLM's proxy: the one asked for, or this one if its proxy imports
    (the ``litellm`` package alone, as the dev extra has it for the client tests, lacks the
    proxy's own dependencies: ``pip install 'litellm[proxy]'``)."""
    if requested:
        return requested
    if importlib.util.find_spec("litellm") is None:
        return None
    check = subprocess.run(
        [sys.executable, "-c", "import litellm.proxy.proxy_server"],
        capture_output=True,
        timeout=120,
        check=False,
    )
    return sys.executable if check.returncode == 0 else None


def _redis_pid(url: str) -> int:
    from redis import Redis

    with Redis.from_url(url) as client:
        info: dict[str, Any] = client.info("server")
    return int(info["process_id"])


def have_redis(note: Note, what: str) -> bool:
    if shutil.which(os.environ.get("SLUICE_TEST_REDIS_SERVER", "redis-server")) is not None:
        return True
    note(f"{what}: no redis-server on the PATH (or at $SLUICE_TEST_REDIS_SERVER), left out")
    return False


@contextlib.contextmanager
def redis_fleet(
    spawner: Spawner, engine: str, count: int, slots: int
) -> Iterator[tuple[list[str], dict[str, list[int]], str]]:
    """``count`` gateways and ``count`` workers on a fresh Redis: their URLs, pids by role, the command."""
    with redis_server() as broker:
        workers, gateways, urls = [], [], []
        for i in range(count):
            args = ["worker", "--broker", broker, "--backend", engine, "--max-concurrency", str(slots)]
            workers.append(spawner.sluice(f"worker-{count}-{i}", *args, "--log-level", "warning"))
        for i in range(count):
            port = free_port()
            args = ["gateway", "--broker", broker, "--port", str(port), "--log-level", "warning"]
            gateways.append(spawner.sluice(f"gateway-{count}-{i}", *args))
            wait_ready(_url(port) + "/readyz", gateways[-1])
            urls.append(_url(port))
        for url in urls:
            wait_answer(url)
        roles = {
            "gateway": [p.pid for p in gateways],
            "workers": [p.pid for p in workers],
            "redis": [_redis_pid(broker)],
        }
        command = f"{count} x sluice gateway + {count} x sluice worker --max-concurrency {slots}, Redis"
        try:
            yield urls, roles, command
        finally:
            for proc in gateways + workers:
                spawner.stop(proc)
