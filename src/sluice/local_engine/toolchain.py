"""The programs a build runs: the compilers, cmake, ninja or make, and ccache when there is one,
found on the PATH, with the options and environment that turn the compiler cache on."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice.local_engine.cache import cpu_flags
from sluice.local_engine.errors import MissingToolError


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


def ccache_env(work: Path) -> dict[str, str]:
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
