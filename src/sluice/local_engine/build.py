"""The local engine's binary: llama.cpp's ``llama-server``, built from source into the cache
(:mod:`sluice.local_engine.cache`).

The sources come from the llama-cpp-python sdist, which vendors llama.cpp. A build's work directory
outlives a failed or interrupted attempt: the next attempt for the same build key reuses the download
and the sources, and ninja compiles only the steps that are missing. It is removed once the binary is
installed.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from sluice.local_engine.cache import (
    BINARY_NAME,
    CMAKE_ARGS,
    ENV_LLAMA_SERVER,
    LLAMA_CPP_PYTHON_VERSION,
    MODEL_ALIAS,
    build_key,
    build_work_dir,
    cached_binary_path,
    file_lock,
    find_llama_server,
    install_file,
    is_executable_file,
    llama_server_version,
    logs_dir,
    say,
    usable_cpus,
    write_json_atomic,
)
from sluice.local_engine.commands import Progress, log_tail, pip_download, run_logged, steps_done
from sluice.local_engine.errors import EngineBuildError, EngineError
from sluice.local_engine.toolchain import ccache_env, check_build_tools, compiler_cache_args

# MODEL_ALIAS is re-exported for the callers that still import it from here (bench/fleet.py).
__all__ = ["MODEL_ALIAS", "build_llama_server", "ensure_llama_server"]

_SDIST_PREFIX = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"


def _extract_llama_cpp(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(_SDIST_PREFIX)]
        if not members:
            raise EngineBuildError(f"{sdist.name} holds no {_SDIST_PREFIX}")
        if hasattr(tarfile, "data_filter"):
            archive.extractall(dest, members=members, filter="data")
        else:  # Python < 3.11.4; the archive comes from the package index over TLS
            archive.extractall(dest, members=members)


def _replace_dir(partial: Path, dest: Path) -> None:
    """Move a finished ``partial`` directory to ``dest``: a directory that exists is always complete."""
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(partial, dest)


def _llama_cpp_sources(work: Path, log: IO[str]) -> Path:
    """llama.cpp's tree from the sdist, reusing what an earlier attempt left in ``work``.

    ``download/`` and ``src/`` appear only complete (each is filled under a ``.partial`` name, then
    renamed), so whatever exists can be trusted and is not fetched or extracted again.
    """
    sources = work / "src"
    if (sources / _SDIST_PREFIX).is_dir():
        return sources / _SDIST_PREFIX
    download = work / "download"
    sdists = sorted(download.glob("*.tar.gz"))
    if sdists:
        say(
            f"reusing the llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist downloaded by an earlier attempt"
        )
    else:
        say(f"downloading llama.cpp: llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist")
        partial = work / "download.partial"
        shutil.rmtree(partial, ignore_errors=True)
        # --no-binary for this package only: ":all:" would also build pip's metadata build
        # dependencies (scikit-build-core and its own) from source, for minutes.
        pip_download(
            ["--no-binary", "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"], partial, log
        )
        if not any(partial.glob("*.tar.gz")):
            raise EngineBuildError("pip downloaded no llama-cpp-python sdist")
        _replace_dir(partial, download)
        sdists = sorted(download.glob("*.tar.gz"))
    partial = work / "src.partial"
    shutil.rmtree(partial, ignore_errors=True)
    _extract_llama_cpp(sdists[0], partial)
    _replace_dir(partial, sources)
    return sources / _SDIST_PREFIX


def build_llama_server(
    *,
    force: bool = False,
    jobs: int | None = None,
    source_dir: Path | None = None,
    progress_bar: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Build llama-server into the cache (unless a complete build is there) and return its path.

    ``force`` rebuilds from scratch: a cached binary is replaced and a kept work directory discarded.
    ``source_dir`` builds from an existing llama.cpp tree instead of downloading the llama-cpp-python
    sdist. ``progress_bar`` forces the tqdm bar on or off (default: on when stderr is a terminal).
    ``on_progress(done, total)`` is called at each compile step (from this thread).

    An attempt that fails or is interrupted keeps its work directory (:func:`build_work_dir`), and the
    next attempt resumes there; it is removed once the binary is installed.
    """
    tools = check_build_tools()
    final = cached_binary_path()
    with file_lock(final.parent.with_name(final.parent.name + ".lock")):
        if not force and is_executable_file(final):
            return final
        key = build_key()
        logs_dir().mkdir(parents=True, exist_ok=True)
        log_path = logs_dir() / f"build-{key}.log"
        work = build_work_dir(key)
        if force:
            shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True)
        build_dir = work / "build"
        resumed_steps = 0
        started = time.monotonic()
        phases: dict[str, float] = {}
        try:
            with log_path.open("w") as log:
                if source_dir is None:
                    source_dir = _llama_cpp_sources(work, log)
                phases["download_s"] = round(time.monotonic() - started, 1)
                env = dict(os.environ, CC=tools.cc, CXX=tools.cxx, NINJA_STATUS="[%f/%t] ")
                if tools.ccache is not None:
                    say(f"using ccache ({tools.ccache})")
                    env.update(ccache_env(work))
                else:
                    log.write("no ccache on the PATH: every step is compiled\n")
                configure = [tools.cmake, "-S", str(source_dir), "-B", str(build_dir), "-G", tools.generator]
                configure += [f"-DCMAKE_MAKE_PROGRAM={tools.make_program}", *CMAKE_ARGS]
                configure += compiler_cache_args(tools.ccache)
                kept_tree = (build_dir / "CMakeCache.txt").is_file()
                say(f"configuring llama-server ({tools.generator}); log: {log_path}")
                rc = run_logged(configure, log, None, env)
                if rc != 0 and kept_tree:
                    # Another generator or source tree than the kept one's, or a damaged CMake cache.
                    say("the build tree kept from an earlier attempt does not configure; starting it afresh")
                    shutil.rmtree(build_dir, ignore_errors=True)
                    kept_tree = False
                    rc = run_logged(configure, log, None, env)
                if rc != 0:
                    raise EngineBuildError("cmake configure failed")
                phases["configure_s"] = round(time.monotonic() - started - phases["download_s"], 1)
                if kept_tree:
                    resumed_steps = steps_done(build_dir)
                    say(f"resuming the build kept from an earlier attempt ({resumed_steps} steps done)")
                n_jobs = jobs or usable_cpus()
                progress = Progress("building llama-server", bar=progress_bar, on_update=on_progress)
                try:
                    build = [
                        tools.cmake,
                        "--build",
                        str(build_dir),
                        "--target",
                        BINARY_NAME,
                        "-j",
                        str(n_jobs),
                    ]
                    rc = run_logged(build, log, progress, env)
                finally:
                    progress.close()
                if rc != 0:
                    hint = "; `sluice engine build --force` starts it from scratch" if kept_tree else ""
                    raise EngineBuildError(f"compiling llama-server failed (exit code {rc}){hint}")
                phases["compile_s"] = round(time.monotonic() - started - sum(phases.values()), 1)
            built = build_dir / "bin" / BINARY_NAME
            version = llama_server_version(built) if is_executable_file(built) else None
            if version is None:
                what = "does not run (`--version` failed)" if built.exists() else "was not produced"
                # ninja would call this tree up to date and hand the same product to the next attempt:
                # only the download is worth keeping.
                shutil.rmtree(build_dir, ignore_errors=True)
                raise EngineBuildError(f"the build finished but {built} {what}")
            seconds = round(time.monotonic() - started, 1)
            write_json_atomic(
                work / "build-info.json",
                {
                    "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
                    "llama_server_version": version,
                    "build_key": key,
                    "cmake_args": list(CMAKE_ARGS),
                    "generator": tools.generator,
                    "compiler_launcher": tools.ccache,
                    "jobs": n_jobs,
                    "build_seconds": seconds,
                    "phase_seconds": phases,
                    "resumed_steps": resumed_steps,
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                },
            )
            install_file(work / "build-info.json", final.parent / "build-info.json", 0o644)
            # The binary goes last: its presence is what marks the cache entry as complete.
            install_file(built, final, 0o755)
        except EngineBuildError as exc:
            kept = f"; the next attempt resumes from {work}"
            raise EngineBuildError(f"{exc}{kept}; full log: {log_path}\n{log_tail(log_path)}") from None
        # Only after the install: until then, the work dir is what spares the next attempt a rebuild.
        shutil.rmtree(work, ignore_errors=True)
        say(f"built llama-server in {seconds:.0f} s: {final}")
        return final


def ensure_llama_server(on_progress: Callable[[int, int], None] | None = None) -> Path:
    """The binary to run, building it on first use (a few minutes; progress goes to stderr and to
    ``on_progress(done, total)``)."""
    override = os.environ.get(ENV_LLAMA_SERVER)
    if override:
        found = find_llama_server()
        if found is None:
            raise EngineError(f"${ENV_LLAMA_SERVER} is set to {override}, which is not an executable file")
        return found
    return find_llama_server() or build_llama_server(on_progress=on_progress)
