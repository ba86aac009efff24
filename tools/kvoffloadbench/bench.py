"""``make bench``: data-path and control-path figures, as ratios to same-run baselines.

Everything is measured in one run on one machine: a plain memcpy baseline first,
then the same bytes moved through a real kvoffloadd subprocess, so the ratios hold
whatever the machine. Targets are DESIGN.md section 6.

    python -m kvoffloadbench.bench [--quick] [--json FILE] [--only tiers] [--tier-threads 1,2]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

import kvoffload
from kvoffload.engine.streaming import StreamingWorker
from kvoffload.engine.view import EngineView
from kvoffload.worker import Worker

from .bench_control import filled, store_rounds
from .bench_gpu import cuda_available, report_gpu, run_gpu
from .bench_tiers import TIER_THREADS, run_tiers, tier_rows
from .echo_floor import EchoPeer, interleaved, percentiles_us, placed, wire_peer
from .launch import BULK_STORES, DaemonProcess, wait_prefault

MIB = 1 << 20


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def memcpy_gbps(nbytes: int, repeats: int, buffers: tuple[Any, Any] | None = None) -> float:
    """Best single-threaded copy of one large buffer: numpy's and libc's memmove
    (into and out of ``buffers`` when given, fresh ones of ``nbytes`` otherwise)."""
    src, dst = buffers or (np.ones(nbytes, dtype=np.uint8), np.ones(nbytes, dtype=np.uint8))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        ctypes.memmove(dst.ctypes.data, src.ctypes.data, nbytes)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def data_path(
    client: kvoffload.Client,
    name: str,
    pages: list[int],
    num_blocks: int,
    blocks_per_job: int,
    repeats: int,
    window: list[float] | None = None,
    *,
    one_way: bool = False,
) -> tuple[float, float]:
    """Store then load ``num_blocks`` blocks in jobs; best GB/s of each direction.
    ``window`` gets a one-thread memcpy of the same bytes before each repeat: the
    baseline of the same minutes, on a machine whose load changes. ``one_way``: the
    jobs are submitted as an engine's worker submits them (``StreamingWorker``, the
    daemon copying: one-way submits, results pushed); else each with a blocking round
    trip (``Worker``)."""
    layout = kvoffload.KVLayout(tensor_page_bytes=pages)
    ns = client.namespace(name, layout)
    src = [kvoffload.shared_kv_cache(num_blocks, p) for p in pages]
    dst = [kvoffload.shared_kv_cache(num_blocks, p) for p in pages]
    for t in src + dst:
        t.fill_(1)
    ws: Worker
    wd: Worker
    if one_way:
        ws = StreamingWorker(ns, src, copy_mode="daemon")
        wd = StreamingWorker(ns, dst, copy_mode="daemon")
    else:
        ws, wd = ns.attach_worker(src), ns.attach_worker(dst)
    block_bytes = sum(pages)
    best_store = best_load = float("inf")
    job = 0
    total = num_blocks * block_bytes
    buffers = (np.ones(total, dtype=np.uint8), np.ones(total, dtype=np.uint8))
    for r in range(repeats):
        if window is not None:
            window.append(memcpy_gbps(total, 1, buffers))
        keys = [b"%s-%d-%08d" % (name.encode(), r, i) for i in range(num_blocks)]
        plan = ns.prepare_store(keys)
        assert plan is not None and len(plan.slots) == num_blocks, "region too small for bench"
        t0 = time.perf_counter()
        jobs = []
        for a in range(0, num_blocks, blocks_per_job):
            job += 1
            ids = np.arange(a, min(a + blocks_per_job, num_blocks))
            assert ws.submit_store(job, ids, plan.slots[a : a + ids.size]), ws.last_error
            jobs.append(job)
        ws.wait(jobs)
        best_store = min(best_store, time.perf_counter() - t0)
        assert all(x.success for x in ws.get_finished())
        ns.complete_store(keys)
        lp = ns.prepare_load(keys)
        t0 = time.perf_counter()
        jobs = []
        for a in range(0, num_blocks, blocks_per_job):
            job += 1
            ids = np.arange(a, min(a + blocks_per_job, num_blocks))
            assert wd.submit_load(job, lp.slots[a : a + ids.size], ids), wd.last_error
            jobs.append(job)
        wd.wait(jobs)
        best_load = min(best_load, time.perf_counter() - t0)
        assert all(x.success for x in wd.get_finished())
        ns.complete_load(keys)
        client.evict(name)
    ws.close()
    wd.close()
    return total / best_store / 1e9, total / best_load / 1e9


def latencies(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _lookup_worker(sock: str, seconds: float, start: Any, out: Any) -> None:
    client = kvoffload.connect(sock)
    ns = client.namespace("ctl", kvoffload.KVLayout(tensor_page_bytes=[16384]))
    keys = [b"ctl-%08d" % i for i in range(16)]
    start.wait()
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        ns.lookup(keys)
        n += 1
    out.put(n)
    client.close()


def concurrent_lookups(sock: str, clients: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_lookup_worker, args=(sock, seconds, start, out)) for _ in range(clients)
    ]
    for p in procs:
        p.start()
    time.sleep(1.0)  # let every client connect before the clock starts
    start.set()
    total = sum(int(out.get(timeout=seconds + 60)) for _ in procs)
    for p in procs:
        p.join(30)
    return total / seconds


def mirror_lookup_us(
    ns: kvoffload.Namespace, keys: list[bytes], rounds: int
) -> tuple[float, float]:
    """Per-key cost of an engine view's lookup (what vLLM's per-key ``lookup`` costs),
    and of a bare Python set membership test in the same process as the baseline. Each
    round is one scheduler step: its first lookup reads the pushes that arrived."""
    view = EngineView(ns)
    look = view.lookup
    t0 = time.perf_counter()
    for _ in range(rounds):
        for k in keys:
            look(k)
        view.end_step()
    per_key_us = (time.perf_counter() - t0) / (rounds * len(keys)) * 1e6
    ready = set(keys)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for k in keys:
            _ = k in ready
    return per_key_us, (time.perf_counter() - t0) / (rounds * len(keys)) * 1e6


def filled_index(keys: list[bytes]) -> Any:
    """An in-process namespace index (no daemon) holding ``keys`` as stored blocks."""
    from kvoffload.protocol.messages import KVLayout
    from kvoffloadd.index.index import NamespaceIndex
    from kvoffloadd.region.allocator import ExtentPool
    from kvoffloadd.region.slots import SlotPool

    pool = ExtentPool(len(keys) // 1024 + 1, 1024 * 4096)
    idx = NamespaceIndex(0, "m", KVLayout([4096]), "f", SlotPool(pool, 0, 4096))
    for a in range(0, len(keys), 4096):
        batch = keys[a : a + 4096]
        plan = idx.prepare_store(batch, 1)
        assert plan is not None
        idx.mark_written(plan.slots, 0)
        idx.complete_store(batch, True, 1)
    return idx


def index_bytes_per_block(n: int) -> float:
    keys = [os.urandom(32) + (0).to_bytes(4, "big") for _ in range(n)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = filled_index(keys)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del keys, idx
    return used / n


def run(
    quick: bool, only_tiers: bool = False, tier_threads: tuple[int, ...] = TIER_THREADS
) -> dict[str, Any]:
    r: dict[str, Any] = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.python_version()}"
    }
    big = 2 * MIB
    nblocks = 64 if quick else 192
    repeats = 2 if quick else 4
    r["memcpy_gbps"] = memcpy_gbps(nblocks * big, repeats + 2)
    if only_tiers:
        r.update(run_tiers(quick, tier_threads))
        return r
    with DaemonProcess(
        "1GiB", "--log-level", "warning", start_timeout_s=60, settings=BULK_STORES
    ) as d:
        client = kvoffload.connect(d.socket_path)
        wait_prefault(client)
        # each row against the memcpys taken between its own repeats (window_of)
        window: dict[str, list[float]] = {"2mib": [], "32x32k": [], "32x32k_blocking": []}
        r["memcpy_window_gbps"] = window
        # the targets' rows as engines submit (one-way); the blocking API's for reference
        small = [32 * 1024] * 32
        for name, pages, row in (("b2m", [big], "2mib"), ("p32", small, "32x32k")):
            st, ld = data_path(client, name, pages, nblocks, 16, repeats, window[row], one_way=True)
            r[f"store_{row}_gbps"], r[f"load_{row}_gbps"] = st, ld
        st, ld = data_path(client, "q32", small, nblocks, 16, repeats, window["32x32k_blocking"])
        r["store_32x32k_blocking_gbps"], r["load_32x32k_blocking_gbps"] = st, ld

        n = 2000 if quick else 10000
        ns, keys = filled(client)
        echo, wire = EchoPeer(), wire_peer()
        try:
            # the floors and the daemon pinned alike (echo_floor.placed): on one CPU
            # (the work's cost; the targets' rows), then client and server apart
            for apart, suffix in ((False, ""), (True, "_apart")):
                with placed([echo.proc.pid, wire.proc.pid, d.pid], apart) as made:
                    if made:
                        r.update(control_path(client, echo, wire, ns, keys, n, suffix))
        finally:
            echo.close()
            wire.close()
        r["mirror_lookup_us"], r["set_lookup_us"] = mirror_lookup_us(
            ns, keys, 200 if quick else 1000
        )
        r["lookup_calls_per_s_8_clients"] = concurrent_lookups(
            d.socket_path, 8, 2.0 if quick else 4.0
        )
        client.close()
    r["index_bytes_per_block"] = index_bytes_per_block(50_000 if quick else 200_000)
    r.update(run_tiers(quick, tier_threads))
    return r


def control_path(
    client: kvoffload.Client,
    echo: EchoPeer,
    wire: EchoPeer,
    ns: kvoffload.Namespace,
    keys: list[bytes],
    n: int,
    suffix: str,
) -> dict[str, float]:
    """Echo, bare wire loop and ping p50/p99 (in alternating blocks: a neighbour's
    burst hits all three), a lookup of the 1,000 stored ``keys`` and a store round of
    16 new keys."""
    out: dict[str, float] = {}
    fns: dict[str, Callable[[], object]] = {
        "echo": echo.round_trip,
        "wire": wire.round_trip,
        "ping": client.ping,
    }
    for name, took in interleaved(fns, n).items():
        out[f"{name}_p50_us{suffix}"], out[f"{name}_p99_us{suffix}"] = percentiles_us(took)
    lk = latencies(lambda: ns.lookup(keys), n // 2)
    out["lookup1000_p50_us" + suffix] = pct(lk, 0.5) * 1e6
    out["lookup1000_p99_us" + suffix] = pct(lk, 0.99) * 1e6
    sr = latencies(store_rounds(ns), n // 4)
    out["store_round16_p50_us" + suffix] = pct(sr, 0.5) * 1e6
    out["store_round16_p99_us" + suffix] = pct(sr, 0.99) * 1e6
    return out


def control_rows(r: dict[str, Any], suffix: str, where: str) -> list[tuple[str, str, str]]:
    """The control-path rows of one placement (targets on the one-CPU rows)."""
    if "ping_p50_us" + suffix not in r:
        return []
    target = not suffix

    def us(key: str) -> str:
        return f"{r[key + '_p50_us' + suffix]:.1f} / {r[key + '_p99_us' + suffix]:.1f} us"

    ratio = r["ping_p50_us" + suffix] / r["echo_p50_us" + suffix]
    wire = []
    if "wire_p50_us" + suffix in r:  # absent from figures saved before it was timed
        wire_ratio = r["wire_p50_us" + suffix] / r["echo_p50_us" + suffix]
        what = f"{wire_ratio:.2f} x the floor: the daemon's wire work alone"
        wire.append((f"bare Python loop p50 / p99, {where}", us("wire"), what))
    return [
        (f"unix-socket echo p50 / p99 (floor), {where}", us("echo"), "plain Python, no daemon"),
        *wire,
        (
            f"ping p50 / p99, {where}",
            us("ping"),
            f"{ratio:.2f} x the floor" + ("; target p50 <= 1.3 x" if target else ""),
        ),
        (
            f"lookup 1000 keys p50 / p99, {where}",
            us("lookup1000"),
            "target p50 <= 100" if target else "",
        ),
        (
            f"store round, 16 keys p50 / p99, {where}",
            us("store_round16"),
            "target p50 <= 148" if target else "",
        ),
    ]


def window_of(key: str) -> str:
    """The memcpy window of a data-path figure: ``store_32x32k_gbps`` -> ``32x32k``."""
    return key.split("_", 1)[1].removesuffix("_gbps")


def cpu_rows(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    base = r["memcpy_gbps"]
    rows = [
        ("machine", r["machine"], ""),
        ("memcpy baseline (1 thread)", f"{base:.2f} GB/s", "1.00"),
    ]
    if "store_2mib_gbps" not in r:  # --only tiers
        return rows + tier_rows(r)
    window = r.get("memcpy_window_gbps", {})
    for key, label, target in [
        ("store_2mib_gbps", "store, 2 MiB blocks", 0.8),
        ("load_2mib_gbps", "load, 2 MiB blocks", 0.8),
        ("store_32x32k_gbps", "store, 32 x 32 KiB pages/block", 0.8),
        ("load_32x32k_gbps", "load, 32 x 32 KiB pages/block", 0.8),
        ("store_32x32k_blocking_gbps", "store, 32 x 32 KiB, blocking submits", None),
        ("load_32x32k_blocking_gbps", "load, 32 x 32 KiB, blocking submits", None),
    ]:
        if key not in r:  # a file from before the blocking rows
            continue
        # against the best memcpy measured between this row's own repeats, if any
        near = max(window.get(window_of(key), []), default=base)
        note = f"memcpy then {near:.2f} GB/s" if near != base else ""
        ratio = r[key] / near
        why = ", ".join(x for x in (f"target >= {target}" if target else "", note) if x)
        rows.append(
            (label, f"{r[key]:.2f} GB/s", f"{ratio:.2f} ({why})" if why else f"{ratio:.2f}")
        )
    rows += control_rows(r, "", "one CPU")
    rows += control_rows(r, "_apart", "client and server apart")
    rows += [
        (
            "lookup calls/s, 8 clients",
            f"{r['lookup_calls_per_s_8_clients']:.0f}",
            "target >= 20000",
        ),
        (
            "vLLM lookup (key mirror), per key",
            f"{r['mirror_lookup_us']:.2f} us",
            f"{r['mirror_lookup_us'] / r['set_lookup_us']:.1f} x a set lookup; target <= 2 us",
        ),
        ("index memory per block", f"{r['index_bytes_per_block']:.0f} B", "target <= 314 B"),
    ]
    return rows + tier_rows(r)


def report(r: dict[str, Any]) -> str:
    rows = cpu_rows(r) if "memcpy_gbps" in r else []
    if "gpu" in r:
        rows += report_gpu(r["gpu"])
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows)
    return "\n".join(f"{a.ljust(w0)}  {b.ljust(w1)}  {c}" for a, b, c in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvoffloadbench.bench")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--json", help="also write the raw figures to this file")
    p.add_argument("--gpu-only", action="store_true", help="only the GPU data path")
    p.add_argument("--daemon-args", default="", help="extra kvoffloadd flags (GPU part)")
    p.add_argument("--only", choices=["tiers"], help="only the secondary tiers (and memcpy)")
    p.add_argument(
        "--tier-threads",
        default=",".join(map(str, TIER_THREADS)),
        help="tier_threads values to measure promotion with (comma-separated)",
    )
    args = p.parse_args(argv)
    threads = tuple(int(t) for t in args.tier_threads.split(","))
    r = {} if args.gpu_only else run(args.quick, args.only == "tiers", threads)
    if cuda_available() and not args.only:
        r["gpu"] = run_gpu(args.quick, args.daemon_args.split())
    elif args.gpu_only:
        print("no CUDA device: nothing to measure")
        return 1
    print(report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
