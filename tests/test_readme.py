"""The README's first screen stays true: its commands are run as written.

The install-and-serve command runs in a copy of the working tree (a fresh virtual environment, the
real ``pip install -e .``, the real ``sluice serve`` on the local engine, whose llama-server build is
cached in ~/.cache/sluice), then the "Use it" examples run against it, read from the README with only
the port changed. ``bash .ci/run`` is checked to end with the test command the Develop section names.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port
from tests.local_engine.tethered import Keeper, tethered
from tests.local_engine.tethered import descendants as process_tree

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the README's port, replaced by a free one in the examples
README_PORT = 8000
#: pip install -e . into a fresh venv takes about a minute; then the cached engine starts in seconds
READY_WITHIN_S = 420.0
STOP_WITHIN_S = 30.0
#: the programs the "Use it" examples may need: both come with the first screen's requirements
EXAMPLE_PROGRAMS = {"curl", "python3"}


def readme() -> str:
    return README.read_text(encoding="utf-8")


def blocks(text: str, lang: str = "bash") -> list[str]:
    """The fenced code blocks of one language, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.DOTALL | re.MULTILINE)


def section(text: str, heading: str) -> str:
    """The text of a ``## heading`` section, up to the next one."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.DOTALL | re.MULTILINE)
    assert match, f"the README has no '## {heading}' section"
    return match.group(1)


def commands(block: str) -> list[str]:
    """The block's shell commands, each with its continuation lines (a line ending in a backslash)."""
    out: list[str] = []
    current: list[str] = []
    for line in block.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current.append(line)
        if not line.rstrip().endswith("\\"):
            out.append("\n".join(current))
            current = []
    assert not current, "a command ends in a backslash with nothing after it"
    return out


def programs(command: str) -> set[str]:
    """The programs a command runs: its first word and each after a pipe or inside ``$(``, outside
    quoted strings."""
    unquoted = re.sub(r"'[^']*'|\"[^\"]*\"", "''", command)
    return set(re.findall(r"(?:^|[|;&]|\$\()\s*([A-Za-z_][\w.-]*)\b(?!=)", unquoted, re.MULTILINE))


# --- the parts that need nothing running -------------------------------------------------------


def test_ci_run_ends_with_the_develop_test_command() -> None:
    first_screen = blocks(readme())
    assert first_screen[1].strip() == "bash .ci/run"
    ci = ROOT / ".ci" / "run"
    assert ci.is_file()
    develop = blocks(section(readme(), "Develop"))[0]
    test_command = next(
        line.split("#")[0].strip() for line in develop.splitlines() if line.split()[0].endswith("pytest")
    )
    last = [line.strip() for line in ci.read_text(encoding="utf-8").splitlines() if line.strip()][-1]
    assert last.removeprefix("exec ").strip() == test_command


def test_use_it_needs_only_curl_and_python3() -> None:
    use_it = commands(blocks(section(readme(), "Use it"))[0])
    assert use_it and all(f"localhost:{README_PORT}" in c for c in use_it)
    for command in use_it:
        assert programs(command) <= EXAMPLE_PROGRAMS, command
    assert programs("id=$(curl -s x | python3 -c 'y')\njq .id") == {"curl", "python3", "jq"}


# --- the first screen, run as written ----------------------------------------------------------


def copy_tree(dest: Path) -> None:
    """The working tree's files that git tracks or would track (not .venv or other ignored paths)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    for raw in listed.split(b"\0"):
        source = ROOT / os.fsdecode(raw)
        if raw and source.is_file():  # a file deleted in the tree, or a submodule, is not copied
            target = dest / os.fsdecode(raw)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def descendants(pid: int) -> dict[int, bytes]:
    """pid's descendants and their command lines, from /proc (empty where there is none)."""
    out: dict[int, bytes] = {}
    for child in process_tree(pid):
        with contextlib.suppress(OSError):
            out[child] = (Path("/proc") / str(child) / "cmdline").read_bytes()
    return out


def alive(pid: int, cmdline: bytes) -> bool:
    """Whether pid still runs the same command (not a zombie, not a reused pid)."""
    proc = Path("/proc") / str(pid)
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z" and (proc / "cmdline").read_bytes() == cmdline
    except OSError:
        return False


