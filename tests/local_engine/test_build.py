"""The local engine's build: cache key and lookup, tool checks, and the whole pipeline against a fake cmake.

Unit tests: no compiler, no network, about 5 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sluice.local_engine import build as engine_build
from sluice.local_engine.build import (
    EngineBuildError,
    MissingToolError,
    build_key,
    build_llama_server,
    cached_binary_path,
    check_build_tools,
    find_llama_server,
    find_model,
    parse_progress,
)
from tests.local_engine.procs import alive


def _executable(path: Path, body: str = "exit 0") -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(root))
    for name in ("SLUICE_LLAMA_SERVER", "SLUICE_MODEL", "CC", "CXX"):
        monkeypatch.delenv(name, raising=False)
    return root


def test_build_key_names_version_and_changes_with_cpu(cache: Path) -> None:
    key = build_key(flags="avx2 fma sse4_2")
    assert key.startswith(f"{engine_build.LLAMA_CPP_PYTHON_VERSION}-")
    assert key == build_key(flags="avx2 fma sse4_2")
    assert key != build_key(flags="avx2 avx512f fma sse4_2")
    assert key != build_key(version="9.9.9", flags="avx2 fma sse4_2")
    assert cached_binary_path().is_relative_to(cache / "llama-server")
    assert cached_binary_path().parent.name == build_key()


def test_find_llama_server_env_var_and_cache(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert find_llama_server() is None
    cached = cached_binary_path()
    cached.parent.mkdir(parents=True)
    _executable(cached)
    assert find_llama_server() == cached
    other = _executable(tmp_path / "my-llama-server")
    monkeypatch.setenv("SLUICE_LLAMA_SERVER", str(other))
    assert find_llama_server() == other
    monkeypatch.setenv("SLUICE_LLAMA_SERVER", str(tmp_path / "absent"))
    assert find_llama_server() is None


def test_find_model_env_var_and_cache(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_build, "_installed_package_model", lambda: None)
    assert find_model() is None
    cached = engine_build.model_cache_path()
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    assert find_model() == cached
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(b"GGUF")
    monkeypatch.setenv("SLUICE_MODEL", str(mine))
    assert find_model() == mine


def _toolbox(tmp_path: Path, names: list[str]) -> str:
    box = tmp_path / "bin"
    box.mkdir()
    for name in names:
        _executable(box / name)
    return str(box)


def test_tool_check_names_missing_cmake(cache: Path, tmp_path: Path) -> None:
    path = _toolbox(tmp_path, ["cc", "c++", "ninja"])
    with pytest.raises(MissingToolError) as info:
        check_build_tools(path=path)
    assert info.value.missing == ["cmake"]
    message = str(info.value)
    assert "cmake" in message
    assert "apt-get install build-essential cmake ninja-build" in message


def test_tool_check_names_every_missing_tool(cache: Path, tmp_path: Path) -> None:
    path = _toolbox(tmp_path, [])
    with pytest.raises(MissingToolError) as info:
        check_build_tools(path=path)
    missing = " ".join(info.value.missing)
    for word in ("C compiler", "C++ compiler", "cmake", "ninja or make"):
        assert word in missing


def test_tool_check_falls_back_to_make(cache: Path, tmp_path: Path) -> None:
    tools = check_build_tools(path=_toolbox(tmp_path, ["gcc", "g++", "cmake", "make"]))
    assert tools.generator == "Unix Makefiles"
    assert Path(tools.make_program).name == "make"
    assert Path(tools.cc).name == "gcc"
    assert Path(tools.cxx).name == "g++"


def test_parse_progress() -> None:
    assert parse_progress("[12/206] Building CXX object src/llama.cpp.o\n") == (12, 206)
    assert parse_progress("[ 45%] Building C object ggml.c.o") == (45, 100)
    assert parse_progress("-- Configuring done") is None


# A stand-in for cmake that "builds" a llama-server script, so the whole pipeline runs in milliseconds.
FAKE_CMAKE = textwrap.dedent(
    """\
    if [ "$1" = "--build" ]; then
        [ -n "$FAIL" ] && { echo "[1/2] Building CXX object x.o"; echo "error: boom"; exit 1; }
        echo "[1/2] Building CXX object x.o"
        echo "[2/2] Linking CXX executable bin/llama-server"
        mkdir -p "$2/bin"
        printf '#!/bin/sh\\necho "version: 1 (fake)" >&2\\n' > "$2/bin/llama-server"
        chmod +x "$2/bin/llama-server"
    else
        echo "-- Configuring done"
    fi
    """
)


@pytest.fixture
def fake_toolchain(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    box = tmp_path / "fakebin"
    box.mkdir()
    for name in ("cc", "c++", "ninja"):
        _executable(box / name)
    _executable(box / "cmake", FAKE_CMAKE)
    monkeypatch.setenv("PATH", f"{box}:/usr/bin:/bin")
    source = tmp_path / "llama.cpp"
    source.mkdir()
    return source


def test_build_pipeline_installs_binary_and_info(fake_toolchain: Path, cache: Path) -> None:
    path = build_llama_server(source_dir=fake_toolchain, progress_bar=False)
    assert path == cached_binary_path()
    assert find_llama_server() == path
    info = json.loads((path.parent / "build-info.json").read_text())
    assert info["llama_server_version"] == "version: 1 (fake)"
    assert info["build_key"] == build_key()
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in info["cmake_args"]
    assert set(info["phase_seconds"]) == {"download_s", "configure_s", "compile_s"}
    assert not any((cache / "tmp").iterdir()), "the work directory is removed after the build"
    # A second call finds the cached build and does not rebuild.
    before = path.stat().st_mtime_ns
    assert build_llama_server(source_dir=fake_toolchain) == path
    assert path.stat().st_mtime_ns == before


def test_failed_build_leaves_nothing_that_looks_done(
    fake_toolchain: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAIL", "1")
    with pytest.raises(EngineBuildError) as info:
        build_llama_server(source_dir=fake_toolchain, progress_bar=False)
    assert "error: boom" in str(info.value), "the error shows the tail of the build log"
    assert find_llama_server() is None
    assert not cached_binary_path().exists()
    assert not any((cache / "tmp").iterdir())


def test_interrupted_build_stops_its_compilers_and_leaves_no_binary(
    fake_toolchain: Path, cache: Path
) -> None:
    marker = cache / "compiler.pid"
    hanging_cmake = textwrap.dedent(
        f"""\
        if [ "$1" = "--build" ]; then
            echo "[1/2] Building CXX object x.o"
            sleep 60 &
            echo $! > {marker}
            wait
        fi
        """
    )
    _executable(Path(os.environ["PATH"].split(":")[0]) / "cmake", hanging_cmake)
    command = [
        sys.executable,
        "-m",
        "sluice.cli",
        "engine",
        "build",
        "--no-model",
        "--source",
        str(fake_toolchain),
    ]
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True) as build:
        deadline = time.monotonic() + 30
        while not marker.exists() or not marker.read_text().strip():
            assert time.monotonic() < deadline, "the fake compiler never started"
            time.sleep(0.05)
        compiler = int(marker.read_text())
        build.send_signal(signal.SIGTERM)
        _, err = build.communicate(timeout=30)
    survived = alive(compiler)
    if survived:
        os.kill(compiler, signal.SIGKILL)
    assert not survived, "the compiler outlived the interrupted build"
    assert build.returncode == 130, err
    assert "interrupted" in err
    assert find_llama_server() is None
    assert not any((cache / "tmp").iterdir())


def test_cli_status_exits_1_when_absent(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_build, "_installed_package_model", lambda: None)
    from sluice.cli import main

    assert main(["engine", "status"]) == 1


def test_cli_build_reports_missing_tool_without_traceback(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", _toolbox(tmp_path, ["cc", "c++", "make"]))
    from sluice.cli import main

    assert main(["engine", "build", "--no-model"]) == 1
    err = capsys.readouterr().err
    assert "missing cmake" in err
    assert "Traceback" not in err
