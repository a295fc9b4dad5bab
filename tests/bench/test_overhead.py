"""``python -m sluice.bench.overhead`` against the simulator for a second a row: every row comes out,
with numbers that add up (no timing assertions: the figures are the benchmark's, not the test's)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.bench import overhead, overhead_load, overhead_parts, overhead_profile, overhead_report
from sluice.sim.server import serve_in_background

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

HAVE_REDIS = shutil.which("redis-server") is not None


def test_every_row_with_sane_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--seconds", "1", "--warmup", "0.5", "--connections", "4", "--stream-tokens", "16"]
    args += ["--flood-connections", "24", "--gateways", "1,2", "--out", str(tmp_path), "--label", "t"]
    assert overhead.main(args) == 0
    result = json.loads((tmp_path / "t.json").read_text())
    rows = {row["name"]: row for row in result["rows"]}

    have_litellm = result["options"]["litellm_python"] is not None
    targets = ["engine", "passthrough", "sluice", *(["litellm"] if have_litellm else [])]
    expected = set(targets)
    expected |= {f"{t} streamed {n}" for t in targets for n in (8, 16)}
    expected |= {f"{t} flooded" for t in targets if t != "passthrough"}
    expected |= {f"{library} client alone" for library in overhead_load.CLIENTS}
    if HAVE_REDIS:
        expected |= {"1 gateway on Redis", "2 gateways on Redis", "sluice on Redis flooded"}
    assert set(rows) == expected
    if not have_litellm:
        assert any("LiteLLM" in note for note in result["notes"])

    for name, row in rows.items():
        assert row["answers"] > 0, name
        assert row["errors"] == 0, name
        assert 0 < row["p50_ms"] <= row["p99_ms"], name
        # The simulator answers every request with all of its max_tokens, streamed or not.
        assert row["tokens"] == row["answers"] * row["max_tokens"], name
        assert row["answers_per_s"] == pytest.approx(row["answers"] / row["seconds"])
        alone = name.startswith("engine") or row["group"] == "clients"
        roles = {"engine", "load"} | (set() if alone else {"gateway"})
        if "Redis" in name:
            roles |= {"workers", "redis"}
        assert set(row["cpu_s"]) == roles, name
        # No process did more than the machine's cores allow. CPU time is read in clock ticks
        # (10 ms): a process that served a 1-s window lightly may read 0, so only the ones that do
        # the most work (the engine, the gateway) must show some.
        for role, cpu in row["cpu_s"].items():
            assert 0 <= cpu <= row["seconds"] * result["cpus"] * 1.5, (name, role)
        assert row["cpu_s"]["engine"] > 0, name
        if "gateway" in row["cpu_s"]:
            assert row["cpu_s"]["gateway"] > 0, name
        if row["stream"]:
            assert 0 < row["ttft_p50_ms"] <= row["p50_ms"], name
        else:
            assert row["ttft_p50_ms"] is not None, name  # a whole answer's tokens arrive at once
    gateways = [t for t in targets if t != "engine"]
    assert set(result["per_token_us"]) == set(gateways)
    for target in gateways:
        short, long = rows[f"{target} streamed 8"], rows[f"{target} streamed 16"]
        extra = long["cpu_ms_per_request"]["gateway"] - short["cpu_ms_per_request"]["gateway"]
        assert result["per_token_us"][target] == pytest.approx(extra / 8 * 1000)
    curve = result["scaling_curve"]
    if HAVE_REDIS:
        assert set(curve) == {"1 gateway on Redis", "2 gateways on Redis"}
        for name, point in curve.items():
            row = rows[name]
            assert point["per_gateway_core"] == pytest.approx(row["answers_per_s"] / row["cores"]["gateway"])
        assert curve["1 gateway on Redis"]["against_one"] == 1.0
    printed = capsys.readouterr().out
    groups = [g for g in overhead_report.GROUPS if HAVE_REDIS or g != "scaling"]
    assert all(overhead_report.TITLES[group] in printed for group in groups)


def test_the_load_generator_reads_the_simulators_answers() -> None:
    """Whole and streamed answers on one keep-alive connection, and an error that keeps it open."""

    async def main() -> None:
        async with serve_in_background() as url:
            port = int(url.rsplit(":", 1)[1])
            _, client = await asyncio.get_running_loop().create_connection(
                overhead_load._Client, "127.0.0.1", port
            )
            try:
                for stream in (False, True, False, True):
                    request = overhead_load.request_bytes(url, overhead_load.Load(1, 5, stream=stream))
                    reply = await client.exchange(request)
                    assert (reply.status, reply.tokens, reply.close) == (200, 5, False)
                    assert reply.first_token is not None
                reply = await client.exchange(
                    overhead_load.request_bytes(url, overhead_load.Load(1, 0, stream=False))
                )
                assert (reply.status, reply.tokens, reply.first_token) == (400, 0, None)
                reply = await client.exchange(
                    overhead_load.request_bytes(url, overhead_load.Load(1, 3, stream=True))
                )
                assert (reply.status, reply.tokens) == (200, 3)
            finally:
                client.close()

    asyncio.run(main())


class _Transport:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def _chunk(piece: bytes) -> bytes:
    return f"{len(piece):x}\r\n".encode() + piece + b"\r\n"


def test_the_load_generator_parses_answers_cut_anywhere() -> None:
    """However TCP cuts an answer, and even with a token's text split between two chunks."""
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunked += _chunk(b'data: {"content": " tok0"}\n\n') + _chunk(b'data: {"content": " to') + _chunk(b'k1"}')
    chunked += b"0\r\n\r\n"
    whole = b'{"content": " tok0 tok1 tok2"}'
    sized = b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: %d\r\nConnection: close\r\n\r\n" % len(whole)
    sized += whole

    async def main() -> None:
        for raw, expected in ((chunked, (200, 2, False)), (sized, (429, 3, True))):
            for cut in range(len(raw) + 1):
                client = overhead_load._Client()
                client.connection_made(_Transport())  # type: ignore[arg-type]
                reply = client.exchange(b"")
                client.data_received(raw[:cut])
                client.data_received(raw[cut:])
                assert reply.done(), cut
                got = reply.result()
                assert (got.status, got.tokens, got.close) == expected, cut

    asyncio.run(main())


