"""Secondary-tier throughput for ``make bench``: cascade down, promotion back up, and how
promotion scales with the tier's promotion threads (``tier_threads``).

One daemon per tier kind and thread count (a disk directory under the temporary
directory; a throwaway redis-server and a throwaway mooncake_master on loopback, when
installed), started with ``tier_threads`` = 1, then 2 (``--tier-threads``). Blocks are
stored into the region, the time until every one has cascaded is the cascade rate;
then the region is emptied by an admin eviction and one lookup starts the promotion
of all of them, and the time from that lookup until the daemon's loop made the last of
them ready (``last_promotion_done_s`` in the tier's stats, read from the clock this
process reads: ``CLOCK_MONOTONIC``) is the promotion rate: the median of
``PROMOTION_ROUNDS`` such rounds. The benchmark's lookups only find out that the
round is over (``_until_promoted``): their waits no longer add to the time measured,
but their CPU still comes out of the promotion's, so they are kept out of its way:
none in the first ``QUIET_FRACTION`` of the time the copies alone would take, then
one key every ``POLL_S``. A poll costs the daemon's loop and this process a few
hundred microseconds of CPU, which on 2 vCPUs comes out of the promotion's threads.
Before each round and after the last, the machine's own copy+MAC rate with as many
threads is measured in this process (``CopyMac``: the same bytes copied in the same
``PIECE_BYTES`` pieces, each hashed with the same keyed BLAKE3 just after its copy, by
the function the tier's promotion uses: ``BlockMac.copy_and_hash`` from memory as
from Mooncake's own segment, and for the disk tier ``BlockMac.read_and_hash`` from
the tier's own block files, opened and read from the page cache as the promotion
reads them), and each round is set against the mean of the two around it: the work a
promotion has to do, on the threads it has, measured while the machine is as busy
(2 vCPUs shared with other processes swing by 2x from minute to minute). What the
promotion adds to that work (its lookup, the checks of each file and seal, handing
blocks to threads, the slots' bookkeeping) is what the ratio measures.
Then single blocks are evicted and looked up again: the median time from
the lookup that starts one block's promotion to the lookup that hits it is its
latency. The disk figures are with the files in the page cache (just written, then
flushed to the drive so its write-back does not run during the rounds), so they show
kvoffload's overhead, not the drive's speed. Each daemon's region is pre-faulted
before anything is measured, as in the rest of ``make bench``. ``mac_rates`` gives
the MAC's own cost on one thread.
"""

from __future__ import annotations

import itertools
import mmap
import os
import pathlib
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

import kvoffload
from kvoffloadd.tiers.base import TierNamespace
from kvoffloadd.tiers.blockauth import PIECE_BYTES, SEAL, BlockMac

from .launch import SHM, DaemonProcess, wait_prefault
from .mooncake_master import MooncakeMaster
from .redis_server import RedisServer

MIB = 1 << 20
PROMOTION_ROUNDS = 5  # whole promotions timed per daemon; the median is reported
POLL_S = 0.002  # the benchmark's lookups while a promotion runs: a few ms apart
QUIET_FRACTION = 0.75  # of the time copy+MAC alone would take: no lookups before
TIER_THREADS = (1, 2)  # make bench's promotion threads per tier
SAME_THREADS_TARGET = 0.8  # promotion / the machine's copy+MAC with the same threads
MEMCPY_TARGETS = {"disk": 0.5, "redis": 0.1, "mooncake": 0.5}  # promotion / memcpy


def _wait(predicate: Any, deadline_s: float = 120.0, poll_s: float = 0.0005) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise RuntimeError("tier benchmark timed out")
        time.sleep(poll_s)


def region_like(nbytes: int, fill: int) -> npt.NDArray[np.uint8]:
    """``nbytes`` shared, of the kind the bench daemons' regions are (a file in
    ``/dev/shm``, the default backing): their page size, faulted in (``fill``) as the
    regions are pre-faulted. Anonymous memory the size of a promotion is given
    transparent huge pages (numpy asks for them), and two threads copy into it some 20%
    faster than into 4 KiB shared pages on this machine: the copy rate a promotion is
    set against would have been that of other memory."""
    fd, path = tempfile.mkstemp(dir=SHM, prefix="kvoffload-bench-")
    try:
        os.unlink(path)
        os.ftruncate(fd, nbytes)
        out = np.frombuffer(mmap.mmap(fd, nbytes), np.uint8)
    finally:
        os.close(fd)
    out.fill(fill)
    return out


