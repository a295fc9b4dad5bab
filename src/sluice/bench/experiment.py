"""What the scripted experiments (``sluice.bench.article``, ``sluice.bench.llm``) share.

Each ``sluice bench`` run is a child ``python -m sluice.cli bench ...``, as a user would type it, so
that every run starts from a fresh process and its result records the command that made it. Paths
are relative to the checkout's root, where the results (``.bench-out/``) and the documentation's
plots (``docs/img/``) live.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["DOCS_IMG", "bench", "checkout_root", "copy_plot", "measured_capacity", "sluice"]

DOCS_IMG = Path("docs/img")


def checkout_root() -> Path:
    """The checkout this package runs from (an editable install), else the current directory."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").is_file() and (root / "docs").is_dir() else Path.cwd()


def sluice(*args: str) -> None:
    """Run ``sluice ARGS`` with this interpreter; a failed run stops the experiment."""
    subprocess.run([sys.executable, "-m", "sluice.cli", *args], check=True)


def bench(out: Path, *args: str) -> None:
    """One ``sluice bench`` run into ``out``, without a progress bar (the tables go to stdout)."""
    sluice("bench", "--out", str(out), "--no-progress", *args)


def measured_capacity(result: Path) -> float:
    """A capacity run's answers per second while the batch was full, rounded to 0.01 req/s."""
    summary = json.loads(result.read_text())["summary"]
    return round(float(summary["goodput_steady_rps"]), 2)


def copy_plot(plot: Path, name: str) -> None:
    """Copy a comparison plot into docs/img/ as ``name``; say so when there is none (no matplotlib)."""
    if not plot.is_file():
        print(f"no {plot} to copy to {DOCS_IMG / name}", file=sys.stderr, flush=True)
        return
    shutil.copyfile(plot, DOCS_IMG / name)
