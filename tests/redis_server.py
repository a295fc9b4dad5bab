"""A real ``redis-server`` for tests: started on a free port in a temporary directory, and stopped,
killed (SIGKILL) or restarted on demand, so that failure tests can take Redis away for real.

    server = RedisServer(aof=True)      # appendonly yes + appendfsync always
    server.start()
    ... server.url ...
    server.kill()                       # as a crash: nothing flushed beyond what AOF already has
    server.restart()                    # same port, same directory: the data comes back from AOF
    server.stop()                       # SHUTDOWN; removes the directory unless keep_dir

Or as a context manager: ``with RedisServer() as server: ...``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

REDIS_SERVER = os.environ.get("SLUICE_TEST_REDIS_SERVER", "redis-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process bound to 127.0.0.1.

    Args:
        port: the port; a free one is picked when None (and kept across restarts).
        aof: append-only file with ``appendfsync always``: every acknowledged write survives SIGKILL.
        appendfsync: the fsync policy when ``aof`` is on (``always``, ``everysec`` or ``no``).
        extra: further ``redis-server`` options, e.g. ``{"maxmemory": "10mb"}``.
        keep_dir: leave the data directory behind on stop (for post-mortems).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        aof: bool = False,
        appendfsync: str = "always",
        extra: dict[str, str] | None = None,
        keep_dir: bool = False,
    ) -> None:
        self.port = port or _free_port()
        self.aof = aof
        self.appendfsync = appendfsync
        self.extra = dict(extra or {})
        self.keep_dir = keep_dir
        self.dir = Path(tempfile.mkdtemp(prefix="sluice-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _args(self) -> list[str]:
        opts = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "dir": str(self.dir),
            "save": "",
            "appendonly": "yes" if self.aof else "no",
            "appendfsync": self.appendfsync,
            "maxmemory-policy": "noeviction",
            "daemonize": "no",
            "logfile": str(self.dir / "redis.log"),
        }
        opts.update(self.extra)
        args = [REDIS_SERVER]
        for name, value in opts.items():
            args += [f"--{name}", value]
        return args

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING (and has loaded its data)."""
        if self.running:
            return self
        self.proc = subprocess.Popen(self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.proc.returncode}; see {self.dir}/redis.log"
                )
            if self._ping():
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer within {timeout} s")
            time.sleep(0.01)

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")  # -LOADING while the AOF is read back
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash: the process gets no chance to save anything."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        """A clean stop (SIGTERM: Redis flushes and exits), then remove the directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        if not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def restart(self, *, kill: bool = False, timeout: float = 10.0) -> RedisServer:
        """Stop (or SIGKILL) and start again on the same port and directory."""
        if kill:
            self.kill()
        elif self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
        return self.start(timeout)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
