"""Tier blocks are authenticated, with real daemons and a real Redis, Valkey, Mooncake
master and disk directory: a block written in the right format but without the
secret misses, so does one copied from another key or namespace (a replay); daemons
with the same secret share; a changed secret misses and says so once in the log."""

from __future__ import annotations

import os
import pathlib
import shutil
import struct
from collections.abc import Iterator
from functools import partial

import pytest
from helpers import poll
from tiered import LAYOUT, Engine, disk_toml, keys, mooncake_toml, redis_toml, tier_daemon

from kvoffloadbench.mooncake_master import MooncakeMaster
from kvoffloadbench.redis_server import RedisServer
from kvoffloadd.copies.crc import crc32
from kvoffloadd.tiers import disk, mooncake_tier, redis_tier
from kvoffloadd.tiers.base import TierNamespace
from kvoffloadd.tiers.blockauth import SEAL, BlockMac, read_secret

PAGE = 4096
OTHER = BlockMac(b"\x07" * 32)  # a secret the daemons do not have
WRONG_SECRET_LINE = "sealed with another tier secret"


def refused(e: Engine, tier: str, ks: list[bytes], failures: int) -> None:
    """Looking ``ks`` up until the tier has refused ``failures`` blocks by their seal;
    then each key misses for good, and none was promoted."""

    def looked_up() -> bool:
        for k in ks:
            e.ns.lookup([k])
        return bool(e.tier(tier)["auth_failures_total"] >= failures)

    def missed(k: bytes) -> bool:
        return e.ns.lookup([k]) == 0

    poll(looked_up, f"{failures} blocks to be refused")
    for k in ks:
        poll(partial(missed, k), f"{k!r} to miss")
        assert e.ns.lookup([k]) == 0
    assert e.tier(tier)["promoted_blocks_total"] == 0


def forged_seal(magic: bytes, key_id: bytes, data: bytes) -> bytes:
    """The right format and this deployment's key id, with a tag made without the
    secret."""
    return SEAL.pack(magic, key_id, len(data), os.urandom(32))


def ns_of(e: Engine) -> TierNamespace:
    return TierNamespace.of(e.ns.name, LAYOUT.fingerprint(), PAGE)


# ------------------------------------------------------------------ Redis and Valkey


def test_redis_blocks_without_the_secret_or_replayed_miss(
    tmp_path: pathlib.Path, redis_server: RedisServer
) -> None:
    """Another user of the Redis writes blocks in the daemon's format: sealed with their
    own secret, with the daemon's key id and a made-up tag, and copies of real blocks
    under other keys and another namespace. Each is found, refused and missed."""
    import redis as redis_py

    r = redis_py.Redis.from_url(redis_server.url)
    with tier_daemon(tmp_path, redis_toml(redis_server.url)) as d:
        e, other_ns = Engine(d), Engine(d, "mistral")
        e.wait_healthy("redis")
        a = keys(b"a", 2)
        e.store(a, seed=1)
        other_ns.store(keys(b"m", 1), seed=2)
        poll(lambda: e.tier("redis")["stores_total"] == 3, "the cascade")
        tid, mistral = ns_of(e).tier_id, ns_of(other_ns).tier_id
        real = r.hgetall(f"kvoffload:b:{tid}:".encode() + a[0])
        sealed, data = real[b"m"], real[b"d"]
        assert isinstance(sealed, bytes) and isinstance(data, bytes)  # not decoded
        key_id = SEAL.unpack(sealed)[1]
        f = keys(b"f", 4)
        planted = {
            (tid, f[0]): OTHER.seal(redis_tier.MAGIC, ns_of(e), f[0], data),  # own secret
            (tid, f[1]): forged_seal(redis_tier.MAGIC, key_id, data),  # our key id, no MAC
            (tid, f[2]): sealed,  # a replay under another key
            (mistral, a[0]): sealed,  # a replay into another namespace
            (tid, f[3]): struct.pack("<8sIQ", b"KVORED03", crc32(data), PAGE),  # CRC only
        }
        now_ms = int(r.time()[0]) * 1000
        for (t, k), m in planted.items():
            r.hset(f"kvoffload:b:{t}:".encode() + k, mapping={b"m": m, b"d": data})
            r.zadd("kvoffload:idx", {f"{t}:{PAGE}:".encode() + k: now_ms})
        refused(e, "redis", f, 4)
        refused(other_ns, "redis", a[:1], 5)
        st = e.tier("redis")
        assert st["auth_other_secret_total"] == 1 and st["auth_unauthenticated_total"] == 1
        assert st["auth_bad_mac_total"] == 3 and st["auth_failures_total"] == 5
        assert st["promoted_blocks_total"] == 0 and d.alive()
        for x in (e, other_ns):
            x.close()
        assert d.stop() == 0
    r.close()


