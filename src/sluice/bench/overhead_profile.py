"""py-spy for :mod:`sluice.bench.overhead`: the Sluice gateway recorded through a row (py-spy's raw
collapsed stacks), and where its samples went: by library, by task, by frame, and the share of
the gateway's HTTP client to the engine.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any


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
        _wait_tool(proc, seconds, "py-spy")


def _wait_tool(proc: subprocess.Popen[bytes], seconds: float, name: str) -> None:
    """Wait for a recording tool that runs ``seconds`` (killed 30 s past them), and say on stderr
    if it failed: a run goes on without its recording rather than stopping."""
    try:
        _, err = proc.communicate(timeout=seconds + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    if proc.returncode != 0:
        print(f"{name} failed ({proc.returncode}): {err.decode(errors='replace')[-500:]}", file=sys.stderr)


#: The system calls ``perf_syscalls`` counts: those a gateway writes and reads its sockets with.
SYSCALLS = ("write", "writev", "sendto", "sendmsg", "read", "recvfrom")


@contextlib.contextmanager
def perf_syscalls(pid: int, seconds: float, path: Path | None) -> Iterator[None]:
    """Count ``pid``'s system calls of :data:`SYSCALLS` (perf's syscall tracepoints, all its
    threads) for ``seconds`` while inside; perf's CSV goes to ``path``. Needs perf and the right to
    read tracepoints (root, or a low enough ``perf_event_paranoid``)."""
    if path is None:
        yield
        return
    perf = shutil.which("perf")
    if perf is None:
        print("--syscalls: perf is not installed; nothing counted", file=sys.stderr)
        yield
        return
    events = ",".join(f"syscalls:sys_enter_{name}" for name in SYSCALLS)
    argv = [perf, "stat", "-x", ",", "-e", events, "-p", str(pid), "-o", str(path)]
    argv += ["--", "sleep", str(max(1, round(seconds)))]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield
    finally:
        _wait_tool(proc, seconds, "perf")


def syscall_counts(path: Path) -> dict[str, int]:
    """From perf stat's CSV (``-x ,``): each counted system call's name -> how many calls (a count
    perf could not read is left out)."""
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        fields = line.split(",")
        if len(fields) < 3 or not fields[0].isdigit():
            continue
        event = fields[2]
        if event.startswith("syscalls:sys_enter_"):
            counts[event.removeprefix("syscalls:sys_enter_")] = int(fields[0])
    return counts


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


#: The engine client's frames: Sluice's adapter and the HTTP libraries it has used (the gateway
#: uses none of these for anything else: its server side is uvicorn and httptools).
ENGINE_CLIENT = ("sluice/backends/", "aiohttp/", "httpx/", "httpcore/", "h11/")


def engine_client_share(path: Path) -> float | None:
    """The share of samples with a frame of the engine client anywhere in their stack (aiohttp's
    protocol callbacks run from the event loop, below no frame of Sluice's): None without samples."""
    counts = Counter[bool]()
    for frames, count in _stacks(path):
        counts[any(lib in frame for frame in frames for lib in ENGINE_CLIENT)] += count
    samples = counts[True] + counts[False]
    return counts[True] / samples if samples else None


def print_profile(path: Path) -> None:
    print(f"\npy-spy, the Sluice gateway ({path.stem}); shares of its samples")
    share = engine_client_share(path)
    if share is not None:
        print(f"\nthe HTTP client to the engine (any frame of {', '.join(ENGINE_CLIENT)}): {share:.1%}")
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


def function_name(key: Any) -> str:
    """A function counted by a profile hook (``sys.setprofile``: a code object for a Python call,
    the C function for a C call), named as its qualified name and where it is (a C function: its
    name only); :mod:`sluice.bench.ttft_path` and :mod:`sluice.bench.overhead_calls` count by it."""
    code = getattr(key, "co_qualname", None)
    if code is not None:
        return f"{code} ({key.co_filename.rsplit('/', 2)[-1]}:{key.co_firstlineno})"
    return f"{getattr(key, '__qualname__', repr(key))} (C)"
