"""The local engine's build: cache key and lookup, tool checks, and the whole pipeline against a fake cmake
(resume after a failure, ccache, an interrupted build).

Unit tests: no compiler, no network, about 5 s.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from sluice.local_engine import build as engine_build
from sluice.local_engine import cache as engine_cache
from sluice.local_engine.build import build_llama_server
from sluice.local_engine.cache import (
    LLAMA_CPP_PYTHON_VERSION,
    build_key,
    build_work_dir,
    cached_binary_path,
    cpu_flags,
    find_llama_server,
    find_model,
    model_cache_path,
)
from sluice.local_engine.commands import parse_progress, stop_group
from sluice.local_engine.errors import EngineBuildError, MissingToolError
from sluice.local_engine.toolchain import check_build_tools
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
    assert key.startswith(f"{LLAMA_CPP_PYTHON_VERSION}-")
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
    monkeypatch.setattr(engine_cache, "_installed_package_model", lambda: None)
    assert find_model() is None
    cached = model_cache_path()
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


# A stand-in for cmake that "builds" a llama-server script, so the whole pipeline runs in milliseconds. Like
# ninja, it compiles only the objects its build tree lacks, records each finished one in .ninja_log and
# lists it in $COMPILED (so a test sees what a second attempt redid); $FAIL_AT names the object whose
# compile fails, $FAIL fails the first. Every call's arguments go to $CMAKE_CALLS when that is set, and the
# build step's CCACHE_* environment to <build>/ccache-env.
FAKE_CMAKE = textwrap.dedent(
    """\
    [ -n "$CMAKE_CALLS" ] && echo "$*" >> "$CMAKE_CALLS"
    if [ "$1" = "--build" ]; then
        env | grep '^CCACHE_' > "$2/ccache-env"
        [ -n "$FAIL" ] && FAIL_AT=x.o
        for obj in x.o y.o; do
            [ -e "$2/$obj" ] && continue
            echo "[1/3] Building CXX object $obj"
            [ "$FAIL_AT" = "$obj" ] && { echo "error: boom"; exit 1; }
            : > "$2/$obj"
            printf '0\\t1\\t0\\t%s\\t0\\n' "$obj" >> "$2/.ninja_log"
            echo "$obj" >> "$COMPILED"
        done
        echo "[3/3] Linking CXX executable bin/llama-server"
        mkdir -p "$2/bin"
        printf '#!/bin/sh\\necho "version: 1 (fake)" >&2\\n' > "$2/bin/llama-server"
        chmod +x "$2/bin/llama-server"
    else
        [ -n "$FAIL_CONFIGURE" ] && { echo "CMake Error: generator does not match"; exit 1; }
        mkdir -p "$4"
        : > "$4/CMakeCache.txt"
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
    monkeypatch.setenv("COMPILED", str(tmp_path / "compiled"))
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
    assert info["resumed_steps"] == 0
    assert not any((cache / "tmp").iterdir()), "the work directory is removed after the install"
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
    assert str(build_work_dir()) in str(info.value), "the error says where the next attempt resumes"
    assert find_llama_server() is None
    assert not cached_binary_path().exists()
    assert list((cache / "tmp").iterdir()) == [build_work_dir()], "only the build tree is kept"


def _compiled() -> list[str]:
    """The objects the fake cmake has compiled, all attempts together."""
    return Path(os.environ["COMPILED"]).read_text().split()