class CopyMac:
    """The machine's copy+MAC rate: blocks copied into ``dst`` and hashed, as a
    promotion does it, on a given number of threads taking blocks in turn. The copy is
    the one the tier's promotion makes: from memory (``src``: Mooncake's own segment)
    by ``BlockMac.copy_and_hash``, or, given the tier's block ``files``, read from them
    (the disk tier: the page cache) by ``BlockMac.read_and_hash``. ``dst`` is memory of
    the region's kind (``region_like``): the same pages the promotion writes to."""

    def __init__(self, block_bytes: int, nblocks: int) -> None:
        self.block_bytes = block_bytes
        self.nblocks = nblocks
        self.mac = BlockMac(bytes(32))
        self.ns = TierNamespace.of("bench", "f" * 32, block_bytes)
        self.src: npt.NDArray[np.uint8] = np.ones(nblocks * block_bytes, np.uint8)
        self.dst = region_like(nblocks * block_bytes, 1)

    def gbps(self, threads: int, files: Sequence[pathlib.Path] = ()) -> float:
        view = memoryview(self.dst.data)
        src, dst, n = self.src.ctypes.data, self.dst.ctypes.data, self.block_bytes
        blocks = itertools.count()  # next() is atomic: each thread takes the next block
        start = threading.Barrier(threads + 1)
        assert not files or len(files) == self.nblocks

        def work() -> None:
            start.wait()
            while (i := next(blocks)) < self.nblocks:
                at = i * n
                if not files:
                    self.mac.copy_and_hash(self.ns, b"k", view[at : at + n], dst + at, src + at)
                    continue
                fd = os.open(files[i], os.O_RDONLY | os.O_CLOEXEC)
                try:
                    tag = self.mac.read_and_hash(self.ns, b"k", view[at : at + n], fd, SEAL.size)
                finally:
                    os.close(fd)
                assert tag is not None

        pool = [threading.Thread(target=work) for _ in range(threads)]
        for t in pool:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in pool:
            t.join()
        seconds = time.perf_counter() - t0
        view.release()
        return self.nblocks * n / seconds / 1e9


def tier_rates(
    tier_toml: str, tier: str, block_bytes: int, nblocks: int, tier_threads: int, base: CopyMac
) -> dict[str, Any]:
    """Cascade GB/s, promotion GB/s (median of the rounds), the machine's copy+MAC GB/s
    on ``tier_threads`` threads (median, measured around each round), the median of the
    rounds' ratios to it, and one block's promotion in ms, through one daemon with one
    tier promoting on ``tier_threads`` threads."""
    with tempfile.TemporaryDirectory(prefix="kvoffload-bench-") as tmp:
        cfg = pathlib.Path(tmp) / "d.toml"
        head = (
            f'tier_secret_file = "{tmp}/tier-secret"\n'  # blocks sealed, MACs checked
            f"tier_threads = {tier_threads}\n"
        )
        cfg.write_text(head + tier_toml.replace("@TMP@", tmp).replace("@T@", str(tier_threads)))
        with DaemonProcess("1GiB", "--config", str(cfg), "--log-level", "warning") as d:
            client = kvoffload.connect(d.socket_path)
            # The region's pre-fault clears 1 GiB on one of the CPUs: measuring while it
            # runs would charge a one-time start-up cost to the tier.
            wait_prefault(client, poll_s=0.01)
            # a tier that is still connecting would drop the cascades measured below
            _wait(lambda: bool(client.stats()["tiers"][tier]["healthy"]), poll_s=0.01)
            ns = client.namespace("bench", kvoffload.KVLayout(tensor_page_bytes=[block_bytes]))
            cache = kvoffload.shared_kv_cache(nblocks, block_bytes)
            cache.fill_(7)
            w = ns.attach_worker([cache])
            keys = [b"tier-%08d" % i for i in range(nblocks)]
            plan = ns.prepare_store(keys)
            assert plan is not None and len(plan.slots) == nblocks, "region too small"
            assert w.submit_store(1, np.arange(nblocks), plan.slots), w.last_error
            w.wait([1])
            assert all(r.success for r in w.get_finished())

            def tier_stat(field: str) -> int:
                return int(client.stats()["tiers"][tier][field])

            t0 = time.perf_counter()
            ns.complete_store(keys)
            _wait(lambda: tier_stat("stores_total") >= nblocks, poll_s=POLL_S)
            cascade_s = time.perf_counter() - t0
            assert tier_stat("tier_threads") == tier_threads
            _flush(pathlib.Path(tmp))
            # the disk tier's promotion reads its files: so does its copy+MAC
            files = sorted(pathlib.Path(tmp).glob("disk/*/*/*.kvb"))
            copy_mac = [base.gbps(tier_threads, files)]  # before each round, after the last
            promote_s = []
            for _ in range(PROMOTION_ROUNDS):
                assert client.evict("bench") == nblocks
                # no poll before most of the time the copies and MACs alone would take
                quiet_s = QUIET_FRACTION * nblocks * block_bytes / (copy_mac[-1] * 1e9)
                t0 = time.monotonic()  # the daemon's clock too (CLOCK_MONOTONIC)
                assert ns.lookup(keys) is None, "the promotion did not start"
                time.sleep(quiet_s)
                _until_promoted(ns, keys)
                done_s = float(client.stats()["tiers"][tier]["last_promotion_done_s"])
                assert t0 < done_s <= time.monotonic(), "the promotion's end is not this round's"
                promote_s.append(done_s - t0)
                copy_mac.append(base.gbps(tier_threads, files))
            assert tier_stat("promotion_failures_total") == 0
            one_ms = []
            for k in keys[:16]:
                assert client.evict("bench", keys=[k]) == 1
                t0 = time.perf_counter()
                assert ns.lookup([k]) is None, "the promotion did not start"
                _wait(lambda k=k: ns.lookup([k]) == 1, poll_s=0.0001)
                one_ms.append((time.perf_counter() - t0) * 1e3)
            w.close()
            client.close()
            assert d.stop() == 0
    total = nblocks * block_bytes
    promote = [total / t / 1e9 for t in promote_s]
    # each round against the machine's rate just before and just after it
    ratios = [p / ((a + b) / 2) for p, a, b in zip(promote, copy_mac, copy_mac[1:])]
    return {
        "threads": tier_threads,
        "cascade_gbps": total / cascade_s / 1e9,
        "promote_gbps": statistics.median(promote),
        "copy_mac_gbps": statistics.median(copy_mac),
        "same_threads_ratio": statistics.median(ratios),
        "one_block_ms": statistics.median(one_ms),
    }


