"""One source for the configuration: the reference page and the example file are what
the code's fields and the comments above them say, and every field says what it means."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from kvoffloadd import configdoc
from kvoffloadd.config import TIER_TYPES, DaemonConfig, TierConfig, load_config

ROOT = Path(__file__).parents[2]


class Commented(msgspec.Struct, kw_only=True):
    # how many things
    # example: 3
    count: int | None = None
    # the name of the thing, over
    # two lines
    name: str = "x"


class Uncommented(msgspec.Struct, kw_only=True):
    # how many things
    count: int = 0
    name: str = "x"


class CommentedAfter(msgspec.Struct, kw_only=True):
    # how many things
    count: int = 0
    name: str = "x"  # the name


class NoExample(msgspec.Struct, kw_only=True):
    # who may; unset: everyone
    uids: list[int] | None = None


def test_the_generated_files_are_what_the_code_says() -> None:
    """Run ``make docs`` after changing a field or its comment."""
    for path, text in configdoc.outputs(ROOT).items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run make docs"
    assert configdoc.main(["--root", str(ROOT), "--check"]) == 0


def test_a_field_without_a_comment_above_it_is_named() -> None:
    keys = configdoc.keys_of(Commented)
    assert [(k.name, k.meaning, k.example) for k in keys] == [
        ("count", "how many things", 3),
        ("name", "the name of the thing, over two lines", msgspec.NODEFAULT),
    ]
    with pytest.raises(configdoc.ConfigDocError, match=r"Uncommented\.name .*no comment above"):
        configdoc.keys_of(Uncommented)
    with pytest.raises(configdoc.ConfigDocError, match=r"CommentedAfter\.name .*lines above"):
        configdoc.keys_of(CommentedAfter)
    with pytest.raises(configdoc.ConfigDocError, match=r"NoExample\.uids .*example"):
        configdoc.keys_of(NoExample)


def test_every_key_of_the_code_is_on_the_page_and_in_the_example() -> None:
    page = (ROOT / configdoc.REFERENCE).read_text()
    example = (ROOT / configdoc.EXAMPLE).read_text()
    for _, cls in configdoc.STRUCTS:
        for field in msgspec.structs.fields(cls):
            assert f"| `{field.name}` |" in page, f"{cls.__name__}.{field.name}"
            assert re.search(rf"^(# )?({field.name} =|\[\[{field.name}\]\])", example, re.M)
    assert example.startswith("# kvoffloadd configuration.")  # the hand-written header


def test_the_example_file_loads_as_the_defaults_and_its_tier_tables_load_too(
    tmp_path: Path,
) -> None:
    example = (ROOT / configdoc.EXAMPLE).read_text()
    assert load_config(str(ROOT / configdoc.EXAMPLE), {}) == DaemonConfig().validate()
    tables = re.findall(r"^# \[\[tiers\]\]\n(?:# .*\n)+", example, re.M)
    assert len(tables) == len(TIER_TYPES)
    for table in tables:
        f = tmp_path / "tier.toml"
        f.write_text("\n".join(line[2:] for line in table.splitlines()))
        (tier,) = load_config(str(f), {}).tiers
        assert isinstance(tier, TierConfig)
