"""What a shared tier holds cannot stall or trick the daemon: a flood of Redis index
members, a view at its cap, and a disk tier's directory that others could write to or
that holds planted links (some planted by another uid, as_uid)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import select
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
from canary import Canary
from helpers import poll
from hostile import NOBODY, as_uid, requires_root, rss_bytes
from test_tier_stores import MAC, NS, block, run, wait_for
from tiered import LAYOUT, Engine, disk_toml, keys, redis_toml, tier_daemon

from kvoffloadbench.redis_server import RedisServer
from kvoffloadd.tiers import disk
from kvoffloadd.tiers.base import TierError, TierNamespace, WakeFd
from kvoffloadd.tiers.disk import DiskTier
from kvoffloadd.tiers.redis_tier import RedisTier
from kvoffloadd.tiers.remote import VIEW_ENTRIES_PER_TURN

MIB = 1 << 20
FLOOD = 400_000


@pytest.fixture
def wake() -> Iterator[WakeFd]:
    w = WakeFd()
    yield w
    w.close()


def flood_index(url: str, tid: str, n: int, score: float) -> None:
    """``n`` index members of namespace ``tid`` (no blocks behind them) at ``score``."""
    import redis

    r = redis.Redis.from_url(url)
    try:
        for a in range(0, n, 20_000):
            batch = {f"{tid}:4096:".encode() + b"%016d" % i: score for i in range(a, a + 20_000)}
            r.zadd("kvoffload:idx", batch)
    finally:
        r.close()


def test_a_flood_of_far_future_index_members_neither_stalls_nor_grows_the_daemon(
    tmp_path: pathlib.Path, redis_server: RedisServer
) -> None:
    """Scenario: another user of the Redis adds 400,000 members of the victim's
    namespace to the shared index, scored far in the future. Each refresh used to read
    them all again from the last score seen (which the writer chose) into an unbounded
    view: the loop stalled 0.87 s at a time and grew by 287 MiB. Now scores past the
    server's clock are not believed, a refresh reads one page, and the view is capped:
    the canary never stalls, memory stays, real blocks still round-trip."""
    with tier_daemon(tmp_path, redis_toml(redis_server.url)) as d:
        e = Engine(d)
        e.wait_healthy("redis")
        tid = TierNamespace.of("llama", LAYOUT.fingerprint(), 4096).tier_id
        canary = Canary(d.socket_path, d.pid)
        time.sleep(0.5)
        rss0 = rss_bytes(d.pid)
        flood_index(redis_server.url, tid, FLOOD, 1e15)
        end = time.monotonic() + 4.0  # refreshes every 50 ms, full reads every second
        peak = rss0
        while time.monotonic() < end:
            peak = max(peak, rss_bytes(d.pid))
            time.sleep(0.05)
        canary.stop()
        print(
            f"\nindex flood: RSS {rss0 / MIB:.0f} -> peak {peak / MIB:.0f} MiB, {canary.line()}, "
            f"view {e.tier('redis')['blocks']} blocks"
        )
        canary.check("index flood")
        assert peak - rss0 < 64 * MIB, f"the daemon grew by {(peak - rss0) / MIB:.0f} MiB"
        assert e.tier("redis")["blocks"] == 0 and e.tier("redis")["healthy"]
        a = keys(b"a", 4)
        data = e.store(a, seed=1)
        poll(lambda: e.tier("redis")["stores_total"] == 4, "the cascade")
        assert e.client.evict("llama") == 4
        poll(lambda: e.ns.lookup(a) == 4, "the promotion")
        assert e.load(a) == data
        e.close()
        assert d.stop() == 0


def test_the_shared_view_is_capped_and_applied_in_slices(
    redis_server: RedisServer, wake: WakeFd
) -> None:
    """Scenario: 30,000 members of a namespace with good scores and no blocks. The view
    takes at most max_view_blocks of them, the oldest leaving first, and one call of
    get_finished (one loop turn) applies at most VIEW_ENTRIES_PER_TURN entries."""
    tier = RedisTier(
        "redis", redis_server.url, 0, wake, mac=MAC, refresh_s=0.02, max_view_blocks=5000
    )
    tier.open_namespace(NS)
    try:
        now_ms = float(int(time.time() * 1000))
        flood_index(redis_server.url, NS.tier_id, 30_000, now_ms)
        deadline = time.monotonic() + 20
        most = 0  # entries that entered the view in one get_finished (one loop turn)

        def admitted() -> int:
            st = tier.statistics()
            return int(st["blocks"] + st["view_evicted_total"])

        while tier.statistics()["view_evicted_total"] < 25_000:
            assert time.monotonic() < deadline, "the view never took the flood"
            select.select([wake.fd], [], [], 0.05)
            wake.clear()
            before = admitted()
            tier.get_finished()
            most = max(most, admitted() - before)
            assert tier.statistics()["blocks"] <= 5000
        assert tier.statistics()["blocks"] == 5000
        assert 0 < most <= VIEW_ENTRIES_PER_TURN
        assert run(tier, wake, True, keys(b"r", 1), [block(1)]).ok == [True]  # still works
        assert tier.lookup(NS, keys(b"r", 1)) == [True]
    finally:
        tier.close()


# ------------------------------------------------------------------ disk directory


def test_a_tier_directory_others_can_write_to_is_refused_naming_it(
    tmp_path: pathlib.Path,
    wake: WakeFd,
    capfd: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    """Scenario: the tier's path is a root-owned 1777 directory (sticky, like /tmp),
    where another uid has planted a block; or the tier sits in one. Before, the sticky
    bit exempted both and the planted block was served. Now the start is refused,
    naming the directory, and the planted file is left alone."""
    requires_root()
    base = pathlib.Path(tempfile.mkdtemp(prefix="kvoffload-shared-"))
    os.chmod(base, 0o755)  # the other uid must reach it (pytest's directories are 0700)
    request.addfinalizer(lambda: shutil.rmtree(base))
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)

    def plant() -> None:
        d = shared / NS.tier_id / "6b"
        d.mkdir(parents=True)
        (d / "6b.kvb").write_bytes(b"a block from another uid")

    as_uid(plant, NOBODY)
    with pytest.raises(TierError, match=f"{shared} is writable by others"):
        DiskTier("disk", str(shared), 1 << 20, wake, mac=MAC)
    with pytest.raises(TierError, match=f"{shared}, above .* is writable by others"):
        DiskTier("disk", str(shared / "blocks"), 1 << 20, wake, mac=MAC)
    assert not (shared / "blocks").exists() or not os.listdir(shared / "blocks")
    d = tier_daemon(tmp_path, disk_toml(shared))
    with pytest.raises(RuntimeError, match="did not start"):
        d.start()
    assert f"{shared} is writable by others" in capfd.readouterr().err
    assert (shared / NS.tier_id / "6b" / "6b.kvb").read_bytes() == b"a block from another uid"


def test_links_planted_under_the_tier_are_never_followed(tmp_path: pathlib.Path) -> None:
    """Scenario: under a tier directory, links planted where the daemon writes its
    namespace label (to a root-owned file), where it keeps a namespace (to a directory
    outside, holding a *.tmp file), and where it keeps blocks of one key prefix. Before,
    the label write clobbered the file, the start-up scan deleted the *.tmp outside, and
    stores went through the link. Now nothing outside the tier changes."""
    path = tmp_path / "disk"
    path.mkdir(mode=0o700)
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "root-owned.conf"
    victim.write_text("keep me\n")
    (outside / "ab").mkdir()
    (outside / "ab" / "x.tmp").write_text("not the tier's")
    (outside / "y.tmp").write_text("not the tier's")
    tid = TierNamespace.of("llama", LAYOUT.fingerprint(), 4096).tier_id
    (path / tid).mkdir(mode=0o700)
    (path / tid / "NAMESPACE").symlink_to(victim)
    (path / tid / "61").symlink_to(outside)  # keys starting with b"a"
    (path / ("f" * 32)).symlink_to(outside)  # a namespace directory that is a link
    before = sorted(p.name for p in outside.rglob("*"))
    with tier_daemon(tmp_path, disk_toml(path)) as d:
        e = Engine(d)
        poll(lambda: e.tier("disk")["scanned"], "the scan")
        e.store(keys(b"a", 2), seed=3)  # its directory is a link: these fail
        data = e.store(keys(b"b", 2), seed=4)
        poll(lambda: e.tier("disk")["stores_total"] >= 2, "the other cascades")
        poll(lambda: e.tier("disk")["store_failures_total"] == 2, "the linked ones to fail")
        assert e.client.evict("llama") >= 2
        poll(lambda: e.ns.lookup(keys(b"b", 2)) == 2, "the good blocks to promote")
        assert e.load(keys(b"b", 2)) == data
        e.close()
        assert d.stop() == 0
    assert victim.read_text() == "keep me\n"
    assert sorted(p.name for p in outside.rglob("*")) == before
    label = path / tid / "NAMESPACE"
    assert not label.is_symlink() and "llama" in label.read_text()


class HostileRedis:
    """A unix socket that answers the tier's script loads, then every other command
    with a status line that never ends."""

    def __init__(self, path: pathlib.Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.stop = threading.Event()
        self.commands: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the tier closed it
            data = conn.recv(1 << 20)
            self.commands.append(data[:64])
            if b"SCRIPT" in data:
                conn.sendall(b"+OK\r\n" * data.count(b"SCRIPT"))
                self.commands.append(conn.recv(1 << 20)[:64])
            conn.sendall(b"+")
            while not self.stop.is_set():
                conn.sendall(b"x" * 65536)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def test_a_server_that_answers_a_store_without_end_fails_it_within_bounds(
    tmp_path: pathlib.Path, wake: WakeFd
) -> None:
    """Scenario: whoever runs the Redis server (or took its address) answers a store
    with a reply line that never ends. The store fails, the tier goes unhealthy, its
    threads are free again and the daemon holds no more than a line's bound."""
    server = HostileRedis(tmp_path / "r.sock")
    tier = RedisTier(
        "redis", f"unix://{tmp_path}/r.sock", 0, wake, mac=MAC, timeout_s=0.5, connections=1
    )
    tier.open_namespace(NS)
    rss_before = rss_bytes(os.getpid())
    try:
        for attempt in range(3):  # run() has a 10 s deadline for each
            ks = keys(b"s%d" % attempt, 4)
            assert run(tier, wake, True, ks, [block(i) for i in range(4)]).ok == [False] * 4
        assert any(c.startswith(b"*2\r\n$3\r\nDEL") for c in server.commands)  # stores sent
        assert not tier.statistics()["healthy"]
        assert rss_bytes(os.getpid()) - rss_before < 64 * MIB
    finally:
        server.close()
        tier.close()


def test_a_scan_takes_at_most_its_bound_of_files_even_from_one_subdirectory(
    tmp_path: pathlib.Path,
    wake: WakeFd,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Twelve block files in one fan-out subdirectory, a scan bound of five: a
    restarted tier lists five (the bound holds within a subdirectory, not only
    between them) and says the rest are not used."""
    ks = keys(b"c", 12)
    assert len({k.hex()[:2] for k in ks}) == 1  # one subdirectory
    tier = DiskTier("disk", str(tmp_path), 1 << 20, wake, mac=MAC)
    try:
        assert run(tier, wake, True, ks, [block(i) for i in range(12)]).ok == [True] * 12
    finally:
        tier.close()
    monkeypatch.setattr(disk, "MAX_SCAN_FILES", 5)
    again = DiskTier("disk", str(tmp_path), 1 << 20, wake, mac=MAC)
    try:
        wait_for(again, wake, lambda: again.scanned)
        assert sum(again.lookup(NS, ks)) == 5
        assert "took the first 5 files" in caplog.text
    finally:
        again.close()