def test_top_frames_share_samples(tmp_path: Path) -> None:
    stacks = tmp_path / "raw.txt"
    stacks.write_text("main;serve;parse 6\nmain;serve;send 3\nmain;idle 1\nmain;serve;serve;parse 2\n")
    frames = {frame: (total, own) for frame, total, own in overhead_profile.top_frames(stacks)}
    assert frames["parse"] == (pytest.approx(8 / 12), pytest.approx(8 / 12))
    assert frames["serve"] == (pytest.approx(11 / 12), 0.0)  # a recurring frame counts once per sample
    assert frames["main"] == (1.0, 0.0)
    assert next(iter(frames)) == "parse"


def test_the_engine_client_share_counts_every_stack_it_is_in(tmp_path: Path) -> None:
    stacks = tmp_path / "raw.txt"
    stacks.write_text(
        "run (uvloop/__init__.py:1);stream (sluice/backends/openai.py:9);post (aiohttp/client.py:3) 5\n"
        "run (uvloop/__init__.py:1);data_received (aiohttp/client_proto.py:7) 3\n"
        "run (uvloop/__init__.py:1);handle (sluice/api/openai.py:2) 12\n"
    )
    assert overhead_profile.engine_client_share(stacks) == pytest.approx(8 / 20)


def test_syscall_counts_read_perfs_csv(tmp_path: Path) -> None:
    record = tmp_path / "row.txt"
    record.write_text(
        "# started on Tue Dec  1 19:58:31 2026\n\n"
        "60346,,syscalls:sys_enter_write,3032081946,100.00,,\n"
        "0,,syscalls:sys_enter_writev,3032081946,100.00,,\n"
        "<not counted>,,syscalls:sys_enter_sendto,0,0.00,,\n"
        "13583,,syscalls:sys_enter_read,3032081946,100.00,,\n"
    )
    assert overhead_profile.syscall_counts(record) == {"write": 60346, "writev": 0, "read": 13583}


