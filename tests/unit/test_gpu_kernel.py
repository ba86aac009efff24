"""The gather kernel path against the fake driver: the choice, the tiles and launch
parameters, and byte-exact transfers through the daemon (the fake runs each launch's
tile records as gather.cu does, so the planned descriptors are checked byte for byte).

What tests/gpu checks on a real GPU (the kernel's bytes against the DMA path's),
checked here for logic.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest
from fake_cuda import FakeCuda, FakeCudaTensor
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gpu_path import BLOCKS, PAGES, Rig, attach, gpu_caches, make_rig, open_ns, prepare

from kvoffload.cuda.export import StoreFence, export_cuda_caches
from kvoffload.protocol import messages as m
from kvoffload.protocol.packing import pack_ids, pack_keys
from kvoffloadbench.inproc import handle_now
from kvoffloadd.copies.calibrate import calibrate
from kvoffloadd.copies.choice import (
    WARPS_PER_CTA,
    DeviceChoice,
    Timings,
    crossover,
    grid_ctas,
    kernel_runs,
    tiles,
)
from kvoffloadd.copies.gather import TileRing, load_kernel

COPIES = Path(__file__).parents[2] / "daemon" / "kvoffloadd" / "copies"
SIZES = (512, 8192, 65536, 1 << 20)
COUNTS = (1, 16, 256)
SMALL_CALIBRATION = {"scratch_bytes": 1 << 20, "sizes": (512, 8192), "counts": (1, 16)}


# ------------------------------------------------------------------ the shipped PTX


def test_the_shipped_ptx_is_built_from_the_source() -> None:
    """tools/build-ptx records the source's hash: a changed gather.cu needs a rebuild."""
    first = (COPIES / "gather.ptx").read_text().splitlines()[0]
    digest = hashlib.sha256((COPIES / "gather.cu").read_bytes()).hexdigest()
    assert first == f"// kvoffload gather.cu sha256 {digest}", "run tools/build-ptx"
    ptx = (COPIES / "gather.ptx").read_text()
    assert re.search(r"^\.version 7\.0$", ptx, re.M) and re.search(r"^\.target sm_80$", ptx, re.M)


# ------------------------------------------------------------------ the choice


def timings(per_run_s: dict[int, float], fixed_s: float) -> Timings:
    """Times of a method costing ``fixed_s`` per call and ``per_run_s[size]`` per run."""
    t = np.array([[fixed_s + c * per_run_s[s] for c in COUNTS] for s in SIZES])
    return Timings(SIZES, COUNTS, t)


def link_choice() -> DeviceChoice:
    """DMA: 2 us per descriptor plus the bytes at 50 GB/s; the kernel: 20 us a launch,
    the bytes at 45 GB/s (the same both ways)."""
    dma = timings({s: 2e-6 + s / 50e9 for s in SIZES}, 5e-6)
    kernel = timings({s: s / 45e9 for s in SIZES}, 20e-6)
    both = {True: kernel, False: kernel}
    return DeviceChoice(both, {True: dma, False: dma}, {True: 8, False: 8})


def test_predictions_interpolate_the_measured_grid() -> None:
    t = timings({s: s * 1e-9 for s in SIZES}, 1e-5)
    assert t.predict(8192, 16) == pytest.approx(1e-5 + 16 * 8192e-9)
    assert t.predict(8192, 100) == pytest.approx(1e-5 + 100 * 8192e-9)  # linear in count
    assert t.predict(8192, 1000) == pytest.approx(1e-5 + 1000 * 8192e-9)  # extrapolated
    between = t.predict(16384, 16)  # geometric between 8 KiB and 64 KiB
    assert t.predict(8192, 16) < between < t.predict(65536, 16)
    holes = t.seconds.copy()
    holes[-1, 1:] = np.nan  # 1 MiB runs measured once only
    t2 = Timings(SIZES, COUNTS, holes)
    assert t2.predict(1 << 20, 4) == pytest.approx(4 * holes[-1, 0])


