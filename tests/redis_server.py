"""A real ``redis-server`` for tests: started on a free port in a temporary directory, and stopped,
killed (SIGKILL) or restarted on demand, so that failure tests can take Redis away for real.

    server = RedisServer(aof=True)      # appendonly yes + appendfsync always
    server.start()
    ... server.url ...
    server.kill()                       # as a crash: nothing flushed beyond what AOF already has
    server.restart()                    # same port, same directory: the data comes back from AOF
    server.stop()                       # SHUTDOWN; removes the directory unless keep_dir

Or as a context manager: ``with RedisServer() as server: ...``.

Replicated Redis, for failover tests (every process on free ports, each in its own directory):

    with SentinelGroup(replicas=2) as group:    # a primary, its replicas, three sentinels
        ... group.url ...                       # redis+sentinel://127.0.0.1:P1,.../sluice
        old = group.kill_primary()              # SIGKILL
        new = group.wait_failover(old)          # the replica the sentinels promoted

    with RedisClusterNodes() as cluster:        # 3 masters, 1 replica each
        ... cluster.url ...                     # redis+cluster://127.0.0.1:P1,...
        master = cluster.master_of("{sluice}:x")
        master.kill(); cluster.wait_promoted(master, "{sluice}:x")
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

REDIS_SERVER = os.environ.get("SLUICE_TEST_REDIS_SERVER", "redis-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, check: Callable[[], bool], timeout: float) -> None:
    """Poll ``check`` until it holds, at most ``timeout`` seconds; errors count as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)


def _client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1, decode_responses=True)


def _cluster_ok(node: RedisServer) -> bool:
    """Whether ``node`` says the cluster is whole (CLUSTER INFO's ``cluster_state:ok``)."""
    with node.client() as c:
        return "cluster_state:ok" in str(c.execute_command("CLUSTER", "INFO"))


#: Redis Cluster's hash slots
CLUSTER_SLOTS = 16384


def _node_id(node: RedisServer) -> str:
    with node.client() as c:
        return str(c.execute_command("CLUSTER", "MYID"))


def _known_nodes(node: RedisServer) -> set[str]:
    """The ids of the nodes ``node`` has met (its handshakes done), itself included."""
    with node.client() as c:
        lines = str(c.execute_command("CLUSTER", "NODES")).strip().splitlines()
    fields = [line.split() for line in lines]
    return {f[0] for f in fields if "handshake" not in f[2] and "noaddr" not in f[2]}


def _slot_map(node: RedisServer) -> set[tuple[int, int, int]] | None:
    """``node``'s slot map as (first slot, last slot, master's port), when it covers every slot (what
    a client reading CLUSTER SLOTS from it is told); None while some slot has no master."""
    with node.client() as c:
        ranges = [(int(r[0]), int(r[1]), int(r[2][1])) for r in c.execute_command("CLUSTER", "SLOTS")]
    return set(ranges) if sum(last - first + 1 for first, last, _ in ranges) == CLUSTER_SLOTS else None


