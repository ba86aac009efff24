"""The region's recoverable format and the service's sharing of it between namespaces."""

from __future__ import annotations

import mmap
import struct
import uuid
from collections.abc import Iterator

import numpy as np
import posix_ipc
import pytest

from kvoffload.datapath.regionfmt import (
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    SLOT_DTYPE,
    SLOT_READY,
    ready_crc,
)
from kvoffload.protocol import messages as m
from kvoffload.protocol.packing import pack_keys, unpack_ids
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import CpuCopier
from kvoffloadd.region.journal import _READY_LOOP_MAX
from kvoffloadd.region.region import Geometry, RegionError, SharedOffloadRegion
from kvoffloadd.service.service import Service

MIB = 1 << 20


@pytest.fixture
def service() -> Iterator[Service]:
    cfg = DaemonConfig(instance=f"u{uuid.uuid4().hex[:8]}", region_size="24MiB", extent_size="2MiB")
    region = SharedOffloadRegion(cfg.region_name, Geometry.plan(cfg.region_bytes, 2 * MIB, 16384))
    copier = CpuCopier(1)
    svc = Service(cfg, region, copier)
    yield svc
    copier.close()
    svc.namespaces.clear()
    region.close()


def open_ns(svc: Service, sid: int, name: str, page: int) -> int:
    s = svc.sessions.get(sid) or svc.open_session(sid, 1, 0, 0)
    r = svc.handle(s, m.OpenNamespace(1, name, m.KVLayout([page])))
    assert isinstance(r, m.NamespaceOpened)
    return r.ns


def store(svc: Service, sid: int, ns: int, keys: list[bytes]) -> m.Reply | None:
    s = svc.sessions[sid]
    kp, kb = pack_keys(keys)
    r = svc.handle(s, m.PrepareStore(2, ns, kp, kb))
    if isinstance(r, m.StorePlanReply):
        index = svc.namespaces[ns]
        index.mark_written(unpack_ids(r.slots).tolist(), 0)
        svc.handle(s, m.CompleteStore(3, ns, kp, kb, True))
    return r


@pytest.mark.parametrize(
    ("page", "n"),
    [(512 * 1024, 3), (16384, _READY_LOOP_MAX + 8)],  # records one by one, then per field
)
def test_header_and_slot_table_describe_completed_stores(
    service: Service, page: int, n: int
) -> None:
    ns = open_ns(service, 1, "a", page)
    keys = [b"key-%04d" % i for i in range(n)]
    store(service, 1, ns, keys)
    shm = posix_ipc.SharedMemory(service.region.name)  # size 0: never resize it
    with mmap.mmap(shm.fd, shm.size, prot=mmap.PROT_READ) as mm:
        shm.close_fd()
        fields = HEADER.unpack(mm[: HEADER.size])
        assert fields[0] == MAGIC and fields[1] == FORMAT_VERSION
        g = service.region.geometry
        assert fields[3:6] == (g.region_bytes, g.extent_bytes, g.num_extents)
        table = np.frombuffer(mm, SLOT_DTYPE, g.num_extents * g.slots_per_extent_max, g.slot_table)
        ready = table[table["state"] == SLOT_READY]
        got = sorted(bytes(r["key"])[: r["key_len"]] for r in ready)
        assert got == keys
        assert sorted(ready["seq"].tolist()) == list(range(1, n + 1))
        for r in ready:  # what recovery checks of each record
            key = bytes(r["key"])[: r["key_len"]]
            assert r["ns"] == ns and r["crc"] == ready_crc(ns, int(r["seq"]), key)
        ext = np.frombuffer(mm, "<u4", g.num_extents * 4, g.extent_table).reshape(-1, 4)
        assert ext[0, 0] == ns and ext[0, 1] == page
        del table, ready, ext


