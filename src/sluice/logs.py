"""Structured logs: one JSON object per line, with the fields a record carries in ``extra["fields"]``.

No line may hold a prompt or an answer, and request data reaches exceptions in many ways (a
UnicodeEncodeError holds the whole string it failed on, a KeyError its key, a ValueError whatever
its raiser put in). So an exception is logged by its type and the file:line frames of its traceback,
never by its message or its locals; only an OSError keeps its errno and the system's text for it,
which come from the operating system and not from a request. The server's own loggers (uvicorn's)
and asyncio's go through the same formatter, so the output stays one JSON object per line.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from types import TracebackType
from typing import Any

#: The loggers of the libraries that serve HTTP or run tasks: they get Sluice's handler too.
LIBRARY_LOGGERS = ("uvicorn", "asyncio")

# asyncio's messages add reprs of the task or future on the lines after the first, and a repr holds
# the coroutine's arguments (a job, its prompt) and the exception's message.
_FIRST_LINE_ONLY = ("asyncio",)

#: What logging hands formatException (sys.exc_info()'s shape).
ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]


def describe(exc: BaseException) -> str:
    """What an exception is, without what it says: its qualified type name; for an OSError, its
    errno and the system's text for it."""
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{name}: [Errno {exc.errno}] {exc.strerror or ''}".rstrip()
    if isinstance(exc, BaseExceptionGroup):
        return f"{name} of {', '.join(describe(e) for e in exc.exceptions)}"
    return name


def safe_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` and of the exceptions it was raised from or during, each frame as
    ``file:line in function`` (the lines of code themselves are left out, as are messages)."""
    chain: list[tuple[BaseException, str]] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    link = ""
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append((current, link))
        if current.__cause__ is not None:
            current, link = current.__cause__, "The above exception was the direct cause of:"
        elif current.__context__ is not None and not current.__suppress_context__:
            current, link = current.__context__, "During handling of the above exception:"
        else:
            current = None
    lines: list[str] = []
    # Oldest first, as Python prints them; each link sentence leads to the exception after it.
    for err, link in reversed(chain):
        lines.append("Traceback (most recent call last):")
        lines.extend(
            f"  {f.filename}:{f.lineno} in {f.name}" for f in traceback.extract_tb(err.__traceback__)
        )
        lines.append(describe(err))
        if link:
            lines.append(link)
    return "\n".join(lines)


def _message(record: logging.LogRecord) -> str:
    message = record.getMessage()
    if record.name.split(".", 1)[0] in _FIRST_LINE_ONLY:
        return message.split("\n", 1)[0]
    return message


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _message(record),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)

    def formatException(self, ei: ExcInfo) -> str:
        return safe_traceback(ei[1]) if ei[1] is not None else ""


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        # The exception is written here, never from record.exc_text: another handler may have left
        # the standard traceback there, messages and all.
        saved = record.msg, record.args, record.exc_info, record.exc_text, record.stack_info
        record.msg, record.args = _message(record), None
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            line = super().format(record)
        finally:
            record.msg, record.args, record.exc_info, record.exc_text, record.stack_info = saved
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        if record.exc_info and record.exc_info[1] is not None:
            line += "\n" + safe_traceback(record.exc_info[1])
        return line


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    """Sluice's loggers at ``level``, and the libraries' (warnings and worse), on one handler."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("sluice")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.handlers[:] = [handler]
        library.propagate = False
        if library.level == logging.NOTSET:
            library.setLevel(logging.WARNING)