#: Times a server whose picked port was taken before it could bind picks another.
PORT_TRIES = 3


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


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
        #: Whether the ports are ours to change: picked here, and the server never started on them
        #: (a restart keeps its port; another test's server may take a picked port before we bind).
        self._may_repick = port is None
        self.aof = aof
        self.appendfsync = appendfsync
        self.extra = dict(extra or {})
        self.keep_dir = keep_dir
        self.dir = Path(tempfile.mkdtemp(prefix="sluice-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    def client(self) -> redis.Redis:
        """A synchronous client for the test's own checks (1 s timeouts)."""
        return _client(self.port)

    def role(self) -> str:
        """``master`` or ``slave``, as ROLE answers."""
        with self.client() as c:
            return str(c.execute_command("ROLE")[0])

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
        for _ in range(PORT_TRIES):
            if self._launch(timeout):
                self._may_repick = False
                return self
            # Another process took a port picked for us between the pick and the bind: pick again.
            self.port = _free_port()
            if "cluster-port" in self.extra:
                self.extra["cluster-port"] = str(_free_port())
        raise RuntimeError(f"redis-server found its ports taken {PORT_TRIES} times; see {self.dir}/redis.log")

    def _launch(self, timeout: float) -> bool:
        """Start the process and wait until it answers PING; False when it could not bind a port
        picked for it (and may pick another)."""
        log = self.dir / "redis.log"
        if self._may_repick:
            log.unlink(missing_ok=True)  # only a failed try of this start wrote it
        self.proc = subprocess.Popen(self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                if self._may_repick and "Address already in use" in _read(log):
                    self.proc = None
                    return False
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {log}")
            if self._ping():
                return True
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


def wait_replicas(primary: RedisServer, count: int, timeout: float = 30.0) -> None:
    """Until ``primary`` has at least ``count`` replicas online (in sync, taking its stream)."""

    def synced() -> bool:
        with primary.client() as c:
            info = c.info("replication")
        online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        return sum(1 for r in online if r.get("state") == "online") >= count

    _wait(f"{count} replica(s) of {primary.port} in sync", synced, timeout)


class DelayedLink:
    """A TCP relay from a free port to ``target`` that holds every chunk ``delay_ms`` each way, in
    its own thread: a replica that replicates through it lags its primary as one across a network
    does. :meth:`sever` drops at once whatever is still on its way, as the network does when the
    primary's machine goes down (a killed process's kernel would still send it)."""

    def __init__(self, target: int, delay_ms: float) -> None:
        self.port = _free_port()
        self.target = target
        self.delay_s = delay_ms / 1000
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"delayed-link-{self.port}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delayed link did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", self.port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            self._loop.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )
        for w in (writer, up_writer):
            w.close()
            self._writers.discard(w)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                at, chunk = await queue.get()
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                if not chunk:  # the far end closed, and what it sent before has arrived
                    return
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while chunk := await reader.read(65536):
                queue.put_nowait((time.monotonic() + self.delay_s, chunk))
            queue.put_nowait((time.monotonic() + self.delay_s, b""))
            await sender
        finally:
            sender.cancel()
            with contextlib.suppress(BaseException):
                await sender
            writer.close()

    def sever(self) -> None:
        """Cut every connection now, dropping what is still delayed; returns once it is cut."""
        done = threading.Event()

        def cut() -> None:
            for w in list(self._writers):
                w.transport.abort()
            done.set()

        self._loop.call_soon_threadsafe(cut)
        done.wait(5)

    def close(self) -> None:
        self.sever()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


# --- replicated Redis: Sentinel ---------------------------------------------------------------------


class SentinelServer:
    """One sentinel (``redis-server FILE --sentinel``) on a free port, watching one master.

    Args:
        master: the primary to watch, and its name.
        quorum: sentinels that must agree the primary is down before a failover.
        down_after_ms: how long a silent primary takes to count as down.
        failover_timeout_ms: Sentinel's failover-timeout (also how soon a failed failover is retried).
    """

    def __init__(
        self, master: RedisServer, name: str, *, quorum: int, down_after_ms: int, failover_timeout_ms: int
    ) -> None:
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="sluice-sentinel-"))
        self.name = name
        (self.dir / "sentinel.conf").write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            f"dir {self.dir}\n"
            f"logfile {self.dir / 'sentinel.log'}\n"
            f"sentinel monitor {name} 127.0.0.1 {master.port} {quorum}\n"
            f"sentinel down-after-milliseconds {name} {down_after_ms}\n"
            f"sentinel failover-timeout {name} {failover_timeout_ms}\n"
            f"sentinel parallel-syncs {name} 1\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SentinelServer:
        self.proc = subprocess.Popen(
            [REDIS_SERVER, str(self.dir / "sentinel.conf"), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait(f"sentinel on {self.port}", lambda: bool(_client(self.port).ping()), 10)
        return self

    def master(self) -> dict[str, Any]:
        """What this sentinel knows of the master (SENTINEL MASTER, as a dict)."""
        with _client(self.port) as c:
            reply = c.execute_command("SENTINEL", "MASTER", self.name)
        if isinstance(reply, dict):  # redis-py parses it
            return reply
        return dict(zip(reply[::2], reply[1::2], strict=True))

    def master_port(self) -> int:
        with _client(self.port) as c:
            return int(c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name)[1])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelGroup:
    """A primary, ``replicas`` replicas of it and ``sentinels`` sentinels watching it, on free ports.
    The data nodes run with AOF (``appendfsync`` as asked) and noeviction, like RedisServer.

    Args:
        replicas: replicas of the primary; with one, a failover leaves the new primary none.
        sentinels: sentinel processes; the quorum is a majority of them.
        name: the master's name (the URL's path).
        down_after_ms: how long a silent primary takes to be declared down.
        failover_timeout_ms: Sentinel's failover-timeout.
        appendfsync: the data nodes' fsync policy.
        link_delay_ms: when above 0, the replicas replicate through a :class:`DelayedLink` that
            holds the stream this long each way, as a network between machines does; killing the
            primary then severs those links too (its machine is gone). Sentinel would point such a
            replica at the primary directly after twice its failover-timeout, so that is raised.
    """

    def __init__(
        self,
        replicas: int = 1,
        sentinels: int = 3,
        *,
        name: str = "sluice",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        appendfsync: str = "always",
        link_delay_ms: float = 0,
    ) -> None:
        self.name = name
        self.primary_at_start = RedisServer(aof=True, appendfsync=appendfsync)
        self.nodes = [self.primary_at_start]
        self.links: list[DelayedLink] = []
        self.link_delay_ms = link_delay_ms
        if link_delay_ms:
            failover_timeout_ms = max(failover_timeout_ms, 120_000)
        for _ in range(replicas):
            port = self.primary_at_start.port
            if link_delay_ms:
                self.links.append(DelayedLink(port, link_delay_ms))
                port = self.links[-1].port
            self.nodes.append(
                RedisServer(aof=True, appendfsync=appendfsync, extra={"replicaof": f"127.0.0.1 {port}"})
            )
        self.sentinels = [
            SentinelServer(
                self.primary_at_start,
                name,
                quorum=sentinels // 2 + 1,
                down_after_ms=down_after_ms,
                failover_timeout_ms=failover_timeout_ms,
            )
            for _ in range(sentinels)
        ]

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels) + f"/{self.name}"

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def primary(self) -> RedisServer:
        """The data node the first sentinel names as master now."""
        return self.node(self.sentinels[0].master_port())

    def start(self, timeout: float = 30.0) -> SentinelGroup:
        for node in self.nodes:
            node.start()
        self.wait_replicas(self.primary_at_start, len(self.nodes) - 1, timeout)
        for sentinel in self.sentinels:
            sentinel.start()

        def known() -> bool:  # every sentinel sees the others and every replica
            return all(
                int(m["num-other-sentinels"]) == len(self.sentinels) - 1
                and int(m["num-slaves"]) == len(self.nodes) - 1
                for m in (s.master() for s in self.sentinels)
            )

        _wait("the sentinels meeting", known, timeout)
        return self

    def wait_replicas(self, primary: RedisServer, count: int, timeout: float = 30.0) -> None:
        """Until ``primary`` has ``count`` replicas online and in sync."""
        wait_replicas(primary, count, timeout)

    def kill_primary(self, primary: RedisServer | None = None) -> RedisServer:
        """SIGKILL the primary (``primary``, or the one the sentinels name), cutting its delayed
        links first if it has any; returns it (its process gone, its data directory kept)."""
        primary = primary or self.primary()
        if primary is self.primary_at_start:
            for link in self.links:
                link.sever()
        primary.kill()
        return primary

    def wait_failover(self, old: RedisServer, timeout: float = 30.0) -> RedisServer:
        """Until the sentinels name another primary and it says it is one; returns it."""

        def promoted() -> bool:
            ports = {s.master_port() for s in self.sentinels if s.proc is not None}
            if ports == {old.port} or len(ports) != 1:
                return False
            return self.node(ports.pop()).role() == "master"

        _wait("a failover", promoted, timeout)
        return self.primary()

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        for node in self.nodes:
            node.stop()
        for link in self.links:
            link.close()

    def __enter__(self) -> SentinelGroup:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# --- replicated Redis: Cluster ----------------------------------------------------------------------


