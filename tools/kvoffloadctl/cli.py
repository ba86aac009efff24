"""``kvoffloadctl``: admin CLI for a running kvoffloadd (stats, clients, evict).

Human tables on a terminal, ``--json`` for scripts. An unreachable daemon is one
line on stderr and exit status 1; a refused request is exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import kvoffload
import msgspec
from kvoffload.protocol.errors import DaemonUnavailableError, KVOffloadError


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and key.endswith("_bytes"):
        return f"{value} ({_human_bytes(value)})"
    return str(value)


def print_stats(sections: dict[str, Any]) -> None:
    for name, section in sections.items():
        if name == "namespaces":
            for ns_name, fields in section.items():
                print(f"# namespace {ns_name}")
                for k, v in fields.items():
                    print(f"{k}: {_fmt(k, v)}")
                print()
            continue
        print(f"# {name}")
        for k, v in section.items():
            print(f"{k}: {_fmt(k, v)}")
        print()


def print_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    cells = [[str(r[c]) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvoffloadctl", description="Administer kvoffloadd.")
    p.add_argument(
        "--socket", help="daemon socket (default: $KVOFFLOAD_SOCKET or the default path)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("stats", help="daemon statistics in named sections")
    sub.add_parser("clients", help="connected clients")
    ev = sub.add_parser("evict", help="evict unpinned blocks")
    ev.add_argument("--namespace", help="only this namespace (default: all)")
    ev.add_argument("--key", action="append", default=None, help="hex key (repeatable)")
    sub.add_parser("ping", help="round trip to the daemon")
    args = p.parse_args(argv)

    try:
        client = kvoffload.connect(args.socket, timeout_s=args.timeout, name="kvoffloadctl")
    except DaemonUnavailableError as exc:
        print(f"kvoffloadctl: {exc.args[0]}", file=sys.stderr)
        return 1
    try:
        return _run(client, args)
    except DaemonUnavailableError as exc:
        print(f"kvoffloadctl: {exc.args[0]}", file=sys.stderr)
        return 1
    except KVOffloadError as exc:
        print(f"kvoffloadctl: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()


def _run(client: kvoffload.Client, args: argparse.Namespace) -> int:
    if args.command == "stats":
        sections = client.stats()
        if args.json:
            print(json.dumps(sections, indent=2, sort_keys=True))
        else:
            print_stats(sections)
    elif args.command == "clients":
        rows = [msgspec.structs.asdict(c) for c in client.clients()]
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            print_table(
                rows,
                [
                    "client_id",
                    "pid",
                    "uid",
                    "name",
                    "namespaces",
                    "workers",
                    "pinned_blocks",
                    "writing_blocks",
                    "inflight_jobs",
                    "bytes_stored",
                    "bytes_loaded",
                ],
            )
    elif args.command == "evict":
        keys = [bytes.fromhex(k) for k in args.key] if args.key else None
        n = client.evict(args.namespace, keys)
        scope = f"namespace {args.namespace}" if args.namespace else "all namespaces"
        if args.json:
            print(json.dumps({"evicted_blocks": n, "namespace": args.namespace}))
        else:
            print(f"evicted {n} blocks from {scope}")
    elif args.command == "ping":
        rtt_s = client.ping()
        print(json.dumps({"rtt_s": rtt_s}) if args.json else f"pong in {rtt_s * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
