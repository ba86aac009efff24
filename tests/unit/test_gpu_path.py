"""The daemon's GPU data path against a fake CUDA driver (no GPU needed).

What tests/gpu checks on a real GPU, checked here for logic: export descriptors,
import validation and handle lifetimes, chunked pinning, run splitting, the store
fence, batched versus looped copies, and block_size_factor/skip semantics identical
to the CPU path.
"""

from __future__ import annotations

import select
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from fake_cuda import FakeCuda, FakeCudaTensor
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.cuda.export import StoreFence, export_cuda_caches
from kvoffload.datapath.runs import split_at_boundaries
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.packing import pack_ids, pack_keys
from kvoffloadbench.inproc import handle_now
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import CpuCopier
from kvoffloadd.copies.gpu import GpuRuntime
from kvoffloadd.region.pinning import MAX_CHUNK_BYTES, RegionPinner, plan_chunks
from kvoffloadd.region.region import Geometry, SharedOffloadRegion
from kvoffloadd.service.service import Service
from kvoffloadd.service.session import Session

MIB = 1 << 20
PAGES = [4096, 8192]
BLOCKS = 32
UUID = b"\x11" * 16


# ------------------------------------------------------------------ pure planning


def test_pinning_chunks_are_extent_aligned_and_at_most_64_gib() -> None:
    chunks = plan_chunks(4200 * 48 * MIB, 48 * MIB)  # ~197 GiB of 48 MiB extents
    assert all(n <= MAX_CHUNK_BYTES and off % (48 * MIB) == 0 for off, n in chunks)
    assert all(n % (48 * MIB) == 0 for _, n in chunks)
    assert sum(n for _, n in chunks) == 4200 * 48 * MIB and len(chunks) == 4
    assert [off for off, _ in chunks] == sorted({off for off, _ in chunks})
    assert plan_chunks(64 * MIB, 4 * MIB) == [(0, 64 * MIB)]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 3000)), min_size=0, max_size=20),
    st.integers(64, 1024),
)
def test_split_at_boundaries_covers_every_byte_once(
    runs: list[tuple[int, int]], boundary: int
) -> None:
    region = np.array([r for r, _ in runs], dtype=np.int64)
    nbytes = np.array([n for _, n in runs], dtype=np.int64)
    other = region * 3 + 100_000  # any distinct mapping of the other side
    r2, o2, n2 = split_at_boundaries(region, other, nbytes, boundary)
    assert np.all((r2 // boundary) == ((r2 + n2 - 1) // boundary)), "a piece crosses"
    want = {(int(r) + k, int(o) + k) for r, o, n in zip(region, other, nbytes) for k in range(n)}
    got = {(int(r) + k, int(o) + k) for r, o, n in zip(r2, o2, n2) for k in range(n)}
    assert got == want and int(n2.sum()) == int(nbytes.sum())


# ------------------------------------------------------------------ pinning


def test_pinner_registers_every_chunk_and_unregisters_on_close() -> None:
    fake = FakeCuda()
    pinner = RegionPinner(fake, 1 << 40, plan_chunks(96 * MIB, 8 * MIB, 32 * MIB))
    pinner.start()
    assert pinner.done.wait(10)
    assert pinner.fully_pinned and pinner.pinned_bytes == 96 * MIB
    assert fake.registered == [((1 << 40) + i * 32 * MIB, 32 * MIB) for i in range(3)]
    pinner.close()
    assert fake.registered == []


def test_a_failed_registration_keeps_the_daemon_pageable() -> None:
    fake = FakeCuda(fail_register_at=1)
    pinner = RegionPinner(fake, 1 << 40, plan_chunks(96 * MIB, 8 * MIB, 32 * MIB))
    pinner.start()
    assert pinner.done.wait(10)
    assert not pinner.fully_pinned and pinner.pinned_bytes == 32 * MIB
    assert "CUDA_ERROR_OUT_OF_MEMORY" in pinner.error
    pinner.close()
    assert fake.registered == []


# ------------------------------------------------------------------ export


def test_export_describes_views_inside_one_allocation() -> None:
    fake = FakeCuda()
    buf = fake.alloc(4096 + BLOCKS * sum(PAGES))
    a = buf[4096 : 4096 + BLOCKS * 4096].reshape(BLOCKS, 4096)
    b = buf[4096 + BLOCKS * 4096 :].reshape(BLOCKS, 8192)
    export = export_cuda_caches([FakeCudaTensor(a), FakeCudaTensor(b)], fake)
    assert export.device_uuid == UUID and export.ordinal == 0
    d0, d1 = export.descs
    assert (d0.kind, d0.offset_bytes, d0.page_bytes, d0.num_blocks) == ("cuda", 4096, 4096, 32)
    assert d1.offset_bytes == 4096 + BLOCKS * 4096 and d1.row_stride_bytes == 8192
    assert d0.ipc_handle == d1.ipc_handle and len(d0.ipc_handle) == 64


def test_memory_cuda_ipc_cannot_export_is_refused_with_what_to_change() -> None:
    fake = FakeCuda(ipc_capable=False)
    t = FakeCudaTensor(fake.alloc(BLOCKS * 4096).reshape(BLOCKS, 4096))
    with pytest.raises(InvalidArgumentError, match="expandable_segments:False"):
        export_cuda_caches([t], fake)
    with pytest.raises(InvalidArgumentError, match="one GPU"):
        export_cuda_caches([t, FakeCudaTensor(t.rows, device=1)], FakeCuda())


# ------------------------------------------------------------------ daemon side


@dataclass
class Rig:
    fake: FakeCuda
    svc: Service
    copier: CpuCopier
    pinner: RegionPinner

    def session(self, sid: int = 1) -> Session:
        return self.svc.sessions.get(sid) or self.svc.open_session(sid, 1, 0, 0)

    def drain(self, timeout_s: float = 10.0) -> list[tuple[int, m.Reply]]:
        """Apply finished copies; waits up to ``timeout_s`` for the first."""
        r, _, _ = select.select([self.copier.wake_fd], [], [], timeout_s)
        return self.svc.on_completions(self.copier.drain()) if r else []


def make_rig(
    fake: FakeCuda,
    pin: bool = True,
    verify: bool = False,
    kernel_mode: str = "off",
    calibration: dict[str, object] | None = None,
) -> Iterator[Rig]:
    cfg = DaemonConfig(
        instance=f"g{uuid.uuid4().hex[:8]}",
        region_size="32MiB",
        extent_size="2MiB",
        verify_checksums=verify,
    )
    region = SharedOffloadRegion(cfg.region_name, Geometry.plan(cfg.region_bytes, 2 * MIB, 4096))
    copier = CpuCopier(1)
    g = region.geometry
    base = int(region.buffer.ctypes.data) + g.data_offset
    pinner = RegionPinner(fake, base, plan_chunks(g.num_extents * g.extent_bytes, 2 * MIB, 8 * MIB))
    if pin:
        pinner.start()
        assert pinner.done.wait(10)
    gpu = GpuRuntime(fake, copier.sink, base, pinner, kernel_mode, calibration)
    svc = Service(cfg, region, copier, gpu)
    yield Rig(fake, svc, copier, pinner)
    gpu.close()
    copier.close()
    svc.namespaces.clear()
    region.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    yield from make_rig(FakeCuda())


def open_ns(rig: Rig, factor: int) -> int:
    r = rig.svc.handle(
        rig.session(), m.OpenNamespace(1, f"ns{factor}", m.KVLayout(PAGES, 1, factor))
    )
    assert isinstance(r, m.NamespaceOpened)
    return r.ns


def gpu_caches(fake: FakeCuda, seed: int | None) -> list[FakeCudaTensor]:
    rng = np.random.default_rng(seed)
    out = []
    for p in PAGES:
        rows = fake.alloc(BLOCKS * p).reshape(BLOCKS, p)
        if seed is not None:
            rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
        out.append(FakeCudaTensor(rows))
    return out


def attach(rig: Rig, ns: int, caches: list[FakeCudaTensor]) -> tuple[int, StoreFence]:
    export = export_cuda_caches(caches, rig.fake)
    fence = StoreFence(rig.fake, 0)
    r = handle_now(
        rig.svc,
        rig.session(),
        m.AttachWorker(2, ns, 0, export.descs, export.device_uuid, fence.handle),
    )
    assert isinstance(r, m.WorkerAttached)
    return r.worker, fence


def prepare(rig: Rig, ns: int, keys: list[bytes], load: bool = False) -> np.ndarray:
    kp, kb = pack_keys(keys)
    s = rig.session()
    if load:
        r = rig.svc.handle(s, m.PrepareLoad(3, ns, kp, kb))
        assert isinstance(r, m.LoadPlanReply)
    else:
        r = rig.svc.handle(s, m.PrepareStore(3, ns, kp, kb))
        assert isinstance(r, m.StorePlanReply)
    return np.frombuffer(r.slots, dtype=np.int64)


def test_store_and_load_keep_factor_and_skip_semantics(rig: Rig) -> None:
    factor, skip, n = 3, 1, 8
    ns = open_ns(rig, factor)
    src = gpu_caches(rig.fake, seed=5)
    w, fence = attach(rig, ns, src)
    keys = [b"k%03d" % i for i in range(n)]
    src_ids = np.random.default_rng(1).permutation(BLOCKS)[: n * factor]
    slots = prepare(rig, ns, keys)
    fence.record(0)
    rig.svc.handle(rig.session(), m.SubmitStore(4, w, 1, pack_ids(src_ids), pack_ids(slots)))
    rig.drain()
    kp, kb = pack_keys(keys)
    rig.svc.handle(rig.session(), m.CompleteStore(5, ns, kp, kb, True))
    dst = gpu_caches(rig.fake, seed=None)
    w2, _ = attach(rig, ns, dst)
    lslots = prepare(rig, ns, keys, load=True)
    dst_ids = np.arange(n * factor - skip) + 2
    r = rig.svc.handle(
        rig.session(), m.SubmitLoad(6, w2, 1, pack_ids(lslots), pack_ids(dst_ids), skip)
    )
    assert isinstance(r, m.OkReply)
    rig.drain()
    for s, d in zip(src, dst):
        assert np.array_equal(d.rows[dst_ids], s.rows[src_ids[skip:]])
    batched, looped = rig.svc.gpu.lane_counts()  # type: ignore[union-attr]
    assert (batched, looped) == (2, 0)
    assert rig.fake.calls["memcpy_batch_async"] == 2


def test_store_waits_for_the_engine_stream(rig: Rig) -> None:
    """A store must copy what the engine's queued kernels write, not what was there."""
    ns = open_ns(rig, 1)
    src = gpu_caches(rig.fake, seed=None)  # zeros until the "kernel" writes
    w, fence = attach(rig, ns, src)
    slots = prepare(rig, ns, [b"late"])
    gate = rig.fake.hold(0)  # the engine's stream is still busy computing KV
    fence.record(0)
    rig.svc.handle(rig.session(), m.SubmitStore(4, w, 1, pack_ids([3]), pack_ids(slots)))
    assert rig.drain(timeout_s=0.2) == [] and rig.svc.inflight_jobs == 1
    for t in src:  # the kernel writes the KV ...
        t.rows[3] = 0xAB
    rig.fake.release(gate)  # ... and finishes
    rig.drain()
    region = rig.svc.region.buffer
    off = int(rig.svc.namespaces[ns].slots.region_offsets(slots)[0])
    assert (region[off : off + sum(PAGES)] == 0xAB).all()


def test_import_is_validated_and_never_leaks_handles(rig: Rig) -> None:
    ns = open_ns(rig, 1)
    export = export_cuda_caches(gpu_caches(rig.fake, None), rig.fake)
    fence = StoreFence(rig.fake, 0).handle
    s = rig.session()
    with pytest.raises(InvalidArgumentError, match="not visible to kvoffloadd"):
        handle_now(rig.svc, s, m.AttachWorker(2, ns, 0, export.descs, b"\x22" * 16, fence))
    with pytest.raises(InvalidArgumentError, match="do not tile"):
        handle_now(rig.svc, s, m.AttachWorker(2, ns, 0, export.descs[:1], UUID, fence))
    with pytest.raises(InvalidArgumentError, match="store event"):
        handle_now(rig.svc, s, m.AttachWorker(2, ns, 0, export.descs, UUID, b""))
    too_big = [
        export.descs[0],
        m.CacheDesc("cuda", BLOCKS + 1, 8192, -1, 0, 8192, export.descs[1].ipc_handle),
    ]
    with pytest.raises(InvalidArgumentError, match="CUDA allocation holds"):
        handle_now(rig.svc, s, m.AttachWorker(2, ns, 0, too_big, UUID, fence))
    assert sum(rig.fake.open_refs.values()) == 0 and rig.svc.gpu.open_handles == 0  # type: ignore[union-attr]


def test_shared_allocation_opened_once_and_closed_only_after_drain(rig: Rig) -> None:
    ns = open_ns(rig, 1)
    buf = rig.fake.alloc(BLOCKS * sum(PAGES))
    caches = [
        FakeCudaTensor(buf[: BLOCKS * 4096].reshape(BLOCKS, 4096)),
        FakeCudaTensor(buf[BLOCKS * 4096 :].reshape(BLOCKS, 8192)),
    ]
    w, fence = attach(rig, ns, caches)
    base = int(buf.ctypes.data)
    assert rig.fake.open_refs[base] == 1 and rig.svc.gpu.open_handles == 1  # type: ignore[union-attr]
    slots = prepare(rig, ns, [b"x"])
    gate = rig.fake.hold(0)
    fence.record(0)
    rig.svc.handle(rig.session(), m.SubmitStore(4, w, 1, pack_ids([0]), pack_ids(slots)))
    assert rig.svc.handle(rig.session(), m.DetachWorker(9, w)) is None  # deferred
    assert rig.fake.closed == []
    rig.fake.release(gate)
    replies = rig.drain()
    assert (1, m.OkReply(9)) in replies
    end = time.monotonic() + 10  # a copier thread closes the import, off the loop
    while not rig.fake.closed and time.monotonic() < end:
        rig.drain(0.1)
    assert rig.fake.closed == [base] and rig.fake.open_refs[base] == 0


def test_unpinned_region_uses_a_copy_loop() -> None:
    for fake, pin in ((FakeCuda(), False), (FakeCuda(has_batch=False), True)):
        for r in make_rig(fake, pin):
            ns = open_ns(r, 1)
            w, fence = attach(r, ns, gpu_caches(fake, seed=2))
            slots = prepare(r, ns, [b"a", b"b"])
            fence.record(0)
            r.svc.handle(r.session(), m.SubmitStore(4, w, 1, pack_ids([5, 9]), pack_ids(slots)))
            r.drain()
            assert r.svc.gpu.lane_counts() == (0, 1)  # type: ignore[union-attr]
            assert fake.calls["memcpy_async"] == 4 and fake.calls["memcpy_batch_async"] == 0


def test_a_daemon_without_gpus_refuses_cuda_workers_clearly() -> None:
    cfg = DaemonConfig(instance=f"n{uuid.uuid4().hex[:8]}", region_size="8MiB", extent_size="2MiB")
    region = SharedOffloadRegion(cfg.region_name, Geometry.plan(cfg.region_bytes, 2 * MIB, 4096))
    copier = CpuCopier(1)
    try:
        svc = Service(cfg, region, copier, None, "no CUDA driver (libcuda.so.1 missing)")
        s = svc.open_session(1, 1, 0, 0)
        r = svc.handle(s, m.OpenNamespace(1, "n", m.KVLayout(PAGES)))
        assert isinstance(r, m.NamespaceOpened)
        descs = [m.CacheDesc("cuda", 4, p, -1, 0, p, b"\0" * 64) for p in PAGES]
        with pytest.raises(InvalidArgumentError, match=r"libcuda\.so\.1 missing"):
            handle_now(svc, s, m.AttachWorker(2, r.ns, 0, descs, UUID, b"\0" * 64))
    finally:
        copier.close()
        region.close()


def test_gpu_loads_verify_checksums_before_copying() -> None:
    fake = FakeCuda()
    for r in make_rig(fake, verify=True):
        ns = open_ns(r, 1)
        w, fence = attach(r, ns, gpu_caches(fake, seed=3))
        keys = [b"a", b"b"]
        slots = prepare(r, ns, keys)
        fence.record(0)
        r.svc.handle(r.session(), m.SubmitStore(4, w, 1, pack_ids([1, 2]), pack_ids(slots)))
        r.drain()
        kp, kb = pack_keys(keys)
        r.svc.handle(r.session(), m.CompleteStore(5, ns, kp, kb, True))
        off = int(r.svc.namespaces[ns].slots.region_offsets(slots[1:])[0])
        r.svc.region.buffer[off] ^= 1
        dst = gpu_caches(fake, seed=None)
        w2, _ = attach(r, ns, dst)
        lslots = prepare(r, ns, keys, load=True)
        r.svc.handle(r.session(), m.SubmitLoad(6, w2, 1, pack_ids(lslots), pack_ids([0, 1])))
        r.drain()
        assert r.svc.workers[w2].finished[0].success is False
        assert not any(t.rows.any() for t in dst)
        assert r.svc.errors_by_code["CHECKSUM_MISMATCH"] == 1


def test_runs_that_cross_a_pinning_chunk_are_cut_there(rig: Rig) -> None:
    """A batched copy may not span two host registrations (the fake refuses one, as
    the driver does): contiguous blocks into contiguous slots merge into one run
    longer than a pinning chunk (8 MiB here), which the lane cuts where chunks meet;
    every byte lands, both ways."""
    page, n = 16384, 768  # 12 MiB
    r = rig.svc.handle(rig.session(), m.OpenNamespace(1, "long", m.KVLayout([page], 1, 1)))
    assert isinstance(r, m.NamespaceOpened)
    src = FakeCudaTensor(rig.fake.alloc(n * page).reshape(n, page))
    src.rows[:] = np.random.default_rng(3).integers(0, 256, src.rows.shape, dtype=np.uint8)
    w, fence = attach(rig, r.ns, [src])
    keys = [b"c%04d" % i for i in range(n)]
    slots = prepare(rig, r.ns, keys)
    assert (np.diff(slots) == 1).all(), "the test wants one run"
    fence.record(0)
    ids = pack_ids(np.arange(n))
    rig.svc.handle(rig.session(), m.SubmitStore(4, w, 1, ids, pack_ids(slots)))
    rig.drain()
    kp, kb = pack_keys(keys)
    rig.svc.handle(rig.session(), m.CompleteStore(5, r.ns, kp, kb, True))
    dst = FakeCudaTensor(rig.fake.alloc(n * page).reshape(n, page))
    w2, _ = attach(rig, r.ns, [dst])
    lslots = prepare(rig, r.ns, keys, load=True)
    rig.svc.handle(rig.session(), m.SubmitLoad(6, w2, 1, pack_ids(lslots), ids, 0))
    rig.drain()
    assert np.array_equal(dst.rows, src.rows)
    assert rig.svc.gpu.lane_counts() == (2, 0)  # type: ignore[union-attr]


def test_a_job_that_cannot_be_prepared_fails_alone_and_jobs_issue_in_order() -> None:
    """Jobs are prepared on a pool, several at once, but issued in the order they came;
    one whose preparation raises fails by itself and the lane goes on."""
    from concurrent.futures import ThreadPoolExecutor

    from kvoffloadd.copies.copier import CompletionSink
    from kvoffloadd.copies.lanes import CopyLane, GpuJob

    fake, sink = FakeCuda(), CompletionSink()
    src = fake.alloc(64 * 1024)
    src[:] = np.arange(src.size, dtype=np.uint64).astype(np.uint8)
    dst = np.zeros(src.size, dtype=np.uint8)
    base_s, base_d = int(src.ctypes.data), int(dst.ctypes.data)

    def prepare(job: GpuJob) -> None:
        if job.token == 2:
            raise ValueError("no runs for this one")
        at = (job.token - 1) * 8192
        job.dst = np.array([base_d + at], dtype=np.int64)
        job.src = np.array([base_s + at], dtype=np.int64)
        job.nbytes = np.array([8192], dtype=np.int64)

    empty = np.zeros(0, dtype=np.int64)
    with ThreadPoolExecutor(2) as pool:
        lane = CopyLane(fake, 0, True, sink, lambda job: False, prepare, None, pool)
        for token in range(1, 9):
            lane.submit(GpuJob(token, empty, empty, empty, 0, 0, 0.0))
        done: list[object] = []
        end = time.monotonic() + 10
        while len(done) < 8 and time.monotonic() < end:
            select.select([sink.wake_fd], [], [], 1)
            done.extend(sink.drain())
        lane.close()
    assert [c.token for c in done] == list(range(1, 9))  # type: ignore[attr-defined]
    assert [c.success for c in done] == [t != 2 for t in range(1, 9)]  # type: ignore[attr-defined]
    ok = [t for t in range(1, 9) if t != 2]
    for t in ok:
        at = (t - 1) * 8192
        assert np.array_equal(dst[at : at + 8192], src[at : at + 8192])
    sink.close()
