"""``kvoffloadctl``: admin CLI for a running kvoffloadd (stats, clients, evict,
drop-namespace, top, config, ping), and ``check``: whether this node is ready for the
configured region (no daemon needed, check.py).

Human tables on a terminal, ``--json`` for scripts. The global options (``--socket``,
``--json``, ``--timeout``) go before or after the subcommand, as with kubectl or
systemctl. Exit status: 0 done, 1 the daemon is unreachable (one line on stderr), 2 a
usage error, 3 the daemon refused the request (not an admin, bad arguments), 4 the
configured region does not fit this node (``check``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec

import kvoffload
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import DaemonUnavailableError, KVOffloadError, NoSpaceError
from kvoffloadctl.check import EXIT_UNFIT, check
from kvoffloadd.config import ConfigError, load_config


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
    """One block per section; namespaces and tiers get one block each."""
    for name, section in sections.items():
        flat = {k: v for k, v in section.items() if not isinstance(v, dict)}
        if flat or name not in ("namespaces", "tiers"):
            _print_block(name, flat)
        for sub, fields in section.items():
            if isinstance(fields, dict):
                _print_block(f"{name.rstrip('s')} {sub}", fields)


def _print_block(title: str, fields: dict[str, Any]) -> None:
    print(f"# {title}")
    for k, v in fields.items():
        print(f"{k}: {_fmt(k, v)}")
    print()


def print_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    cells = [[str(r[c]) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


TOP_HEADER = "STORE_GB/s  LOAD_GB/s  LOOKUPS/s  HIT_RATE  OCCUPANCY  USED        CLIENTS  EVICT/s"


def top_sample(prev: dict[str, Any], cur: dict[str, Any], dt_s: float) -> dict[str, Any]:
    """One line of ``top``: rates over the interval between two stats snapshots."""

    def delta(section: str, key: str) -> float:
        return float(cur[section][key] - prev[section][key])

    looked = delta("blocks", "lookup_keys_total")
    return {
        "store_gbps": delta("copies", "stored_bytes_total") / dt_s / 1e9,
        "load_gbps": delta("copies", "loaded_bytes_total") / dt_s / 1e9,
        "lookup_keys_per_s": looked / dt_s,
        "hit_rate": delta("blocks", "hit_keys_total") / looked if looked else 0.0,
        "occupancy_ratio": cur["blocks"]["occupancy_ratio"],
        "used_bytes": cur["blocks"]["used_bytes"],
        "clients": cur["clients"]["connected"],
        "evicted_per_s": delta("eviction", "evicted_blocks_total") / dt_s,
    }


def run_top(client: kvoffload.Client, interval_s: float, count: int, as_json: bool) -> None:
    tty = sys.stdout.isatty() and not as_json
    prev, t_prev = client.stats(), time.monotonic()
    n = 0
    while count <= 0 or n < count:
        time.sleep(interval_s)
        cur, t = client.stats(), time.monotonic()
        row = top_sample(prev, cur, t - t_prev)
        prev, t_prev, n = cur, t, n + 1
        if as_json:
            print(json.dumps(row), flush=True)
            continue
        if tty:
            print("\x1b[H\x1b[2J", end="")
        if tty or n == 1:
            print(TOP_HEADER)
        used = _human_bytes(row["used_bytes"])
        print(
            f"{row['store_gbps']:10.2f}  {row['load_gbps']:9.2f}  {row['lookup_keys_per_s']:9.0f}  "
            f"{row['hit_rate']:8.1%}  {row['occupancy_ratio']:9.1%}  {used:10}  "
            f"{row['clients']:7d}  {row['evicted_per_s']:7.0f}",
            flush=True,
        )


DROP_RETRY_S = 0.05  # a drop refused while copies run in the namespace is asked again


def drop_when_quiet(client: kvoffload.Client, name: str, timeout_s: float) -> m.NamespaceDropped:
    """Drop the namespace, asking again while copies run in it (``NO_SPACE``) until
    ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.drop_namespace(name)
        except NoSpaceError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(DROP_RETRY_S)


EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3
GLOBAL_DEFAULTS: dict[str, Any] = {"socket": None, "json": False, "timeout": 5.0}