class RedisClusterNodes:
    """A Redis Cluster of ``masters`` masters with ``replicas`` replicas each, made with the CLUSTER
    commands (as ``redis-cli --cluster create`` makes one); every node on a free port (and a free
    cluster-bus port), with AOF.

    Args:
        masters: masters (at least three: a majority of masters votes for a failover).
        replicas: replicas per master.
        node_timeout_ms: how long a silent node takes to be declared failed.
        appendfsync: the nodes' fsync policy.
    """

    def __init__(
        self, masters: int = 3, replicas: int = 1, *, node_timeout_ms: int = 1000, appendfsync: str = "always"
    ) -> None:
        self.masters = masters
        self.replicas = replicas
        self.nodes = [
            RedisServer(
                aof=True,
                appendfsync=appendfsync,
                extra={
                    "cluster-enabled": "yes",
                    "cluster-config-file": "nodes.conf",
                    "cluster-node-timeout": str(node_timeout_ms),
                    "cluster-port": str(_free_port()),
                    "repl-diskless-sync-delay": "0",
                },
            )
            for _ in range(masters * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[: self.masters])

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def start(self, timeout: float = 60.0) -> RedisClusterNodes:
        """Start the nodes and make them one cluster, within ``timeout`` seconds; returns once every
        node says the cluster is whole and sees the same masters, each with its replicas in sync.

        The cluster is made with the cluster commands themselves rather than ``redis-cli --cluster
        create``, which sleeps a second between its checks, and a node's first replica is synced at
        once (``repl-diskless-sync-delay 0``) rather than after Redis's five-second wait for more
        replicas: on a loaded machine the waits added up to most of the bound.
        """
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            node.start()
        masters, replicas = self.nodes[: self.masters], self.nodes[self.masters :]
        ids = {node.port: _node_id(node) for node in self.nodes}
        per = CLUSTER_SLOTS // self.masters
        for i, node in enumerate(masters):
            last = CLUSTER_SLOTS - 1 if i == self.masters - 1 else (i + 1) * per - 1
            with node.client() as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
        for epoch, node in enumerate(self.nodes, start=1):
            with node.client() as c:  # distinct epochs: no collision for the nodes to settle first
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            with node.client() as c:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", first.port, first.extra["cluster-port"])

        def met() -> bool:  # every node knows every other one, handshakes done
            return all(_known_nodes(node) == set(ids.values()) for node in self.nodes)

        _wait("the cluster nodes meeting", met, deadline - time.monotonic())
        for i, node in enumerate(replicas):
            with node.client() as c:
                c.execute_command("CLUSTER", "REPLICATE", ids[masters[i % self.masters].port])

        def ready() -> bool:  # every node whole and of one slot map, every master's replicas in sync
            if not all(_cluster_ok(node) for node in self.nodes):
                return False
            maps = [_slot_map(node) for node in self.nodes]
            if maps[0] is None or any(m != maps[0] for m in maps):
                return False
            return all(len(self.replicas_of(m)) == self.replicas for m in self.current_masters())

        _wait("the cluster forming", ready, deadline - time.monotonic())
        return self

    def _slots(self) -> list[list[Any]]:
        for node in self.nodes:
            if node.running:
                try:
                    with node.client() as c:
                        return list(c.execute_command("CLUSTER", "SLOTS"))
                except (redis.RedisError, OSError):
                    continue
        raise RuntimeError("no cluster node answers")

    def current_masters(self) -> list[RedisServer]:
        return [self.node(int(entry[2][1])) for entry in self._slots()]

    def replicas_of(self, master: RedisServer) -> list[RedisServer]:
        """The replicas online and in sync with ``master``."""
        with master.client() as c:
            info = c.info("replication")
        return [
            self.node(int(v["port"]))
            for k, v in info.items()
            if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
        ]

    def master_of(self, key: str) -> RedisServer:
        """The node serving ``key``'s slot now, as a live node sees it."""
        with next(n for n in self.nodes if n.running).client() as c:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
        for start, end, master, *_ in self._slots():
            if int(start) <= slot <= int(end):
                return self.node(int(master[1]))
        raise RuntimeError(f"slot {slot} is not served")

    def wait_promoted(self, old: RedisServer, key: str, timeout: float = 30.0) -> RedisServer:
        """Until another node serves ``key``'s slot as master and the cluster is whole; returns it."""

        def promoted() -> bool:
            master = self.master_of(key)
            return master is not old and master.role() == "master" and _cluster_ok(master)

        _wait("a cluster failover", promoted, timeout)
        return self.master_of(key)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterNodes:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
