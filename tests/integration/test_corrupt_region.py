"""A kept region whose tables were damaged: the next daemon starts, and serves only
blocks whose bytes are right (recovery.py).

One daemon fills three namespaces with blocks whose bytes derive from their namespace
and key, and stops keeping the region. Each case then restores the tables as they
were, damages one field of one record (written whole with a fresh CRC, as a buggy
writer would, or flipped under its CRC, as a stray write would), and starts a daemon
on the region: it must start, serve every block the damage did not touch, never serve
a wrong byte or a key nobody stored, and store again. The fuzz does the same with
random damage.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import posix_ipc
import pytest

import kvoffload
from kvoffload.datapath.regionfmt import (
    FREE_OWNER,
    HEADER,
    NAMESPACE_CRC_OFFSET,
    NAMESPACE_LAYOUT_OFFSET,
    NAMESPACE_RECORD_BYTES,
    SLOT_DTYPE,
    SLOT_READY,
    extent_crc,
    namespace_crc,
    ready_crc,
)
from kvoffload.protocol.errors import KVOffloadError
from kvoffloadbench.launch import DaemonProcess
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import CpuCopier
from kvoffloadd.region.region import Geometry, SharedOffloadRegion
from kvoffloadd.service.service import Service

MIB = 1 << 20
ARGS = ("--extent-size", "1MiB", "--keep-region", "--log-level", "error")
LAYOUTS = {
    "a": kvoffload.KVLayout([16384]),  # 64 slots per 1 MiB extent
    "b": kvoffload.KVLayout([32768]),  # 32 slots per extent
    "c": kvoffload.KVLayout([16384]),  # a's layout and keys, other bytes
}
KEYS = {
    "a": [b"key-%05d" % i for i in range(100)],  # two extents: 64 + 36
    "b": [b"key-%05d" % i for i in range(40)],  # two extents: 32 + 8
    "c": [b"key-%05d" % i for i in range(20)],
}


def block(name: str, key: bytes) -> np.ndarray:
    page = LAYOUTS[name].tensor_page_bytes[0]
    digest = hashlib.shake_128(name.encode() + b"/" + key).digest(page)
    return np.frombuffer(digest, dtype=np.int8)


class Tables:
    """A writable view of a kept region's tables, and the damage a test does to them."""

    def __init__(self, name: str) -> None:
        shm = posix_ipc.SharedMemory(name)
        self.mm = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        f = HEADER.unpack_from(self.mm, 0)
        self.num_extents, self.spe_max = f[5], f[6]
        self.extent_table, self.namespace_table = f[9], f[10]
        self.slot_table, self.data_offset = f[11], f[13]
        self.extents = np.frombuffer(self.mm, "<u4", self.num_extents * 4, self.extent_table)
        self.extents = self.extents.reshape(-1, 4)
        self.slots = np.frombuffer(
            self.mm, SLOT_DTYPE, self.num_extents * self.spe_max, self.slot_table
        )

    def close(self) -> None:
        del self.extents, self.slots
        self.mm.close()

    def snapshot(self) -> bytes:
        return self.mm[:]  # data too: a daemon stores into what a damaged record freed

    def restore(self, pristine: bytes) -> None:
        self.mm[: len(pristine)] = pristine

    # ------------------------------------------------------------ where things are

    def ns_id(self, name: str) -> int:
        for i in range(256):
            if self.ns_record(i)[:256].split(b"\0", 1)[0] == name.encode():
                return i
        raise KeyError(name)

    def ns_record(self, i: int) -> bytes:
        off = self.namespace_table + i * NAMESPACE_RECORD_BYTES
        return self.mm[off : off + NAMESPACE_RECORD_BYTES]

    def ns_extents(self, name: str) -> list[int]:
        ns = self.ns_id(name)
        owned = [e for e in range(self.num_extents) if self.extents[e, 0] == ns]
        return sorted(owned, key=lambda e: int(self.extents[e, 2]))

    def record_of(self, name: str, key: bytes) -> int:
        ns = self.ns_id(name)
        ready: list[int] = np.flatnonzero(self.slots["state"] == SLOT_READY).tolist()
        for i in ready:
            rec = self.slots[i]
            if rec["ns"] == ns and bytes(rec["key"])[: rec["key_len"]] == key:
                return i
        raise KeyError(key)

    def keys_in_extent(self, name: str, ext: int) -> set[tuple[str, bytes]]:
        recs = self.slots[ext * self.spe_max : (ext + 1) * self.spe_max]
        ready = recs[recs["state"] == SLOT_READY]
        return {(name, bytes(r["key"])[: r["key_len"]]) for r in ready}

    def ready_keys(self) -> set[tuple[int, bytes]]:
        ready = self.slots[self.slots["state"] == SLOT_READY]
        return {(int(r["ns"]), bytes(r["key"])[: min(64, int(r["key_len"]))]) for r in ready}

    # ------------------------------------------------------------ damage

    def set_extent(self, ext: int, column: int, value: int, seal: bool = True) -> None:
        self.extents[ext, column] = value
        if seal:
            owner, slot_bytes, chunk = (int(v) for v in self.extents[ext, :3])
            self.extents[ext, 3] = extent_crc(ext, owner, slot_bytes, chunk)

    def set_ns_bytes(self, i: int, offset: int, data: bytes, seal: bool = True) -> None:
        off = self.namespace_table + i * NAMESPACE_RECORD_BYTES
        self.mm[off + offset : off + offset + len(data)] = data
        if seal:
            crc = namespace_crc(self.ns_record(i))
            self.mm[off + NAMESPACE_CRC_OFFSET : off + NAMESPACE_RECORD_BYTES] = struct.pack(
                "<I", crc
            )

    def set_slot(self, i: int, seal: bool = True, **fields: object) -> None:
        for k, v in fields.items():
            self.slots[k][i] = v
        if seal:
            rec = self.slots[i]
            key = bytes(rec["key"])[: min(64, int(rec["key_len"]))]
            self.slots["crc"][i] = ready_crc(int(rec["ns"]), int(rec["seq"]), key)


