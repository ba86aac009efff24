"""Secondary-tier throughput for ``make bench``: cascade down, promotion back up.

One daemon per tier kind (a disk directory under the temporary directory; a throwaway
redis-server and a throwaway mooncake_master on loopback, when installed). Blocks are
stored into the region, the time until every one has cascaded is the cascade rate;
then the region is emptied by an admin eviction and one lookup starts the promotion
of all of them, and the time until a lookup hits them all is the promotion rate (the
median of ``PROMOTION_ROUNDS`` such rounds: one round on 2 vCPUs shared with the
server varies by 2x from run to run).
Then single blocks are evicted and looked up again: the median time from the lookup
that starts one block's promotion to the lookup that hits it is its latency. The disk
figures are with the files in the page cache (just written), so they show kvoffload's
overhead, not the drive's speed. Each daemon's region is pre-faulted before anything
is measured, as in the rest of ``make bench``. Every block is sealed on its way down
and its keyed MAC verified on its way up (tiers/blockauth.py); ``mac_rates`` gives the
MAC's own cost on one thread: hashing a block, and copying it in pieces each hashed
while in the cache (as the disk and Mooncake tiers promote).
"""

from __future__ import annotations

import pathlib
import tempfile
import time
from typing import Any

import numpy as np

import kvoffload
from kvoffloadd.tiers.base import TierNamespace
from kvoffloadd.tiers.blockauth import BlockMac

from .launch import DaemonProcess, wait_prefault
from .mooncake_master import MooncakeMaster
from .redis_server import RedisServer

MIB = 1 << 20
PROMOTION_ROUNDS = 3  # whole promotions timed per tier; the median is reported


def _wait(predicate: Any, deadline_s: float = 120.0, poll_s: float = 0.0005) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise RuntimeError("tier benchmark timed out")
        time.sleep(poll_s)


def tier_rates(
    tier_toml: str, tier: str, block_bytes: int, nblocks: int
) -> tuple[float, float, float]:
    """(cascade GB/s, promotion GB/s, one block's promotion in ms) through one daemon
    with one tier."""
    with tempfile.TemporaryDirectory(prefix="kvoffload-bench-") as tmp:
        cfg = pathlib.Path(tmp) / "d.toml"
        secret = f'tier_secret_file = "{tmp}/tier-secret"\n'  # blocks sealed, MACs checked
        cfg.write_text(secret + tier_toml.replace("@TMP@", tmp))
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
            _wait(lambda: tier_stat("stores_total") >= nblocks, poll_s=0.002)
            cascade_s = time.perf_counter() - t0
            promote_s = []
            for _ in range(PROMOTION_ROUNDS):
                assert client.evict("bench") == nblocks
                t0 = time.perf_counter()
                assert ns.lookup(keys) is None, "the promotion did not start"
                _wait(lambda: ns.lookup(keys) == nblocks, poll_s=0.002)
                promote_s.append(time.perf_counter() - t0)
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
    median_s = sorted(promote_s)[len(promote_s) // 2]
    return total / cascade_s / 1e9, total / median_s / 1e9, sorted(one_ms)[len(one_ms) // 2]


def mac_rates(block_bytes: int, total_bytes: int, repeats: int = 5) -> tuple[float, float]:
    """(MAC GB/s, copy + MAC GB/s) of one thread over ``total_bytes`` of blocks, best of
    ``repeats``: what verification costs a tier thread per byte."""
    mac = BlockMac(bytes(32))
    ns = TierNamespace.of("bench", "f" * 32, block_bytes)
    src = np.ones(total_bytes, np.uint8)
    dst = np.zeros(total_bytes, np.uint8)
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


def run_tiers(quick: bool) -> dict[str, Any]:
    block = 2 * MIB
    n = 32 if quick else 128
    out: dict[str, Any] = {"tier_block_bytes": block, "tier_blocks": n}
    out["mac_gbps"], out["copy_mac_gbps"] = mac_rates(block, n * block)
    disk = '[[tiers]]\ntype = "disk"\npath = "@TMP@/disk"\ncapacity = "2GiB"\n'
    _record(out, "disk", tier_rates(disk, "disk", block, n))
    if why := RedisServer.available():
        out["redis_skipped"] = why
    else:
        with RedisServer() as server:
            redis = f'[[tiers]]\ntype = "redis"\nurl = "{server.url}"\n'
            _record(out, "redis", tier_rates(redis, "redis", block, n))
    if why := MooncakeMaster.available():
        out["mooncake_skipped"] = why
    else:
        with MooncakeMaster() as m:
            mooncake = (
                f'[[tiers]]\ntype = "mooncake"\nmaster = "{m.master}"\n'
                f'metadata_server = "{m.metadata_url}"\nadmin_url = "{m.admin_url}"\n'
                f'segment_size = "{2 * n * block >> 20}MiB"\n'
            )
            # A master's first clients run slower (its allocator warms up): one warm-up
            # daemon first, as a long-running master in a deployment has served many.
            tier_rates(
                mooncake.replace('"mooncake"', '"mooncake"\nprefix = "warm"', 1),
                "mooncake",
                block,
                8,
            )
            _record(out, "mooncake", tier_rates(mooncake, "mooncake", block, n))
    return out


def _record(out: dict[str, Any], kind: str, rates: tuple[float, float, float]) -> None:
    out[f"{kind}_cascade_gbps"], out[f"{kind}_promote_gbps"], out[f"{kind}_one_block_ms"] = rates


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
                "copy + MAC in 256 KiB pieces, 1 thread",
                f"{both:.2f} GB/s",
                f"{both / base:.2f} of memcpy (a promotion's work per byte)",
            ),
        ]
    for kind in ("disk", "redis", "mooncake"):
        if f"{kind}_promote_gbps" not in r:
            rows.append((f"{kind} tier", "not measured", r.get(f"{kind}_skipped", "")))
            continue
        for what in ("cascade", "promote"):
            v = r[f"{kind}_{what}_gbps"]
            way = "cascade (region -> tier)" if what == "cascade" else "promotion (tier -> region)"
            label = f"{kind} tier {way}"
            target = {"disk": 0.5, "mooncake": 0.5, "redis": 0.1}[kind]
            note = f"{v / base:.2f} of memcpy"
            if what == "promote":
                note += f" (target >= {target}, MACs verified)"
            rows.append((label, f"{v:.2f} GB/s", note))
        if f"{kind}_one_block_ms" in r:
            ms = r[f"{kind}_one_block_ms"]
            rows.append((f"{kind} tier, one block's promotion", f"{ms:.2f} ms", "lookup to hit"))
    return rows
