"""Secondary tiers with the real daemon: a disk directory and a real redis-server.

Each namespace here may hold 4 blocks of the region (a quota), so storing 4 more
evicts the first 4; those must come back from a tier, byte-identical.
"""

from __future__ import annotations

import os
import pathlib
import time

import pytest
import torch
from helpers import ctl, poll
from tiered import (
    Engine,
    disk_toml,
    evict_by_storing_more,
    keys,
    redis_toml,
    scrape,
    shared_by_two,
    tier_daemon,
)

import kvoffload
from kvoffloadbench.redis_server import RedisServer, restart_on_same_port
from kvoffloadbench.server_process import free_port


def test_disk_tier_promotes_evicted_blocks_byte_identical(tmp_path: pathlib.Path) -> None:
    port = free_port()
    with tier_daemon(tmp_path, disk_toml(tmp_path / "disk"), "d", "--metrics-port", str(port)) as d:
        e = Engine(d)
        a = keys(b"a", 4)
        data = e.store(a, seed=1)
        evict_by_storing_more(e, "disk")
        assert e.client.stats()["namespaces"]["llama"]["stored_blocks"] == 4
        assert e.tier("disk")["last_promotion_done_s"] == 0  # none yet
        started_s = time.monotonic()  # the daemon's clock too
        assert e.ns.lookup(a) is None  # found on disk: promotion started, ask again
        poll(lambda: e.ns.lookup(a) == 4, "the promotion")
        assert started_s < e.tier("disk")["last_promotion_done_s"] <= time.monotonic()
        assert e.load(a) == data
        st = e.tier("disk")
        assert st["promoted_blocks_total"] == 4 and st["found_keys_total"] == 4
        assert st["blocks"] == 8 and st["loads_total"] == 4 and st["healthy"]
        assert st["cascade_backlog_blocks"] == 0 and st["promotion_failures_total"] == 0
        out = ctl(d.socket_path, "stats")
        assert (
            out.returncode == 0 and "# tier disk" in out.stdout and "promoted_blocks" in out.stdout
        )
        series = 'kvoffload_tier_promoted_blocks_total{kind="disk",tier="disk"} 4.0'
        poll(lambda: series in scrape(port), "the tier metrics")
        assert 'kvoffload_tier_healthy{kind="disk",tier="disk"} 1.0' in scrape(port)
        e.close()
        assert d.stop() == 0


def test_disk_tier_survives_a_restart_and_drops_partial_files(tmp_path: pathlib.Path) -> None:
    disk = tmp_path / "disk"
    with tier_daemon(tmp_path, disk_toml(disk), "first") as d:
        e = Engine(d)
        a = keys(b"a", 4)
        data = e.store(a, seed=2)
        poll(lambda: e.tier("disk")["stores_total"] == 4, "the cascade")
        e.close()
        assert d.stop() == 0
    files = sorted(disk.rglob("*.kvb"))
    assert len(files) == 4
    partial = files[0].parent / (files[0].name + ".123-4.tmp")  # a crash mid-write
    partial.write_bytes(b"half a block")
    bad_key = keys(b"z", 1)
    bad = files[0].parent.parent / bad_key[0].hex()[:2] / (bad_key[0].hex() + ".kvb")
    bad.parent.mkdir(exist_ok=True)
    bad.write_bytes(files[0].read_bytes()[:100])  # torn: header of another key, no block
    with tier_daemon(tmp_path, disk_toml(disk), "second") as d:  # a new region: empty
        e = Engine(d)
        poll(lambda: e.ns.lookup(a) == 4, "the blocks from before the restart")
        assert e.load(a) == data
        assert not partial.exists()
        assert e.ns.lookup(bad_key) is None  # listed, so promoted; the read rejects it
        poll(lambda: e.ns.lookup(bad_key) == 0, "the torn file to miss")
        assert e.tier("disk")["promotion_failures_total"] == 1
        poll(lambda: not bad.exists(), "the torn file to be deleted")
        e.close()
        assert d.stop() == 0


def test_two_daemons_share_blocks_through_one_redis(
    tmp_path: pathlib.Path, redis_server: RedisServer
) -> None:
    toml = redis_toml(redis_server.url)
    with tier_daemon(tmp_path, toml, "a") as da, tier_daemon(tmp_path, toml, "b") as db:
        ea, eb, a, _ = shared_by_two(da, db, "redis", seed=3)
        assert eb.tier("redis")["stores_total"] == 0  # Redis had them: not written again
        other = Engine(db, "mistral")  # same layout, another model: shares nothing
        assert other.ns.probe(a) == [kvoffload.KEY_ABSENT]
        for e in (ea, eb, other):
            e.close()
        assert da.stop() == 0 and db.stop() == 0


