"""Gateway overhead: what one gateway process passes, how fast, and at what CPU cost per request.

A closed loop: ``--connections`` keep-alive connections each send a short chat completion, wait
for the whole answer and send the next at once, for ``--seconds`` after ``--warmup``. Every
process is its own, as in production, and each one's CPU time (user + system, from
``/proc/PID/stat``, children included) is read at the start and the end of the measured window,
so each row says what each process spent per request. Groups of rows:

* ``closed``: short non-streaming requests (``--tokens``, 8) against the engine directly, the raw
  pass-through reference (:mod:`sluice.bench.passthrough`: the floor of a Python proxy), Sluice
  (``sluice serve``, memory broker) and LiteLLM's proxy when it is installed;
* ``stream``: the same targets streamed, at ``--tokens`` and at ``--stream-tokens`` (64) tokens,
  for the CPU per relayed token (the difference of the two, per extra token) and the time to
  the first token under load;
* ``flood``: ``--flood-connections`` (64) in front of a saturated 16-sequence engine (the
  ``article`` preset): answers and refusals per second, and the CPU of each refusal;
* ``scaling``: Sluice on a real Redis (a ``redis-server`` started on a free port), with 1, 2, ...
  gateways (``--gateways``) and as many workers; the load is spread over the gateways;
* ``clients``: the gateway's HTTP client to the engine alone (httpx, set up as in
  :mod:`sluice.backends.openai`) against aiohttp's, each making the closed loop's requests from
  this process: what the client costs per request (the ``load`` CPU).

The engine for ``closed``, ``stream``, ``scaling`` and ``clients`` is the simulator with 256 slots
and 1.25 ms steps (an 8-token answer in 10 ms), so that the engine is not the limit. The load
generator is a minimal HTTP/1.1 client on uvloop in this process (its CPU is the ``load`` column).

Writes ``LABEL.json`` (every row) to ``--out``, and ``LABEL.png`` with ``--plot`` (the ``bench``
extra). ``--py-spy DIR`` records the Sluice gateway during each of its rows (py-spy's raw
collapsed stacks, ``DIR/ROW.txt``) and prints where its samples went: by library, by task, by frame.

Usage: python -m sluice.bench.overhead [--seconds 10] [--connections 32] [--groups closed,stream,...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple, cast
from urllib.parse import urlsplit

import httpx

from sluice.bench.broker_cycles import redis_server
from sluice.bench.cli import free_port
from sluice.sim.model import token_text

GROUPS = ("closed", "stream", "flood", "scaling", "clients")
TARGETS = ("engine", "passthrough", "sluice", "litellm")
MODEL = "sim"
# 256 slots, 1.25 ms per step whatever the batch: an 8-token answer in 10 ms, and 32 connections
# never fill the engine.
FAST_ENGINE = ["--max-num-seqs", "256", "--base-step-ms", "1.25", "--per-seq-ms", "0"]
FAST_ENGINE += ["--prefill-ms-per-token", "0"]
# The article's engine: 16 sequences, 16 ms steps (about 88 eight-token answers per second).
FLOOD_ENGINE = ["--preset", "article"]
FLOOD_SLOTS = 16
FAST_SLOTS = 256
# Every generated token's text starts with this (" tok0", " tok1", ...): counting it in the bytes
# received counts the tokens, streamed or not, without decoding JSON in the load generator.
TOKEN_MARK = token_text(0).rstrip("0").encode()
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# -- CPU accounting --------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: the fields start after the last ')'.
    return text[text.rindex(")") + 2 :].split()


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, of every process now running."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields_ := _stat_fields(int(entry))) is not None:
            tree.setdefault(int(fields_[1]), []).append(int(entry))
    return tree


def cpu_seconds(pids: Sequence[int]) -> float | None:
    """User + system CPU seconds of these processes and all their descendants; None without /proc."""
    if not Path("/proc/self/stat").exists():
        return None
    tree, total, todo = _children(), 0, list(pids)
    while todo:
        pid = todo.pop()
        stat = _stat_fields(pid)
        if stat is not None:
            total += int(stat[11]) + int(stat[12])  # utime, stime (fields 14 and 15)
        todo.extend(tree.get(pid, ()))
    return total / CLK_TCK


def _own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


# -- the load ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Load:
    """What every connection of a closed loop sends, over and over.

    ``connections``: how many keep-alive connections, each with one request in flight at a time.
    ``max_tokens``: the answer's length in tokens (the simulator always produces all of them).
    ``stream``: whether the answer is streamed (SSE) or comes whole.
    """

    connections: int
    max_tokens: int
    stream: bool


def request_bytes(url: str, load: Load) -> bytes:
    """The whole HTTP/1.1 request, built once: the load generator writes it as it is."""
    parts = urlsplit(url)
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": load.max_tokens,
            "stream": load.stream,
        }
    ).encode()
    head = (
        f"POST {parts.path.rstrip('/')}/v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Reply(NamedTuple):
    """One whole answer as the load generator saw it.

    ``status``: the HTTP status. ``tokens``: generated tokens in the body. ``first_token``: the
    ``perf_counter`` time the first token arrived, if any did. ``close``: the server asked to
    close the connection.
    """

    status: int
    tokens: int
    first_token: float | None
    close: bool


class _Client(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: one request at a time, Content-Length or chunked answers."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._reply: asyncio.Future[Reply] | None = None
        self._lost = False
        self._start_reply()

    def _start_reply(self) -> None:
        self._status = 0
        self._in_body = False
        self._length: int | None = None
        self._chunked = False
        self._close = False
        self._tokens = 0
        self._first: float | None = None
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio's, only alike.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(ConnectionError("the server closed the connection"))

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        try:
            self._parse()
        except ValueError as exc:
            if self._reply is not None and not self._reply.done():
                self._reply.set_exception(ConnectionError(f"unreadable answer: {exc}"))
            assert self._transport is not None
            self._transport.close()

    def exchange(self, request: bytes) -> asyncio.Future[Reply]:
        if self._lost or self._transport is None:
            raise ConnectionError("the connection is closed")
        self._reply = asyncio.get_running_loop().create_future()
        self._transport.write(request)
        return self._reply

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _body(self, piece: bytes) -> None:
        # A token's mark may straddle two pieces: count it in the last few bytes kept from before.
        text = self._tail + piece
        found = text.count(TOKEN_MARK)
        if found and self._first is None:
            self._first = time.perf_counter()
        self._tokens += found
        self._tail = text[-(len(TOKEN_MARK) - 1) :]

    def _finish(self) -> None:
        reply = Reply(self._status, self._tokens, self._first, self._close)
        self._start_reply()
        if self._reply is not None and not self._reply.done():
            self._reply.set_result(reply)

    def _parse(self) -> None:
        buffer = self._buffer
        while True:
            if not self._in_body:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                lines = bytes(buffer[:end]).split(b"\r\n")
                del buffer[: end + 4]
                self._status = int(lines[0].split()[1])
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    name, value = name.strip().lower(), value.strip().lower()
                    if name == b"content-length":
                        self._length = int(value)
                    elif name == b"transfer-encoding":
                        self._chunked = b"chunked" in value
                    elif name == b"connection":
                        self._close = value == b"close"
                self._in_body = True
            elif not self._chunked:
                length = self._length or 0
                if len(buffer) < length:
                    return
                self._body(bytes(buffer[:length]))
                del buffer[:length]
                self._finish()
            else:
                line_end = buffer.find(b"\r\n")
                if line_end < 0:
                    return
                size = int(bytes(buffer[:line_end]).split(b";")[0], 16)
                if len(buffer) < line_end + 2 + size + 2:
                    return
                piece = bytes(buffer[line_end + 2 : line_end + 2 + size])
                del buffer[: line_end + 2 + size + 2]  # no trailers: none of these servers sends any
                if size:
                    self._body(piece)
                else:
                    self._finish()


@dataclass(slots=True)
class Tally:
    """What the load got back inside the measured window.

    ``answered``: latencies (seconds) of 200 answers. ``refused``: latencies of 429 and 503
    answers (the gateway's refusals). ``ttft``: times from sending to the first token, of the
    answers that had one. ``tokens``: tokens received in answers. ``errors``: other statuses,
    dropped connections and failed connects.
    """

    answered: list[float] = field(default_factory=list)
    refused: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0


async def _connection(url: str, load: Load, tally: Tally, window: list[float]) -> None:
    """One connection of the closed loop, until cancelled; records what ends inside ``window``."""
    loop = asyncio.get_running_loop()
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = request_bytes(url, load)
    while True:
        client: _Client | None = None
        try:
            _, client = await loop.create_connection(_Client, host, port)
            while True:
                start = time.perf_counter()
                reply = await client.exchange(request)
                end = time.perf_counter()
                if window[0] <= end < window[1]:
                    if reply.status == 200:
                        tally.answered.append(end - start)
                        tally.tokens += reply.tokens
                        if reply.first_token is not None:
                            tally.ttft.append(reply.first_token - start)
                    elif reply.status in (429, 503):
                        tally.refused.append(end - start)
                    else:
                        tally.errors += 1
                if reply.close:
                    break
        except OSError:  # ConnectionError included: count it and connect again
            if window[0] <= time.perf_counter() < window[1]:
                tally.errors += 1
            await asyncio.sleep(0.01)
        finally:
            if client is not None:
                client.close()


class Window(NamedTuple):
    """One measured window: the load's tally, its length, and CPU seconds per role at its two ends."""

    tally: Tally
    seconds: float
    cpu_before: dict[str, float | None]
    cpu_after: dict[str, float | None]


Worker = Callable[[Tally, list[float]], Coroutine[Any, Any, None]]


async def _windowed(
    workers: Sequence[Worker], warmup_s: float, seconds: float, roles: dict[str, list[int]]
) -> Window:
    """Run ``workers`` (each records into the tally what ends inside the window) and measure a window."""
    tally = Tally()
    window = [float("inf"), float("inf")]
    tasks = [asyncio.create_task(worker(tally, window)) for worker in workers]
    try:
        await asyncio.sleep(warmup_s)
        before = _snapshot(roles)
        window[0] = time.perf_counter()
        await asyncio.sleep(seconds)
        window[1] = time.perf_counter()
        after = _snapshot(roles)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return Window(tally, window[1] - window[0], before, after)


def _snapshot(roles: dict[str, list[int]]) -> dict[str, float | None]:
    cpu: dict[str, float | None] = {role: cpu_seconds(pids) for role, pids in roles.items()}
    cpu["load"] = _own_cpu_seconds()
    return cpu


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # Windows: no uvloop; the load generator then costs more of the CPU
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def closed_loop(
    urls: Sequence[str], load: Load, warmup_s: float, seconds: float, roles: dict[str, list[int]]
) -> Window:
    """Run the closed loop against ``urls`` (connections spread round-robin) and measure one window."""
    workers = [functools.partial(_connection, urls[i % len(urls)], load) for i in range(load.connections)]
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        return runner.run(_windowed(workers, warmup_s, seconds, roles))


async def _client_requests(
    url: str, library: str, load: Load, warmup_s: float, seconds: float, roles: dict[str, list[int]]
) -> Window:
    """The closed loop with a client library in place of the load generator's own HTTP client."""
    body = json.loads(request_bytes(url, load).partition(b"\r\n\r\n")[2])
    path = "/v1/chat/completions"
    post: Callable[[], Awaitable[bytes]]
    if library == "httpx":
        # As the gateway's backend client is set up (sluice.backends.openai): no pool limit.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=FAST_SLOTS)
        client = httpx.AsyncClient(base_url=url, limits=limits, timeout=30.0)

        async def post() -> bytes:
            answer = await client.post(path, json=body)
            answer.raise_for_status()
            return answer.content

        close: Callable[[], Awaitable[None]] = client.aclose
    else:
        import aiohttp

        session = aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0))

        async def post() -> bytes:
            async with session.post(path, json=body) as answer:
                answer.raise_for_status()
                return await answer.read()

        close = session.close

    async def worker(tally: Tally, window: list[float]) -> None:
        while True:
            start = time.perf_counter()
            try:
                text = await post()
                json.loads(text)  # the gateway reads the answer as JSON too
            except Exception:  # either library's errors: counted, and the loop goes on
                if window[0] <= time.perf_counter() < window[1]:
                    tally.errors += 1
                await asyncio.sleep(0.01)
                continue
            end = time.perf_counter()
            if window[0] <= end < window[1]:
                tally.answered.append(end - start)
                tally.ttft.append(end - start)
                tally.tokens += text.count(TOKEN_MARK)

    try:
        return await _windowed([worker] * load.connections, warmup_s, seconds, roles)
    finally:
        await close()