def test_small_runs_go_to_the_kernel_large_ones_to_dma() -> None:
    choice = link_choice()
    for to_host in (True, False):
        n = np.array([512] * 64 + [8192] * 64 + [1 << 20] * 64, dtype=np.int64)
        addr = np.arange(n.size, dtype=np.int64) * (2 << 20)
        mine = kernel_runs(choice, to_host, addr, addr + (1 << 40), n)
        assert mine[:128].all() and not mine[128:].any()
    assert crossover(choice.kernel[True], choice.dma[True]) == 1 << 20


def test_the_choice_depends_on_the_run_count() -> None:
    """One 8 KiB run: the kernel's launch costs more than one descriptor; 256 do not."""
    choice = link_choice()
    one = np.array([8192], dtype=np.int64)
    assert not kernel_runs(choice, True, one * 0, one * 0 + 4096, one).any()
    many = np.full(256, 8192, dtype=np.int64)
    addr = np.arange(256, dtype=np.int64) * 16384
    assert kernel_runs(choice, True, addr, addr + (1 << 30), many).all()


def test_one_size_class_is_one_choice_and_misaligned_runs_still_stay_with_dma() -> None:
    """Runs of one size class (here 512 to 1008 bytes) are decided once, as a whole;
    the misaligned one among them goes by DMA all the same, and asking again gives the
    same answer (from the device's memo)."""
    choice = link_choice()
    n = np.array([512, 1008, 784, 512] * 64, dtype=np.int64)
    dst = np.arange(n.size, dtype=np.int64) * 4096
    src = dst + (1 << 30)
    src[5] += 8
    for _ in range(2):
        mine = kernel_runs(choice, True, dst, src, n)
        assert not mine[5] and mine.sum() == n.size - 1


def test_misaligned_runs_stay_with_dma_even_always() -> None:
    n = np.array([512, 520, 512, 512], dtype=np.int64)
    dst = np.array([0, 4096, 8196, 12288], dtype=np.int64)
    src = np.array([1 << 20, 2 << 20, 3 << 20, (4 << 20) + 8], dtype=np.int64)
    assert kernel_runs(None, True, dst, src, n).tolist() == [True, False, False, False]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 200), min_size=0, max_size=30),
    st.sampled_from([16, 64, 4096]),
)
def test_tiles_cover_every_byte_once(units: list[int], tile_bytes: int) -> None:
    nbytes = np.array(units, dtype=np.int64) * 16
    dst = np.cumsum(np.concatenate(([0], nbytes[:-1] + 32))).astype(np.int64) if units else nbytes
    src = dst * 3 + (1 << 20)
    td, ts, tn = tiles(dst, src, nbytes, tile_bytes)
    assert (tn <= tile_bytes).all() and (tn > 0).all() and int(tn.sum()) == int(nbytes.sum())
    assert ((td | ts | tn) % 16 == 0).all()
    want = {(int(d) + k, int(s) + k) for d, s, n in zip(dst, src, nbytes) for k in range(0, n, 16)}
    got = {(int(d) + k, int(s) + k) for d, s, n in zip(td, ts, tn) for k in range(0, n, 16)}
    assert got == want


def test_grid_has_a_warp_per_tile_up_to_the_calibrated_ctas() -> None:
    assert grid_ctas(1, 264) == 1
    assert grid_ctas(WARPS_PER_CTA * 10 + 1, 264) == 11
    assert grid_ctas(100_000, 264) == 264


# ------------------------------------------------------------------ launches


def test_a_ring_launch_copies_every_tile_in_launches_of_its_capacity() -> None:
    fake = FakeCuda()
    kernel, why = load_kernel(fake, 0)
    assert kernel is not None, why
    src = fake.alloc(1 << 20)
    src[:] = np.random.default_rng(3).integers(0, 256, src.size, dtype=np.uint8)
    dst = fake.alloc(1 << 20)
    rng = np.random.default_rng(4)
    pages = rng.permutation(256)[:100].astype(np.int64)
    s_addr = int(src.ctypes.data) + pages * 4096
    d_addr = int(dst.ctypes.data) + np.arange(100, dtype=np.int64) * 4096
    ring = TileRing(fake, capacity=64, buffers=2)
    stream = fake.stream_create()
    n = np.full(100, 4096, dtype=np.int64)
    gate = fake.hold(stream)  # the engine's work ahead: two launches queue behind it
    ring.launch(kernel, d_addr[:32], s_addr[:32], n[:32], stream, 3, 2048)
    assert not dst.any() and fake.calls["event_synchronize"] == 0
    fake.release(gate)
    ring.launch(kernel, d_addr, s_addr, n, stream, 3, 1024)  # 400 tiles: 7 launches
    assert fake.calls["event_synchronize"] == 6  # each reuse waited for its buffer
    ring.close()
    want = src.reshape(256, 4096)[pages]
    assert np.array_equal(dst[: 100 * 4096].reshape(100, 4096), want)
    assert fake.launches == [(3, 256, 64)] * 7 + [(2, 256, 16)]
    assert fake.calls["mem_alloc"] == fake.calls["mem_free"] == 2


