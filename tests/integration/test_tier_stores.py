"""The disk and Redis tiers driven directly, as the loop drives them: capacity and LRU,
blocks found again by a new instance, blocks lost under a tier."""

from __future__ import annotations

import itertools
import os
import pathlib
import random
import select
import shutil
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from hostile import requires_root
from tiered import keys

from kvoffloadbench.redis_server import RedisServer, make_tls_files
from kvoffloadd.copies.crc import crc32
from kvoffloadd.tiers.base import SecondaryTier, TierJob, TierNamespace, TierResult, WakeFd
from kvoffloadd.tiers.blockauth import BlockMac
from kvoffloadd.tiers.disk import DiskTier, file_bytes
from kvoffloadd.tiers.redis_tier import LOAD_WINDOW_BYTES, RedisTier

MAC = BlockMac(bytes(range(32)))  # the tests' tier secret
BLOCK = 4096
NS = TierNamespace.of("llama", "f" * 32, BLOCK)
_ids = itertools.count(1)


def run(
    tier: SecondaryTier,
    wake: WakeFd,
    store: bool,
    ks: list[bytes],
    blocks: list[bytes],
    ns: TierNamespace = NS,
) -> TierResult:
    """Submit one job and wait (deadline) for its result on the loop side."""
    bufs = [memoryview(bytearray(b if store else bytes(ns.block_bytes))) for b in blocks]
    job = TierJob(next(_ids), ns, ks, bufs)
    (tier.submit_store if store else tier.submit_load)(job)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        select.select([wake.fd], [], [], 0.05)
        wake.clear()
        for result in tier.get_finished():
            if result.job_id == job.job_id:
                if not store:
                    blocks[:] = [bytes(b) for b in bufs]
                return result
    raise AssertionError("tier job did not finish")


def wait_for(tier: SecondaryTier, wake: WakeFd, predicate: Callable[[], object]) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "tier view did not settle"
        select.select([wake.fd], [], [], 0.05)
        wake.clear()
        tier.get_finished()


def block(i: int) -> bytes:
    return bytes([i]) * BLOCK


@pytest.fixture
def wake() -> Iterator[WakeFd]:
    w = WakeFd()
    yield w
    w.close()


def test_disk_tier_keeps_its_byte_budget_least_recently_used_first(
    tmp_path: pathlib.Path, wake: WakeFd
) -> None:
    ks = keys(b"d", 4)
    cap = 3 * file_bytes(ks[0], BLOCK)
    tier = DiskTier("disk", str(tmp_path), cap, wake, mac=MAC, threads=2)
    try:
        wait_for(tier, wake, lambda: tier.scanned)
        assert run(tier, wake, True, ks[:3], [block(i) for i in range(3)]).ok == [True] * 3
        out = [b""]
        assert run(tier, wake, False, ks[:1], out).ok == [True] and out == [block(0)]
        assert run(tier, wake, True, ks[3:], [block(3)]).ok == [True]  # over budget
        assert tier.lookup(NS, ks) == [True, False, True, True]  # 1 was least recently used
        assert tier.used_bytes == cap and tier.counters.evicted_blocks_total == 1
        wait_for(tier, wake, lambda: len(list(tmp_path.rglob("*.kvb"))) == 3)
        # written once: storing a held key again writes nothing
        before = os.stat(next(tmp_path.rglob(ks[0].hex() + ".kvb"))).st_mtime_ns
        assert run(tier, wake, True, ks[:1], [block(9)]).ok == [True]
        assert os.stat(next(tmp_path.rglob(ks[0].hex() + ".kvb"))).st_mtime_ns == before
        # a block larger than the whole budget is refused, not half-written
        big = TierNamespace(NS.tier_id, NS.name, NS.fingerprint, 4 * BLOCK)
        assert run(tier, wake, True, keys(b"e", 1), [block(1) * 4], big).ok == [False]
        assert tier.lookup(NS, ks) == [True, False, True, True]
    finally:
        tier.close()
    # a new instance over the same directory finds the blocks, oldest first
    again = DiskTier("disk", str(tmp_path), cap, wake, mac=MAC)
    try:
        wait_for(again, wake, lambda: again.scanned)
        assert again.lookup(NS, ks) == [True, False, True, True]
        out = [b""]
        assert run(again, wake, False, ks[3:], out).ok == [True] and out == [block(3)]
        assert again.used_bytes == cap
    finally:
        again.close()


