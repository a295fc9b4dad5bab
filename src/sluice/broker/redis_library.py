"""The broker's Lua scripts as one Redis Functions library (``FUNCTION LOAD`` once, ``FCALL`` each call).

The scripts stay one file each in ``sluice/lua`` (``lua/README.md``), each naming the shared files it
uses by ``-- @include <file>``; this module builds from them the one text Redis loads. With ``EVALSHA``
every call ran the included files' definitions again (some 60 k instructions an admission, about
a twentieth of its cost); in a library the shared files are run once, when it is loaded, and each
script is a function whose body is the script's own text, ``KEYS`` and ``ARGV`` its parameters.

The library's name and its functions' names carry a digest of its text, so that gateways of two
versions can share a Redis during an upgrade: each calls its own functions. Redis keeps a library
in its data set (saved with it, replicated to the replicas, not removed by ``FLUSHALL``); a server
without it (a restart without persistence, a new cluster master, a ``FUNCTION FLUSH``) answers
"Function not found", and the caller loads it and sends the call again (``redis_pipe.Batcher``).
Functions need Redis 7.0 or later.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis.exceptions import ResponseError

#: The shared files, in the order the library defines them: a file may use what the files before it
#: define (``_job.lua`` uses ``_tenant.lua``'s ``tenant_move``, ``_policy.lua`` uses ``_state.lua``).
SHARED_FILES = (
    "_keys.lua",
    "_state.lua",
    "_tenant.lua",
    "_job.lua",
    "_fairqueue.lua",
    "_classes.lua",
    "_workers.lua",
    "_drain.lua",
    "_policy.lua",
)

_INCLUDE = "-- @include "

#: How Redis answers an FCALL of a function it does not have (redis-py drops the "ERR ").
_NOT_FOUND = "Function not found"


def _read(name: str) -> str:
    return (resources.files("sluice") / "lua" / name).read_text(encoding="utf-8")


def script_parts(name: str) -> tuple[list[str], str]:
    """The shared files ``name``.lua includes, in order, and its own text without those lines."""
    includes: list[str] = []
    lines: list[str] = []
    for line in _read(f"{name}.lua").splitlines():
        if line.startswith(_INCLUDE):
            includes.append(line.removeprefix(_INCLUDE).strip())
        else:
            lines.append(line)
    return includes, "\n".join(lines) + "\n"


@dataclass(frozen=True, eq=False)
class Library:
    """The library text and its functions' names.

    Attributes:
        name: the library's name, ``sluice_<digest>``.
        source: the text ``FUNCTION LOAD`` takes.
        functions: script name → the name of its function.
    """

    name: str
    source: str
    functions: dict[str, str]

    def load_command(self) -> tuple[str, ...]:
        # REPLACE: two gateways of one version may load it at once; the same text replaces itself.
        return ("FUNCTION", "LOAD", "REPLACE", self.source)


def build_library(names: Sequence[str]) -> Library:
    """The library of the scripts ``names``: the shared files once, then each script's function."""
    bodies: list[tuple[str, str]] = []
    for name in names:
        includes, body = script_parts(name)
        unknown = [f for f in includes if f not in SHARED_FILES]
        if unknown:
            raise ValueError(f"{name}.lua includes {unknown}, which are not in SHARED_FILES")
        bodies.append((name, body))
    shared = "".join(f"-- {f}\n{_read(f)}\n" for f in SHARED_FILES)
    digest = hashlib.sha1((shared + "".join(b for _, b in bodies)).encode()).hexdigest()[:16]
    library = f"sluice_{digest}"
    functions = {name: f"{library}_{name}" for name in names}
    parts = [f"#!lua name={library}\n", shared]
    for name, body in bodies:
        # One line for the opening, so that an error's line number inside a body is the library's;
        # it sets _keys.lua's rcall (redis.call exists only once the library is loaded).
        opening = f"redis.register_function('{functions[name]}', function(KEYS, ARGV) rcall = redis.call"
        parts.append(f"{opening}\n{body}end)\n")
    return Library(library, "".join(parts), functions)


def function_missing(reply: Any) -> bool:
    """Whether ``reply`` is Redis saying it has no such function (the library is not loaded)."""
    return isinstance(reply, ResponseError) and str(reply).startswith(_NOT_FOUND)
