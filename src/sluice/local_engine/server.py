"""The local engine: a llama.cpp ``llama-server`` that Sluice builds, starts and keeps alive.

``LocalEngine`` is an async context manager that runs llama-server as a child process on loopback,
waits until it answers ``/health``, restarts it on the same port whenever it dies, and stops it on exit.
The build and the model are provisioned on first use by :mod:`sluice.local_engine.build`.

CLI: ``sluice engine build | start | status``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import TracebackType

import httpx

from sluice import aio
from sluice.local_engine.build import build_llama_server, ensure_llama_server
from sluice.local_engine.cache import (
    BINARY_NAME,
    LLAMA_CPP_PYTHON_VERSION,
    MODEL_ALIAS,
    build_key,
    cache_dir,
    cached_binary_path,
    cpu_flags,
    find_llama_server,
    find_model,
    llama_server_version,
    logs_dir,
    read_build_info,
    usable_cpus,
)
from sluice.local_engine.errors import EngineBuildError, EngineError, MissingToolError, ModelUnavailableError
from sluice.local_engine.model import ensure_model
from sluice.local_engine.toolchain import check_build_tools
from sluice.startup import EngineStartup, StartupPhase

__all__ = [
    "BINARY_NAME",
    "DEFAULT_CTX_PER_SLOT",
    "DEFAULT_SLOTS",
    "EngineBuildError",
    "EngineError",
    "EngineStartError",
    "LocalEngine",
    "MissingToolError",
    "ModelUnavailableError",
    "build_llama_server",
    "cache_dir",
    "check_build_tools",
    "configure_parser",
    "default_threads",
    "ensure_llama_server",
    "ensure_model",
    "find_llama_server",
    "find_model",
    "free_port",
    "llama_server_command",
    "run",
]

log = logging.getLogger("sluice.engine")

DEFAULT_SLOTS = 4
DEFAULT_CTX_PER_SLOT = 2048
DEFAULT_HOST = "127.0.0.1"

# A run that lasted this long counts as healthy, so the next crash restarts at the shortest backoff.
_STABLE_RUN_S = 30.0
# An automatically chosen port can be taken by someone else between our probe and the server's bind.
_PORT_ATTEMPTS = 3
_LOG_RETENTION_S = 7 * 24 * 3600

OnRestart = Callable[["LocalEngine"], Awaitable[None]]


class EngineStartError(EngineError):
    """llama-server did not become healthy in time, or exited while starting."""


def default_threads() -> int:
    return usable_cpus()


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def llama_server_command(
    binary: Path | str,
    model_path: Path | str,
    *,
    port: int,
    host: str = DEFAULT_HOST,
    threads: int,
    slots: int = DEFAULT_SLOTS,
    ctx_per_slot: int = DEFAULT_CTX_PER_SLOT,
    alias: str = MODEL_ALIAS,
    extra_args: Sequence[str] = (),
    repack: bool | None = None,
) -> list[str]:
    """The llama-server command line. ``-c`` is the total context, which llama-server splits over slots.

    ``repack`` (default: unless the CPU has AMX) lets llama.cpp repack the weights for its special
    kernels. On a CPU that reports AMX, repacked weights go to the AMX tile kernels, and those die
    with SIGILL under hypervisors that do not pass tile state through (seen in Firecracker VMs);
    the tiny default model has no other repacked layout, so nothing is lost by skipping it.
    """
    if repack is None:
        repack = "amx_tile" not in cpu_flags().split()
    if slots < 1 or ctx_per_slot < 1 or threads < 1:
        raise ValueError(
            f"slots, ctx_per_slot and threads must be >= 1 (got {slots}, {ctx_per_slot}, {threads})"
        )
    if not 0 < port < 65536:
        raise ValueError(f"invalid port {port}")
    return [
        str(binary),
        "-m", str(model_path),
        "--alias", alias,
        "--host", host,
        "--port", str(port),
        "-t", str(threads),
        "-c", str(slots * ctx_per_slot),
        "-np", str(slots),
        "--metrics",
        "--no-webui",
        *([] if repack else ["--no-repack"]),
        *extra_args,
    ]  # fmt: skip


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec_fn that makes Linux SIGKILL the child when its parent dies, even by SIGKILL.

    The kernel tracks the *thread* that forked, so the engine also dies if the thread running the
    event loop that started it exits; that is when the loop, and so the supervisor, ends anyway.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        # Resolved here, before fork: loading a library in the child would not be async-signal-safe.
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook


def _log_tail(path: Path, start: int, lines: int = 25) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(start)
            text = handle.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    tail = text.splitlines()[-lines:]
    return "\n".join(tail) if tail else "(empty log)"


class LocalEngine:
    """A supervised llama-server child process.

    Usage::

        async with LocalEngine() as engine:   # builds and downloads on first use
            ... engine.url, engine.model, engine.slots ...

    ``binary`` and ``model_path`` default to the cached build and model, provisioned if absent. ``port``
    defaults to a free one, kept across restarts. ``on_restart`` is awaited after each restart once the
    new process is healthy; its exceptions are logged, never raised into the supervisor. ``startup``,
    when given, is kept informed of the build's progress and of the start (``sluice serve`` answers
    from it while the engine is not serving yet).
    """

    def __init__(
        self,
        *,
        binary: Path | str | None = None,
        model_path: Path | str | None = None,
        host: str = DEFAULT_HOST,
        port: int | None = None,
        slots: int = DEFAULT_SLOTS,
        ctx_per_slot: int = DEFAULT_CTX_PER_SLOT,
        threads: int | None = None,
        alias: str = MODEL_ALIAS,
        log_path: Path | str | None = None,
        startup_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        restart: bool = True,
        restart_backoff: tuple[float, float] = (0.25, 10.0),
        on_restart: OnRestart | None = None,
        extra_args: Sequence[str] = (),
        startup: EngineStartup | None = None,
    ) -> None:
        if slots < 1 or ctx_per_slot < 1:
            raise ValueError("slots and ctx_per_slot must be >= 1")
        self.binary: Path | None = Path(binary) if binary is not None else None
        self.model_path: Path | None = Path(model_path) if model_path is not None else None
        self.host = host
        self._requested_port = port
        self.port: int | None = port
        self.slots = slots
        self.ctx_per_slot = ctx_per_slot
        self.threads = threads if threads is not None else default_threads()
        self.model = alias
        self.log_path: Path | None = Path(log_path) if log_path is not None else None
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.restart = restart
        self.restart_backoff = restart_backoff
        self.on_restart = on_restart
        self.extra_args = tuple(extra_args)
        self.startup = startup
        self.restarts = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._stopping = False
        self._started_at = 0.0
        self._log_offset = 0

    # ------------------------------------------------------------------------------ public state

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the engine has not been started")
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    @property
    def command(self) -> list[str]:
        if self.binary is None or self.model_path is None or self.port is None:
            raise RuntimeError("the engine has not been started")
        return llama_server_command(
            self.binary,
            self.model_path,
            port=self.port,
            host=self.host,
            threads=self.threads,
            slots=self.slots,
            ctx_per_slot=self.ctx_per_slot,
            alias=self.model,
            extra_args=self.extra_args,
        )

    # -------------------------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> LocalEngine:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Provision what is missing, start llama-server and wait until it is healthy."""
        if self._process() is not None:
            raise RuntimeError("the engine is already started")
        # Building takes minutes of blocking subprocess work; keep the event loop responsive meanwhile.
        on_progress = self.startup.build_progress if self.startup is not None else None
        if self.binary is None:
            self.binary = await asyncio.to_thread(ensure_llama_server, on_progress)
        if self.startup is not None:
            self.startup.enter(StartupPhase.STARTING)
        if self.model_path is None:
            self.model_path = await asyncio.to_thread(ensure_model)
        self._stopping = False
        try:
            await self._start_on_some_port()
        except BaseException:
            # Cancelled or failed half-way: __aexit__ will not run, so no child may outlive this call.
            await self.stop()
            raise
        if self.restart:
            self._watcher = asyncio.create_task(self._watch(), name=f"llama-server-watcher:{self.port}")

    async def _start_on_some_port(self) -> None:
        attempts = 1 if self._requested_port is not None else _PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            if self._requested_port is None:
                self.port = free_port(self.host)
            try:
                await self._spawn_and_wait()
                return
            except EngineStartError as exc:
                # Our free port can be taken between probing it and the server's bind; only then retry.
                if attempt == attempts or "couldn't bind" not in str(exc):
                    raise
                log.warning("port %s was taken while llama-server started; trying another", self.port)

    async def stop(self) -> None:
        """Stop supervising, then SIGTERM the engine, and SIGKILL it if it outlives ``stop_timeout``."""
        self._stopping = True
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        proc, self._proc = self._proc, None
        if proc is not None:
            await self._terminate(proc)

    async def wait_healthy(self, timeout: float | None = None) -> None:
        """Wait until the engine answers ``/health`` with 200 (e.g. after a crash, while it restarts)."""
        deadline = time.monotonic() + (self.startup_timeout if timeout is None else timeout)
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as client:
            while True:
                if self._proc is not None and await self._healthy(client):
                    return
                if time.monotonic() >= deadline:
                    raise EngineStartError(f"llama-server at {self.url} is not healthy")
                await asyncio.sleep(0.05)

    # --------------------------------------------------------------------------------- internals

    # Methods rather than attribute reads, so that type checkers do not narrow state other tasks change.
    def _process(self) -> asyncio.subprocess.Process | None:
        return self._proc

    def _should_stop(self) -> bool:
        return self._stopping

    def _default_log_path(self) -> Path:
        directory = logs_dir()
        # One file per port keeps concurrent engines apart; without pruning they would pile up.
        cutoff = time.time() - _LOG_RETENTION_S
        for old in directory.glob("llama-server-*.log"):
            with contextlib.suppress(OSError):
                if old.stat().st_mtime < cutoff:
                    old.unlink()
        return directory / f"llama-server-{self.port}.log"

    async def _spawn(self) -> asyncio.subprocess.Process:
        command = self.command
        if self.log_path is None:
            self.log_path = self._default_log_path()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            log_file.write(
                f"\n=== sluice: {time.strftime('%Y-%m-%d %H:%M:%S')} start #{self.restarts + 1}: "
                f"{' '.join(command)}\n".encode()
            )
            log_file.flush()
            self._log_offset = log_file.tell()
            proc = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                # Its own session: a Ctrl-C in the terminal reaches Sluice only, which then stops the
                # engine in order instead of both dying at once.
                start_new_session=True,
                preexec_fn=_die_with_parent_hook(),
            )
        self._proc = proc
        self._started_at = time.monotonic()
        return proc

    async def _healthy(self, client: httpx.AsyncClient) -> bool:
        try:
            response = await client.get(f"{self.url}/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _spawn_and_wait(self) -> None:
        proc = await self._spawn()
        assert self.log_path is not None
        deadline = time.monotonic() + self.startup_timeout
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as client:
            while True:
                if proc.returncode is not None:
                    raise EngineStartError(
                        f"llama-server exited with code {proc.returncode} while starting; "
                        f"log {self.log_path}:\n{_log_tail(self.log_path, self._log_offset)}"
                    )
                if await self._healthy(client):
                    return
                if time.monotonic() >= deadline:
                    await self._terminate(proc)
                    raise EngineStartError(
                        f"llama-server did not answer {self.url}/health with 200 within "
                        f"{self.startup_timeout:g} s; log {self.log_path}:\n"
                        f"{_log_tail(self.log_path, self._log_offset)}"
                    )
                await asyncio.sleep(0.05)

    async def _terminate(self, proc: asyncio.subprocess.Process) -> None:
        try:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), self.stop_timeout)
                except TimeoutError:
                    log.warning(
                        "llama-server (pid %s) outlived SIGTERM by %g s; killing it",
                        proc.pid,
                        self.stop_timeout,
                    )
        finally:
            # Also when our caller is cancelled while waiting: the child must not outlive stop().
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await asyncio.shield(proc.wait())

    async def _watch(self) -> None:
        initial, ceiling = self.restart_backoff
        backoff = initial
        while not self._should_stop():
            proc = self._proc
            if proc is None:
                return
            code = await proc.wait()
            if self._should_stop():
                return
            if time.monotonic() - self._started_at >= _STABLE_RUN_S:
                backoff = initial
            log.warning(
                "llama-server on port %s exited with code %s; restarting in %.2g s", self.port, code, backoff
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, ceiling)
            if self._should_stop():
                return
            self.restarts += 1
            # Counted from the attempt, so that attempts failing before a process exists (say, the
            # binary was deleted) still read as short runs and the backoff keeps growing.
            self._started_at = time.monotonic()
            try:
                await self._spawn_and_wait()
            except Exception as exc:  # the supervisor outlives any one failure; the next loop backs off
                log.error("restarting llama-server failed: %s", exc)
                continue
            log.info("llama-server restarted on port %s (restart #%d)", self.port, self.restarts)
            if self.on_restart is not None:
                try:
                    await self.on_restart(self)
                except Exception:
                    log.exception("on_restart callback failed")


