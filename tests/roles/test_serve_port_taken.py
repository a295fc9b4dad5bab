"""A port already taken fails `sluice serve` at once, with a hint, before anything slow starts."""

from __future__ import annotations

import socket
import subprocess
import sys


def test_serve_on_a_taken_port_fails_at_once_with_a_hint() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        # No --backend would build the local engine first; a dead backend keeps this test quick, and
        # the bind must fail before either would be touched.
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "sluice.cli",
                "serve",
                "--port",
                str(port),
                "--backend",
                "http://127.0.0.1:9",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert f"127.0.0.1:{port}" in done.stderr and "--port" in done.stderr
    assert "serving" not in done.stdout + done.stderr