def test_attempt_after_a_failed_build_compiles_only_what_is_missing(
    fake_toolchain: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAIL_AT", "y.o")
    with pytest.raises(EngineBuildError):
        build_llama_server(source_dir=fake_toolchain, progress_bar=False)
    assert _compiled() == ["x.o"], "the first attempt compiled x.o, then failed on y.o"
    monkeypatch.delenv("FAIL_AT")
    capsys.readouterr()
    path = build_llama_server(source_dir=fake_toolchain, progress_bar=False)
    assert "resuming the build kept from an earlier attempt (1 steps done)" in capsys.readouterr().err
    assert _compiled() == ["x.o", "y.o"], "the second attempt, in the kept tree, compiled y.o alone"
    assert path == find_llama_server()
    info = json.loads((path.parent / "build-info.json").read_text())
    assert info["resumed_steps"] == 1
    assert not build_work_dir().exists(), "the kept tree goes once the binary is installed"


def test_force_starts_from_scratch(
    fake_toolchain: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAIL_AT", "y.o")
    with pytest.raises(EngineBuildError):
        build_llama_server(source_dir=fake_toolchain, progress_bar=False)
    monkeypatch.delenv("FAIL_AT")
    build_llama_server(source_dir=fake_toolchain, progress_bar=False, force=True)
    assert _compiled() == ["x.o", "x.o", "y.o"], "the kept tree was discarded: x.o was compiled again"
    info = json.loads((cached_binary_path().parent / "build-info.json").read_text())
    assert info["resumed_steps"] == 0


def test_kept_tree_that_does_not_configure_is_started_afresh(
    fake_toolchain: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAIL_AT", "y.o")
    with pytest.raises(EngineBuildError):
        build_llama_server(source_dir=fake_toolchain, progress_bar=False)
    monkeypatch.delenv("FAIL_AT")
    # A cmake that refuses the kept tree (another generator, say) and configures an empty one.
    refusing = FAKE_CMAKE.replace('[ -n "$FAIL_CONFIGURE" ]', '[ -e "$4/CMakeCache.txt" ]')
    _executable(Path(os.environ["PATH"].split(":")[0]) / "cmake", refusing)
    build_llama_server(source_dir=fake_toolchain, progress_bar=False)
    assert "does not configure; starting it afresh" in capsys.readouterr().err
    assert _compiled() == ["x.o", "x.o", "y.o"], "the fresh tree compiled everything"
    info = json.loads((cached_binary_path().parent / "build-info.json").read_text())
    assert info["resumed_steps"] == 0


def _fake_sdist(dest: Path) -> None:
    """A llama-cpp-python sdist holding just the vendored llama.cpp directory and one file."""
    dest.mkdir(parents=True, exist_ok=True)
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    with tarfile.open(dest / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz", "w:gz") as sdist:
        data = b"cmake_minimum_required(VERSION 3.14)\n"
        member = tarfile.TarInfo(prefix + "CMakeLists.txt")
        member.size = len(data)
        sdist.addfile(member, io.BytesIO(data))


def test_download_is_kept_across_attempts_and_a_cut_one_is_redone(
    fake_toolchain: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    downloads: list[Path] = []
    cut = [True]

    def fake_pip_download(args: list[str], dest: Path, log: object) -> None:
        downloads.append(dest)
        if cut[0]:
            dest.mkdir(parents=True)
            (dest / "llama_cpp_python.tar.gz").write_bytes(b"half an archive")
            raise EngineBuildError("`pip download` failed (exit code 2)")
        _fake_sdist(dest)

    monkeypatch.setattr(engine_build, "pip_download", fake_pip_download)
    with pytest.raises(EngineBuildError):
        build_llama_server(progress_bar=False)
    cut[0] = False
    monkeypatch.setenv("FAIL_AT", "y.o")
    with pytest.raises(EngineBuildError):
        build_llama_server(progress_bar=False)
    assert len(downloads) == 2, "the cut download was not taken for a whole one"
    monkeypatch.delenv("FAIL_AT")
    build_llama_server(progress_bar=False)
    assert len(downloads) == 2, "the third attempt reused the second one's download"
    assert not build_work_dir().exists()


def test_build_uses_ccache_when_on_the_path(
    fake_toolchain: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    box = Path(os.environ["PATH"].split(":")[0])
    ccache = _executable(box / "ccache")
    calls = cache / "cmake-calls"
    monkeypatch.setenv("CMAKE_CALLS", str(calls))
    key = build_key()
    monkeypatch.setenv("FAIL_AT", "y.o")  # so the build tree, and the environment it saw, stay
    with pytest.raises(EngineBuildError):
        build_llama_server(source_dir=fake_toolchain, progress_bar=False)
    assert f"using ccache ({ccache})" in capsys.readouterr().err
    configure = calls.read_text().splitlines()[0].split()
    assert f"-DCMAKE_C_COMPILER_LAUNCHER={ccache}" in configure
    assert f"-DCMAKE_CXX_COMPILER_LAUNCHER={ccache}" in configure
    assert "-DGGML_CCACHE=OFF" in configure, "llama.cpp's own ccache lookup is off: Sluice chooses"
    ccache_env = dict(
        line.split("=", 1) for line in (build_work_dir() / "build" / "ccache-env").read_text().splitlines()
    )
    assert ccache_env["CCACHE_BASEDIR"] == str(build_work_dir())
    flags_file = Path(ccache_env["CCACHE_EXTRAFILES"])
    assert flags_file.read_text().strip() == cpu_flags(), "ccache hashes the CPU's flags"
    assert build_key() == key, "ccache does not change what is built, so not the key either"


def test_build_without_ccache_clears_the_launcher(
    fake_toolchain: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if shutil.which("ccache"):
        pytest.skip("ccache is installed in /usr/bin or /bin, which the fake toolchain's PATH keeps")
    calls = cache / "cmake-calls"
    monkeypatch.setenv("CMAKE_CALLS", str(calls))
    path = build_llama_server(source_dir=fake_toolchain, progress_bar=False)
    assert "using ccache" not in capsys.readouterr().err
    configure = calls.read_text().splitlines()[0].split()
    # Empty, not absent: a tree kept from an attempt that had ccache would otherwise still call it.
    assert "-DCMAKE_C_COMPILER_LAUNCHER=" in configure
    assert "-DCMAKE_CXX_COMPILER_LAUNCHER=" in configure
    assert "-DGGML_CCACHE=OFF" in configure
    assert json.loads((path.parent / "build-info.json").read_text())["compiler_launcher"] is None


def test_interrupted_build_stops_its_compilers_and_leaves_no_binary(
    fake_toolchain: Path, cache: Path
) -> None:
    marker = cache / "compiler.pid"
    partial = build_work_dir() / "build" / "partial.o"
    # The "compiler" deletes its half-written object on SIGTERM, as gcc does; it writes its pid only once
    # its trap is set and the object exists.
    hanging_cmake = textwrap.dedent(
        f"""\
        if [ "$1" = "--build" ]; then
            echo "[1/2] Building CXX object x.o"
            sh -c 'trap "rm -f {partial}; exit 143" TERM; : > {partial}; echo $$ > {marker}.tmp;
                   mv {marker}.tmp {marker}; while :; do sleep 0.1; done' &
            wait
        else
            mkdir -p "$4"
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
    assert build_work_dir().is_dir(), "the build tree is kept for the next attempt"
    assert not partial.exists(), "the compiler got SIGTERM first, and time to delete its partial object"


def test_a_compiler_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    marker = tmp_path / "stubborn.pid"
    stubborn_compiler = (
        f"trap '' TERM; echo $$ > {marker}.tmp; mv {marker}.tmp {marker}; while :; do sleep 0.1; done"
    )
    script = f'sh -c "{stubborn_compiler}" & wait'
    with subprocess.Popen(["sh", "-c", script], start_new_session=True, text=True) as group:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert time.monotonic() < deadline, "the stubborn compiler never started"
            time.sleep(0.02)
        stubborn = int(marker.read_text())
        started = time.monotonic()
        stop_group(group, grace=0.5)
        took = time.monotonic() - started
    deadline = time.monotonic() + 10
    while alive(stubborn):  # reparented to PID 1, which reaps it when it gets round to it
        assert time.monotonic() < deadline, "the compiler that ignores SIGTERM outlived the SIGKILL"
        time.sleep(0.02)
    assert 0.5 <= took < 5, f"SIGKILL came {took:.2f} s after SIGTERM, not after the 0.5 s grace"


def test_cli_status_exits_1_when_absent(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_cache, "_installed_package_model", lambda: None)
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