# ----------------------------------------------------------------------------------------------- CLI


def configure_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="engine_command", metavar="ACTION")
    build = sub.add_parser("build", help="build llama-server (or report the cached build) and print its path")
    build.add_argument("--force", action="store_true", help="rebuild from scratch, even if cached")
    build.add_argument(
        "--jobs", "-j", type=int, default=None, help="parallel compile jobs (default: all cores)"
    )
    build.add_argument("--no-model", action="store_true", help="do not also download the model")
    build.add_argument(
        "--source", type=Path, default=None, help="build from this llama.cpp tree instead of the sdist's copy"
    )
    start = sub.add_parser("start", help="run llama-server in the foreground until Ctrl-C")
    start.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default: %(default)s)")
    start.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    start.add_argument(
        "--slots", type=int, default=DEFAULT_SLOTS, help="parallel slots, -np (default: %(default)s)"
    )
    start.add_argument(
        "--ctx-per-slot",
        type=int,
        default=DEFAULT_CTX_PER_SLOT,
        help="context tokens per slot (default: %(default)s)",
    )
    start.add_argument("--threads", type=int, default=None, help="CPU threads (default: all usable cores)")
    start.add_argument(
        "--log", type=Path, default=None, help="engine log file (default: in the cache's logs/)"
    )
    sub.add_parser("status", help="show whether the binary and the model are present; exit 1 if not")
    parser.set_defaults(_engine_parser=parser)