def test_a_killed_redis_degrades_to_misses(
    tmp_path: pathlib.Path, redis_server: RedisServer
) -> None:
    with tier_daemon(tmp_path, redis_toml(redis_server.url)) as d:
        e = Engine(d)
        a = keys(b"a", 4)
        e.store(a, seed=4)
        poll(lambda: e.tier("redis")["stores_total"] == 4, "the cascade")
        assert e.client.evict("llama") == 4
        redis_server.kill()
        # at most one failed promotion, then misses, never "ask again" forever
        poll(lambda: e.ns.lookup(a) == 0, "lookups to miss", deadline_s=10)
        b = keys(b"b", 4)
        data = e.store(b, seed=5)  # the region works as before
        assert e.ns.lookup(b) == 4 and e.load(b) == data
        # failed, or skipped once the tier is known to be down
        poll(
            lambda: (
                (st := e.tier("redis"))["store_failures_total"] + st["cascade_dropped_total"] >= 4
            ),
            "the cascade to fail",
        )
        assert not e.tier("redis")["healthy"] and d.alive()
        server = restart_on_same_port(redis_server)  # back, empty
        try:
            poll(lambda: e.tier("redis")["healthy"], "the tier to recover", deadline_s=10)
            c = keys(b"c", 4)
            e.store(c, seed=6)
            poll(lambda: e.tier("redis")["stores_total"] == 8, "cascades to resume")
        finally:
            server.stop()
        e.close()
        assert d.stop() == 0


def test_an_unwritable_disk_tier_stops_the_start_with_a_clear_error(
    tmp_path: pathlib.Path,
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    d = tier_daemon(tmp_path, disk_toml(blocker / "sub"))
    with pytest.raises(RuntimeError, match="did not start"):
        d.start()
    assert os.path.exists(blocker)


def e_scanned(c: kvoffload.Client) -> bool:
    return bool(c.stats()["tiers"]["disk"]["scanned"])


def test_a_stop_during_cascades_is_clean(tmp_path: pathlib.Path) -> None:
    """SIGTERM while tier jobs are in flight: exit 0, region and socket gone, and the
    files a new daemon finds are whole (any it cannot read are dropped, never served)."""
    disk = tmp_path / "disk"
    with tier_daemon(tmp_path, disk_toml(disk, "64MiB"), "busy") as d:
        c = kvoffload.connect(d.socket_path)
        ns = c.namespace("big", kvoffload.KVLayout(tensor_page_bytes=[256 * 1024]))
        cache = kvoffload.shared_kv_cache(32, 256 * 1024)
        cache.random_(-128, 127)
        w = ns.attach_worker([cache])
        ks = keys(b"s", 32)
        plan = ns.prepare_store(ks)
        assert plan is not None
        assert w.submit_store(1, list(range(32)), plan.slots)
        w.wait([1])
        ns.complete_store(ks)  # 32 cascades of 256 KiB start now
        assert d.stop() == 0  # while they run
        w.close()
        c.close()
    assert not os.path.exists(f"/dev/shm{d.region_name}")
    assert not os.path.exists(d.socket_path)
    with tier_daemon(tmp_path, disk_toml(disk, "64MiB"), "after") as d2:
        c = kvoffload.connect(d2.socket_path)
        ns = c.namespace("big", kvoffload.KVLayout(tensor_page_bytes=[256 * 1024]))
        dst = kvoffload.shared_kv_cache(32, 256 * 1024)
        w = ns.attach_worker([dst])
        poll(lambda: e_scanned(c), "the disk scan")
        poll(lambda: ns.lookup(ks) is not None, "the promotions to finish")
        hits = ns.lookup(ks) or 0
        if hits:
            slots = ns.prepare_load(ks[:hits]).slots
            assert w.submit_load(2, slots, list(range(hits)))
            w.wait([2])
            assert all(r.success for r in w.get_finished())
            assert torch.equal(dst[:hits], cache[:hits])  # whatever survived is exact
            ns.complete_load(ks[:hits])
        w.close()
        c.close()
        assert d2.stop() == 0
