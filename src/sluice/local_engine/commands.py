"""The commands a provisioning runs: each logged to its log file, the build's steps followed as
progress, and a build stopped as a whole process group (its compilers too) when it is cut short."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from sluice.local_engine.errors import EngineBuildError

_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


def parse_progress(line: str) -> tuple[int, int] | None:
    """(done, total) from a ninja ``[n/N]`` or make ``[ p%]`` status line; None for other lines."""
    match = _NINJA_STEP.match(line)
    if match:
        return int(match.group(1)), int(match.group(2))
    match = _MAKE_PERCENT.match(line)
    if match:
        return int(match.group(1)), 100
    return None


class Progress:
    """A tqdm bar on a terminal; otherwise a line every tenth of the way, so CI logs stay short."""

    def __init__(
        self,
        desc: str,
        stream: IO[str] | None = None,
        bar: bool | None = None,
        on_update: Callable[[int, int], None] | None = None,
    ) -> None:
        self._on_update = on_update
        self._stream = stream if stream is not None else sys.stderr
        self._desc = desc
        use_bar = self._stream.isatty() if bar is None else bar
        self._bar: Any = None
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=None, desc=desc, unit="step", file=self._stream, dynamic_ncols=True)
        self._last_tenth = -1

    def update(self, done: int, total: int) -> None:
        if self._on_update is not None:
            self._on_update(done, total)
        if self._bar is not None:
            if self._bar.total != total:
                self._bar.total = total
            self._bar.n = done
            self._bar.refresh()
            return
        tenth = done * 10 // max(total, 1)
        if tenth > self._last_tenth:
            self._last_tenth = tenth
            print(f"sluice: {self._desc}: {done}/{total} ({done * 100 // max(total, 1)}%)", file=self._stream)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` of a log, for an error message (empty if it cannot be read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def pip_download(args: Sequence[str], dest: Path, log: IO[str]) -> None:
    """``pip download`` into ``dest`` with this interpreter's pip, its output to ``log``."""
    if importlib.util.find_spec("pip") is None:
        raise EngineBuildError(
            f"pip is not available in {sys.executable}; install it (`{sys.executable} -m ensurepip`)"
        )
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    command += ["-d", str(dest), *args]
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise EngineBuildError(f"`pip download {' '.join(args)}` failed (exit code {done.returncode})")


def steps_done(build_dir: Path) -> int:
    """How many build steps ninja has recorded as finished in ``build_dir`` (0 for make or a new tree).

    ``.ninja_log`` gets a line when a step completes, and a step that was cut short gets none; a step
    done twice has two lines, so outputs are counted once each.
    """
    try:
        lines = (build_dir / ".ninja_log").read_text(errors="replace").splitlines()
    except OSError:
        return 0
    outputs = {fields[3] for line in lines if len(fields := line.split("\t")) >= 5}
    return len(outputs)


def run_logged(command: Sequence[str], log: IO[str], progress: Progress | None, env: dict[str, str]) -> int:
    """Run ``command`` in its own process group, its output to ``log`` (and its steps to ``progress``);
    its exit code. Whatever interrupts the wait stops the whole group first (:func:`stop_group`)."""
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    with subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env=env,
        # Its own process group, so that an interrupted build can take ninja and the compilers down
        # with cmake; killing cmake alone would leave them compiling into a deleted directory.
        start_new_session=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()  # so `tail -f` on the build log follows along
                if progress is not None:
                    step = parse_progress(line)
                    if step is not None:
                        progress.update(*step)
            return proc.wait()
        finally:
            if proc.poll() is None:
                stop_group(proc)


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs; zombies do not count.

    On Linux from /proc: ``killpg(pgid, 0)`` also succeeds for zombies, and the compilers that outlive
    cmake are reparented to PID 1, which in a container may reap them late or never.
    """
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a member we may not signal is still a member
            return True
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after it.
            state, _ppid, pgrp = entry.joinpath("stat").read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if pgrp == str(pgid) and state != "Z":
            return True
    return False


def stop_group(proc: subprocess.Popen[str], grace: float = 5.0) -> None:
    """SIGTERM to the build's process group, then SIGKILL to whatever is left after ``grace`` seconds.

    SIGTERM first because the build tree is kept for the next attempt: gcc deletes the object it was
    writing, make deletes its half-made target and ninja leaves unfinished steps out of its log, so the
    next attempt redoes them instead of linking a truncated object. The wait is for the whole group, not
    just cmake, which exits at once while its compilers are still cleaning up.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc.poll() is not None and not group_alive(proc.pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
