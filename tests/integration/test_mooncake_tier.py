"""The Mooncake Store tier with real daemons and a real mooncake_master on loopback.

Each daemon mounts its own segment into the store; blocks move between the store and
region slots through Mooncake's transfer engine (TCP here).
"""

from __future__ import annotations

import pathlib
import signal
import socket
import tempfile
from collections.abc import Iterator

import pytest
from helpers import poll
from tiered import Engine, evict_by_storing_more, keys, mooncake_toml, shared_by_two, tier_daemon

import kvoffload
from kvoffloadbench.mooncake_master import MooncakeMaster
from kvoffloadbench.server_process import free_ports

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def mooncake_ready() -> None:
    why = MooncakeMaster.available()
    if why:
        pytest.skip(why)


@pytest.fixture
def master(mooncake_ready: None) -> Iterator[MooncakeMaster]:
    m = MooncakeMaster().start()
    yield m
    m.stop()


def test_a_master_that_cannot_bind_its_ports_says_why_and_leaves_nothing(
    mooncake_ready: None,
) -> None:
    """A master whose admin port is taken exits at start: the error names the cause
    from the master's own log, and its temporary directory goes with it."""
    dirs = pathlib.Path(tempfile.gettempdir())
    before = set(dirs.glob("kvoffload-mooncake-*"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        m = MooncakeMaster(ports=(*free_ports(2), taken.getsockname()[1]))
        try:
            with pytest.raises(RuntimeError, match=r"exited with .*Address already in use"):
                m.start()
            assert m.proc is not None and m.proc.poll() is not None
            assert set(dirs.glob("kvoffload-mooncake-*")) == before  # its directory went
        finally:
            m.stop()


def ours(m: MooncakeMaster) -> list[str]:
    return [k for k in m.objects() if k.startswith("kvoffload/")]


def test_store_evict_promote_is_byte_identical(
    tmp_path: pathlib.Path, master: MooncakeMaster
) -> None:
    with tier_daemon(tmp_path, mooncake_toml(master)) as d:
        e = Engine(d)
        e.wait_healthy("mooncake")
        a = keys(b"a", 4)
        data = e.store(a, seed=1)
        evict_by_storing_more(e, "mooncake")
        assert len(ours(master)) == 8  # one object per block, in the store
        assert e.client.stats()["namespaces"]["llama"]["stored_blocks"] == 4
        assert e.ns.lookup(a) is None  # in the store: promotion started, ask again
        poll(lambda: e.ns.lookup(a) == 4, "the promotion")
        assert e.load(a) == data
        st = e.tier("mooncake")
        assert st["promoted_blocks_total"] == 4 and st["loads_total"] == 4
        assert st["own_segment_reads_total"] == 4  # its one segment: copied by its threads
        assert st["stores_total"] == 8 and st["promotion_failures_total"] == 0
        assert st["kind"] == "mooncake" and st["master"] == master.master
        e.close()
        assert d.stop() == 0


@pytest.mark.parametrize("admin", [True, False], ids=["admin-listing", "existence-checks"])
def test_two_daemons_share_blocks_through_one_master(
    tmp_path: pathlib.Path, master: MooncakeMaster, admin: bool
) -> None:
    toml = mooncake_toml(master, admin)
    with tier_daemon(tmp_path, toml, "a") as da, tier_daemon(tmp_path, toml, "b") as db:
        # b learns of a's blocks from the master, promotes them over the transfer engine
        ea, eb, a, _ = shared_by_two(da, db, "mooncake", seed=3)
        assert eb.tier("mooncake")["stores_total"] == 0  # the store had them: not written
        other = Engine(db, "mistral")  # same layout, another model: shares nothing
        assert other.ns.probe(a) == [kvoffload.KEY_ABSENT]
        assert len(ours(master)) == 4
        for e in (ea, eb, other):
            e.close()
        assert da.stop() == 0 and db.stop() == 0


def test_blocks_in_another_daemons_segment_come_through_the_transfer_engine(
    tmp_path: pathlib.Path, master: MooncakeMaster
) -> None:
    """a lends no memory, so its blocks lie in b's segment: b copies them itself, a
    reads them back over Mooncake's transfer engine; both byte-identical."""
    lender = mooncake_toml(master, segment="32MiB")
    with (
        tier_daemon(tmp_path, mooncake_toml(master, segment="0"), "a") as da,
        tier_daemon(tmp_path, lender, "b") as db,
    ):
        ea, eb, a, data = shared_by_two(da, db, "mooncake", seed=5)
        assert eb.tier("mooncake")["own_segment_reads_total"] == 4
        evict_by_storing_more(ea, "mooncake")
        assert ea.ns.lookup(a) is None
        poll(lambda: ea.ns.lookup(a) == 4, "a to promote them back")
        assert ea.load(a) == data
        st = ea.tier("mooncake")
        assert st["own_segment_reads_total"] == 0 and st["promotion_failures_total"] == 0
        for e in (ea, eb):
            e.close()
        assert da.stop() == 0 and db.stop() == 0


def test_a_block_removed_behind_the_daemons_back_costs_one_miss(
    tmp_path: pathlib.Path, master: MooncakeMaster
) -> None:
    """Mooncake evicts on its own; the view follows. Without the listing, the gone
    block fails one promotion and then misses; with it, the view drops it first."""
    with tier_daemon(tmp_path, mooncake_toml(master, admin=False, full_sync_s=30.0)) as d:
        e = Engine(d)
        e.wait_healthy("mooncake")
        a = keys(b"a", 4)
        data = e.store(a, seed=4)
        evict_by_storing_more(e, "mooncake")
        from mooncake.store import MooncakeDistributedStore

        gone = next(k for k in ours(master) if k.endswith(a[0].hex()))
        admin = MooncakeDistributedStore()
        rc = admin.setup("127.0.0.1", master.metadata_url, 0, 16 << 20, "tcp", "", master.master)
        assert rc == 0
        poll(lambda: admin.remove(gone) == 0, "the object's lease to end", deadline_s=10)
        admin.close()
        assert e.ns.lookup(a) is None  # the view still lists it: a promotion starts
        poll(lambda: e.ns.lookup(a) == 0, "the gone block to miss")
        assert e.tier("mooncake")["promotion_failures_total"] == 1
        assert e.ns.lookup(a) == 0  # and it stays a miss: no endless retries
        poll(lambda: e.ns.lookup(a[1:]) == 3, "the others, promoted in the same job")
        assert e.load(a[1:]) == data[4096:]
        e.close()
        assert d.stop() == 0


def test_a_killed_master_degrades_to_misses_and_recovers(
    tmp_path: pathlib.Path, master: MooncakeMaster
) -> None:
    with tier_daemon(tmp_path, mooncake_toml(master), top="tier_job_timeout_s = 5.0\n") as d:
        e = Engine(d)
        e.wait_healthy("mooncake")
        a = keys(b"a", 4)
        e.store(a, seed=5)
        big = e.client.namespace("big", kvoffload.KVLayout(tensor_page_bytes=[1 << 20]))
        cache = kvoffload.shared_kv_cache(16, 1 << 20)
        cache.random_(-128, 127)
        w = big.attach_worker([cache])
        bk = keys(b"B", 16)
        plan = big.prepare_store(bk)
        assert plan is not None and w.submit_store(1, list(range(16)), plan.slots)
        w.wait([1])
        assert master.proc is not None
        master.proc.send_signal(signal.SIGSTOP)  # the master hangs...
        big.complete_store(bk)  # ...while 16 MiB of cascades start...
        poll(lambda: e.tier("mooncake")["cascade_inflight_blocks"] > 0, "cascades in flight")
        master.kill()  # ...and dies under them
        assert e.client.evict("llama") == 4
        poll(lambda: not e.tier("mooncake")["healthy"], "the tier to notice", deadline_s=15)
        poll(lambda: e.ns.lookup(a) == 0, "lookups to miss", deadline_s=15)
        b = keys(b"b", 4)
        data = e.store(b, seed=6)  # the region works as before
        assert e.ns.lookup(b) == 4 and e.load(b) == data
        assert d.alive()
        fresh = master.restarted()  # back, empty: every block is gone with its metadata
        try:
            poll(lambda: e.tier("mooncake")["healthy"], "the tier to recover", deadline_s=30)
            # gone from the store: a miss (after a promotion still failing, at most)
            poll(lambda: e.ns.lookup(a) == 0, "the lost blocks to miss")
            assert e.ns.lookup(a) == 0 and e.ns.lookup(a) == 0  # and no more retries
            c = keys(b"c", 4)
            # b's blocks fill the namespace's quota, and a block on its way to the tier
            # is not evicted: c's store makes room once b's cascades are through (a
            # cascade the outage failed may start again once the tier is back)

            def room_for(ks: list[bytes]) -> bool:
                plan = e.ns.prepare_store(ks)
                if plan is None:
                    return False
                e.ns.complete_store(plan.keys_to_store, success=False)
                return plan.keys_to_store == ks

            poll(lambda: room_for(c), "room for c once b's cascades are through")
            before = e.tier("mooncake")["stores_total"]
            e.store(c, seed=7)
            poll(lambda: e.tier("mooncake")["stores_total"] >= before + 4, "cascades to resume")
            poll(lambda: len(ours(fresh)) >= 4, "the new blocks in the new master")
        finally:
            fresh.stop()
        w.close()
        e.close()
        assert d.stop() == 0


def test_a_daemon_starts_before_its_master_and_connects_when_it_comes(
    tmp_path: pathlib.Path, mooncake_ready: None
) -> None:
    """No master yet: the daemon serves from its region, the tier misses (unhealthy)
    and keeps trying; when the master starts, cascades begin."""
    m = MooncakeMaster()  # ports chosen, not started
    with tier_daemon(tmp_path, mooncake_toml(m)) as d:
        e = Engine(d)
        a = keys(b"a", 4)
        data = e.store(a, seed=8)
        assert e.load(a) == data  # the region works without the tier
        assert not e.tier("mooncake")["healthy"] and d.alive()
        m.start()
        try:
            e.wait_healthy("mooncake")
            b = keys(b"b", 4)
            e.store(b, seed=9)
            poll(lambda: e.tier("mooncake")["stores_total"] >= 4, "cascades to start")
        finally:
            m.stop()
        e.close()
        assert d.stop() == 0