def test_a_new_namespace_reclaims_its_fair_share(service: Service) -> None:
    """Memory moves between namespaces: the one over its share gives whole extents back."""
    a = open_ns(service, 1, "a", 1 * MIB)
    total = service.region.geometry.num_extents
    keys_a = [b"a-%06d" % i for i in range(2 * total)]
    assert isinstance(store(service, 1, a, keys_a), m.StorePlanReply)
    assert service.region.pool.num_free == 0
    b = open_ns(service, 2, "b", 512 * 1024)
    r = store(service, 2, b, [b"b-%06d" % i for i in range(4 * (total // 2))])
    assert isinstance(r, m.StorePlanReply)
    extents = {n.name: len(n.slots.extents) for n in service.namespaces.values()}
    assert extents["b"] == total // 2 and extents["a"] == total - total // 2
    evicted = [k for e in service.namespaces[a].take_events(1) if e.removed for k in e.keys]
    assert len(evicted) == 2 * (total // 2)
    # what a kept is still there and readable
    assert service.namespaces[a].lookup(keys_a[: len(keys_a) - len(evicted)]) > 0


def test_pinned_extent_is_never_reclaimed(service: Service) -> None:
    a = open_ns(service, 1, "a", 1 * MIB)
    total = service.region.geometry.num_extents
    keys_a = [b"a-%06d" % i for i in range(2 * total)]
    store(service, 1, a, keys_a)
    kp, kb = pack_keys(keys_a)
    service.handle(service.sessions[1], m.PrepareLoad(4, a, kp, kb))  # pin everything
    b = open_ns(service, 2, "b", 512 * 1024)
    from kvoffload.protocol.errors import NoSpaceError

    with pytest.raises(NoSpaceError):
        store(service, 2, b, [b"b-000001"])
    assert service.namespaces[a].lookup(keys_a) == len(keys_a)


def test_incompatible_region_is_refused_unless_discarded() -> None:
    name = f"/kvoffload-stale{uuid.uuid4().hex[:6]}"
    g = Geometry.plan(8 * MIB, 2 * MIB, 16384)
    old = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=g.region_bytes)
    with mmap.mmap(old.fd, g.region_bytes) as mm:
        mm[:8] = MAGIC  # a kvoffload region of an unknown format version
    old.close_fd()
    with pytest.raises(RegionError, match=r"format version 0.*--discard-region"):
        SharedOffloadRegion(name, g)
    region = SharedOffloadRegion(name, g, discard=True)
    assert struct.unpack_from("<I", region.buffer.data, 8)[0] == FORMAT_VERSION
    region.close()
    with pytest.raises(posix_ipc.ExistentialError):
        posix_ipc.SharedMemory(name)


def test_copier_moves_bytes_and_reports(service: Service) -> None:
    src = np.arange(1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    copier = service.copier
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    offs = np.array([0, 4096, 65536], dtype=np.int64)
    n = np.array([4096, 8192, 1 << 19], dtype=np.int64)
    copier.submit(7, offs + base_d, offs + base_s, n)
    import select

    select.select([copier.wake_fd], [], [], 10)
    done = copier.drain()
    assert [(c.token, c.success, c.nbytes) for c in done] == [(7, True, int(n.sum()))]
    for o, k in zip(offs, n):
        assert np.array_equal(dst[o : o + k], src[o : o + k])
    assert not dst[12288:65536].any()


def test_chunk_runs_and_split_cover_every_byte_once() -> None:
    from kvoffloadd.copies.copier import chunk_runs, split_by_bytes

    dst = np.array([1000, 50_000], dtype=np.int64)
    src = np.array([0, 90_000], dtype=np.int64)
    n = np.array([10_000, 25], dtype=np.int64)
    d, s, k = chunk_runs(dst, src, n, 4096)
    assert k.tolist() == [4096, 4096, 1808, 25]
    assert d.tolist() == [1000, 5096, 9192, 50_000]
    assert s.tolist() == [0, 4096, 8192, 90_000]
    halves = split_by_bytes(k, 2)
    assert len(halves) == 2 and [i for a, b in halves for i in range(a, b)] == [0, 1, 2, 3]
    ranges = split_by_bytes(np.full(10, 7, dtype=np.int64), 3)
    assert [i for a, b in ranges for i in range(a, b)] == list(range(10))