def _status() -> int:
    binary = find_llama_server()
    model = find_model()
    print(f"cache:        {cache_dir()}")
    if binary is not None:
        info = read_build_info(binary) or {}
        version = info.get("llama_server_version") or llama_server_version(binary) or "unknown"
        source = info.get("llama_cpp_python", "?")
        print(f"llama-server: {binary} ({version}; llama.cpp from llama-cpp-python {source})")
    else:
        print(f"llama-server: missing (expected {cached_binary_path()}); run `sluice engine build`")
        print(f"              build key {build_key()} (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION})")
    if model is not None:
        print(f"model:        {model} ({model.stat().st_size / 1e6:.1f} MB)")
    else:
        print("model:        missing; run `sluice engine build`")
    return 0 if binary is not None and model is not None else 1


def _build(args: argparse.Namespace) -> int:
    cached = find_llama_server()
    if cached is not None and not args.force:
        print(f"sluice: llama-server is already built ({cached.parent.name})", file=sys.stderr)
        binary = cached
    else:
        binary = build_llama_server(force=args.force, jobs=args.jobs, source_dir=args.source)
    if not args.no_model:
        ensure_model()
    print(binary)
    return 0


async def _start(args: argparse.Namespace) -> int:
    engine = LocalEngine(
        host=args.host,
        port=args.port,
        slots=args.slots,
        ctx_per_slot=args.ctx_per_slot,
        threads=args.threads,
        log_path=args.log,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    async with engine:
        # Only now: while a first-run build is going on, Ctrl-C must interrupt it, not wait for it.
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        print(
            f"sluice: llama-server is ready: {engine.model}, {engine.slots} slots, "
            f"{engine.threads} threads, log {engine.log_path}; Ctrl-C stops it",
            file=sys.stderr,
        )
        print(engine.url, flush=True)
        await stop.wait()
        print("sluice: stopping llama-server", file=sys.stderr)
    return 0


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:
        # Restart notices from the supervisor, without every health probe that httpx logs at INFO.
        logging.basicConfig(level=logging.WARNING, format="sluice: %(message)s", stream=sys.stderr)
        log.setLevel(logging.INFO)
    command = getattr(args, "engine_command", None)
    if command not in ("build", "start", "status"):
        args._engine_parser.print_help(sys.stderr)
        return 2
    # SIGTERM's default action skips `finally`; as an exception it lets a build clean up its compilers.
    previous = None
    with contextlib.suppress(ValueError):  # not the main thread
        previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        if command == "build":
            return _build(args)
        if command == "start":
            return aio.run(_start(args))
        return _status()
    except EngineError as exc:
        print(f"sluice: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sluice: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
