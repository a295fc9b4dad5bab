"""Does a waiting batch cost interactive traffic anything? ``python -m sluice.bench.batch_idle``.

The same interactive load (``sluice bench``, open loop, the same seed) runs against a fresh
``sluice serve`` on the simulator, once with no batch and once per batch setting with a batch of
``--lines`` lines created (and running) before the load starts. Each run reports the interactive
p50/p99 latency and goodput, and how many batch lines finished meanwhile (the engine's otherwise
idle capacity that the batch took). docs/batches.md holds the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _batch(url: str, lines: int, max_tokens: int) -> str:
    content = "".join(
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "sim",
                    "messages": [{"role": "user", "content": f"summarise document {i}"}],
                    "max_tokens": max_tokens,
                },
            }
        )
        + "\n"
        for i in range(lines)
    ).encode()
    r = httpx.post(
        url + "/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}, timeout=60
    )
    r.raise_for_status()
    body = {"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    r = httpx.post(url + "/v1/batches", json=body, timeout=30)
    r.raise_for_status()
    return str(r.json()["id"])


def _completed(url: str, batch_id: str) -> int:
    return int(httpx.get(f"{url}/v1/batches/{batch_id}", timeout=10).json()["request_counts"]["completed"])


def run_one(
    args: argparse.Namespace, sim: str, label: str, inflight: int | None, headroom: int | None, out: Path
) -> dict[str, Any]:
    port = _port()
    url = f"http://127.0.0.1:{port}"
    files = tempfile.mkdtemp(prefix="sluice-batch-bench-")
    env = {"SLUICE_FILES_DIR": files, "SLUICE_LOG_LEVEL": "warning"}
    if inflight:  # None: unbounded but for the idle slots; 0: no batch at all
        env["SLUICE_BATCH_MAX_INFLIGHT"] = str(inflight)
    if headroom is not None:
        env["SLUICE_BATCH_HEADROOM_SLOTS"] = str(headroom)
    serve = _cli(
        "serve", "--backend", sim, "--port", str(port), "--max-concurrency", str(args.slots), env=env
    )
    try:
        _wait(url + "/readyz")
        batch_id = None
        if inflight != 0:
            batch_id = _batch(url, args.lines, args.max_tokens)
            end = time.monotonic() + 60
            while _completed(url, batch_id) < 1 and time.monotonic() < end:
                time.sleep(0.2)  # the engine is busy with the batch before the load starts
        before = _completed(url, batch_id) if batch_id else 0
        t0 = time.monotonic()
        subprocess.run(
            [
                sys.executable, "-m", "sluice.cli", "bench", "--target", url, "--mode", "sync",
                "--rate", str(args.rate), "--duration", str(args.duration), "--seed", "1",
                "--max-tokens", str(args.max_tokens), "--out", str(out), "--label", label,
                "--no-progress", "--no-plot",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        elapsed = time.monotonic() - t0
        done = (_completed(url, batch_id) - before) if batch_id else 0
        summary = json.loads((out / f"{label}.json").read_text())
        s = summary.get("summary", summary)
        return {
            "label": label,
            "batch_max_inflight": inflight,
            "batch_headroom_slots": headroom,
            "p50_s": s["latency_ok_s"]["p50"],
            "p99_s": s["latency_ok_s"]["p99"],
            "goodput_rps": s["goodput_rps"],
            "ok": s["outcomes"]["ok"],
            "offered": s["offered"],
            "batch_lines_per_s": done / elapsed,
        }
    finally:
        serve.terminate()
        serve.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="article")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--lines", type=int, default=5000)
    parser.add_argument(
        "--runs",
        default="0,default,h0",
        help="comma-separated runs: 0 (no batch), default (the settings' defaults), hN "
        "(batch_headroom_slots N) or N (batch_max_inflight N)",
    )
    parser.add_argument("--out", default=".bench-out/batch-idle")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sim_port = _port()
    sim = _cli("sim", "--preset", args.preset, "--port", str(sim_port), "--max-num-seqs", str(args.slots))
    rows = []
    try:
        sim_url = f"http://127.0.0.1:{sim_port}"
        _wait(sim_url + "/v1/models")
        for entry in args.runs.split(","):
            inflight = headroom = None
            if entry.startswith("h"):
                headroom = int(entry[1:])
            elif entry != "default":
                inflight = int(entry)
            label = "no-batch" if inflight == 0 else f"batch-{entry}"
            row = run_one(args, sim_url, label, inflight, headroom, out)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        sim.terminate()
        sim.wait(10)
    (out / "batch-idle.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
