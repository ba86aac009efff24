"""The configuration reference (docs/configuration.md) and the keys of the example file
(systemd/kvoffloadd.toml.example), generated from the configuration's code.

Rules:
- One source: the fields of ``DaemonConfig``, ``TierConfig`` and ``NamespaceQuota``
  (``config``) and of ``NamespaceRule`` (``access``): name, type and default from the
  code, the meaning from the comment line(s) directly above each field. A field
  without one, or with a comment after it on its line, is an error naming it. The
  flags come from ``main.parser``; a flag that names no key is an error too.
- A comment line ``# example: <TOML value>`` above a field is the value the example
  file shows where the default is none (an unset list, a required key); every such
  field has one.
- The example file keeps what stands above ``MARKER`` (its hand-written header); what
  follows is generated. ``make docs`` writes both files; ``python -m
  kvoffloadd.configdoc --check`` (and ``tests/unit/test_configdoc.py``) fails when
  either differs from what the code says.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvoffloadd import access, config
from kvoffloadd import main as daemon_main
from kvoffloadd.ledger import DERIVED, LINES, UNLIMITED

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MARKER = "# ---- generated from daemon/kvoffloadd/config.py by `make docs`: edit the comments there"
WIDTH = 88  # columns of the example file
INLINE_COLUMN = 30  # where a sub-key's meaning starts in the example file
REFERENCE = "docs/configuration.md"
EXAMPLE = "systemd/kvoffloadd.toml.example"
# (the TOML table a struct's keys live in, the struct); DaemonConfig's keys are top-level
STRUCTS: list[tuple[str, type[msgspec.Struct]]] = [
    ("", config.DaemonConfig),
    ("tiers", config.TierConfig),
    ("namespace_quotas", config.NamespaceQuota),
    ("namespace_access", access.NamespaceRule),
]
_TYPES_PREFIX = re.compile(
    rf"^((?:{'|'.join(config.TIER_TYPES)})(?:, (?:{'|'.join(config.TIER_TYPES)}))*): "
)


class ConfigDocError(ValueError):
    pass


@dataclass(frozen=True)
class Key:
    """One configuration key, as the code declares it."""

    name: str
    type: str  # the annotation as written
    default: Any  # msgspec.NODEFAULT: required
    meaning: str  # the comment above the field, as one paragraph
    example: Any  # the ``# example:`` value, or msgspec.NODEFAULT

    @property
    def required(self) -> bool:
        return self.default is msgspec.NODEFAULT

    @property
    def shown(self) -> Any:
        """The value the example file shows."""
        if self.example is not msgspec.NODEFAULT:
            return self.example
        return self.default

    def tier_types(self) -> tuple[str, ...]:
        """The tier types a ``TierConfig`` key applies to (its comment's prefix)."""
        m = _TYPES_PREFIX.match(self.meaning)
        return tuple(m.group(1).split(", ")) if m else tuple(config.TIER_TYPES)

    def plain_meaning(self) -> str:
        """The meaning without its tier types prefix."""
        return _TYPES_PREFIX.sub("", self.meaning, count=1)


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string[1:].strip()
    return out


def keys_of(cls: type[msgspec.Struct]) -> list[Key]:
    """The keys of ``cls`` in declaration order, each with its comment and default."""
    path = inspect.getsourcefile(cls)
    if path is None:  # pragma: no cover - the daemon ships its sources
        raise ConfigDocError(f"{cls.__name__}: no source file to read comments from")
    source = Path(path).read_text()
    lines = source.splitlines()
    comments = _comments(source)
    node = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.ClassDef) and n.name == cls.__name__
    )
    defaults = {f.name: f for f in msgspec.structs.fields(cls)}
    out = []
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        where = f"{cls.__name__}.{name} ({Path(path).name}:{stmt.lineno})"
        if any(n in comments for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)):
            raise ConfigDocError(f"{where}: move the comment after the field to the lines above")
        above: list[str] = []
        n = stmt.lineno - 1
        while n >= 1 and lines[n - 1].strip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        example: Any = msgspec.NODEFAULT
        meaning = []
        for text in above:
            if text.startswith("example:"):
                value = text.removeprefix("example:").strip()
                try:
                    example = tomllib.loads(f"v = {value}")["v"]
                except tomllib.TOMLDecodeError as exc:
                    raise ConfigDocError(f"{where}: example {value!r} is not TOML: {exc}") from exc
            else:
                meaning.append(text)
        if not meaning:
            raise ConfigDocError(
                f"{where}: no comment above the field: say in one line what it means"
            )
        f = defaults[name]
        default = f.default
        if f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        key = Key(name, ast.unparse(stmt.annotation), default, " ".join(meaning), example)
        if key.shown is None or (key.required and example is msgspec.NODEFAULT):
            raise ConfigDocError(f"{where}: has no default to show: add '# example: <value>'")
        out.append(key)
    return out


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise ConfigDocError(f"{value!r}: no TOML form")


