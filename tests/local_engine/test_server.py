"""The local engine's supervisor: the llama-server command line (unit) and a real llama-server (llm)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from openai.types.chat import ChatCompletionMessageParam

from sluice.local_engine.server import (
    EngineStartError,
    LocalEngine,
    find_llama_server,
    find_model,
    llama_server_command,
)
from tests.local_engine.procs import alive

# Found before any test changes the environment: the real engine tests use the user's real cache.
REAL_BINARY = find_llama_server()
REAL_MODEL = find_model()


# ---------------------------------------------------------------------------------------- unit


def test_command_line_splits_context_over_slots() -> None:
    command = llama_server_command(
        "/opt/llama-server", "/m/model.gguf", port=8012, threads=2, slots=4, ctx_per_slot=2048, repack=True
    )
    assert command == [
        "/opt/llama-server",
        "-m", "/m/model.gguf",
        "--alias", "smollm2",
        "--host", "127.0.0.1",
        "--port", "8012",
        "-t", "2",
        "-c", "8192",
        "-np", "4",
        "--metrics",
        "--no-webui",
    ]  # fmt: skip


def test_command_line_skips_repacking_on_amx_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import sluice.local_engine.server

    def command() -> list[str]:
        return llama_server_command("/b", "/m", port=1, threads=1)

    monkeypatch.setattr(
        sluice.local_engine.server, "cpu_flags", lambda: "avx2 avx512f amx_bf16 amx_int8 amx_tile fma"
    )
    assert "--no-repack" in command()
    monkeypatch.setattr(sluice.local_engine.server, "cpu_flags", lambda: "avx2 avx512f fma")
    assert "--no-repack" not in command()
    assert "--no-repack" in llama_server_command("/b", "/m", port=1, threads=1, repack=False)


def test_command_line_custom_values_and_extra_args() -> None:
    command = llama_server_command(
        Path("/b"), Path("/m"), port=1, host="0.0.0.0", threads=8, slots=3, ctx_per_slot=1000,
        alias="tiny", extra_args=["--seed", "1"],
    )  # fmt: skip
    assert command[command.index("-c") + 1] == "3000"
    assert command[command.index("-np") + 1] == "3"
    assert command[command.index("--alias") + 1] == "tiny"
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert command[-2:] == ["--seed", "1"]


@pytest.mark.parametrize("bad", [{"slots": 0}, {"ctx_per_slot": 0}, {"threads": 0}, {"port": 0}])
def test_command_line_rejects_nonsense(bad: dict[str, int]) -> None:
    kwargs = {"port": 8000, "threads": 2, "slots": 4, "ctx_per_slot": 2048} | bad
    with pytest.raises(ValueError):
        llama_server_command("/b", "/m", **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------- real engine

llm = pytest.mark.llm
needs_engine = pytest.mark.skipif(
    REAL_BINARY is None or REAL_MODEL is None,
    reason="llama-server or the model is absent: run `sluice engine build` (about 4 minutes)",
)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[LocalEngine]:
    async with LocalEngine(
        binary=REAL_BINARY,
        model_path=REAL_MODEL,
        slots=2,
        ctx_per_slot=1024,
        log_path=tmp_path / "engine.log",
    ) as running:
        yield running


def _client(engine: LocalEngine) -> AsyncOpenAI:
    # trust_env=False: a proxy configured in the environment must not intercept loopback traffic.
    return AsyncOpenAI(
        base_url=f"{engine.url}/v1", api_key="unused", http_client=DefaultAsyncHttpxClient(trust_env=False)
    )


MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]


async def _chat(engine: LocalEngine, max_tokens: int = 16) -> int:
    async with _client(engine) as client:
        reply = await client.chat.completions.create(
            model=engine.model,
            messages=MESSAGES,
            max_tokens=max_tokens,
            temperature=0,
        )
    assert len(reply.choices) == 1
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None
    assert 0 < reply.usage.completion_tokens <= max_tokens
    assert reply.usage.prompt_tokens > 0
    return reply.usage.completion_tokens


@llm
@needs_engine
async def test_engine_answers_chat_completion(engine: LocalEngine) -> None:
    assert engine.url == f"http://127.0.0.1:{engine.port}"
    assert engine.model == "smollm2"
    assert engine.log_path is not None and engine.log_path.stat().st_size > 0
    await _chat(engine)


@llm
@needs_engine
async def test_engine_streams_with_usage(engine: LocalEngine) -> None:
    content_chunks = 0
    finish_reasons: list[str] = []
    usage = None
    async with _client(engine) as client:
        stream = await client.chat.completions.create(
            model=engine.model,
            messages=MESSAGES,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    content_chunks += 1
                if choice.finish_reason is not None:
                    finish_reasons.append(choice.finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage
    assert finish_reasons in (["stop"], ["length"])
    assert usage is not None
    assert 0 < usage.completion_tokens <= 16
    assert 0 < content_chunks <= usage.completion_tokens


@llm
@needs_engine
async def test_engine_runs_the_requested_slots(engine: LocalEngine) -> None:
    async with httpx.AsyncClient(trust_env=False) as client:
        props = (await client.get(f"{engine.url}/props")).json()
        metrics = await client.get(f"{engine.url}/metrics")
    assert props["total_slots"] == engine.slots == 2
    assert metrics.status_code == 200 and "llamacpp:" in metrics.text
    counts = await asyncio.gather(*(_chat(engine, max_tokens=8) for _ in range(3)))
    assert all(0 < n <= 8 for n in counts)


@llm
@needs_engine
async def test_engine_restarts_after_kill_9(tmp_path: Path) -> None:
    restarted = asyncio.Event()
    seen: list[int | None] = []

    async def on_restart(e: LocalEngine) -> None:
        seen.append(e.pid)
        restarted.set()

    async with LocalEngine(
        binary=REAL_BINARY, model_path=REAL_MODEL, slots=1, ctx_per_slot=512, on_restart=on_restart,
        log_path=tmp_path / "engine.log", restart_backoff=(0.1, 1.0),
    ) as engine:  # fmt: skip
        first_pid, url = engine.pid, engine.url
        assert first_pid is not None
        os.kill(first_pid, signal.SIGKILL)
        async with asyncio.timeout(30):
            await restarted.wait()
        assert engine.restarts == 1
        assert engine.url == url, "the restarted engine keeps its port"
        assert seen == [engine.pid] and engine.pid != first_pid
        await _chat(engine, max_tokens=8)
    assert engine.pid is None


@llm
@needs_engine
async def test_engine_stop_leaves_no_process(tmp_path: Path) -> None:
    async with LocalEngine(
        binary=REAL_BINARY, model_path=REAL_MODEL, slots=1, ctx_per_slot=512, log_path=tmp_path / "e.log"
    ) as engine:
        pid = engine.pid
        assert pid is not None and alive(pid)
    assert not alive(pid)
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(trust_env=False) as client:
            await client.get(f"{engine.url}/health")


@llm
@needs_engine
async def test_engine_start_failure_reports_log_tail(tmp_path: Path) -> None:
    bad_model = tmp_path / "not-a-model.gguf"
    bad_model.write_bytes(b"this is not a gguf file")
    with pytest.raises(EngineStartError) as info:
        async with LocalEngine(
            binary=REAL_BINARY, model_path=bad_model, log_path=tmp_path / "e.log", startup_timeout=30
        ):
            pytest.fail("a broken model must not start")
    message = str(info.value)
    assert "exited with code" in message
    assert str(tmp_path / "e.log") in message
    assert "gguf" in message.lower(), "the message carries the engine's own complaint"


@llm
@needs_engine
async def test_engine_retries_when_its_free_port_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from sluice.local_engine import server as engine_module

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken, engine_module.free_port()])
        monkeypatch.setattr(engine_module, "free_port", lambda host: next(ports))
        async with LocalEngine(
            binary=REAL_BINARY, model_path=REAL_MODEL, slots=1, ctx_per_slot=512, log_path=tmp_path / "e.log"
        ) as engine:
            assert engine.port != taken
            assert engine.running
    assert "couldn't bind" in (tmp_path / "e.log").read_text()


@llm
@needs_engine
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PDEATHSIG is Linux-only")
def test_engine_dies_with_its_parent(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""\
        import asyncio
        from sluice.local_engine.server import LocalEngine

        async def main() -> None:
            async with LocalEngine(binary={str(REAL_BINARY)!r}, model_path={str(REAL_MODEL)!r},
                                   slots=1, ctx_per_slot=512, log_path={str(tmp_path / "e.log")!r}) as e:
                print(e.pid, flush=True)
                await asyncio.sleep(3600)

        asyncio.run(main())
        """
    )
    engine_pid = 0
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as parent:
        try:
            assert parent.stdout is not None
            engine_pid = int(parent.stdout.readline())
            assert alive(engine_pid)
            parent.kill()
            parent.wait(timeout=10)
            deadline = time.monotonic() + 10
            while alive(engine_pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not alive(engine_pid), "the engine outlived its supervisor"
        finally:
            parent.kill()
            if engine_pid and alive(engine_pid):
                os.kill(engine_pid, signal.SIGKILL)