@dataclass
class Kept:
    """The damaged daemon's region, its instance and the pristine region."""

    daemon: DaemonProcess
    region: str
    pristine: bytes
    ns_ids: dict[str, int] = field(default_factory=dict)


def store(ns: kvoffload.Namespace, name: str, keys: list[bytes]) -> None:
    """Store the keys' blocks, 16 at a time, through a real copy."""
    cache = kvoffload.shared_kv_cache(len(keys), LAYOUTS[name].tensor_page_bytes[0])
    cache.numpy()[:] = np.stack([block(name, k) for k in keys])
    w = ns.attach_worker([cache])
    for job, first in enumerate(range(0, len(keys), 16), start=1):
        batch = keys[first : first + 16]
        plan = ns.prepare_store(batch)
        assert plan is not None and plan.keys_to_store == batch, ns.last_error
        assert w.submit_store(job, np.arange(first, first + len(batch)), plan.slots)
        w.wait([job])
        assert all(r.success for r in w.get_finished())
        ns.complete_store(batch)
    w.close()


def store_all(d: DaemonProcess) -> None:
    with kvoffload.connect(d.socket_path) as c:
        for name, keys in KEYS.items():
            store(c.namespace(name, LAYOUTS[name]), name, keys)


@pytest.fixture(scope="module")
def kept() -> Iterator[Kept]:
    d = DaemonProcess("64MiB", *ARGS).start()
    region = d.banner.split(" region ", 1)[1].split()[0]
    store_all(d)
    assert d.stop() == 0
    t = Tables(region)
    k = Kept(d, region, t.snapshot(), {n: t.ns_id(n) for n in KEYS})
    t.close()
    yield k
    posix_ipc.unlink_shared_memory(region)
    shutil.rmtree(os.path.dirname(d.socket_path), ignore_errors=True)


def restart(k: Kept) -> DaemonProcess:
    return DaemonProcess(
        "64MiB", *ARGS, instance=k.daemon.instance, socket_path=k.daemon.socket_path
    ).start()


