"""docs/configuration.md's tables are what sluice.config_doc makes from the settings' models."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from sluice import config_doc
from sluice.cli import build_parser
from sluice.config import Settings
from sluice.core.policy import CoDelPolicy

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_page_is_what_the_generator_makes() -> None:
    page = DOC.read_text(encoding="utf-8")
    assert config_doc.render(page) == page, (
        "docs/configuration.md is stale: python -m sluice.config_doc --write"
    )
    assert "PydanticUndefined" not in page and "| `None` |" not in page


def test_check_and_write(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(DOC.read_text(encoding="utf-8").replace("| `port` | `8000` |", "| `port` | `80` |"))
    assert config_doc.main(["--check", "--doc", str(stale)]) == 1
    assert config_doc.main(["--write", "--doc", str(stale)]) == 0
    assert stale.read_text(encoding="utf-8") == DOC.read_text(encoding="utf-8")
    assert config_doc.main(["--check", "--doc", str(stale)]) == 0


def test_defaults_come_from_the_model() -> None:
    class Inner(BaseModel):
        name: str
        share: float = 0.0

    class Toy(BaseModel):
        url: str = Field(description="required one")
        ratio: float = Field(default=0.25, description="a float")
        flag: bool = Field(default=False, description="a bool")
        unset: int | None = Field(default=None, description="a | pipe")
        items: list[Inner] = Field(
            default_factory=lambda: [Inner(name="a"), Inner(name="b", share=0.5)], description="models"
        )
        table: dict[str, int] = Field(default_factory=lambda: {"x y": 1}, description="a dict")

    rows = config_doc.table(Toy).splitlines()
    assert rows[0] == "| setting | default | meaning |"
    assert rows[2:] == [
        "| `url` | required | required one |",
        "| `ratio` | `0.25` | a float |",
        "| `flag` | `false` | a bool |",
        "| `unset` | unset | a \\| pipe |",
        '| `items` | `[{name = "a"}, {name = "b", share = 0.5}]` | models |',
        '| `table` | `{"x y" = 1}` | a dict |',
    ]


def test_required_fields_first_and_every_field_described() -> None:
    class Late(BaseModel):
        a: int = Field(default=1, description="x")
        b: str = Field(description="y")

    assert [r.split("|")[1].strip() for r in config_doc.table(Late).splitlines()[2:]] == ["`b`", "`a`"]

    class Undescribed(BaseModel):
        a: int = 1

    with pytest.raises(ValueError, match="Undescribed: fields without a description: a"):
        config_doc.table(Undescribed)


def test_regions_must_be_known_and_complete() -> None:
    with pytest.raises(ValueError, match="unknown generated table 'Nope'"):
        config_doc.render("<!-- generated: Nope -->\n<!-- end -->\n")
    with pytest.raises(ValueError, match="missing"):
        config_doc.render("<!-- generated: Settings -->\n<!-- end -->\n")


def test_a_changed_default_changes_the_table() -> None:
    field = Settings.model_fields["port"]
    assert "| `port` | `8000` | `--port` |" in config_doc.table(Settings)
    old = field.default
    field.default = 9123
    try:
        assert "| `port` | `9123` | `--port` |" in config_doc.table(Settings)
    finally:
        field.default = old


@pytest.mark.parametrize("role", ["serve", "gateway", "worker"])
def test_every_flag_of_a_role_is_in_the_tables(role: str) -> None:
    parser = build_parser(role)
    sub = next(a for a in parser._actions if a.dest == "command")
    role_parser = sub.choices[role]  # type: ignore[index]
    options = {o for a in role_parser._actions for o in a.option_strings if o.startswith("--")}
    documented = set(config_doc.flags().values()) | {"--help", "--config"}
    assert options <= documented, f"flags missing from config_doc: {options - documented}"
    page = DOC.read_text(encoding="utf-8")
    for option in options - {"--help", "--config"}:
        assert f"`{option}`" in page


def test_the_burst_rise_in_the_prose_is_the_code_s() -> None:
    values = re.findall(r"queue_burst_rise = ([0-9.]+)", DOC.read_text(encoding="utf-8"))
    assert values and float(values[-1]) == CoDelPolicy().burst_rise
