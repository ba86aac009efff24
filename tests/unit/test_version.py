"""The version is written in one place (``kvoffload.version``); the distribution's
metadata, both packages and both commands report it."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

import kvoffload
import kvoffloadd
from kvoffload.version import __version__
from kvoffloadctl import cli
from kvoffloadd import main

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).parents[2]


def test_the_version_is_assigned_once_and_pyproject_reads_it() -> None:
    assigned = []
    for top in ("daemon", "libclient", "tools"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id in ("__version__", "VERSION")
                    for t in node.targets
                ):
                    assigned.append(path.relative_to(ROOT).as_posix())
    assert assigned == ["libclient/kvoffload/version.py"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "kvoffload.version.__version__"


def test_packages_metadata_and_commands_agree() -> None:
    assert kvoffload.__version__ == kvoffloadd.__version__ == __version__
    assert importlib.metadata.version("kvoffload") == __version__, "reinstall: make setup"


@pytest.mark.parametrize(("name", "entry"), [("kvoffloadd", main.main), ("kvoffloadctl", cli.main)])
def test_both_commands_print_the_version(
    name: str, entry: object, capsys: pytest.CaptureFixture[str]
) -> None:
    assert callable(entry)
    with pytest.raises(SystemExit) as exit_:
        entry(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"{name} {__version__}\n"