def test_a_device_that_cannot_load_the_kernel_copies_with_dma() -> None:
    for fake, why in (
        (FakeCuda(module_error="CUDA_ERROR_UNSUPPORTED_PTX_VERSION"), "UNSUPPORTED_PTX"),
        (FakeCuda(host_pointer_ok=False), "host address"),
    ):
        kernel, reason = load_kernel(fake, 0)
        assert kernel is None and why in reason


# ------------------------------------------------------------------ through the daemon


def kernel_rig(mode: str, fake: FakeCuda | None = None, **kw: object) -> Rig:
    gen = make_rig(fake or FakeCuda(), kernel_mode=mode, **kw)  # type: ignore[arg-type]
    rig = next(gen)
    rig.gen = gen  # type: ignore[attr-defined]
    return rig


def close(rig: Rig) -> None:
    next(rig.gen, None)  # type: ignore[attr-defined]


def store_then_load(rig: Rig, n: int = 6) -> tuple[list[FakeCudaTensor], list[FakeCudaTensor]]:
    ns = open_ns(rig, 1)
    src = gpu_caches(rig.fake, seed=8)
    w, fence = attach(rig, ns, src)
    assert rig.svc.gpu is not None and rig.svc.gpu.paths[0].done.wait(10)
    keys = [b"k%02d" % i for i in range(n)]
    slots = prepare(rig, ns, keys)
    ids = np.random.default_rng(2).permutation(BLOCKS)[:n]
    fence.record(0)
    rig.svc.handle(rig.session(), m.SubmitStore(4, w, 1, pack_ids(ids), pack_ids(slots)))
    rig.drain()
    kp, kb = pack_keys(keys)
    rig.svc.handle(rig.session(), m.CompleteStore(5, ns, kp, kb, True))
    dst = gpu_caches(rig.fake, seed=None)
    w2, _ = attach(rig, ns, dst)
    lslots = prepare(rig, ns, keys, load=True)
    back = np.arange(n) + 3
    rig.svc.handle(rig.session(), m.SubmitLoad(6, w2, 1, pack_ids(lslots), pack_ids(back)))
    rig.drain()
    for s, d in zip(src, dst):
        assert np.array_equal(d.rows[back], s.rows[ids])
    return src, dst


def test_always_copies_every_run_with_the_kernel_byte_exact() -> None:
    rig = kernel_rig("always")
    try:
        store_then_load(rig)
        st = rig.svc.gpu.kernel_counts()  # type: ignore[union-attr]
        assert st == (2, 2 * 6 * sum(PAGES))
        assert rig.svc.gpu.lane_counts() == (0, 0)  # type: ignore[union-attr]
        assert rig.svc.gpu.paths[0].describe()["state"] == "ready"  # type: ignore[union-attr]
    finally:
        close(rig)


def test_auto_calibrates_on_the_device_and_follows_its_choice() -> None:
    rig = kernel_rig("auto", calibration=SMALL_CALIBRATION)
    try:
        store_then_load(rig)
        paths = rig.svc.gpu.paths[0]  # type: ignore[union-attr]
        assert paths.choice is not None
        for to_host in (True, False):
            assert not np.isnan(paths.choice.kernel[to_host].seconds).any()
            assert paths.choice.max_ctas[to_host] in (1, 2, 4, 8)
        jobs, _ = rig.svc.gpu.kernel_counts()  # type: ignore[union-attr]
        batched, looped = rig.svc.gpu.lane_counts()  # type: ignore[union-attr]
        assert jobs + batched + looped >= 2  # every job went one way or both
    finally:
        close(rig)