def client_requests(
    url: str, library: str, load: Load, warmup_s: float, seconds: float, roles: dict[str, list[int]]
) -> Window:
    """``load.connections`` concurrent requests through ``library``'s client (httpx or aiohttp) alone."""
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        return runner.run(_client_requests(url, library, load, warmup_s, seconds, roles))


# -- rows -------------------------------------------------------------------------------------------


def _quantile_ms(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


@dataclass(frozen=True, slots=True)
class Row:
    """One measured window, in the units the tables print.

    ``group`` and ``name``: which table and which line. ``command``: what served the requests.
    ``connections``, ``max_tokens``, ``stream``: the load. ``seconds``: the window's length.
    ``answers``, ``refusals``, ``errors``, ``tokens``: counts inside the window. ``p50_ms``,
    ``p99_ms``: latency of the answers; ``ttft_p50_ms``: their time to the first token;
    ``refusal_p50_ms``, ``refusal_p99_ms``: latency of the refusals. ``cpu_s``: CPU seconds per
    role (``gateway``: the process or processes in front of the engine; ``workers``; ``redis``;
    ``engine``; ``load``: the load generator), None where it could not be read. ``load_average``:
    the machine's 1, 5 and 15 minute load averages as the window began.
    """

    group: str
    name: str
    command: str
    connections: int
    max_tokens: int
    stream: bool
    seconds: float
    answers: int
    refusals: int
    errors: int
    tokens: int
    p50_ms: float | None
    p99_ms: float | None
    ttft_p50_ms: float | None
    refusal_p50_ms: float | None
    refusal_p99_ms: float | None
    cpu_s: dict[str, float | None]
    load_average: tuple[float, float, float]

    @property
    def answers_per_s(self) -> float:
        return self.answers / self.seconds

    @property
    def refusals_per_s(self) -> float:
        return self.refusals / self.seconds

    def cpu_ms_per_request(self, role: str) -> float | None:
        """CPU of ``role`` per answer or refusal, in milliseconds."""
        cpu, done = self.cpu_s.get(role), self.answers + self.refusals
        return None if cpu is None or not done else cpu / done * 1000

    def cpu_us_per_token(self, role: str) -> float | None:
        cpu = self.cpu_s.get(role)
        return None if cpu is None or not self.tokens else cpu / self.tokens * 1e6

    def cores(self, role: str) -> float | None:
        """How many cores ``role`` kept busy on average (1.0: one core all the time)."""
        cpu = self.cpu_s.get(role)
        return None if cpu is None else cpu / self.seconds

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        roles = list(self.cpu_s)
        data["answers_per_s"] = self.answers_per_s
        data["refusals_per_s"] = self.refusals_per_s
        data["cpu_ms_per_request"] = {r: self.cpu_ms_per_request(r) for r in roles}
        data["cpu_us_per_token"] = {r: self.cpu_us_per_token(r) for r in roles}
        data["cores"] = {r: self.cores(r) for r in roles}
        return data


def make_row(group: str, name: str, command: str, load: Load, window: Window) -> Row:
    tally = window.tally
    cpu: dict[str, float | None] = {}
    for role, after in window.cpu_after.items():
        before = window.cpu_before.get(role)
        cpu[role] = None if after is None or before is None else after - before
    return Row(
        group=group,
        name=name,
        command=command,
        connections=load.connections,
        max_tokens=load.max_tokens,
        stream=load.stream,
        seconds=window.seconds,
        answers=len(tally.answered),
        refusals=len(tally.refused),
        errors=tally.errors,
        tokens=tally.tokens,
        p50_ms=_quantile_ms(tally.answered, 0.5),
        p99_ms=_quantile_ms(tally.answered, 0.99),
        ttft_p50_ms=_quantile_ms(tally.ttft, 0.5),
        refusal_p50_ms=_quantile_ms(tally.refused, 0.5),
        refusal_p99_ms=_quantile_ms(tally.refused, 0.99),
        cpu_s=cpu,
        load_average=os.getloadavg(),
    )


# -- the processes ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Options:
    """Everything a benchmark run needs (the command line's flags; see ``--help``)."""

    seconds: float = 10.0
    warmup_s: float = 2.0
    connections: int = 32
    tokens: int = 8
    stream_tokens: int = 64
    flood_connections: int = 64
    flood_tokens: int = 8
    gateways: tuple[int, ...] = (1, 2)
    groups: tuple[str, ...] = GROUPS
    targets: tuple[str, ...] = TARGETS
    litellm_python: str | None = None
    out: Path = Path(".bench-out")
    label: str = "overhead"
    plot: bool = False
    py_spy: Path | None = None


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
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

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
    spawner: Spawner, target: str, engine: str, slots: int, options: Options
) -> tuple[str, subprocess.Popen[bytes], str]:
    """Start ``target`` in front of ``engine``; its URL, its process, and the command, for the table."""
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
        assert options.litellm_python is not None
        config = options.out / "litellm.yaml"
        model = {"model": f"openai/{MODEL}", "api_base": f"{engine}/v1", "api_key": "none"}
        # Open, as Sluice is on loopback without keys: no master key, so no key check on a request.
        general = {"dangerously_permit_weak_or_unset_master_key": True}
        litellm_config = {
            "model_list": [{"model_name": MODEL, "litellm_params": model}],
            "general_settings": general,
        }
        config.write_text(json.dumps(litellm_config))  # JSON is YAML: no YAML writer needed here
        code = "import sys; from litellm import run_server; sys.exit(run_server())"
        argv = [options.litellm_python, "-c", code, "--config", str(config), "--port", str(port)]
        # Its own copy of the model price list, not one fetched from GitHub at start-up.
        offline = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        proc, ready = spawner.start(target, argv, offline), "/health/liveliness"
        command = "litellm --config litellm.yaml (openai/sim at ENGINE)"
    else:
        raise ValueError(f"unknown target {target!r}")
    wait_ready(_url(port) + ready, proc, timeout_s=120)
    wait_answer(_url(port))
    return _url(port), proc, command


