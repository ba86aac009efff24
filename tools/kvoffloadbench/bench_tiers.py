"""Secondary-tier throughput for ``make bench``: cascade down, promotion back up.

One daemon per tier kind (a disk directory under the temporary directory; a throwaway
redis-server on loopback, when one is installed). Blocks are stored into the region,
the time until every one has cascaded is the cascade rate; then the region is emptied
by an admin eviction and one lookup starts the promotion of all of them, and the time
until a lookup hits them all is the promotion rate. The disk figures are with the
files in the page cache (just written), so they show kvoffload's overhead, not the
drive's speed.
"""

from __future__ import annotations

import pathlib
import tempfile
import time
from typing import Any

import numpy as np

import kvoffload

from .launch import DaemonProcess
from .redis_server import RedisServer

MIB = 1 << 20


def _wait(predicate: Any, deadline_s: float = 120.0, poll_s: float = 0.0005) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise RuntimeError("tier benchmark timed out")
        time.sleep(poll_s)


def tier_rates(tier_toml: str, tier: str, block_bytes: int, nblocks: int) -> tuple[float, float]:
    """(cascade GB/s, promotion GB/s) through one daemon with one tier."""
    with tempfile.TemporaryDirectory(prefix="kvoffload-bench-") as tmp:
        cfg = pathlib.Path(tmp) / "d.toml"
        cfg.write_text(tier_toml.replace("@TMP@", tmp))
        with DaemonProcess("1GiB", "--config", str(cfg), "--log-level", "warning") as d:
            client = kvoffload.connect(d.socket_path)
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
            assert client.evict("bench") == nblocks
            t0 = time.perf_counter()
            assert ns.lookup(keys) is None, "the promotion did not start"
            _wait(lambda: ns.lookup(keys) == nblocks)
            promote_s = time.perf_counter() - t0
            assert tier_stat("promotion_failures_total") == 0
            w.close()
            client.close()
            assert d.stop() == 0
    total = nblocks * block_bytes
    return total / cascade_s / 1e9, total / promote_s / 1e9


def run_tiers(quick: bool) -> dict[str, Any]:
    block = 2 * MIB
    n = 32 if quick else 128
    out: dict[str, Any] = {"tier_block_bytes": block, "tier_blocks": n}
    disk = '[[tiers]]\ntype = "disk"\npath = "@TMP@/disk"\ncapacity = "2GiB"\n'
    out["disk_cascade_gbps"], out["disk_promote_gbps"] = tier_rates(disk, "disk", block, n)
    why = RedisServer.available()
    if why:
        out["redis_skipped"] = why
        return out
    with RedisServer() as server:
        redis = f'[[tiers]]\ntype = "redis"\nurl = "{server.url}"\n'
        out["redis_cascade_gbps"], out["redis_promote_gbps"] = tier_rates(redis, "redis", block, n)
    return out


def tier_rows(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    base = r["memcpy_gbps"]
    rows = []
    for kind in ("disk", "redis"):
        if f"{kind}_promote_gbps" not in r:
            rows.append((f"{kind} tier", "not measured", r.get(f"{kind}_skipped", "")))
            continue
        for what in ("cascade", "promote"):
            v = r[f"{kind}_{what}_gbps"]
            way = "cascade (region -> tier)" if what == "cascade" else "promotion (tier -> region)"
            label = f"{kind} tier {way}"
            rows.append((label, f"{v:.2f} GB/s", f"{v / base:.2f} of memcpy"))
    return rows
