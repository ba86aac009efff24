"""make bench-sglang: L3 backup and prefetch through SGLang 0.5.23's own cache controller.

Everything in one run on one machine, against baselines taken in the same run:

- memcpy: one thread copying one batch's bytes (the ceiling of a copy of them);
- SGLang's ``file`` backend with its directory on tmpfs (``/dev/shm``), the generic,
  copying path SGLang uses for it;
- SGLang's ``mooncake`` backend (zero-copy ``batch_*_v1``) with a local
  ``mooncake_master`` (TCP on loopback, its segment in this process);
- kvoffload, both ways: ``"allocator": "shm"`` (the daemon copies through the pool's
  memfd) and the default allocator (the client copies through its region mapping).

Each backend gets a fresh SGLang instance (real ``HiCacheController`` and host pool,
``page_first``) and does ``--rounds`` rounds of: back up one batch of ``--pages`` pages
(``write_storage`` -> ack; SGLang's batch is 128 pages), then prefetch it into fresh
host pages (hit query -> ``prefetch_buffer`` -> ack; the loaded bytes are checked).
Throughput is bytes over the backend call's own time (``batch_set_v1`` /
``batch_get_v1``, or ``batch_set``/``batch_get`` for ``file``); the end-to-end prefetch
time is shown beside it. ``batch_exists`` of one batch's keys, all present, is timed
``--exists`` times. The control path's floor is measured too: a round trip to the
daemon (ping) and a plain Python unix-socket echo.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import kvoffload

from .bench import memcpy_gbps, pct
from .echo_floor import echo_round_trip_us
from .launch import DaemonProcess, wait_prefault
from .machine import machine
from .mooncake_master import MooncakeMaster


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=128, help="pages per batch (SGLang: 128)")
    p.add_argument("--page-size", type=int, default=8, help="tokens per page")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="K/V heads of the rank")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--exists", type=int, default=300, help="timed batch_exists calls")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--quick", action="store_true", help="smaller batches, fewer rounds")
    return p.parse_args(argv)


@contextlib.contextmanager
def backends(args: argparse.Namespace) -> Iterator[list[tuple[str, str, dict[str, Any]]]]:
    """(label, --hicache-storage-backend, extra-config) of every backend measured."""
    batch_bytes = args.pages * page_bytes(args)
    # both kvoffload backends' batches (and their warm-up rounds) fit: no eviction
    region = max(1 << 30, (2 * (args.rounds + 1) + 2) * batch_bytes)
    out: list[tuple[str, str, dict[str, Any]]] = []
    with contextlib.ExitStack() as stack:
        # removed however the set-up below ends (a master that fails to start included)
        tmp = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvoffload-hicache-", dir="/dev/shm")
        )
        d = stack.enter_context(
            DaemonProcess(f"{region >> 20}MiB", "--log-level", "warning",
                          settings={"max_writing_fraction": 1.0})
        )  # fmt: skip
        with kvoffload.connect(d.socket_path) as c:
            wait_prefault(c)
        out.append(("kvoffload, shm pool (daemon copies)", "dynamic",
                    {"socket_path": d.socket_path, "allocator": "shm"}))  # fmt: skip
        out.append(("kvoffload, default pool (client copies)", "dynamic",
                    {"socket_path": d.socket_path}))  # fmt: skip
        out.append(("SGLang file backend, tmpfs", "file", {"file_storage_path": tmp}))
        why = MooncakeMaster.available()
        if not why:
            m = stack.enter_context(MooncakeMaster(lease_ttl_ms=5000))
            out.append(("SGLang mooncake backend, local master", "mooncake", {
                "master_server_address": m.master, "metadata_server": m.metadata_url,
                "protocol": "tcp", "local_hostname": "127.0.0.1", "device_name": "",
                "global_segment_size": region, "check_server": False,
            }))  # fmt: skip
        else:
            print(f"mooncake backend skipped: {why}")
        yield out


def page_bytes(args: argparse.Namespace) -> int:
    return int(2 * args.page_size * args.layers * args.heads * args.head_dim * 2)  # K+V, bf16


class Runner:
    """One backend's SGLang instance and its figures so far (its prompts are seeds
    ``first``..: each backend its own, the two kvoffload ones share a namespace)."""

    def __init__(self, args: argparse.Namespace, label: str, backend: str,
                 extra: dict[str, Any], first: int) -> None:  # fmt: skip
        from . import sglang_rig as rig  # SGLang: only here, so ``render`` needs none

        self.args, self.label, self.first, self.rig = args, label, first, rig
        model = rig.Model(layers=args.layers, heads=args.heads, head_dim=args.head_dim)
        self.inst = rig.Instance(
            model, "page_first", args.page_size, 2 * args.pages + 1, extra, backend
        )
        self.get, self.put = (
            ("batch_get", "batch_set") if backend == "file" else ("batch_get_v1", "batch_set_v1")
        )
        for worker in getattr(self.inst.backend, "_workers", []):  # client copies: page tables
            if worker.populating is not None:
                worker.populating.join(60)
        self.src = self.inst.alloc(args.pages)
        self.store_s: list[float] = []
        self.load_s: list[float] = []
        self.prefetch_s: list[float] = []
        self.memcpy_s: list[float] = []  # one thread, the same bytes, just before the load
        self.tokens: list[int] = []

    def round(self, r: int, memcpy: Callable[[], float]) -> None:
        """Back up one batch, then prefetch it into host pages (checked); round -1
        warms up, untimed: the pages a prefetch lands in are the ones the warm-up's
        landed in (SGLang's allocator hands freed pages back out), already touched."""
        inst, args, label = self.inst, self.args, self.label
        want = inst.fill(self.src, self.first + r)
        self.tokens = self.rig.page_tokens(self.first + r, args.pages, args.page_size)
        inst.calls.clear()
        assert inst.backup(self.src, self.tokens) == args.pages * args.page_size, label
        if r >= 0:
            self.store_s.append(sum(s for n, s, _ in inst.calls if n == self.put))
        base = memcpy()
        inst.calls.clear()
        got = inst.prefetch(self.tokens)
        assert got.loaded_tokens == args.pages * args.page_size, label
        assert got.host_indices is not None
        assert inst.page_bytes(got.host_indices) == want, f"{label}: wrong bytes"
        inst.free(got.host_indices)
        if r >= 0:
            self.load_s.append(sum(s for n, s, _ in inst.calls if n == self.get))
            self.prefetch_s.append(got.seconds)
            self.memcpy_s.append(base)

    def exists_us(self) -> list[float]:
        hashes = self.rig.storage_keys(self.tokens, self.args.page_size)
        exists = self.inst.controller.storage_backend._inner.batch_exists
        assert exists(hashes) == self.args.pages
        lat = []
        for _ in range(self.args.exists):
            t0 = time.perf_counter()
            exists(hashes)
            lat.append(time.perf_counter() - t0)
        return lat

    def figures(self, lat: list[float]) -> dict[str, Any]:
        nbytes = self.args.pages * page_bytes(self.args)
        st, ld = statistics.median(self.store_s), statistics.median(self.load_s)
        ratios = [m / s for m, s in zip(self.memcpy_s, self.load_s)]
        return {
            "backend": self.label,
            "backup_gbps": nbytes / st / 1e9,
            "backup_pages_per_s": self.args.pages / st,
            "prefetch_gbps": nbytes / ld / 1e9,
            "prefetch_pages_per_s": self.args.pages / ld,
            "prefetch_end_to_end_ms": statistics.median(self.prefetch_s) * 1e3,
            "prefetch_ratios": ratios,  # per round: against the memcpy beside it
            "prefetch_ratio": statistics.median(ratios),
            "load_s": self.load_s,
            "exists_p50_us": pct(lat, 0.5) * 1e6,
            "exists_p99_us": pct(lat, 0.99) * 1e6,
        }

    def close(self) -> None:
        self.inst.close()


def measure(
    args: argparse.Namespace, todo: list[tuple[str, str, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Every backend's figures, their rounds interleaved: all instances are alive and
    each round visits every backend in turn (the order turning each round), so a
    change of the machine's load falls on all of them alike; each backend's prefetch
    is set against a one-thread memcpy of the same bytes taken just before it."""
    nbytes = args.pages * page_bytes(args)
    buffers = (np.ones(nbytes, dtype=np.uint8), np.ones(nbytes, dtype=np.uint8))

    def memcpy() -> float:
        return float(nbytes / (memcpy_gbps(nbytes, 1, buffers) * 1e9))

    with contextlib.ExitStack() as stack:
        runners = []
        for i, (label, backend, extra) in enumerate(todo):
            runners.append(Runner(args, label, backend, extra, 1000 * (i + 1)))
            stack.callback(runners[-1].close)
        for r in range(-1, args.rounds):
            k = max(r, 0) % len(runners)
            for runner in runners[k:] + runners[:k]:
                runner.round(r, memcpy)
        rows = [runner.figures(runner.exists_us()) for runner in runners]
    for row in rows:
        print(f"measured {row['backend']}", flush=True)
    return rows


def floors(socket_path: str) -> dict[str, float]:
    with kvoffload.connect(socket_path) as c:
        pings = [c.ping() for _ in range(500)]
    echo_p50, echo_p99 = echo_round_trip_us(2000)
    return {
        "ping_p50_us": pct(pings, 0.5) * 1e6,
        "echo_p50_us": echo_p50,
        "echo_p99_us": echo_p99,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.quick:
        args.pages, args.rounds, args.exists, args.layers = 16, 2, 50, 4
    nbytes = args.pages * page_bytes(args)
    result: dict[str, Any] = {"machine": machine(), "page_bytes": page_bytes(args)}
    result["memcpy_gbps"] = memcpy_gbps(nbytes, 5)
    with backends(args) as todo:
        rows = measure(args, todo)
        result.update(floors(todo[0][2]["socket_path"]))
    result["rows"] = rows
    result["setup"] = {k: getattr(args, k.replace("-", "_")) for k in SETUP}
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


SETUP = ("pages", "page-size", "layers", "heads", "head-dim", "rounds")


def render(r: dict[str, Any]) -> str:
    """The figures as Markdown (also ``make bench-report``'s SGLang section)."""
    a = r["setup"]
    base = r["memcpy_gbps"]
    rows = r["rows"]
    paired = all("prefetch_ratios" in row for row in rows)  # older runs: one memcpy
    if paired:
        head = (
            f"median of {a['rounds']} rounds, interleaved across backends; each prefetch "
            "against a one-thread memcpy of the same bytes just before it (median [min-max] "
            f"over rounds; memcpy at the start {base:.2f} GB/s)."
        )
    else:
        head = (
            f"median of {a['rounds']} rounds; memcpy baseline (one thread, one batch's "
            f"bytes) {base:.2f} GB/s."
        )
    lines = [
        f"Batches of {a['pages']} pages of {r['page_bytes'] >> 10} KiB ({a['page-size']} "
        f"tokens, {a['layers']} layers, {a['heads']} K/V heads x {a['head-dim']}, bf16, "
        f"`page_first`), {head}",
        "",
        "| backend | backup GB/s | pages/s | prefetch GB/s (/ memcpy) | pages/s | "
        "prefetch end to end | batch_exists of a batch, p50 / p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if paired:
            q = row["prefetch_ratios"]
            ratio = f"{row['prefetch_ratio']:.2f} [{min(q):.2f}-{max(q):.2f}]"
        else:
            ratio = f"{row['prefetch_gbps'] / base:.2f}"
        lines.append(
            f"| {row['backend']} | {row['backup_gbps']:.2f} | {row['backup_pages_per_s']:.0f} "
            f"| {row['prefetch_gbps']:.2f} ({ratio}) "
            f"| {row['prefetch_pages_per_s']:.0f} | {row['prefetch_end_to_end_ms']:.1f} ms "
            f"| {row['exists_p50_us']:.0f} / {row['exists_p99_us']:.0f} us |"
        )
    lines.append("")
    mooncake = [row for row in rows if "mooncake" in row["backend"]]
    if paired and mooncake:
        theirs = mooncake[0]["load_s"]
        lines += [
            f"Prefetch faster than Mooncake's in the same round: {row['backend']} "
            f"{sum(a < b for a, b in zip(row['load_s'], theirs))} of {len(theirs)}."
            for row in rows
            if row["backend"].startswith("kvoffload")
        ]
        lines.append("")
    lines.append(
        f"Control-path floor in the same run: kvoffloadd ping p50 {r['ping_p50_us']:.0f} us; "
        f"a plain Python unix-socket echo p50 / p99 {r['echo_p50_us']:.0f} / "
        f"{r['echo_p99_us']:.0f} us."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

__all__ = ["main"]