# ------------------------------------------------------------------ the reference page


def _cell(text: str) -> str:
    """``text`` in a Markdown table cell, shown as it is written."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _default_cell(key: Key) -> str:
    if key.required:
        return "required"
    if key.default is None:
        return "unset"
    return f"`{toml_value(key.default)}`"


def _table(keys: list[Key], with_types: bool = False) -> list[str]:
    head = "| key | type | default | " + ("tiers | " if with_types else "") + "meaning |"
    out = [head, "|---" * head.count(" | ") + "|---|"]
    for k in keys:
        types = f"{', '.join(k.tier_types())} | " if with_types else ""
        meaning = k.plain_meaning() if with_types else k.meaning
        out.append(
            f"| `{k.name}` | `{_cell(k.type)}` | {_default_cell(k)} | {types}{_cell(meaning)} |"
        )
    return out


def _rules_of(module: Any) -> list[str]:
    """The bullets under "Rules:" in a module's docstring, as Markdown."""
    doc = inspect.getdoc(module) or ""
    return doc.split("Rules:", 1)[1].strip().replace("``", "`").splitlines()


def _flags() -> list[str]:
    """The command line's flags and the keys they override."""
    keys = {k.name for k in keys_of(config.DaemonConfig)}
    out = ["| flag | overrides | meaning |", "|---|---|---|"]
    for action in daemon_main.parser()._actions:
        flag = max(action.option_strings, key=len, default="")
        if flag in ("", "--help", "--version"):
            continue
        if action.dest == "config":
            key = "(the file itself)"
        elif action.dest in keys:
            key = f"`{action.dest}`"
        else:
            raise ConfigDocError(f"kvoffloadd {flag}: sets {action.dest!r}, which is no key")
        choices = "{" + ",".join(action.choices) + "}" if action.choices else ""
        value = f" {action.metavar or choices}" if action.nargs != 0 else ""
        out.append(f"| `{flag}{value}` | {key} | {_cell(action.help or '')} |")
    return out


def reference() -> str:
    """docs/configuration.md."""
    tier_keys = keys_of(config.TierConfig)
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `make docs` from daemon/kvoffloadd/config.py and access.py: edit",
        "     the comments above the fields there, then run `make docs`. -->",
        "",
        "kvoffloadd reads one TOML file (`--config FILE`, else "
        f"`{config.DEFAULT_CONFIG_PATH}` when it exists); "
        "`systemd/kvoffloadd.toml.example` lists every key with its default. "
        "`kvoffloadctl config` prints the configuration a running daemon uses.",
        "",
        *_rules_of(config),
        "",
        "## Command-line flags",
        "",
        "`kvoffloadd --help` prints them; `kvoffloadd --version` the version.",
        "",
        *_flags(),
        "",
        "## Daemon keys",
        "",
        *_table(keys_of(config.DaemonConfig)),
        "",
        "## `[[tiers]]`: secondary tiers",
        "",
        "One table per tier, fastest first (see [tiers.md](tiers.md)). Tier types:",
        "",
        *(f"- `{t}`: {about}." for t, about in config.TIER_TYPES.items()),
        "",
        *_table(tier_keys, with_types=True),
        "",
        "## `[[namespace_quotas]]`: quotas per namespace",
        "",
        *_table(keys_of(config.NamespaceQuota)),
        "",
        "## `[[namespace_access]]`: who may open which namespaces",
        "",
        *_table(keys_of(access.NamespaceRule)),
        "",
    ]
    return "\n".join(out)


# ------------------------------------------------------------------- the example file


def _comment_lines(text: str, prefix: str = "# ") -> list[str]:
    """``text`` as comment lines of at most ``WIDTH`` columns, ending with a full stop."""
    if not text.endswith("."):
        text += "."
    return textwrap.wrap(text, WIDTH - len(prefix), initial_indent=prefix, subsequent_indent=prefix)


