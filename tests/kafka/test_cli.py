"""``sluice kafka`` refuses, at start, a class its requests could not run in."""

from __future__ import annotations

import subprocess
import sys


def test_an_unknown_priority_is_refused_at_start() -> None:
    args = ["--broker", "redis://127.0.0.1:1", "--bootstrap", "127.0.0.1:1", "--topic", "a"]
    done = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "kafka", *args, "--output-topic", "b", "--priority", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--priority 'nope' is not a class" in done.stderr and "batch" in done.stderr