def _flush(tmp: pathlib.Path) -> None:
    """Write back the disk tier's block files (the kernel would, during the rounds)."""
    for path in tmp.glob("disk/*/*/*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _until_promoted(ns: kvoffload.Namespace, keys: list[bytes]) -> None:
    """Until every key is ready: the last key (its job is queued last) polled every
    ``POLL_S``, then all of them. A lookup of all 128 keys costs the daemon's loop a
    few hundred microseconds; every few ms, it took a tenth of a CPU from the
    promotion it timed (on 2 vCPUs, its threads wait for a CPU as it is)."""
    last = keys[-1:]
    while True:
        _wait(lambda: ns.lookup(last) == 1, poll_s=POLL_S)
        if ns.lookup(keys) == len(keys):
            return
        time.sleep(POLL_S)


def mac_rates(block_bytes: int, total_bytes: int, repeats: int = 5) -> tuple[float, float]:
    """(MAC GB/s, copy + MAC GB/s) of one thread over ``total_bytes`` of blocks, best of
    ``repeats``: what verification costs a tier thread per byte."""
    mac = BlockMac(bytes(32))
    ns = TierNamespace.of("bench", "f" * 32, block_bytes)
    src = np.ones(total_bytes, np.uint8)
    dst = region_like(total_bytes, 0)
    view = memoryview(dst.data)
    best_mac = best_both = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for at in range(0, total_bytes, block_bytes):
            mac.tag(ns, b"k", view[at : at + block_bytes])
        best_mac = min(best_mac, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for at in range(0, total_bytes, block_bytes):
            part = view[at : at + block_bytes]
            mac.copy_and_hash(ns, b"k", part, dst.ctypes.data + at, src.ctypes.data + at)
        best_both = min(best_both, time.perf_counter() - t0)
    return total_bytes / best_mac / 1e9, total_bytes / best_both / 1e9


def run_tiers(quick: bool, tier_threads: Sequence[int] = TIER_THREADS) -> dict[str, Any]:
    block = 2 * MIB
    n = 32 if quick else 128
    out: dict[str, Any] = {
        "tier_block_bytes": block,
        "tier_blocks": n,
        "tier_threads": list(tier_threads),
    }
    out["mac_gbps"], out["copy_mac_gbps"] = mac_rates(block, n * block)
    base = CopyMac(block, n)
    disk = '[[tiers]]\ntype = "disk"\npath = "@TMP@/disk"\ncapacity = "2GiB"\n'
    out["disk"] = [tier_rates(disk, "disk", block, n, t, base) for t in tier_threads]
    if why := RedisServer.available():
        out["redis_skipped"] = why
    else:
        with RedisServer() as server:
            # a prefix per daemon: each writes its blocks anew
            redis = f'[[tiers]]\ntype = "redis"\nurl = "{server.url}"\nprefix = "t@T@"\n'
            out["redis"] = [tier_rates(redis, "redis", block, n, t, base) for t in tier_threads]
    if why := MooncakeMaster.available():
        out["mooncake_skipped"] = why
    else:
        with MooncakeMaster() as m:
            mooncake = (
                f'[[tiers]]\ntype = "mooncake"\nmaster = "{m.master}"\n'
                f'metadata_server = "{m.metadata_url}"\nadmin_url = "{m.admin_url}"\n'
                f'segment_size = "{2 * n * block >> 20}MiB"\nprefix = "t@T@"\n'
            )
            # A master's first clients run slower (its allocator warms up): one warm-up
            # daemon first, as a long-running master in a deployment has served many.
            warm = mooncake.replace('"t@T@"', '"warm"')
            tier_rates(warm, "mooncake", block, 8, 1, CopyMac(block, 8))
            out["mooncake"] = [
                tier_rates(mooncake, "mooncake", block, n, t, base) for t in tier_threads
            ]
    for kind in MEMCPY_TARGETS:  # the flat figures of the most threads, for the report
        if kind in out:
            top = out[kind][-1]
            for field in ("cascade_gbps", "promote_gbps", "one_block_ms"):
                out[f"{kind}_{field}"] = top[field]
    return out


def promotion_targets(r: dict[str, Any], free_cores: int) -> dict[str, Any]:
    """Each measured tier's promotion against its targets, per thread count: its
    fraction of the machine's copy+MAC on as many threads (>= ``SAME_THREADS_TARGET``;
    none for Redis, whose server copies on the same cores) and of memcpy. The memcpy
    target of disk and Mooncake is judged only on runs of at least 4 threads that the
    machine has free cores for (``memcpy_checked`` False where there are none: a
    2-vCPU machine), Redis's on every run; met when the best judged run reaches it."""
    base = r["memcpy_gbps"]
    out: dict[str, Any] = {}
    for kind, memcpy_target in MEMCPY_TARGETS.items():
        if kind not in r:
            continue
        runs = [
            {
                "threads": x["threads"],
                "of_memcpy": round(x["promote_gbps"] / base, 3),
                "of_copy_mac": round(x["same_threads_ratio"], 3),
            }
            for x in r[kind]
        ]
        judged = [
            x["of_memcpy"] for x in runs if kind == "redis" or 4 <= x["threads"] <= free_cores
        ]
        same_target = None if kind == "redis" else SAME_THREADS_TARGET
        out[kind] = {
            "runs": runs,
            "memcpy_target": memcpy_target,
            "memcpy_checked": bool(judged),
            "memcpy_met": bool(judged) and max(judged) >= memcpy_target,
            "same_threads_target": same_target,
            "same_threads_met": same_target is None
            or all(x["of_copy_mac"] >= same_target for x in runs),
        }
    return out


def tier_rows(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    base = r["memcpy_gbps"]
    rows = []
    if "mac_gbps" in r:
        mac, both = r["mac_gbps"], r["copy_mac_gbps"]
        rows += [
            (
                "tier block MAC (keyed BLAKE3), 2 MiB, 1 thread",
                f"{mac:.2f} GB/s",
                f"{1e3 / mac:.0f} ms of CPU per GB verified; memcpy {1e3 / base:.0f} ms",
            ),
            (
                f"copy + MAC in {PIECE_BYTES >> 10} KiB pieces, 1 thread",
                f"{both:.2f} GB/s",
                f"{both / base:.2f} of memcpy (a promotion's work per byte)",
            ),
        ]
    for kind, memcpy_target in MEMCPY_TARGETS.items():
        if kind not in r:
            rows.append((f"{kind} tier", "not measured", r.get(f"{kind}_skipped", "")))
            continue
        runs = r[kind]
        cascade = runs[-1]["cascade_gbps"]
        rows.append(
            (
                f"{kind} tier cascade (region -> tier)",
                f"{cascade:.2f} GB/s",
                f"{cascade / base:.2f} of memcpy",
            )
        )
        for x in runs:
            t, v, own = x["threads"], x["promote_gbps"], x["copy_mac_gbps"]
            threads = f"{t} thread{'s' if t > 1 else ''}"
            same = f"{x['same_threads_ratio']:.2f} of copy+MAC on {threads} ({own:.2f} GB/s)"
            if kind == "redis":  # the server's own copies run on the same cores
                same += f"; {v / base:.2f} of memcpy (target >= {memcpy_target})"
            else:
                same += (
                    f" (target >= {SAME_THREADS_TARGET}); {v / base:.2f} of memcpy "
                    f"(target >= {memcpy_target} with >= 4 free cores)"
                )
            label = f"{kind} tier promotion, tier_threads = {t}"
            rows.append((label, f"{v:.2f} GB/s", same))
        ms = runs[-1]["one_block_ms"]
        rows.append((f"{kind} tier, one block's promotion", f"{ms:.2f} ms", "lookup to hit"))
    return rows
