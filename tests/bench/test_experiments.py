"""The scripted experiments (``python -m sluice.bench.article`` and ``.llm``) run the same ``sluice
bench`` command lines, in the same order, as the shell scripts they replace; checked with every
child process replaced by a recorder (the runs themselves take 10 and 30 minutes)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.bench import article, cli, experiment, llm


def _recorder(monkeypatch: pytest.MonkeyPatch, capacity: float) -> list[str]:
    """Record each child command line (without `python -m sluice.cli`); a capacity run leaves a result."""
    commands: list[str] = []

    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        assert argv[:3] == [sys.executable, "-m", "sluice.cli"] and kwargs == {"check": True}
        args = argv[3:]
        commands.append(" ".join(args))
        if args[-2:] == ["--label", "capacity"]:
            out = Path(args[args.index("--out") + 1])
            summary = {"goodput_steady_rps": capacity}
            (out / "capacity.json").write_text(json.dumps({"summary": summary}))
        if args[:2] == ["bench", "compare"]:
            out = Path(args[2]).parent
            (out / f"{args[args.index('--name') + 1]}.png").write_bytes(b"png")
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(experiment.subprocess, "run", run)
    return commands


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs" / "img").mkdir(parents=True)
    return tmp_path


def test_article_runs_the_shell_scripts_commands(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = _recorder(monkeypatch, capacity=5.4321)
    out = Path(".bench-out/article")
    out.mkdir(parents=True)
    article.experiment(out)
    run = "bench --out .bench-out/article --no-progress --spawn-sim article"
    o = ".bench-out/article"
    assert commands == [
        f"{run} --rate 8 --duration 40 --client-timeout 0 --label capacity",
        f"{run} --capacity 5.43 --label direct-steady",
        f"{run} --spawn-sluice --capacity 5.43 --label sluice-steady",
        f"{run} --spawn-sluice --capacity 5.43 --users 50 --label sluice-50-users-steady",
        f"{run} --capacity 5.43 --profile spike --rate 3 --label direct-spike",
        f"{run} --spawn-sluice --capacity 5.43 --profile spike --rate 3 --label sluice-spike",
        f"{run} --spawn-sluice --capacity 5.43 --profile spike --rate 3 --users 50 "
        "--label sluice-50-users-spike",
        f"bench compare {o}/direct-steady.json {o}/sluice-steady.json {o}/sluice-50-users-steady.json "
        "--name steady",
        f"bench compare {o}/direct-spike.json {o}/sluice-spike.json {o}/sluice-50-users-spike.json "
        "--name spike",
    ]
    assert sorted(p.name for p in (checkout / "docs" / "img").iterdir()) == [
        "article-spike.png",
        "article-steady.png",
    ]


def test_llm_runs_the_shell_scripts_commands(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = _recorder(monkeypatch, capacity=2.7)

    @contextlib.contextmanager
    def engine(out: Path, port: int | None = None) -> Iterator[str]:
        assert port is None  # a free one
        yield "http://127.0.0.1:9999"

    monkeypatch.setattr(llm, "engine", engine)
    out = Path(".bench-out/llm")
    out.mkdir(parents=True)
    llm.experiment(out, "direct,cap,fifo,deadline,codel")
    run = "bench --out .bench-out/llm --no-progress --max-tokens 64 --stream --target http://127.0.0.1:9999"
    each = f"{run} --spawn-sluice --slots 4 --policies"
    clients = "--capacity 2.7 --users 50 --retriers 0.1"
    # round(1.8 * 2.7, 2), round(0.5 * 2.7, 2), round(5 * 2.7, 2), as the shell script's python printed them
    steady = "--rate 4.86 --duration 60"
    spike = "--profile spike --rate 1.35 --peak 13.5 --spike-at 20 --spike-for 10 --duration 60"
    o = ".bench-out/llm"
    policies = ("direct", "cap", "fifo", "deadline", "codel")
    assert commands == [
        f"{run} --mode direct --rate 6 --duration 30 --client-timeout 0 --label capacity",
        f"{each} direct,cap,fifo,deadline,codel {clients} {steady} --label llm-steady",
        f"{each} direct,cap,fifo,deadline,codel {clients} {spike} --label llm-spike",
        "bench compare " + " ".join(f"{o}/llm-steady-{p}.json" for p in policies) + " --name llm-steady",
        "bench compare " + " ".join(f"{o}/llm-spike-{p}.json" for p in policies) + " --name llm-spike",
    ]  # fmt: skip
    copied = sorted(p.name for p in (checkout / "docs" / "img").iterdir())
    assert copied == ["llm-spike.png", "llm-steady.png"]


def test_article_puts_every_run_on_the_ports_chosen(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = _recorder(monkeypatch, capacity=5.5)
    out = Path(".bench-out/article")
    out.mkdir(parents=True)
    article.experiment(out, sim_port=8100, sluice_port=8000)
    runs = [c for c in commands if not c.startswith("bench compare")]
    assert len(runs) == 7
    for command in runs:
        assert "--spawn-sim article --sim-port 8100 " in command
        # the gateway's port only where a gateway is spawned
        assert ("--sluice-port 8000" in command) == ("--spawn-sluice" in command)
    assert sum("--sluice-port 8000" in c for c in runs) == 4


def test_llm_puts_the_engine_and_the_gateways_on_the_ports_chosen(
    checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands = _recorder(monkeypatch, capacity=2.7)
    engine_ports: list[int | None] = []

    @contextlib.contextmanager
    def engine(out: Path, port: int | None = None) -> Iterator[str]:
        engine_ports.append(port)
        yield f"http://127.0.0.1:{port}"

    monkeypatch.setattr(llm, "engine", engine)
    out = Path(".bench-out/llm")
    out.mkdir(parents=True)
    llm.experiment(out, "direct,codel", engine_port=8080, sluice_port=8000)
    assert engine_ports == [8080]
    runs = [c for c in commands if not c.startswith("bench compare")]
    assert all("--target http://127.0.0.1:8080 " in c for c in runs)
    assert "--sluice-port" not in runs[0]  # the capacity run: the engine alone
    assert all("--spawn-sluice --slots 4 --policies" in c and "--sluice-port 8000" in c for c in runs[1:])


def test_the_llm_engine_starts_on_the_port_chosen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[list[str]] = []

    class Engine:
        def __init__(self, command: list[str], **kwargs: Any) -> None:
            started.append(command)

        def poll(self) -> None:
            return None

        def terminate(self) -> None:
            pass

        def wait(self, timeout: float | None = None) -> int:
            return 0

    class Healthy:
        status_code = 200

    monkeypatch.setattr(llm.subprocess, "Popen", Engine)
    monkeypatch.setattr(llm.httpx, "get", lambda url, **kwargs: Healthy())
    port = cli.free_port()
    with llm.engine(tmp_path, port) as url:
        assert url == f"http://127.0.0.1:{port}"
    (command,) = started
    assert command[command.index("--port") + 1] == str(port)
    with llm.engine(tmp_path) as url:  # no port chosen: a free one
        assert started[1][started[1].index("--port") + 1] == url.rsplit(":", 1)[1]


def test_a_missing_plot_is_said_not_copied(checkout: Path, capsys: pytest.CaptureFixture[str]) -> None:
    experiment.copy_plot(Path("nowhere/steady.png"), "article-steady.png")
    assert "no nowhere/steady.png to copy" in capsys.readouterr().err
    assert not list((checkout / "docs" / "img").iterdir())