def parser() -> argparse.ArgumentParser:
    # The global options live in a parent parser shared by every subcommand, with
    # SUPPRESS as default so that one given after the subcommand is not overwritten.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--socket",
        default=argparse.SUPPRESS,
        help="daemon socket (default: $KVOFFLOAD_SOCKET or the default path)",
    )
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    common.add_argument(
        "--timeout",
        type=float,
        default=argparse.SUPPRESS,
        help="seconds to wait for the daemon (default 5)",
    )
    p = argparse.ArgumentParser(
        prog="kvoffloadctl",
        description="Administer kvoffloadd.",
        parents=[common],
        epilog="exit status: 0 done, 1 daemon unreachable, 2 usage error, 3 request refused, "
        f"{EXIT_UNFIT} the region does not fit (check)",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {kvoffload.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, parents=[common])

    command("stats", "daemon statistics in named sections")
    command("clients", "connected clients")
    ev = command("evict", "evict unpinned blocks")
    ev.add_argument("--namespace", help="only this namespace (default: all)")
    ev.add_argument("--key", action="append", default=None, help="hex key (repeatable)")
    ev.add_argument("--prefix", help="only keys starting with these hex bytes")
    drop = command(
        "drop-namespace",
        "drop one namespace: its blocks and table entry go, and the connections that "
        "have it open lose it (they reconnect and may create it again)",
    )
    drop.add_argument("name", help="the namespace's name")
    top = command("top", "live view of throughput, hit rate and occupancy")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--count", type=int, default=0, help="stop after N refreshes (0: never)")
    command("config", "the daemon's effective configuration")
    command("ping", "round trip to the daemon")
    chk = command(
        "check",
        "whether this node is ready for the configured region: limits, huge pages, "
        "NUMA nodes and GPUs (no daemon needed)",
    )
    chk.add_argument(
        "--config", help="the daemon's config file (default: /etc/kvoffload/kvoffloadd.toml)"
    )
    chk.add_argument("--region-size", dest="region_size", help="check this size instead")
    chk.add_argument("--instance", help="the daemon's instance (whose kept region counts)")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    for key, value in GLOBAL_DEFAULTS.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.command == "check":
        overrides = {"region_size": args.region_size, "instance": args.instance}
        try:
            cfg = load_config(args.config, overrides)
        except ConfigError as exc:
            print(f"kvoffloadctl: {exc}", file=sys.stderr)
            return EXIT_USAGE
        return check(cfg, args.json)

    try:
        client = kvoffload.connect(args.socket, timeout_s=args.timeout, name="kvoffloadctl")
    except DaemonUnavailableError as exc:
        print(f"kvoffloadctl: {exc.args[0]}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        return _run(client, args)
    except DaemonUnavailableError as exc:
        print(f"kvoffloadctl: {exc.args[0]}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KVOffloadError as exc:
        print(f"kvoffloadctl: {exc}", file=sys.stderr)
        return EXIT_REFUSED
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
        prefix = bytes.fromhex(args.prefix) if args.prefix else None
        n = client.evict(args.namespace, keys, prefix)
        scope = f"namespace {args.namespace}" if args.namespace else "all namespaces"
        if args.json:
            print(json.dumps({"evicted_blocks": n, "namespace": args.namespace}))
        else:
            print(f"evicted {n} blocks from {scope}")
    elif args.command == "drop-namespace":
        r = drop_when_quiet(client, args.name, args.timeout)
        if args.json:
            out = {"namespace": args.name, "dropped_blocks": r.blocks}
            print(json.dumps(out | {"connections": r.connections}))
        else:
            print(
                f"dropped namespace {args.name}: {r.blocks} blocks; {r.connections} "
                "connections had it open (they reconnect, and may create it again)"
            )
    elif args.command == "config":
        cfg = client.config()
        if args.json:
            print(json.dumps(cfg, indent=2, sort_keys=True))
        else:
            for k, v in sorted(cfg.items()):
                print(f"{k} = {json.dumps(v)}")
    elif args.command == "top":
        run_top(client, args.interval, args.count, args.json)
    elif args.command == "ping":
        rtt_s = client.ping()
        print(json.dumps({"rtt_s": rtt_s}) if args.json else f"pong in {rtt_s * 1e6:.0f} us")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
