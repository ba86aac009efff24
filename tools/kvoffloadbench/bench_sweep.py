"""The long benchmarks behind ``make bench-report``: sweeps, concurrency and scale.

- Data path: store and load GB/s for one-page blocks of 4 KiB to 4 MiB, in jobs of
  1 to 128 blocks, against a same-run memcpy of the same total bytes.
- Control path: p50/p99 round trip and operations per second of each scheduler-side
  operation with 1, 4 and 16 concurrent client processes.
- Scale: daemon start-up (until it listens, until its region is pre-faulted) and its
  own memory for 1, 4 and 16 GiB regions; index memory per block and the cost of a
  1,000-key lookup as the number of stored blocks grows.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import kvoffload

from .bench import data_path, filled_index, index_bytes_per_block, memcpy_gbps, pct
from .launch import BULK_STORES, DaemonProcess, wait_prefault

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
PAGES = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB)
BATCHES = (1, 16, 128)
CLIENTS = (1, 4, 16)
OPS = ("ping", "lookup16", "store_round16", "load_round16", "touch16", "take_events")


def datapath_sweep(quick: bool) -> list[dict[str, Any]]:
    total = (16 if quick else 64) * MIB
    repeats = 2 if quick else 3
    # memcpy speed swings with buffer size on some machines (page placement): the
    # baseline is the best of the sweep's size and a large one
    base = max(memcpy_gbps(total, repeats + 2), memcpy_gbps(384 * MIB, repeats))
    rows = []
    with DaemonProcess(
        "1GiB", "--log-level", "warning", start_timeout_s=60, settings=BULK_STORES
    ) as d:
        client = kvoffload.connect(d.socket_path)
        for page in PAGES:
            for batch in BATCHES:
                blocks = max(batch, min(total // page, 4096 if batch == 1 else 16384))
                st, ld = data_path(client, f"s{page}-{batch}", [page], blocks, batch, repeats)
                rows.append(
                    {
                        "page_bytes": page,
                        "batch_blocks": batch,
                        "blocks": blocks,
                        "store_gbps": st,
                        "load_gbps": ld,
                        "memcpy_gbps": base,
                    }
                )
        client.close()
    return rows


def _ops(ns: kvoffload.Namespace, me: int, keys: list[bytes]) -> dict[str, Callable[[], object]]:
    """Each operation as an engine's scheduler issues it, on 16 keys (``keys`` stored).
    A store round's fresh keys have the length of ``keys``: a namespace holds keys of
    one length."""
    counter = iter(range(1 << 62))
    width = len(keys[0]) - 4  # after b"s" and the client's three digits

    def store_round() -> None:
        ks = [b"s%03d%0*d" % (me, width, next(counter)) for _ in range(16)]
        ns.prepare_store(ks)
        ns.complete_store(ks, success=False)

    def load_round() -> None:
        ns.prepare_load(keys)
        ns.complete_load(keys)

    return {
        "ping": ns.client.ping,
        "lookup16": lambda: ns.lookup(keys),
        "store_round16": store_round,
        "load_round16": load_round,
        "touch16": lambda: ns.touch(keys),
        "take_events": ns.take_events,
    }


def _client(sock: str, me: int, seconds: float, barrier: Any, out: Any) -> None:
    try:
        out.put(_client_ops(sock, me, seconds, barrier))
    except BaseException as exc:
        barrier.abort()
        out.put(f"client {me}: {exc!r}")
        raise


def _client_ops(sock: str, me: int, seconds: float, barrier: Any) -> dict[str, list[float]]:
    client = kvoffload.connect(sock)
    ns = client.namespace("ctl", kvoffload.KVLayout(tensor_page_bytes=[16 * KIB]))
    w = ns.attach_worker([kvoffload.shared_kv_cache(16, 16 * KIB)])
    keys = [b"c%03d-%08d" % (me, i) for i in range(16)]
    plan = ns.prepare_store(keys)
    assert plan is not None
    if plan.keys_to_store:  # not stored by an earlier round
        assert w.submit_store(1, list(range(len(plan.slots))), plan.slots), w.last_error
        w.wait([1])
        ns.complete_store(plan.keys_to_store)
    ops = _ops(ns, me, keys)
    result: dict[str, list[float]] = {}
    for name in OPS:
        fn, samples = ops[name], []
        barrier.wait(60)
        for _ in range(200):  # warm-up, not measured
            fn()
        barrier.wait(60)
        end = time.perf_counter() + seconds
        while (t0 := time.perf_counter()) < end:
            fn()
            samples.append(time.perf_counter() - t0)
        result[name] = samples
    w.close()
    client.close()
    return result


def control_path(quick: bool) -> list[dict[str, Any]]:
    seconds = 0.5 if quick else 1.5
    rows = []
    ctx = mp.get_context("fork")
    with DaemonProcess("256MiB", "--log-level", "warning", "--no-prefault") as d:
        for n in CLIENTS:
            barrier, out = ctx.Barrier(n), ctx.Queue()
            procs = [
                ctx.Process(target=_client, args=(d.socket_path, i, seconds, barrier, out))
                for i in range(n)
            ]
            for p in procs:
                p.start()
            results = [out.get(timeout=120 + seconds * len(OPS)) for _ in procs]
            for p in procs:
                p.join(30)
            failed = [r for r in results if isinstance(r, str)]
            if failed:
                raise RuntimeError(f"control-path clients failed: {failed}")
            for name in OPS:
                samples = [s for r in results for s in r[name]]
                rows.append(
                    {
                        "op": name,
                        "clients": n,
                        "p50_us": pct(samples, 0.5) * 1e6,
                        "p99_us": pct(samples, 0.99) * 1e6,
                        "ops_per_s": len(samples) / seconds,
                    }
                )
    return rows


def _rss_anon_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def startup(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for gib in (1, 4) if quick else (1, 4, 16):
        t0 = time.perf_counter()
        d = DaemonProcess(f"{gib}GiB", "--log-level", "warning", start_timeout_s=120).start()
        listen_s = time.perf_counter() - t0
        client = kvoffload.connect(d.socket_path)
        wait_prefault(client, deadline_s=300, poll_s=0.01)
        rows.append(
            {
                "region_gib": gib,
                "listen_s": listen_s,
                "prefaulted_s": time.perf_counter() - t0,
                "daemon_anon_bytes": _rss_anon_bytes(d.pid),
            }
        )
        client.close()
        d.stop()
    return rows


def index_scale(quick: bool) -> list[dict[str, Any]]:
    """Index memory per block, and a 1,000-key lookup, as stored blocks grow."""
    rows = []
    for n in (10_000, 100_000) if quick else (10_000, 100_000, 1_000_000):
        per_block = index_bytes_per_block(n)
        keys = [os.urandom(32) + bytes(4) for _ in range(n)]
        idx = filled_index(keys)
        probe = keys[n // 2 : n // 2 + 1000]
        for _ in range(100):  # warm-up, not measured
            idx.lookup(probe)
        samples = []
        for _ in range(1000):
            t0 = time.perf_counter()
            idx.lookup(probe)
            samples.append(time.perf_counter() - t0)
        rows.append(
            {
                "blocks": n,
                "index_bytes_per_block": per_block,
                "lookup1000_p50_us": pct(samples, 0.5) * 1e6,
                "lookup1000_p99_us": pct(samples, 0.99) * 1e6,
            }
        )
    return rows