def gone(pid: int, cmdline: bytes) -> bool:
    return not alive(pid, cmdline)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.25)


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def started(command: str, cwd: Path, env: dict[str, str], log: Path) -> Iterator[Keeper]:
    """The command under a keeper (:func:`~tests.local_engine.tethered.tethered`), which leads its
    process group: should this test process die, even by SIGKILL, the keeper kills everything the
    command started (pip, ``sluice serve``, llama-server). On exit the group and every descendant
    are killed, whatever happened (llama-server runs in a session of its own)."""
    with log.open("wb") as out:
        proc = tethered(["bash", "-c", command], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    seen: dict[int, bytes] = {}
    try:
        yield proc
    finally:
        seen.update(descendants(proc.pid))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid, cmdline in seen.items():
            if alive(pid, cmdline):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=STOP_WITHIN_S)
        proc.untether()


def wait_ready(proc: subprocess.Popen[bytes], port: int, log: Path) -> dict[str, object]:
    deadline = time.monotonic() + READY_WITHIN_S
    with httpx.Client(trust_env=False, timeout=5.0) as http:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the command exited with {proc.returncode} before it was ready:\n{tail(log)}")
            with contextlib.suppress(httpx.TransportError, ValueError):
                r = http.get(f"http://127.0.0.1:{port}/readyz")
                body = r.json()
                if r.status_code == 200 and body.get("status") == "ready":
                    return dict(body)
            if time.monotonic() > deadline:
                pytest.fail(f"/readyz did not say ready within {READY_WITHIN_S:.0f} s:\n{tail(log)}")
            time.sleep(0.5)


def check_example(command: str, output: str) -> None:
    """What each "Use it" example must answer; an example this does not know fails the test."""
    if "/v1/chat/completions" in command:
        body = json.loads(output)
        assert body["object"] == "chat.completion", output
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] > 0
    elif re.match(r"^id=\$\(curl\b.*/v1/jobs\b", command, re.DOTALL):
        assert re.fullmatch(r"[\w-]{8,}", output), f"not a job id: {output!r}"
    elif re.search(r"/v1/jobs/\$id\?wait=", command):
        body = json.loads(output)
        assert body["status"] == "succeeded", output
        assert body["result"]["choices"] and body["usage"]["completion_tokens"] > 0
    elif re.search(r"/v1/jobs/\$id/events", command):
        events = re.findall(r"^event: ?(\w+)", output, re.MULTILINE)
        assert events and events[0] == "queued" and events[-1] == "done", output
    else:
        pytest.fail(f"tests/test_readme.py has no check for the README example {command!r}")


def run_examples(port: int, env: dict[str, str]) -> None:
    examples = commands(blocks(section(readme(), "Use it"))[0])
    values: dict[str, str] = {}
    for example in examples:
        command = example.replace(f"localhost:{README_PORT}", f"localhost:{port}")
        assigned = re.match(r"^(\w+)=\$\(", command)
        script = f'{command}\nprintf %s "${assigned.group(1)}"' if assigned else command
        done = subprocess.run(
            ["bash", "-c", "set -euo pipefail\n" + script],
            env={**env, **values},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{example}\n{done.stdout}\n{done.stderr}"
        check_example(example, done.stdout)
        if assigned:
            values[assigned.group(1)] = done.stdout
    sdk = blocks(section(readme(), "Use it"), "python")[0]
    assert f"127.0.0.1:{README_PORT}" in sdk
    done = subprocess.run(
        [sys.executable, "-c", sdk.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{port}")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
@pytest.mark.llm
@pytest.mark.timeout(600)
def test_first_screen_install_and_serve_then_use_it(tmp_path: Path) -> None:
    status = subprocess.run(
        [str(Path(sys.executable).with_name("sluice")), "engine", "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if status.returncode != 0:
        pytest.skip(f"the llama-server build is not there (`sluice engine status`): {status.stdout.strip()}")
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed; the README's examples use it")
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tree to copy is what git tracks")
    install_and_serve = blocks(readme())[0].strip()
    assert "\n" not in install_and_serve and install_and_serve.endswith("sluice serve")

    tree = tmp_path / "tree"
    copy_tree(tree)
    assert not (tree / ".venv").exists() and (tree / "pyproject.toml").is_file()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") and k != "VIRTUAL_ENV"}
    env["SLUICE_PORT"] = str(port)
    log = tmp_path / "serve.log"

    with started(install_and_serve, tree, env, log) as proc:
        ready = wait_ready(proc, port, log)
        assert ready["models"]
        engine = descendants(proc.pid)
        assert any(b"llama-server" in cmdline for cmdline in engine.values()), engine

        run_examples(port, env)

        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal
        try:
            proc.wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"sluice serve, or a process it started, did not stop within {STOP_WITHIN_S:.0f} s "
                f"of SIGINT:\n{tail(log)}"
            )
        assert proc.returncode == 0, tail(log)
        for pid, cmdline in engine.items():
            wait_for(partial(gone, pid, cmdline), STOP_WITHIN_S, f"process {pid} after the stop")