def test_syscalls_without_a_record_count_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # perf "installed", and any process start recorded: without a record none may start.
    started: list[list[str]] = []
    monkeypatch.setattr(overhead_profile.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(overhead_profile.subprocess, "Popen", lambda argv, **_: started.append(argv))
    with overhead_profile.perf_syscalls(1, 1.0, None):
        pass
    assert started == []
    assert overhead.parse_args(["--syscalls", "d"]).syscalls == Path("d")


def test_a_rows_syscalls_ride_on_its_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """perf's counts become the row's own calls per response (in the row's JSON), not an option."""
    record = tmp_path / "spied.txt"

    @contextlib.contextmanager
    def perf(pid: int, seconds: float, path: Path | None) -> Iterator[None]:
        if path is not None:  # counted only with the gateway's pid
            assert path == record
            path.write_text("300,,syscalls:sys_enter_write,1,1,,\n90,,syscalls:sys_enter_read,1,1,,\n")
        yield

    tally = overhead_load.Tally(answered=[0.01] * 40, refused=[0.001] * 20, tokens=320)
    window = overhead_load.Window(tally, 2.0, {"gateway": 1.0}, {"gateway": 1.5})
    monkeypatch.setattr(overhead, "perf_syscalls", perf)
    monkeypatch.setattr(overhead, "closed_loop", lambda *args: window)
    options = overhead.Options(seconds=2.0, warmup_s=1.0, syscalls=tmp_path)
    rows: list[overhead_report.Row] = []
    load = overhead_load.Load(4, 8, stream=False)
    row = overhead._measure(rows, "closed", "spied", "cmd", ["u"], load, {}, options, profile_pid=7)
    # 30 responses a second over the 3 s of warm-up and window: 90 responses.
    assert row.syscalls_per_response == pytest.approx({"write": 300 / 90, "read": 1.0})
    assert rows == [row]
    assert row.as_dict()["syscalls_per_response"] == row.syscalls_per_response
    assert "syscalls_per_response" not in {f.name for f in dataclasses.fields(options)}
    unspied = overhead._measure(rows, "closed", "plain", "cmd", ["u"], load, {}, options, profile_pid=None)
    assert unspied.syscalls_per_response is None


def _scaling_row(gateways: int, answers: int, cpu: dict[str, float | None]) -> overhead_report.Row:
    name = f"{gateways} gateway{'s' if gateways > 1 else ''} on Redis"
    return overhead_report.Row(
        "scaling", name, "cmd", 32, 8, False, 10.0, answers, 0, 0, answers * 8,
        1.0, 2.0, 1.0, None, None, cpu, (1.0, 1.0, 1.0),
    )  # fmt: skip


def test_the_scaling_curve_is_answers_per_gateway_core() -> None:
    one = _scaling_row(1, 5000, {"gateway": 5.0, "redis": 1.0})  # 500/s on half a core
    two = _scaling_row(2, 6000, {"gateway": 8.0, "redis": 1.5})  # 600/s on 0.8 cores
    unread = _scaling_row(3, 6000, {"gateway": None})
    curve = overhead_report.scaling_curve([one, two, unread])
    assert curve == {
        one.name: {"per_gateway_core": 1000.0, "against_one": 1.0, "redis_ceiling": 5000.0},
        two.name: {"per_gateway_core": 750.0, "against_one": 0.75, "redis_ceiling": 4000.0},
    }
    assert "750 answers/s per gateway core, 0.75 of the first row's" in overhead_report.table([one, two])


def test_the_parts_bench_times_every_part(capsys: pytest.CaptureFixture[str]) -> None:
    found = overhead_parts.main(["--number", "5", "--repeat", "1"])
    assert set(found) == set(overhead_parts.parts())
    assert all(v > 0 for v in found.values())
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == found
