"""A tethered command (tests/local_engine/tethered.py, which the README test runs ``sluice serve``
under) dies with the process that started it, SIGKILL included, and otherwise runs and stops as
it would alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.local_engine.procs import alive
from tests.local_engine.tethered import descendants, tethered

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux's")

ROOT = Path(__file__).resolve().parents[2]
#: bounds of the waits: generous, since the machine may be loaded; nothing here is timed
WITHIN_S = 30.0


def wait_for(predicate: Callable[[], bool], what: str, within: float = WITHIN_S) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {within:.0f} s"
        time.sleep(0.02)


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_tethered_command_and_all_it_started_die_when_its_starter_is_killed(tmp_path: Path) -> None:
    """A test-like parent starts a shell tethered, which starts a child and a detached grandchild
    (double fork and setsid, as a daemon would), then the parent is SIGKILLed: no ``finally``
    runs, and everything it had started must go."""
    pids = tmp_path / "pids"
    script = (
        f"sleep 1001 & echo $! >> {pids}; "
        f"(setsid sleep 1002 & echo $! >> {pids}); "  # the subshell exits: sleep 1002 is orphaned
        f"echo $$ >> {pids}.shell; mv {pids}.shell {pids}.ready; wait"
    )
    parent_code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from tests.local_engine.tethered import descendants, tethered
        keeper = tethered(["sh", "-c", {script!r}])
        print(keeper.pid, flush=True)
        time.sleep(1000)
        """
    )
    with subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True) as parent:
        try:
            assert parent.stdout is not None
            keeper = int(parent.stdout.readline())
            wait_for(Path(f"{pids}.ready").exists, "the tethered shell started its children")
            shell = int(Path(f"{pids}.ready").read_text())
            started = [keeper, shell, *map(int, pids.read_text().split())]
            assert len(started) == 4
            # A pid is written as soon as its fork returns: until the child has exec'd its sleep,
            # its cmdline is the shell's, or empty mid-exec (on a loaded machine, once, the detached
            # one's read empty), and what all_gone matches it by below would be wrong.
            sleeps = {started[2]: b"sleep\x001001\x00", started[3]: b"sleep\x001002\x00"}
            wait_for(lambda: all(cmdline(pid) == line for pid, line in sleeps.items()), "the sleeps exec'd")
            seen = {pid: cmdline(pid) for pid in started}
            assert all(seen.values()) and all(alive(pid) for pid in started)
            detached = started[3]
            wait_for(lambda: os.getsid(detached) == detached, "the grandchild detached")
        finally:
            parent.kill()
            parent.wait()

    def all_gone() -> bool:
        # A pid is reused only after its process is gone: a pid running another command is gone too.
        return not any(alive(pid) and cmdline(pid) == line for pid, line in seen.items())

    wait_for(all_gone, "the processes the killed parent had started are gone")


def test_a_tethered_command_keeps_its_exit_status() -> None:
    for script, status in (("exit 3", 3), ("kill -KILL $$", -signal.SIGKILL)):
        keeper = tethered(["sh", "-c", script])
        assert keeper.wait(timeout=WITHIN_S) == status
        keeper.untether()


def test_untethering_a_running_keeper_kills_its_command() -> None:
    """Closing the tether is what the kernel does when the starter dies: the same path, by hand."""
    keeper = tethered(["sh", "-c", "sleep 1003 & wait"])
    wait_for(lambda: any(b"1003" in cmdline(pid) for pid in descendants(keeper.pid)), "the command started")
    started = {pid: cmdline(pid) for pid in descendants(keeper.pid)}
    keeper.untether()
    assert keeper.wait(timeout=WITHIN_S) == 137
    assert not any(alive(pid) and cmdline(pid) == line for pid, line in started.items())


def test_a_ctrl_c_to_the_group_stops_the_command_its_own_way_and_the_keeper_waits_for_what_it_left(
    tmp_path: Path,
) -> None:
    """SIGINT to the keeper's group reaches the command, which stops as it likes (here: after a
    trap, with status 0), and the keeper exits only once the child the command left behind is gone
    too: a command that leaves a process running is not 'stopped'."""
    left = tmp_path / "left"
    script = (
        f"(trap '' INT; sleep 0.5; echo done > {left}) & "  # outlives the shell by half a second
        f"trap 'exit 0' INT; touch {tmp_path}/ready; while :; do sleep 0.05; done"
    )
    keeper = tethered(["sh", "-c", script])
    try:
        wait_for((tmp_path / "ready").exists, "the command started")
        os.killpg(keeper.pid, signal.SIGINT)
        assert keeper.wait(timeout=WITHIN_S) == 0
        assert left.read_text() == "done\n", "the keeper exited before the process the command left"
    finally:
        if keeper.poll() is None:
            os.killpg(keeper.pid, signal.SIGKILL)
            keeper.wait()
        keeper.untether()