def served(
    d: DaemonProcess, ghosts: set[tuple[str, bytes]], names_kept: bool = True
) -> set[tuple[str, bytes]]:
    """Every (namespace, key) the daemon serves, each load checked byte for byte; the
    ghosts (keys nobody stored) must all miss, no namespace may come back under a
    name nobody opened (``names_kept``), and a new store must complete."""
    out = set()
    with kvoffload.connect(d.socket_path) as c:
        names = set(c.stats()["namespaces"])
        if names_kept:
            assert names <= set(KEYS), f"namespaces nobody opened: {names - set(KEYS)}"
        for name, keys in KEYS.items():
            ns = c.namespace(name, LAYOUTS[name])
            for name_, key in ghosts:
                if name_ == name and len(key) == len(keys[0]):
                    assert ns.lookup([key]) == 0, f"{name}: {key!r} was never stored"
            hits = [k for k in keys if ns.lookup([k]) == 1]
            if hits:
                page = LAYOUTS[name].tensor_page_bytes[0]
                dst = kvoffload.shared_kv_cache(len(hits), page)
                w = ns.attach_worker([dst])
                plan = ns.prepare_load(hits)
                assert w.submit_load(1, plan.slots, np.arange(len(hits)))
                w.wait([1])
                assert all(r.success for r in w.get_finished())
                ns.complete_load(hits)
                got = dst.numpy()
                for i, key in enumerate(hits):
                    assert np.array_equal(got[i], block(name, key)), f"{name}: {key!r}"
                w.close()
            out |= {(name, k) for k in hits}
        store(c.namespace("a", LAYOUTS["a"]), "a", [b"new-%05d" % i for i in range(4)])
    return out


ALL = {(n, k) for n, keys in KEYS.items() for k in keys}
Damage = Callable[[Tables, Kept], tuple[set[tuple[str, bytes]], set[tuple[str, bytes]]]]


def _extent_field(chunk: int, column: int, value: int, seal: bool = True) -> Damage:
    def damage(t: Tables, k: Kept) -> tuple[set[tuple[str, bytes]], set[tuple[str, bytes]]]:
        ext = t.ns_extents("a")[chunk]
        lost = t.keys_in_extent("a", ext) if column in (0, 1) else set()
        t.set_extent(ext, column, value, seal)
        return lost, set()

    return damage


def _owner_is_b(t: Tables, k: Kept) -> tuple[set[tuple[str, bytes]], set[tuple[str, bytes]]]:
    ext = t.ns_extents("a")[1]
    lost = t.keys_in_extent("a", ext)
    t.set_extent(ext, 0, k.ns_ids["b"])
    return lost, set()


def _ns_field(offset: int, data: bytes, name: str = "a", seal: bool = True) -> Damage:
    def damage(t: Tables, k: Kept) -> tuple[set[tuple[str, bytes]], set[tuple[str, bytes]]]:
        t.set_ns_bytes(k.ns_ids[name], offset, data, seal)
        return {(name, key) for key in KEYS[name]}, set()

    return damage


def _layout(layout: kvoffload.KVLayout, fingerprint: bool) -> Damage:
    import msgspec

    raw = msgspec.msgpack.encode(layout)

    def damage(t: Tables, k: Kept) -> tuple[set[tuple[str, bytes]], set[tuple[str, bytes]]]:
        i = k.ns_ids["a"]
        t.set_ns_bytes(i, 320, struct.pack("<I", len(raw)), seal=False)
        t.set_ns_bytes(i, NAMESPACE_LAYOUT_OFFSET, raw, seal=False)
        if fingerprint:
            t.set_ns_bytes(i, 256, layout.fingerprint().encode().ljust(64, b"\0"), seal=False)
        t.set_ns_bytes(i, 0, b"a")  # seals
        return {("a", key) for key in KEYS["a"]}, set()

    return damage


def _c_named_a(t: Tables, k: Kept) -> tuple[set[tuple[str, bytes]], set[tuple[str, bytes]]]:
    t.set_ns_bytes(k.ns_ids["c"], 0, b"a\0")
    return {(n, key) for n in "ac" for key in KEYS[n]}, set()


def _key_twice(t: Tables, k: Kept) -> tuple[set[tuple[str, bytes]], set[tuple[str, bytes]]]:
    three, five = KEYS["a"][3], KEYS["a"][5]
    t.set_slot(t.record_of("a", five), key=three.ljust(64, b"\0"))  # the later of the two
    return {("a", three), ("a", five)}, set()


def _in_flight(t: Tables, k: Kept) -> tuple[set[tuple[str, bytes]], set[tuple[str, bytes]]]:
    ghost = b"ghost-0001"[: len(KEYS["a"][0])]
    last = t.ns_extents("a")[1] * t.spe_max + 40  # a free slot of a's second extent
    t.set_slot(last, state=SLOT_READY, ns=k.ns_ids["a"], key_len=len(ghost), seq=0)
    t.set_slot(last, key=ghost.ljust(64, b"\0"))
    return set(), {("a", ghost)}


