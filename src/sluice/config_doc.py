"""The tables of docs/configuration.md, generated from the settings' models so they never drift.

Each table lists one model's fields: the setting, its default as TOML, read from the model
("required" when it has none, "unset" when it is None), the flag that sets it, and the field's
``description``. Required fields come first, then the rest in the model's order.

``python -m sluice.config_doc`` prints the tables; ``--write`` rewrites the generated regions of
docs/configuration.md, each between ``<!-- generated: NAME -->`` and ``<!-- end -->`` (NAME is a
key of :data:`TABLES`); ``--check`` exits 1 when the page differs from what this makes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from sluice.config import Settings
from sluice.config_tables import (
    AliasConfig,
    AliasTarget,
    BackendConfig,
    ClassConfig,
    KeyConfig,
    ModelConfig,
    PoolConfig,
)
from sluice.roles.flags import ALL_GROUPS

#: the generated tables: the name their markers give, and the model each lists
TABLES: dict[str, type[BaseModel]] = {
    "Settings": Settings,
    "BackendConfig": BackendConfig,
    "PoolConfig": PoolConfig,
    "AliasConfig": AliasConfig,
    "AliasTarget": AliasTarget,
    "ClassConfig": ClassConfig,
    "ModelConfig": ModelConfig,
    "KeyConfig": KeyConfig,
}

# The flags that roles/flags.py adds by hand rather than as a Flag (their parsing is special:
# repeatable, store_true, or applied to each --backend).
_OTHER_FLAGS: dict[tuple[type[BaseModel], str], str] = {
    (Settings, "backends"): "--backend",
    (Settings, "insecure_open"): "--insecure-open",
    (BackendConfig, "max_inflight_tokens"): "--max-inflight-tokens",
}

#: the page the tables live in, in the source tree
DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

_REGION = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end -->)", re.DOTALL)
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def flags() -> dict[tuple[type[BaseModel], str], str]:
    """(model, field) -> the command-line flag that sets it."""
    out: dict[tuple[type[BaseModel], str], str] = {
        (Settings, flag.field): flag.name for group in ALL_GROUPS for flag in group
    }
    out.update(_OTHER_FLAGS)
    return out


def toml_value(value: object) -> str:
    """A default as it is written in the TOML file; a model shows only its fields that differ
    from their own defaults."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, BaseModel):
        return toml_value(value.model_dump(exclude_defaults=True))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{_toml_key(str(k))} = {toml_value(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"no TOML form for a default of type {type(value).__name__}")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def default_text(field: FieldInfo) -> str:
    """The default column: ``required``, ``unset`` (None), or the TOML value in backticks."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    return f"`{toml_value(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(model: type[BaseModel]) -> str:
    """The Markdown table of one model's fields; every field must have a ``description``."""
    known = flags()
    fields = list(model.model_fields.items())
    fields.sort(key=lambda item: not item[1].is_required())  # stable: required first, else in order
    missing = [name for name, field in fields if not field.description]
    if missing:
        raise ValueError(f"{model.__name__}: fields without a description: {', '.join(missing)}")
    with_flags = any((model, name) in known for name, _ in fields)
    header = ["setting", "default", *(["flag"] if with_flags else []), "meaning"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, field in fields:
        flag = known.get((model, name))
        cells = [f"`{name}`", default_text(field)]
        if with_flags:
            cells.append(f"`{flag}`" if flag else "")
        cells.append(_cell(field.description or ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render(page: str) -> str:
    """The page with every generated region rewritten; each table of :data:`TABLES` exactly once."""
    seen: list[str] = []

    def region(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise ValueError(f"unknown generated table {name!r}; known: {', '.join(TABLES)}")
        seen.append(name)
        return match.group(1) + table(TABLES[name]) + match.group(4)

    out = _REGION.sub(region, page)
    absent = [name for name in TABLES if name not in seen]
    twice = sorted({name for name in seen if seen.count(name) > 1})
    if absent or twice:
        raise ValueError(f"generated regions: missing {absent}, repeated {twice}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.config_doc",
        description="Print the settings' tables of docs/configuration.md, or rewrite or check that page.",
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="rewrite the page's generated regions")
    action.add_argument("--check", action="store_true", help="exit 1 if the page differs")
    parser.add_argument("--doc", type=Path, default=DOC_PATH, help=f"the page (default: {DOC_PATH})")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        for name, model in TABLES.items():
            print(f"<!-- generated: {name} -->\n{table(model)}<!-- end -->\n")
        return 0
    try:
        page = args.doc.read_text(encoding="utf-8")
        fresh = render(page)
    except (OSError, ValueError) as exc:
        print(f"sluice.config_doc: {args.doc}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if fresh != page:
            print(f"{args.doc} is out of date: run python -m sluice.config_doc --write", file=sys.stderr)
            return 1
        return 0
    if fresh != page:
        args.doc.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