def test_an_unpinned_region_never_reaches_the_kernel() -> None:
    rig = kernel_rig("always", pin=False)
    try:
        store_then_load(rig, 2)
        assert rig.svc.gpu.kernel_counts() == (0, 0)  # type: ignore[union-attr]
        assert rig.svc.gpu.lane_counts() == (0, 2)  # type: ignore[union-attr]
    finally:
        close(rig)


def test_a_kernel_that_does_not_load_leaves_dma_byte_exact() -> None:
    rig = kernel_rig("always", FakeCuda(module_error="CUDA_ERROR_INVALID_PTX"))
    try:
        store_then_load(rig, 2)
        assert rig.svc.gpu.kernel_counts() == (0, 0)  # type: ignore[union-attr]
        state = rig.svc.gpu.paths[0].describe()["state"]  # type: ignore[union-attr]
        assert state.startswith("dma only") and "CUDA_ERROR_INVALID_PTX" in state
    finally:
        close(rig)


def test_canonical_fragments_scatter_through_the_kernel() -> None:
    """NHD-like fragments: 512-byte pieces of the worker's page interleaved into the
    canonical page; the region holds them where the mapping says, and load gathers
    them back."""
    rig = kernel_rig("always")
    try:
        page, frag = 16384, 512
        n_frags = page // frag
        order = np.random.default_rng(5).permutation(n_frags)
        frags = np.array([[i * frag, int(order[i]) * frag, frag] for i in range(n_frags)])
        canon = m.CanonicalDesc(page, frags.astype("<i8").tobytes())
        s = rig.session()
        r = rig.svc.handle(s, m.OpenNamespace(1, "canon", m.KVLayout([page], 1, 1)))
        assert isinstance(r, m.NamespaceOpened)
        rows = rig.fake.alloc(BLOCKS * page).reshape(BLOCKS, page)
        rows[:] = np.random.default_rng(6).integers(0, 256, rows.shape, dtype=np.uint8)
        export = export_cuda_caches([FakeCudaTensor(rows)], rig.fake)
        fence = StoreFence(rig.fake, 0)
        attach_msg = m.AttachWorker(
            2, r.ns, 0, export.descs, export.device_uuid, fence.handle, canonical=[canon]
        )
        wa = handle_now(rig.svc, s, attach_msg)
        assert isinstance(wa, m.WorkerAttached)
        assert rig.svc.gpu is not None and rig.svc.gpu.paths[0].done.wait(10)
        slots = prepare(rig, r.ns, [b"a", b"b"])
        fence.record(0)
        rig.svc.handle(s, m.SubmitStore(4, wa.worker, 1, pack_ids([7, 2]), pack_ids(slots)))
        rig.drain()
        off = rig.svc.namespaces[r.ns].slots.region_offsets(slots)
        region = rig.svc.region.buffer
        for o, b in zip(off.tolist(), (7, 2)):
            stored = region[o : o + page].reshape(n_frags, frag)
            assert np.array_equal(stored[order], rows[b].reshape(n_frags, frag))
        assert rig.svc.gpu.kernel_counts() == (1, 2 * page)
        assert len(rig.fake.launches) == 1 and rig.fake.launches[0][2] > n_frags  # fragments
    finally:
        close(rig)


def test_calibration_times_every_cell_it_can_hold() -> None:
    fake = FakeCuda(multiprocessors=8)
    kernel, _ = load_kernel(fake, 0)
    assert kernel is not None
    choice = calibrate(
        fake, 0, kernel, scratch_bytes=1 << 20, sizes=(512, 65536, 1 << 20), counts=(1, 16)
    )
    for to_host in (True, False):
        k = choice.kernel[to_host].seconds
        assert not np.isnan(k[:2]).any() and not np.isnan(k[2, 0]) and np.isnan(k[2, 1])
        assert choice.max_ctas[to_host] in (2, 4, 8, 16)
    assert fake.calls["mem_alloc"] == fake.calls["mem_free"]
    assert fake.calls["host_alloc"] == fake.calls["host_free"]