def _slot_field(n: int, seal: bool = True, **fields: object) -> Damage:
    def damage(t: Tables, k: Kept) -> tuple[set[tuple[str, bytes]], set[tuple[str, bytes]]]:
        key = KEYS["a"][n]
        values = {f: k.ns_ids["b"] if v == "b" else v for f, v in fields.items()}
        t.set_slot(t.record_of("a", key), seal, **values)
        return {("a", key)}, set()

    return damage


def _flipped_key(t: Tables, k: Kept) -> tuple[set[tuple[str, bytes]], set[tuple[str, bytes]]]:
    key = KEYS["a"][10]
    flipped = key[:-1] + bytes([key[-1] ^ 0x40])  # a key nobody stored
    t.set_slot(t.record_of("a", key), seal=False, key=flipped.ljust(64, b"\0"))
    return {("a", key)}, {("a", flipped)}


CASES: dict[str, Damage] = {
    "extent slot_bytes 0 (ZeroDivisionError)": _extent_field(0, 1, 0),
    "extent slot_bytes doubled": _extent_field(0, 1, 32768),
    "extent slot_bytes below the minimum slot": _extent_field(0, 1, 4096),
    "extent slot_bytes changed under its CRC": _extent_field(0, 1, 20480, seal=False),
    "extent owned by a namespace of another slot size": _owner_is_b,
    "extent owner beyond the table": _extent_field(1, 0, 300),
    "extent chunk with a gap": _extent_field(1, 2, 5),
    "extent chunk claimed twice": _extent_field(1, 2, 0),
    "namespace name not UTF-8": _ns_field(0, b"\xff\xfe"),
    "namespace fingerprint not UTF-8": _ns_field(256, b"\xff\xfe"),
    "namespace layout length beyond its record": _ns_field(320, b"\xff\xff\xff\xff"),
    "namespace layout not matching its fingerprint": _layout(
        kvoffload.KVLayout([32768]), fingerprint=False
    ),
    "namespace layout refused by the rules, fingerprint matching": _layout(
        kvoffload.KVLayout([16384], world_size=0), fingerprint=True
    ),
    "namespace name changed under its CRC": _ns_field(0, b"z", seal=False),
    "a namespace name held twice": _c_named_a,
    "a key READY in two slots": _key_twice,
    "a store in flight marked READY (seq 0)": _in_flight,
    "seq at the end of its range": _slot_field(7, seq=(1 << 64) - 1),
    "key_len 0": _slot_field(8, key_len=0),
    "key_len beyond the key": _slot_field(9, key_len=200),
    "READY record of another namespace": _slot_field(11, ns="b"),
    "slot state out of range": _slot_field(12, state=9),
    "key changed under its CRC": _flipped_key,
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_record_is_dropped_and_the_rest_is_served(kept: Kept, case: str) -> None:
    t = Tables(kept.region)
    try:
        t.restore(kept.pristine)
        lost, ghosts = CASES[case](t, kept)
    finally:
        t.close()
    d = restart(kept)
    try:
        got = served(d, ghosts)
        assert got <= ALL
        assert not (ALL - lost) - got, f"lost blocks the damage did not touch: {(ALL - lost) - got}"
        t = Tables(kept.region)
        try:  # the daemon and the workers' SlotMap read one map: a chunk per extent
            for name in KEYS:
                chunks = [int(t.extents[e, 2]) for e in t.ns_extents(name)]
                assert len(set(chunks)) == len(chunks), (name, chunks)
                assert all(0 <= c < t.num_extents for c in chunks), (name, chunks)
        finally:
            t.close()
    finally:
        assert d.stop() == 0


def _fuzz(t: Tables, rng: random.Random, seal: bool) -> None:
    """Random bytes over the records that say anything: owned extents, the three
    namespace records, READY slot records."""
    owned = [e for e in range(t.num_extents) if t.extents[e, 0] != FREE_OWNER]
    ready = np.flatnonzero(t.slots["state"] == SLOT_READY).tolist()
    for _ in range(rng.randint(1, 12)):
        where = rng.random()
        if where < 0.3:
            ext = rng.choice(owned)
            t.set_extent(
                ext, rng.randrange(3), rng.choice([0, 1, 2, 300, rng.getrandbits(32)]), seal
            )
        elif where < 0.5:
            i = rng.randrange(3)
            offset = rng.choice(
                [0, 1, 256, 300, 320, 321, NAMESPACE_LAYOUT_OFFSET + rng.randrange(40)]
            )
            t.set_ns_bytes(i, offset, bytes([rng.getrandbits(8)]), seal)
        else:
            i = rng.choice(ready)
            f = rng.choice(["state", "key_len", "ns", "seq", "key", "key"])
            if f == "key":
                key = bytearray(bytes(t.slots["key"][i]))
                key[rng.randrange(10)] ^= 1 << rng.randrange(8)
                t.set_slot(i, seal, key=bytes(key))
            else:
                bits = {"state": 8, "key_len": 8, "ns": 32, "seq": 64}[f]
                t.set_slot(i, seal, **{f: int(t.slots[f][i]) ^ (1 << rng.randrange(bits))})


@pytest.mark.parametrize("seed", range(8))
def test_random_damage_never_stops_the_daemon_nor_serves_a_wrong_byte(
    kept: Kept, seed: int
) -> None:
    """Odd seeds flip bits under the CRCs: every key or name a flip made up must stay
    unknown. Even seeds write whole records with fresh CRCs: a key or name made up that
    way is served with the bytes it names, which no check of the tables can tell."""
    rng = random.Random(seed)
    t = Tables(kept.region)
    try:
        t.restore(kept.pristine)
        before = t.ready_keys()
        _fuzz(t, rng, seal=seed % 2 == 0)
        ids = {i: n for n, i in kept.ns_ids.items()}
        made_up = {(ids[ns], key) for ns, key in t.ready_keys() - before if ns in ids} - ALL
        ghosts = made_up if seed % 2 else set()
    finally:
        t.close()
    d = restart(kept)
    try:
        assert served(d, ghosts, names_kept=bool(seed % 2)) <= ALL
    except KVOffloadError as exc:
        raise AssertionError(f"seed {seed}: {exc}") from exc
    finally:
        assert d.stop() == 0


def test_hundreds_of_random_damages_recover_in_process(kept: Kept) -> None:
    """The same damage, 400 rounds, recovered by the daemon's own code in this process
    (no daemon start per round): recovery never raises, every block it brings back
    has its bytes, and no key or name a flip under the CRCs made up comes back."""
    cfg = DaemonConfig(instance=kept.daemon.instance, region_size="64MiB", extent_size="1MiB")
    g = Geometry.plan(cfg.region_bytes, cfg.extent_bytes, cfg.min_slot_bytes)
    copier = CpuCopier(1)
    rng = random.Random(2026)
    t = Tables(kept.region)
    t.restore(kept.pristine)  # data too: the daemons of other tests stored into it
    try:
        for round_ in range(400):
            t.restore(kept.pristine[: t.data_offset])  # recovery writes only tables
            before = t.ready_keys()
            sealed = round_ % 2 == 0
            _fuzz(t, rng, seal=sealed)
            ids = {i: n for n, i in kept.ns_ids.items()}
            made_up = {(ids[ns], key) for ns, key in t.ready_keys() - before if ns in ids} - ALL
            region = SharedOffloadRegion(kept.region, g)
            try:
                svc = Service(cfg, region, copier)
                assert sealed or set(svc.table.by_name) <= set(KEYS), round_
                for name, index in svc.table.by_name.items():
                    pool = index.slots
                    for key in KEYS.get(name, []):
                        if not index.is_ready(key):
                            continue
                        slot = index.slots_of([key])[0]
                        ext = pool.extents[slot // pool.slots_per_extent]
                        assert ext is not None, (round_, name, key)  # a ready block's extent
                        off = g.data_offset + ext * g.extent_bytes
                        off += (slot % pool.slots_per_extent) * pool.slot_bytes
                        page = LAYOUTS[name].tensor_page_bytes[0]
                        got = region.buffer[off : off + page].tobytes()
                        assert got == block(name, key).tobytes(), (round_, name, key)
                    if not sealed:
                        ghosts = [k for n, k in made_up if n == name]
                        assert not any(index.is_ready(k) for k in ghosts), (round_, ghosts)
                svc.namespaces.clear()
                del svc
            finally:
                region.close(unlink=False)
    finally:
        copier.close()
        t.restore(kept.pristine)
        t.close()