def test_disk_tier_rejects_a_block_of_another_size(tmp_path: pathlib.Path, wake: WakeFd) -> None:
    tier = DiskTier("disk", str(tmp_path), 1 << 20, wake, mac=MAC)
    try:
        ks = keys(b"s", 1)
        assert run(tier, wake, True, ks, [block(1)]).ok == [True]
        small = TierNamespace(NS.tier_id, NS.name, NS.fingerprint, BLOCK // 2)
        job = TierJob(next(_ids), small, ks, [memoryview(bytearray(BLOCK // 2))])
        tier.submit_load(job)
        wait_for(tier, wake, lambda: not tier.lookup(NS, ks)[0])  # dropped after the check
        assert tier.counters.load_failures_total == 1
    finally:
        tier.close()


def test_a_start_up_scan_does_not_bring_back_a_block_dropped_while_it_ran(
    tmp_path: pathlib.Path, wake: WakeFd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan lists a file, a failed load drops it, then the scan's list is merged:
    the block stays dropped (it came back and was found by every lookup before)."""
    listed = threading.Event()
    monkeypatch.setattr(DiskTier, "_scan", lambda self: listed.wait(10))
    tier = DiskTier("disk", str(tmp_path), 1 << 20, wake, mac=MAC)
    try:
        ks = keys(b"s", 1)
        assert run(tier, wake, True, ks, [block(1)]).ok == [True]
        small = TierNamespace(NS.tier_id, NS.name, NS.fingerprint, BLOCK // 2)
        assert run(tier, wake, False, ks, [b""], small).ok == [False]
        assert not tier.lookup(NS, ks)[0] and not tier.scanned
        tier._merge_scan([((NS.tier_id, ks[0]), file_bytes(ks[0], BLOCK))], last=True)
        assert not tier.lookup(NS, ks)[0] and tier.scanned
    finally:
        listed.set()
        tier.close()


@pytest.fixture
def redis_url(redis_server_name: str) -> Iterator[str]:
    with RedisServer(name=redis_server_name) as server:
        yield server.url


def server_ms(url: str) -> int:
    import redis

    with redis.Redis.from_url(url) as r:
        sec, usec = r.time()
    return int(sec * 1000 + usec // 1000)


def server_ms_after(url: str, ms: int) -> None:
    """Until the server's clock (what recency is scored by) is past ``ms``."""
    deadline = time.monotonic() + 10
    while server_ms(url) <= ms:
        assert time.monotonic() < deadline, "the server's clock stood still"


def test_redis_tier_budget_evicts_least_recently_used_across_daemons(
    redis_url: str, wake: WakeFd
) -> None:
    a = RedisTier("redis", redis_url, 3 * BLOCK, wake, mac=MAC, refresh_s=0.02, full_sync_s=0.3)
    b = RedisTier("redis", redis_url, 3 * BLOCK, wake, mac=MAC, refresh_s=0.02)
    for t in (a, b):
        t.open_namespace(NS)
    try:
        ks = keys(b"r", 4)
        assert run(a, wake, True, ks[:3], [block(i) for i in range(3)]).ok == [True] * 3
        wait_for(b, wake, lambda: b.lookup(NS, ks[:3]) == [True] * 3)  # b sees a's blocks
        server_ms_after(redis_url, server_ms(redis_url))  # recency is kept in ms
        out = [b""]
        assert run(b, wake, False, ks[:1], out).ok == [True] and out == [block(0)]  # touch
        assert run(b, wake, True, ks[3:], [block(3)]).ok == [True]  # evicts ks[1] for all
        assert b.lookup(NS, ks) == [True, False, True, True]
        wait_for(a, wake, lambda: not a.lookup(NS, ks[1:2])[0])  # the full sync tells a
        out = [b""]
        assert run(a, wake, False, ks[3:], out).ok == [True] and out == [block(3)]
        wait_for(a, wake, lambda: a.used_bytes == 3 * BLOCK)
        assert a.statistics()["healthy"]
    finally:
        a.close()
        b.close()


def test_redis_blocks_expire_after_their_ttl(redis_url: str, wake: WakeFd) -> None:
    tier = RedisTier("redis", redis_url, 0, wake, mac=MAC, ttl_s=0.3, refresh_s=0.02)
    tier.open_namespace(NS)
    try:
        ks = keys(b"t", 2)
        assert run(tier, wake, True, ks, [block(1), block(2)]).ok == [True, True]
        out = [b"", b""]
        assert run(tier, wake, False, ks, out).ok == [True, True] and out[1] == block(2)
        deadline = time.monotonic() + 10
        while run(tier, wake, False, ks[:1], [b""]).ok == [True]:  # until Redis expires it
            assert time.monotonic() < deadline, "the block never expired"
            time.sleep(0.05)
        assert tier.lookup(NS, ks[:1]) == [False]  # a failed load leaves the view
        run(tier, wake, False, ks[1:], [b""])  # forgets the other's index entry too
        wait_for(tier, wake, lambda: tier.used_bytes == 0)  # and the shared byte total
    finally:
        tier.close()


def test_a_fifo_planted_for_a_block_file_fails_that_block_without_blocking(
    tmp_path: pathlib.Path, wake: WakeFd, caplog: pytest.LogCaptureFixture
) -> None:
    """Scenario: someone replaces a block file by a FIFO (or a link). Its read fails at
    once, the other blocks of the job load, and the tier stops without waiting."""
    tier = DiskTier("disk", str(tmp_path), 1 << 20, wake, mac=MAC)
    ks = keys(b"f", 3)
    try:
        assert run(tier, wake, True, ks, [block(1), block(2), block(3)]).ok == [True] * 3
        fifo, link = tier._file((NS.tier_id, ks[0])), tier._file((NS.tier_id, ks[2]))
        os.unlink(fifo)
        os.mkfifo(fifo)
        os.unlink(link)
        os.symlink("/etc/hostname", link)
        out = [b"", b"", b""]
        assert run(tier, wake, False, ks, out).ok == [False, True, False]  # run's deadline
        assert out[1] == block(2)
    finally:
        tier.close()
    # no thread was left stuck opening the FIFO (close() says so when one is)
    assert "stuck" not in caplog.text


def test_garbage_in_redis_stays_inside_its_key(redis_url: str, wake: WakeFd) -> None:
    """Scenario: another Redis user writes a non-number into the shared byte total and a
    string at one block's key. The poller survives, that key fails, others load."""
    import redis

    tier = RedisTier("redis", redis_url, 0, wake, mac=MAC, refresh_s=0.02)
    tier.open_namespace(NS)
    r = redis.Redis.from_url(redis_url)
    try:
        ks = keys(b"g", 2)
        assert run(tier, wake, True, ks, [block(1), block(2)]).ok == [True, True]
        r.set(tier._bytes_key, "not a number")
        r.delete(tier._data_key((NS.tier_id, ks[0])))
        r.set(tier._data_key((NS.tier_id, ks[0])), "a string, not a hash")
        out = [b"", b""]
        assert run(tier, wake, False, ks, out).ok == [False, True] and out[1] == block(2)
        time.sleep(0.2)  # polls go on meanwhile
        assert tier._poller.is_alive()
        r.delete(tier._bytes_key)  # the garbage goes: the tier is healthy and stores again
        wait_for(tier, wake, lambda: tier.statistics()["healthy"])
        assert run(tier, wake, True, keys(b"h", 1), [block(3)]).ok == [True]
    finally:
        r.close()
        tier.close()


def test_a_flipped_byte_or_an_older_format_in_redis_fails_that_block_only(
    redis_url: str, wake: WakeFd
) -> None:
    """A block whose bytes changed under its seal, and one in the format before
    (KVORED03: a CRC-32 anyone can compute, no MAC), are not loaded: each fails alone,
    counted by reason."""
    import struct

    import redis

    tier = RedisTier("redis", redis_url, 0, wake, mac=MAC, refresh_s=0.02)
    tier.open_namespace(NS)
    r = redis.Redis.from_url(redis_url)
    try:
        ks = keys(b"f", 3)
        assert run(tier, wake, True, ks, [block(1), block(2), block(3)]).ok == [True] * 3
        flipped = bytearray(block(1))
        flipped[BLOCK // 2] ^= 0x01
        r.hset(tier._data_key((NS.tier_id, ks[0])), "d", bytes(flipped))
        old = struct.pack("<8sIQ", b"KVORED03", crc32(block(2)), BLOCK)
        r.hset(tier._data_key((NS.tier_id, ks[1])), "m", old)
        out = [b"", b"", b""]
        assert run(tier, wake, False, ks, out).ok == [False, False, True]
        assert out[2] == block(3)
        st = tier.statistics()
        assert st["auth_bad_mac_total"] == 1 and st["auth_unauthenticated_total"] == 1
        assert st["auth_failures_total"] == 2
    finally:
        r.close()
        tier.close()


def test_a_load_longer_than_its_window_keeps_order_past_a_foreign_value(
    redis_url: str, wake: WakeFd
) -> None:
    """9 blocks of 1 MiB through a 4-block window: each reply lands in its own slot,
    and a string planted at one key fails that block only, mid-window."""
    import redis

    big = 1 << 20
    ns = TierNamespace.of("big", "e" * 32, big)
    assert LOAD_WINDOW_BYTES // big < 9
    tier = RedisTier("redis", redis_url, 0, wake, mac=MAC, refresh_s=0.02, connections=1)
    tier.open_namespace(ns)
    r = redis.Redis.from_url(redis_url)
    try:
        ks = keys(b"w", 9)
        blocks = [bytes([i + 1]) * big for i in range(9)]
        assert run(tier, wake, True, ks, blocks, ns).ok == [True] * 9
        r.delete(tier._data_key((ns.tier_id, ks[4])))
        r.set(tier._data_key((ns.tier_id, ks[4])), "a string, not a hash")
        out = [b""] * 9
        result = run(tier, wake, False, ks, out, ns)
        assert result.ok == [True] * 4 + [False] + [True] * 4
        assert [o for i, o in enumerate(out) if i != 4] == blocks[:4] + blocks[5:]
    finally:
        r.close()
        tier.close()


def test_a_disk_tier_directory_someone_else_could_change_is_refused(
    tmp_path: pathlib.Path, wake: WakeFd
) -> None:
    """Scenario: the configured path is a planted symlink, another uid's directory, a
    world-writable one, or sits under a directory another uid owns (who could rename
    the checked directory away and put theirs in its place)."""
    from kvoffloadd.tiers.base import TierError

    requires_root()  # to make a directory of another uid
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(elsewhere)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    os.chmod(open_to_all, 0o777)
    cases = {
        "link": "symlink",
        "theirs": "owned by uid 65534",
        "open": "writable by others",
        "theirs/blocks": "above",
    }
    for sub, needle in cases.items():
        with pytest.raises(TierError, match=needle):
            DiskTier("disk", str(tmp_path / sub), 1 << 20, wake, mac=MAC)
    assert list(elsewhere.iterdir()) == []  # nothing was written through the link
    with pytest.raises(TierError, match="does not exist"):  # parents are never created
        DiskTier("disk", str(tmp_path / "mine" / "blocks"), 1 << 20, wake, mac=MAC)
    assert not (tmp_path / "mine").exists()
    tier = DiskTier("disk", str(tmp_path / "blocks"), 1 << 20, wake, mac=MAC)  # created 0700
    try:
        assert os.stat(tmp_path / "blocks").st_mode & 0o777 == 0o700
    finally:
        tier.close()


def test_a_flushed_script_cache_or_an_idle_timeout_costs_no_store(
    redis_url: str, wake: WakeFd
) -> None:
    """Scenario: an operator runs SCRIPT FLUSH, and the server closes connections idle
    for a second (Redis's ``timeout``, as managed services set it). Stores right after
    either succeed, the tier stays healthy, and every block written is indexed."""
    import redis

    tier = RedisTier("redis", redis_url, 0, wake, mac=MAC, refresh_s=0.02, connections=1)
    tier.open_namespace(NS)
    r = redis.Redis.from_url(redis_url)
    try:
        assert run(tier, wake, True, keys(b"a", 1), [block(1)]).ok == [True]
        r.script_flush()
        assert run(tier, wake, True, keys(b"b", 1), [block(2)]).ok == [True]
        r.config_set("timeout", 1)
        idle = 3  # this test's connection, the tier's poller and its one store thread
        deadline = time.monotonic() + 10
        while len(r.client_list()) == idle:  # until the server closed the idle one
            assert time.monotonic() < deadline, "the server kept its idle connection"
            time.sleep(0.05)
        assert run(tier, wake, True, keys(b"c", 1), [block(3)]).ok == [True]
        out = [b""]
        assert run(tier, wake, False, keys(b"c", 1), out).ok == [True] and out == [block(3)]
        assert tier.statistics()["healthy"]
        data = sorted(r.scan_iter(match=f"kvoffload:b:{NS.tier_id}:*"))
        indexed = r.zrange("kvoffload:idx", 0, -1)
        assert len(data) == len(indexed) == 3
    finally:
        r.config_set("timeout", 0)
        r.close()
        tier.close()


@pytest.fixture
def tls_redis(
    redis_server_name: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RedisServer]:
    """A server that speaks TLS only, its certificate signed by a throwaway CA that
    this process trusts through ``SSL_CERT_FILE`` (as an operator points a daemon at a
    private CA)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    monkeypatch.setenv("SSL_CERT_FILE", make_tls_files(str(tmp_path)))
    with RedisServer(name=redis_server_name, tls_dir=str(tmp_path)) as server:
        yield server


def test_a_tls_tier_moves_blocks_of_many_records_and_survives_an_idle_close(
    tls_redis: RedisServer, wake: WakeFd
) -> None:
    """Scenario: the tier over ``rediss://``, the server's certificate checked. Blocks
    of 1 MiB (each many TLS records, sent one buffer at a time: TLS has no sendmsg) go
    down and come back byte-identical; once the server has closed the tier's idle
    connection, the next store and load still succeed and the tier stays healthy."""
    import redis

    assert tls_redis.url.startswith("rediss://")
    ns = TierNamespace.of("llama", "e" * 32, 1 << 20)
    tier = RedisTier("redis", tls_redis.url, 0, wake, mac=MAC, refresh_s=0.02, connections=1)
    tier.open_namespace(ns)
    r = redis.Redis.from_url(tls_redis.url, ssl_ca_certs=os.environ["SSL_CERT_FILE"])
    try:
        rng = random.Random(7)
        blocks = [rng.randbytes(1 << 20) for _ in range(3)]
        ks = keys(b"s", 3)
        assert run(tier, wake, True, ks, blocks, ns).ok == [True] * 3
        out = [b""] * 3
        assert run(tier, wake, False, ks, out, ns).ok == [True] * 3
        assert out == blocks
        r.config_set("timeout", 1)
        idle = 3  # this test's connection, the tier's poller and its one job thread
        deadline = time.monotonic() + 10
        while len(r.client_list()) == idle:  # until the server closed the idle one
            assert time.monotonic() < deadline, "the server kept its idle connection"
            time.sleep(0.05)
        assert run(tier, wake, True, keys(b"t", 1), blocks[2:], ns).ok == [True]
        out = [b""]
        assert run(tier, wake, False, keys(b"t", 1), out, ns).ok == [True]
        assert out == blocks[2:]
        assert tier.statistics()["healthy"]
    finally:
        r.config_set("timeout", 0)
        r.close()
        tier.close()
