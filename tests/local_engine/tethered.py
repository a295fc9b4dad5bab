"""A command tethered to the process that starts it: it, and everything it starts, dies when that
process dies, however it dies (SIGKILL included, when no ``finally`` runs).

:func:`tethered` starts a keeper, this file run as a script, and the keeper runs the command. The
keeper:

* is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so that whatever the command starts stays
  under it even when its own parent dies or it detaches (a double fork, ``setsid``): an orphan is
  reparented to the keeper, not to PID 1;
* holds the read end of a pipe whose only write end the starting process holds. The kernel closes
  that end when the process dies, whatever killed it, and the keeper then reads end-of-file and
  SIGKILLs every process under it until none is left. No signal needs to reach anyone, and no
  timer guesses.

``PR_SET_PDEATHSIG`` alone would not do: it is set in one child only (the shell), is not inherited
by what that child starts, and fires when the *thread* that forked exits. The keeper is the group
leader of the command (the starter's ``killpg(keeper.pid, SIGINT)`` is a Ctrl-C in a terminal): it
lets SIGINT and SIGTERM pass to the command and keeps running, so that the command's own way of
stopping is what is tested; SIGKILL to the group stops everything at once. It exits once the
command and every process under it are gone, with the command's exit status (killed by a signal:
by the same signal).

Linux only (``prctl``, ``/proc``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

PR_SET_CHILD_SUBREAPER = 36
#: how often the keeper looks at its children and at the tether (seconds)
POLL_S = 0.05


class Keeper(subprocess.Popen[bytes]):
    """The keeper of a tethered command, as its starter sees it.

    Attributes:
        tether_fd: the pipe's write end, held while the starter lives; :meth:`untether` closes it.
    """

    tether_fd: int | None = None

    def untether(self) -> None:
        """Close the tether: the keeper then kills whatever is left under it (at once, if it still
        runs). Done on the starter's death by the kernel; call it when done with the keeper."""
        fd, self.tether_fd = self.tether_fd, None
        if fd is not None:
            os.close(fd)


def tethered(args: list[str], **popen: Any) -> Keeper:
    """Start ``args`` under a keeper in a new session (the keeper leads its process group) and
    return the keeper; ``popen`` is passed to :class:`subprocess.Popen` (cwd, env, stdout, ...).
    The keeper's pid is the command's process group."""
    read_end, write_end = os.pipe()  # both close-on-exec: no other child of ours inherits them
    try:
        keeper = Keeper(
            [sys.executable, str(Path(__file__).resolve()), str(read_end), "--", *args],
            pass_fds=(read_end,),
            start_new_session=True,
            **popen,
        )
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    # Held open for as long as this process lives (the tether), or until untether().
    keeper.tether_fd = write_end
    return keeper


def descendants(pid: int) -> list[int]:
    """Every process under ``pid``, zombies included, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, []))
    return out


def _reap() -> tuple[bool, list[tuple[int, int]]]:
    """Reap every child that has ended: whether any child is left, and the (pid, status) reaped."""
    reaped: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False, reaped
        if pid == 0:
            return True, reaped
        reaped.append((pid, status))


def _kill_everything() -> None:
    """SIGKILL every process under the keeper until none is left (an orphan comes back to the
    keeper, its subreaper, and is killed at the next round)."""
    me = os.getpid()
    while True:
        for pid in descendants(me):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        left, _ = _reap()
        if not left:
            return
        select.select([], [], [], POLL_S / 5)


def _exit_as(status: int) -> None:
    """Exit as the command did: with its code, or killed by the same signal."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to undo
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def keep(tether_fd: int, args: list[str]) -> None:
    """The keeper's whole life: run ``args``, and exit as it did once everything under it is gone,
    or kill everything under it when the tether breaks."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    # Handlers, not SIG_IGN: the command gets the defaults back at exec, so a Ctrl-C (or a SIGTERM)
    # to the group stops the command its own way while the keeper waits for it.
    signal.signal(signal.SIGINT, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: None)
    command = subprocess.Popen(args)  # in the keeper's process group; reaped below, not by Popen
    status: int | None = None
    while True:
        left, reaped = _reap()
        for pid, st in reaped:
            if pid == command.pid:
                status = st
        if not left and status is not None:
            command.returncode = 0  # reaped here; Popen must not wait for it again
            _exit_as(status)
        ready, _, _ = select.select([tether_fd], [], [], POLL_S)
        if ready and os.read(tether_fd, 1) == b"":  # the starting process is gone
            _kill_everything()
            command.returncode = 0
            os._exit(137)


if __name__ == "__main__":
    fd, separator, *command_args = sys.argv[1:]
    assert separator == "--" and command_args, "usage: tethered.py FD -- COMMAND..."
    keep(int(fd), command_args)