def test_redis_same_secret_shares_a_changed_one_misses_and_says_so_once(
    tmp_path: pathlib.Path, redis_server: RedisServer, capfd: pytest.CaptureFixture[str]
) -> None:
    """a writes; b has a copy of a's secret file (as an operator gives every node the
    same one) and promotes a's blocks; c has its own secret: every block misses, and its
    log says why once."""
    toml = redis_toml(redis_server.url)
    copy = tmp_path / "copy" / "tier-secret"
    with tier_daemon(tmp_path, toml, "a") as da:
        ea = Engine(da)
        a = keys(b"a", 4)
        data = ea.store(a, seed=3)
        poll(lambda: ea.tier("redis")["stores_total"] == 4, "the cascade")
        copy.parent.mkdir(mode=0o700)
        shutil.copy2(tmp_path / "tier-secret", copy)
        with tier_daemon(tmp_path, toml, "b", secret=copy) as db:
            eb = Engine(db)
            poll(lambda: eb.ns.lookup(a) == 4, "b to promote a's blocks")
            assert eb.load(a) == data
            eb.close()
            assert db.stop() == 0
        capfd.readouterr()
        with tier_daemon(tmp_path, toml, "c", secret=tmp_path / "c-secret") as dc:
            ec = Engine(dc)
            refused(ec, "redis", a, 4)
            assert ec.tier("redis")["auth_other_secret_total"] == 4
            ec.close()
            assert dc.stop() == 0
        err = capfd.readouterr().err
        assert err.count(WRONG_SECRET_LINE) == 1, err
        ea.close()
        assert da.stop() == 0
    assert read_secret(str(copy)) == read_secret(str(tmp_path / "tier-secret"))
    assert read_secret(str(tmp_path / "c-secret")) != read_secret(str(copy))


# ------------------------------------------------------------------ disk


def test_disk_blocks_without_the_secret_or_replayed_miss_and_go(tmp_path: pathlib.Path) -> None:
    """Files in the block format planted in the tier's directory (by its own uid: nobody
    else can write there): sealed with another secret, with a made-up tag, copied from
    another key or namespace, or of the format before. Each misses and is deleted; a
    daemon with a changed secret misses every block and says so once."""
    path = tmp_path / "disk"
    with tier_daemon(tmp_path, disk_toml(path), "a") as da:
        e, m = Engine(da), Engine(da, "mistral")
        a = keys(b"a", 2)
        data = e.store(a, seed=4)
        m.store(keys(b"m", 1), seed=5)
        poll(lambda: e.tier("disk")["stores_total"] == 3, "the cascade")
        tid, mistral = ns_of(e).tier_id, ns_of(m).tier_id
        ns_a = ns_of(e)
        for x in (e, m):
            x.close()
        assert da.stop() == 0

    def file_of(t: str, k: bytes) -> pathlib.Path:
        f = path / t / k.hex()[:2] / (k.hex() + ".kvb")
        f.parent.mkdir(mode=0o700, exist_ok=True)
        return f

    real = file_of(tid, a[0]).read_bytes()
    key_id = SEAL.unpack(real[: SEAL.size])[1]
    block = data[:PAGE]
    f = keys(b"f", 4)
    old = struct.pack("<8sIIQ", b"KVOBLK01", crc32(block), len(f[3]), PAGE) + f[3] + block
    planted = {
        file_of(tid, f[0]): OTHER.seal(disk.MAGIC, ns_a, f[0], block) + block,
        file_of(tid, f[1]): forged_seal(disk.MAGIC, key_id, block) + block,
        file_of(tid, f[2]): real,  # a replay under another key
        file_of(mistral, a[0]): real,  # a replay into another namespace
        file_of(tid, f[3]): old,
    }
    for p, content in planted.items():
        p.write_bytes(content)
    with tier_daemon(tmp_path, disk_toml(path), "b") as db:
        e, m = Engine(db), Engine(db, "mistral")
        poll(lambda: e.tier("disk")["scanned"], "the scan")
        refused(e, "disk", f, 4)
        refused(m, "disk", a[:1], 5)
        st = e.tier("disk")
        assert st["auth_other_secret_total"] == 1 and st["auth_unauthenticated_total"] == 1
        assert st["auth_bad_mac_total"] == 3
        poll(lambda: not any(p.exists() for p in planted), "the refused files to go")
        assert e.ns.lookup(a) is None  # the real ones still promote
        poll(lambda: e.ns.lookup(a) == 2, "the real blocks")
        assert e.load(a) == data
        for x in (e, m):
            x.close()
        assert db.stop() == 0