def _sub_key_lines(key: Key, value: Any, meaning: str) -> list[str]:
    """``# key = value   # meaning``, the meaning wrapped under itself."""
    left = f"# {key.name} = {toml_value(value)}"
    width = WIDTH - INLINE_COLUMN - 2
    wrapped = textwrap.wrap(meaning, max(width, 20))
    pad = max(INLINE_COLUMN - len(left), 2)
    if len(left) + pad > INLINE_COLUMN:
        return [left, *(f"#{' ' * (INLINE_COLUMN - 1)}# {w}" for w in wrapped)]
    first = f"{left}{' ' * pad}# {wrapped[0]}"
    return [first, *(f"#{' ' * (INLINE_COLUMN - 1)}# {w}" for w in wrapped[1:])]


def _tables(key: Key) -> list[str]:
    """The commented example tables of a list-of-tables key."""
    if key.name == "tiers":
        out = []
        tier_keys = keys_of(config.TierConfig)
        for t, about in config.TIER_TYPES.items():
            out += ["#", *_comment_lines(f"{t}: {about}"), "# [[tiers]]", f'# type = "{t}"']
            for k in tier_keys:
                if k.name != "type" and t in k.tier_types():
                    out += _sub_key_lines(k, k.shown, k.plain_meaning())
        return out
    sub = dict(STRUCTS)[key.name]
    out = [f"# [[{key.name}]]"]
    for k in keys_of(sub):
        out += _sub_key_lines(k, k.shown, k.meaning)
    return out


def example_keys() -> str:
    """Everything below ``MARKER`` in the example file."""
    out = [MARKER, ""]
    for key in keys_of(config.DaemonConfig):
        out += _comment_lines(key.meaning)
        if key.name in dict(STRUCTS):
            out += _tables(key)
        elif key.default is None:
            out.append(f"# {key.name} = {toml_value(key.example)}")
        else:
            out.append(f"{key.name} = {toml_value(key.default)}")
        out.append("")
    return "\n".join(out)


def example(current: str) -> str:
    """The example file: ``current``'s header above ``MARKER``, then the keys."""
    if MARKER not in current:
        raise ConfigDocError(f"{EXAMPLE}: the line {MARKER!r} is missing below its header")
    return current.split(MARKER, 1)[0] + example_keys()


SECURITY = "docs/security.md"
LEDGER_BEGIN = "<!-- the ledger's lines: make docs writes them from kvoffloadd.ledger -->"
LEDGER_END = "<!-- end of the ledger's lines -->"


def _amount(n: int, unit: str) -> str:
    if n >= UNLIMITED:
        return "no limit"
    if unit != "bytes":
        return f"{n:,}"
    for suffix, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {suffix}"
    return f"{n:,} B"


def ledger_table() -> str:
    """docs/security.md's table of every ledger line, its default limits and meaning."""
    rows = [
        "| line | what a peer makes the daemon hold | per connection | per uid | in total "
        "| heap per unit | released |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec in LINES:
        lim = spec.limits
        limits = DERIVED.get(spec.name) or tuple(
            _amount(n, spec.unit) for n in (lim.per_connection, lim.per_uid, lim.total)
        )
        heap = f"{spec.heap_bytes_each:,} B" if spec.heap_bytes_each else "none"
        rows.append(
            f"| `{spec.name}` | {_cell(spec.meaning)} | {' | '.join(map(_cell, limits))} "
            f"| {heap} | {_cell(spec.released)} |"
        )
    return "\n".join(rows) + "\n"


def security(current: str) -> str:
    """docs/security.md with the ledger's table between its markers."""
    if LEDGER_BEGIN not in current or LEDGER_END not in current:
        raise ConfigDocError(f"{SECURITY}: the ledger table's markers are missing")
    head, rest = current.split(LEDGER_BEGIN, 1)
    tail = rest.split(LEDGER_END, 1)[1]
    return f"{head}{LEDGER_BEGIN}\n{ledger_table()}{LEDGER_END}{tail}"


def outputs(root: Path) -> dict[Path, str]:
    """Each generated file under ``root`` with the text it should have."""
    ex, sec = root / EXAMPLE, root / SECURITY
    return {
        root / REFERENCE: reference(),
        ex: example(ex.read_text()),
        sec: security(sec.read_text()),
    }


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvoffloadd.configdoc", description=__doc__)
    p.add_argument("--root", default=".", help="the repository (default: here)")
    p.add_argument("--check", action="store_true", help="exit 1 if a file differs")
    args = p.parse_args(argv)
    try:
        files = outputs(Path(args.root))
    except ConfigDocError as exc:
        print(f"configdoc: {exc}", file=sys.stderr)
        return 1
    stale = [path for path, text in files.items() if _text(path) != text]
    if args.check:
        for path in stale:
            print(f"configdoc: {path} differs from the code: run make docs", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(files[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