def _litellm_python(requested: str | None) -> str | None:
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


# -- py-spy -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def py_spy(pid: int, seconds: float, path: Path | None) -> Iterator[None]:
    """Record ``pid`` with py-spy (raw collapsed stacks, 100 samples/s) while inside."""
    if path is None:
        yield
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    # Not --nonblocking: py-spy then pauses the gateway for each sample (a few µs, 100 times a second),
    # but reads whole stacks; unpaused, it read a truncated stack for 40 % of the samples here.
    argv = [spy, "record", "--pid", str(pid), "--format", "raw", "--output", str(path)]
    # --function: one frame per function (not per line), so that a function's samples add up.
    argv += ["--function", "--rate", "100", "--duration", str(max(1, round(seconds)))]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield
    finally:
        try:
            _, err = proc.communicate(timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            print(
                f"py-spy failed ({proc.returncode}): {err.decode(errors='replace')[-500:]}", file=sys.stderr
            )


def _stacks(path: Path) -> Iterator[tuple[list[str], int]]:
    """py-spy's raw collapsed stacks: each stack's frames, outermost first, and its sample count."""
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if stack and count_text.isdigit():
            yield stack.split(";"), int(count_text)


def top_frames(path: Path, limit: int = 25) -> list[tuple[str, float, float]]:
    """From py-spy's raw collapsed stacks: (frame, share of samples in it, share in it itself), top first.

    A frame's total share counts each sample once, however often the frame recurs in its stack.
    """
    total_count: Counter[str] = Counter()
    self_count: Counter[str] = Counter()
    samples = 0
    for frames, count in _stacks(path):
        samples += count
        for frame in set(frames):
            total_count[frame] += count
        self_count[frames[-1]] += count
    if not samples:
        return []
    ranked = sorted(total_count, key=lambda f: (-self_count[f], -total_count[f]))[:limit]
    return [(f, total_count[f] / samples, self_count[f] / samples) for f in ranked]


def _library(frame: str) -> str:
    """A frame's library: ``sluice/api/x.py`` -> ``sluice/api``, ``httpx/_client.py`` -> ``httpx``."""
    where = frame.rpartition(" (")[2].rstrip(")").rpartition(":")[0]
    if where.startswith("<"):
        return "<frozen>" if where.startswith("<frozen") else where
    parts = where.split("/")
    if parts[0] == "sluice" and len(parts) > 2:
        return "/".join(parts[:2])
    return parts[0].removesuffix(".py")


def _task_root(frames: Sequence[str]) -> str:
    """The first frame below the event loop: which task (or callback) a sample was spent in."""
    in_loop = False
    for frame in frames:
        loop_frame = _library(frame) in ("asyncio", "uvloop")
        if in_loop and not loop_frame:
            return frame
        in_loop = in_loop or loop_frame
    return "(the event loop itself)"


def shares_by(path: Path, key: Callable[[list[str]], str]) -> list[tuple[str, float]]:
    """Share of samples per ``key(stack)``, largest first."""
    counts: Counter[str] = Counter()
    for frames, count in _stacks(path):
        counts[key(frames)] += count
    samples = sum(counts.values())
    return [(k, n / samples) for k, n in counts.most_common()] if samples else []


def print_profile(path: Path) -> None:
    print(f"\npy-spy, the Sluice gateway ({path.stem}); shares of its samples")
    print("\n| in its own code | library |\n|---|---|")
    for library, share in shares_by(path, lambda frames: _library(frames[-1])):
        if share >= 0.005:
            print(f"| {share:.1%} | {library} |")
    print("\n| in the task | task (first frame below the event loop) |\n|---|---|")
    for root, share in shares_by(path, _task_root):
        if share >= 0.005:
            print(f"| {share:.1%} | `{root}` |")
    print("\n| total | self | frame |\n|---|---|---|")
    for frame, total, own in top_frames(path):
        print(f"| {total:.1%} | {own:.1%} | `{frame}` |")


# -- the groups -------------------------------------------------------------------------------------


Note = Callable[[str], None]


def _measure(
    rows: list[Row],
    group: str,
    name: str,
    command: str,
    urls: Sequence[str],
    load: Load,
    roles: dict[str, list[int]],
    options: Options,
    profile_pid: int | None = None,
) -> Row:
    """Measure one row; with ``--py-spy``, ``profile_pid`` (the Sluice gateway) is recorded meanwhile."""
    record = None
    if options.py_spy is not None and profile_pid is not None:
        options.py_spy.mkdir(parents=True, exist_ok=True)
        record = options.py_spy / (name.replace(" ", "-") + ".txt")
    with py_spy(profile_pid or 0, options.warmup_s + options.seconds, record):
        window = closed_loop(urls, load, options.warmup_s, options.seconds, roles)
    row = make_row(group, name, command, load, window)
    rows.append(row)
    print(f"  {name}: {row.answers_per_s:,.0f} answers/s, {row.refusals_per_s:,.0f} refusals/s", flush=True)
    return row


def run_fast_groups(spawner: Spawner, options: Options, rows: list[Row], note: Note) -> None:
    """``closed`` and ``stream``: every target in front of the fast engine."""
    engine, engine_proc = start_engine(spawner, "engine", FAST_ENGINE)
    short = Load(options.connections, options.tokens, stream=False)
    streams = [Load(options.connections, n, stream=True) for n in (options.tokens, options.stream_tokens)]
    for target in options.targets:
        if target == "litellm" and options.litellm_python is None:
            continue
        if target == "engine":
            url, command, roles = engine, "the engine directly", {"engine": [engine_proc.pid]}
            gateway_proc = None
        else:
            url, gateway_proc, command = start_gateway(spawner, target, engine, FAST_SLOTS, options)
            roles = {"gateway": [gateway_proc.pid], "engine": [engine_proc.pid]}
        print(f"{target}: {command}", flush=True)
        spied = gateway_proc.pid if target == "sluice" and gateway_proc is not None else None
        if "closed" in options.groups:
            _measure(rows, "closed", target, command, [url], short, roles, options, spied)
        if "stream" in options.groups:
            for load in streams:
                name = f"{target} streamed {load.max_tokens}"
                _measure(rows, "stream", name, command, [url], load, roles, options, spied)
        if gateway_proc is not None:
            spawner.stop(gateway_proc)
    spawner.stop(engine_proc)


def run_flood(spawner: Spawner, options: Options, rows: list[Row], note: Note) -> None:
    """``flood``: many connections in front of a saturated 16-sequence engine."""
    engine, engine_proc = start_engine(spawner, "flood-engine", FLOOD_ENGINE)
    load = Load(options.flood_connections, options.flood_tokens, stream=False)
    for target in options.targets:
        if target == "passthrough":
            continue  # it queues nothing of its own: the engine's row says what it would pass
        if target == "litellm" and options.litellm_python is None:
            continue
        if target == "engine":
            url, command, roles = engine, "the engine directly", {"engine": [engine_proc.pid]}
            gateway_proc = None
        else:
            url, gateway_proc, command = start_gateway(spawner, target, engine, FLOOD_SLOTS, options)
            roles = {"gateway": [gateway_proc.pid], "engine": [engine_proc.pid]}
        print(f"flood {target}: {command}", flush=True)
        spied = gateway_proc.pid if target == "sluice" and gateway_proc is not None else None
        _measure(rows, "flood", f"{target} flooded", command, [url], load, roles, options, spied)
        if gateway_proc is not None:
            spawner.stop(gateway_proc)
    # The same gateway with its dispatcher in another process (a worker): the refusals then no
    # longer share an event loop with the jobs that feed the engine.
    if "sluice" in options.targets and _have_redis(note, "flood on Redis"):
        with redis_fleet(spawner, engine, 1, FLOOD_SLOTS) as (urls, roles, command):
            print(f"flood: {command}", flush=True)
            roles = {**roles, "engine": [engine_proc.pid]}
            _measure(rows, "flood", "sluice on Redis flooded", command, urls, load, roles, options)
    spawner.stop(engine_proc)


def _redis_pid(url: str) -> int:
    from redis import Redis

    with Redis.from_url(url) as client:
        info: dict[str, Any] = client.info("server")
    return int(info["process_id"])


def _have_redis(note: Note, what: str) -> bool:
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


def run_scaling(spawner: Spawner, options: Options, rows: list[Row], note: Note) -> None:
    """``scaling``: 1, 2, ... gateways and as many workers on one Redis."""
    if "sluice" not in options.targets or not _have_redis(note, "scaling"):
        return
    engine, engine_proc = start_engine(spawner, "scaling-engine", FAST_ENGINE)
    load = Load(options.connections, options.tokens, stream=False)
    for count in options.gateways:
        with redis_fleet(spawner, engine, count, FAST_SLOTS) as (urls, roles, command):
            print(f"scaling: {command}", flush=True)
            name = f"{count} gateway{'s' if count > 1 else ''} on Redis"
            roles = {**roles, "engine": [engine_proc.pid]}
            _measure(rows, "scaling", name, command, urls, load, roles, options)
    spawner.stop(engine_proc)


def run_clients(spawner: Spawner, options: Options, rows: list[Row], note: Note) -> None:
    """``clients``: the HTTP client to the engine alone, httpx (the gateway's) and aiohttp, here."""
    engine, engine_proc = start_engine(spawner, "clients-engine", FAST_ENGINE)
    load = Load(options.connections, options.tokens, stream=False)
    for library in ("httpx", "aiohttp"):
        if importlib.util.find_spec(library) is None:
            note(f"clients: {library} is not installed, its row is left out (pip install 'sluice[bench]')")
            continue
        command = f"{load.connections} concurrent POSTs through one {library} client, in this process"
        print(f"clients: {command}", flush=True)
        window = client_requests(
            engine, library, load, options.warmup_s, options.seconds, {"engine": [engine_proc.pid]}
        )
        rows.append(make_row("clients", f"{library} client alone", command, load, window))
    spawner.stop(engine_proc)


def run(options: Options) -> tuple[list[Row], list[str]]:
    """Run the chosen groups; every row measured, and the notes on what was left out."""
    rows: list[Row] = []
    notes: list[str] = []
    options.out.mkdir(parents=True, exist_ok=True)
    options.litellm_python = _litellm_python(options.litellm_python)
    if "litellm" in options.targets and options.litellm_python is None:
        notes.append(
            "LiteLLM's proxy: not importable here (pip install 'litellm[proxy]'), its rows are left out "
            "(--litellm-python PYTHON names one)"
        )
    with tempfile.TemporaryDirectory(prefix="sluice-overhead-") as folder:
        logs = Path(folder)
        spawner = Spawner(logs)
        try:
            if {"closed", "stream"} & set(options.groups):
                run_fast_groups(spawner, options, rows, notes.append)
            if "flood" in options.groups:
                run_flood(spawner, options, rows, notes.append)
            if "scaling" in options.groups:
                run_scaling(spawner, options, rows, notes.append)
            if "clients" in options.groups:
                run_clients(spawner, options, rows, notes.append)
        except RuntimeError:
            for log in sorted(logs.iterdir()):
                tail = log.read_text(errors="replace")[-2000:]
                print(f"--- {log.name} (last lines)\n{tail}", file=sys.stderr)
            raise
        finally:
            spawner.stop_all()
    return rows, notes


# -- tables ------------------------------------------------------------------------------------------


def _f(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _pair(a: float | None, b: float | None, digits: int = 1) -> str:
    return f"{_f(a, digits)} / {_f(b, digits)}"


def _load_average(row: Row) -> str:
    return " ".join(f"{x:.1f}" for x in row.load_average)


Column = tuple[str, Callable[[Row], str]]

COLUMNS: dict[str, list[Column]] = {
    "closed": [
        ("answers/s", lambda r: _f(r.answers_per_s, 0)),
        ("p50 / p99 ms", lambda r: _pair(r.p50_ms, r.p99_ms)),
        ("gateway CPU ms/req", lambda r: _f(r.cpu_ms_per_request("gateway"))),
        ("engine CPU ms/req", lambda r: _f(r.cpu_ms_per_request("engine"))),
        ("load gen CPU ms/req", lambda r: _f(r.cpu_ms_per_request("load"))),
        ("gateway cores", lambda r: _f(r.cores("gateway"))),
        ("errors", lambda r: str(r.errors)),
        ("load avg", _load_average),
    ],
    "stream": [
        ("answers/s", lambda r: _f(r.answers_per_s, 0)),
        ("tokens/s", lambda r: _f(r.tokens / r.seconds, 0)),
        ("TTFT p50 ms", lambda r: _f(r.ttft_p50_ms)),
        ("p50 / p99 ms", lambda r: _pair(r.p50_ms, r.p99_ms)),
        ("gateway CPU ms/req", lambda r: _f(r.cpu_ms_per_request("gateway"))),
        ("gateway CPU µs/token", lambda r: _f(r.cpu_us_per_token("gateway"), 0)),
        ("engine CPU ms/req", lambda r: _f(r.cpu_ms_per_request("engine"))),
        ("gateway cores", lambda r: _f(r.cores("gateway"))),
        ("load avg", _load_average),
    ],
    "flood": [
        ("answers/s", lambda r: _f(r.answers_per_s, 0)),
        ("refusals/s", lambda r: _f(r.refusals_per_s, 0)),
        ("answer p50 / p99 ms", lambda r: _pair(r.p50_ms, r.p99_ms, 0)),
        ("refusal p50 / p99 ms", lambda r: _pair(r.refusal_p50_ms, r.refusal_p99_ms)),
        ("gateway CPU ms/response", lambda r: _f(r.cpu_ms_per_request("gateway"))),
        ("gateway cores", lambda r: _f(r.cores("gateway"))),
        ("workers cores", lambda r: _f(r.cores("workers"))),
        ("errors", lambda r: str(r.errors)),
        ("load avg", _load_average),
    ],
    "scaling": [
        ("answers/s", lambda r: _f(r.answers_per_s, 0)),
        ("p50 / p99 ms", lambda r: _pair(r.p50_ms, r.p99_ms)),
        ("gateways CPU ms/req", lambda r: _f(r.cpu_ms_per_request("gateway"))),
        ("workers CPU ms/req", lambda r: _f(r.cpu_ms_per_request("workers"))),
        ("redis CPU ms/req", lambda r: _f(r.cpu_ms_per_request("redis"))),
        ("engine CPU ms/req", lambda r: _f(r.cpu_ms_per_request("engine"))),
        ("gateways + workers cores", lambda r: _f((r.cores("gateway") or 0) + (r.cores("workers") or 0))),
        ("errors", lambda r: str(r.errors)),
        ("load avg", _load_average),
    ],
}

COLUMNS["clients"] = [
    ("answers/s", lambda r: _f(r.answers_per_s, 0)),
    ("p50 / p99 ms", lambda r: _pair(r.p50_ms, r.p99_ms)),
    ("client CPU ms/req", lambda r: _f(r.cpu_ms_per_request("load"))),
    ("engine CPU ms/req", lambda r: _f(r.cpu_ms_per_request("engine"))),
    ("client cores", lambda r: _f(r.cores("load"))),
    ("errors", lambda r: str(r.errors)),
    ("load avg", _load_average),
]

TITLES = {
    "closed": "Closed loop, short non-streaming requests",
    "stream": "Streamed",
    "flood": "Flood: in front of a saturated 16-sequence engine",
    "scaling": "Gateways on Redis",
    "clients": "The HTTP client to the engine alone",
}


def per_token_us(rows: Sequence[Row]) -> dict[str, float]:
    """Per target: gateway CPU per extra streamed token (µs), from its two streamed rows."""
    found: dict[str, float] = {}
    by_target: dict[str, list[Row]] = {}
    for row in rows:
        if row.group == "stream":
            by_target.setdefault(row.name.split(" streamed ")[0], []).append(row)
    for target, pair in by_target.items():
        if len(pair) != 2:
            continue
        short, long = sorted(pair, key=lambda r: r.max_tokens)
        a, b = short.cpu_ms_per_request("gateway"), long.cpu_ms_per_request("gateway")
        if a is not None and b is not None and long.max_tokens > short.max_tokens:
            found[target] = (b - a) / (long.max_tokens - short.max_tokens) * 1000
    return found


def refusal_ms(rows: Sequence[Row]) -> dict[str, float]:
    """Per flooded gateway: CPU per refusal (ms), its answers' share taken out at their closed-loop cost."""
    closed = {r.name: r for r in rows if r.group == "closed"}
    found: dict[str, float] = {}
    for row in rows:
        target = row.name.removesuffix(" flooded")
        cpu = row.cpu_s.get("gateway")
        if row.group != "flood" or cpu is None or not row.refusals or target not in closed:
            continue
        per_answer = closed[target].cpu_ms_per_request("gateway")
        if per_answer is not None:
            found[target] = (cpu * 1000 - row.answers * per_answer) / row.refusals
    return found


def table(rows: Sequence[Row]) -> str:
    """The rows as Markdown tables, one per group, with the derived figures below them."""
    out: list[str] = []
    for group in GROUPS:
        chosen = [r for r in rows if r.group == group]
        if not chosen:
            continue
        columns = COLUMNS[group]
        load = chosen[0]
        out.append(f"{TITLES[group]} ({load.connections} connections, {load.seconds:.0f} s each)\n")
        out.append("| row | " + " | ".join(h for h, _ in columns) + " |")
        out.append("|---" * (len(columns) + 1) + "|")
        out.extend("| " + r.name + " | " + " | ".join(fn(r) for _, fn in columns) + " |" for r in chosen)
        if group == "stream":
            for target, us in per_token_us(rows).items():
                out.append(f"\n{target}: {us:,.0f} µs of gateway CPU per extra streamed token")
        if group == "flood":
            for target, ms in refusal_ms(rows).items():
                out.append(f"\n{target}: {ms:.2f} ms of gateway CPU per refusal (answers' share taken out)")
        out.append("")
    return "\n".join(out)


def plot(rows: Sequence[Row], path: Path) -> None:
    """Answers/s and gateway CPU per request of the closed-loop rows, and the scaling curve."""
    from sluice.bench.report import _pyplot

    plt = _pyplot()
    closed = [r for r in rows if r.group == "closed"]
    scaling = [r for r in rows if r.group == "scaling"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = [r.name for r in closed]
    axes[0].bar(names, [r.answers_per_s for r in closed], color="tab:blue")
    axes[0].set_title("answers/s, closed loop")
    axes[1].bar(names, [r.cpu_ms_per_request("gateway") or 0 for r in closed], color="tab:orange")
    axes[1].set_title("gateway CPU ms per request")
    # A scaling row's name starts with its gateway count ("2 gateways on Redis").
    axes[2].plot([int(r.name.split()[0]) for r in scaling], [r.answers_per_s for r in scaling], marker="o")
    axes[2].set_ylim(bottom=0)
    axes[2].set_xticks([int(r.name.split()[0]) for r in scaling])
    axes[2].set_title("answers/s by gateways on Redis")
    axes[2].set_xlabel("gateways (+ as many workers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command line --------------------------------------------------------------------------------------


def _names(text: str, known: Sequence[str]) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown: {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window of each row (10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="load before each window (2)")
    parser.add_argument("--connections", type=int, default=32, help="closed-loop connections (32)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens of a short answer (8)")
    parser.add_argument(
        "--stream-tokens", type=int, default=64, help="tokens of the long streamed answer (64)"
    )
    parser.add_argument("--flood-connections", type=int, default=64, help="connections of the flood (64)")
    parser.add_argument("--flood-tokens", type=int, default=8, help="tokens of a flood answer (8)")
    parser.add_argument(
        "--gateways",
        type=lambda t: tuple(int(x) for x in t.split(",")),
        default=(1, 2),
        help="gateway counts of the scaling rows (1,2)",
    )
    parser.add_argument(
        "--groups",
        type=lambda t: _names(t, GROUPS),
        default=GROUPS,
        help=f"which groups ({','.join(GROUPS)})",
    )
    parser.add_argument(
        "--targets",
        type=lambda t: _names(t, TARGETS),
        default=TARGETS,
        help=f"which targets ({','.join(TARGETS)})",
    )
    parser.add_argument(
        "--litellm-python", help="a Python with litellm installed (default: this one, if it has it)"
    )
    parser.add_argument("--out", type=Path, default=Path(".bench-out"), help="output folder (.bench-out)")
    parser.add_argument("--label", default="overhead", help="name of the output files (overhead)")
    parser.add_argument("--plot", action="store_true", help="write LABEL.png too (needs matplotlib)")
    parser.add_argument(
        "--py-spy",
        type=Path,
        metavar="DIR",
        help="record the Sluice gateway's rows with py-spy in DIR/ROW.txt",
    )
    args = parser.parse_args(argv)
    return Options(
        seconds=args.seconds,
        warmup_s=args.warmup,
        connections=args.connections,
        tokens=args.tokens,
        stream_tokens=args.stream_tokens,
        flood_connections=args.flood_connections,
        flood_tokens=args.flood_tokens,
        gateways=args.gateways,
        groups=args.groups,
        targets=args.targets,
        litellm_python=args.litellm_python,
        out=args.out,
        label=args.label,
        plot=args.plot,
        py_spy=args.py_spy,
    )


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} CPUs")
    rows, notes = run(options)
    text = table(rows)
    print("\n" + text)
    for line in notes:
        print(line)
    result = {
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
        "cpus": os.cpu_count(),
        "rows": [r.as_dict() for r in rows],
        "per_token_us": per_token_us(rows),
        "refusal_ms": refusal_ms(rows),
        "notes": notes,
    }
    path = options.out / f"{options.label}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    if options.plot:
        png = options.out / f"{options.label}.png"
        try:
            plot(rows, png)
            print(f"wrote {png}")
        except ImportError as exc:
            print(exc)
    if options.py_spy is not None and options.py_spy.exists():
        for record in sorted(options.py_spy.glob("*.txt")):
            print_profile(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