def test_disk_a_changed_secret_misses_and_says_so_once(
    tmp_path: pathlib.Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "disk"
    with tier_daemon(tmp_path, disk_toml(path), "a") as da:
        e = Engine(da)
        a = keys(b"a", 4)
        e.store(a, seed=6)
        poll(lambda: e.tier("disk")["stores_total"] == 4, "the cascade")
        e.close()
        assert da.stop() == 0
    capfd.readouterr()
    with tier_daemon(tmp_path, disk_toml(path), "b", secret=tmp_path / "new-secret") as db:
        e = Engine(db)
        poll(lambda: e.tier("disk")["scanned"], "the scan")
        refused(e, "disk", a, 4)
        assert e.tier("disk")["auth_other_secret_total"] == 4
        e.close()
        assert db.stop() == 0
    assert capfd.readouterr().err.count(WRONG_SECRET_LINE) == 1


# ------------------------------------------------------------------ Mooncake


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    if why := MooncakeMaster.available():
        pytest.skip(why)
    m = MooncakeMaster().start()
    yield m
    m.stop()


@pytest.mark.timeout(180)
def test_mooncake_objects_without_the_secret_or_replayed_miss(
    tmp_path: pathlib.Path, master: MooncakeMaster, capfd: pytest.CaptureFixture[str]
) -> None:
    """Another client of the cluster puts objects in the daemon's format under its
    prefix: sealed with another secret, with a made-up tag, copies of real objects under
    another key and namespace, and the format before. Each misses. A daemon with its
    own secret misses every block, and says so once."""
    from mooncake.store import MooncakeDistributedStore

    with tier_daemon(tmp_path, mooncake_toml(master), "a") as d:
        e, m = Engine(d), Engine(d, "mistral")
        e.wait_healthy("mooncake")
        a = keys(b"a", 2)
        e.store(a, seed=7)
        m.store(keys(b"m", 1), seed=8)
        poll(lambda: e.tier("mooncake")["stores_total"] == 3, "the cascade")
        tid, mistral = ns_of(e).tier_id, ns_of(m).tier_id
        ns_a = ns_of(e)
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", master.metadata_url, 0, 16 << 20, "tcp", "", master.master)
        assert rc == 0
        try:
            real = bytes(store.get(f"kvoffload/{tid}/{a[0].hex()}"))
            assert len(real) == PAGE + mooncake_tier.HEADER_BYTES
            block, key_id = real[:PAGE], SEAL.unpack(real[PAGE : PAGE + SEAL.size])[1]
            pad = bytes(mooncake_tier.HEADER_BYTES - SEAL.size)
            f = keys(b"f", 4)
            old = struct.pack("<8sIQ", b"KVOMC002", crc32(block), PAGE).ljust(32, b"\0")
            planted = {
                (tid, f[0]): block + OTHER.seal(mooncake_tier.MAGIC, ns_a, f[0], block) + pad,
                (tid, f[1]): block + forged_seal(mooncake_tier.MAGIC, key_id, block) + pad,
                (tid, f[2]): real,
                (mistral, a[0]): real,
                (tid, f[3]): block + old,
            }
            for (t, k), content in planted.items():
                assert store.put(f"kvoffload/{t}/{k.hex()}", content) == 0
        finally:
            store.close()
        # each is found by an existence check after a miss, then promoted and refused
        refused(e, "mooncake", f, 4)
        refused(m, "mooncake", a[:1], 5)
        st = e.tier("mooncake")
        assert st["auth_failures_total"] == 5 and st["auth_other_secret_total"] == 1
        assert st["promoted_blocks_total"] == 0
        capfd.readouterr()  # a's blocks lie in a's segment: a stays while c looks
        secret = tmp_path / "c-secret"
        with tier_daemon(tmp_path, mooncake_toml(master), "c", secret=secret) as dc:
            ec = Engine(dc)
            ec.wait_healthy("mooncake")
            refused(ec, "mooncake", a, 2)
            assert ec.tier("mooncake")["auth_other_secret_total"] == 2
            ec.close()
            assert dc.stop() == 0
        assert capfd.readouterr().err.count(WRONG_SECRET_LINE) == 1
        for x in (e, m):
            x.close()
        assert d.stop() == 0


def test_the_secret_file_is_made_safely_and_checked(tmp_path: pathlib.Path) -> None:
    """Generated 0600 with 64 hex digits; a link, another's file, an open mode or
    garbage at the path is refused, naming it."""
    from kvoffloadd.tiers.base import TierError

    path = tmp_path / "s" / "tier-secret"
    secret = read_secret(str(path))
    assert len(secret) == 32 and os.stat(path).st_mode & 0o777 == 0o600
    assert read_secret(str(path)) == secret  # read again, not replaced
    assert len(path.read_text().strip()) == 64
    link = tmp_path / "s" / "link"
    link.symlink_to(path)
    with pytest.raises(TierError, match="symlink"):
        read_secret(str(link))
    os.chmod(path, 0o644)
    with pytest.raises(TierError, match="0644"):
        read_secret(str(path))
    os.chmod(path, 0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(TierError, match="uid 65534"):
        read_secret(str(path))
    bad = tmp_path / "s" / "bad"
    bad.write_text("not hex\n")
    os.chmod(bad, 0o600)
    with pytest.raises(TierError, match="64 hex digits"):
        read_secret(str(bad))
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    with pytest.raises(TierError, match="writable by others"):
        read_secret(str(open_dir / "tier-secret"))
    assert not (open_dir / "tier-secret").exists()
    # nothing else left behind in the directory
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["bad", "link", "tier-secret"]
