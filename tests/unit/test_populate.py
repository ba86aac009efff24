"""Populating the region on real memory, and pinning behind it through the fake driver:
chunks come up in order, a chunk is registered only once populated and while later
ones are still being populated, the GIL is free while the kernel works, memory lands
where the plan says (mbind, move_pages, get_mempolicy on this machine), a kept region
is found resident and only mapped, and a failure stops population without a hang."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import mmap
import os
import select
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from fake_cuda import FakeCuda

from kvoffloadd.region import kernel
from kvoffloadd.region.pinning import RegionPinner
from kvoffloadd.region.placement import ChunkStates, Part, RegionPlan, plan_region
from kvoffloadd.region.populate import Populator, populate_write, touch_pages

MIB = 1 << 20
DEADLINE_S = 10.0


@pytest.fixture
def shm() -> Iterator[mmap.mmap]:
    """64 MiB of /dev/shm, mapped shared (what the region is)."""
    path = f"/dev/shm/kvo-test-populate-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 64 * MIB)
        mm = mmap.mmap(fd, 64 * MIB)
        yield mm
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)


def address(mm: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def resident(mm: mmap.mmap) -> int:
    return kernel.resident_bytes(address(mm), len(mm))


def one_part_plan(node: int | None = None, threads: int = 2, mbind: bool = False) -> RegionPlan:
    return plan_region(64 * MIB, 16 * MIB, [Part(node, 0, frozenset())], threads, "test", mbind)


def test_the_libc_handle_releases_the_gil() -> None:
    """Scenario: a thread blocks in a C call through the handle every populate, mbind
    and move_pages call goes through; the main thread must run meanwhile: here it is
    the one that ends the call (a pipe write). Held GIL: poll times out and returns 0."""
    r, w = os.pipe()
    result: list[int] = []

    class PollFd(ctypes.Structure):
        _fields_ = (
            ("fd", ctypes.c_int),
            ("events", ctypes.c_short),
            ("revents", ctypes.c_short),
        )

    fds = PollFd(r, select.POLLIN, 0)
    started = threading.Event()

    def wait_in_c() -> None:
        started.set()
        result.append(kernel.libc.poll(ctypes.byref(fds), 1, int(DEADLINE_S * 1000)))

    t = threading.Thread(target=wait_in_c)
    t.start()
    assert started.wait(DEADLINE_S)
    os.write(w, b"x")  # needs the GIL while the other thread sits in poll
    t.join(DEADLINE_S + 1)
    os.close(r)
    os.close(w)
    assert result == [1]


def test_chunks_are_populated_in_order_by_every_thread(shm: mmap.mmap) -> None:
    plan = dataclasses.replace(one_part_plan(), threads=[2])  # (one per GiB, normally)
    states = ChunkStates(len(plan.chunks))
    assert resident(shm) == 0
    started: list[int] = []
    lock = threading.Lock()

    def touch(addr: int, n: int) -> None:
        with lock:
            started.append(addr)
        populate_write(addr, n)

    pop = Populator(address(shm), plan, states, touch=touch)
    pop.start()
    for c in range(len(plan.chunks)):
        assert states.wait_populated(c, DEADLINE_S) is True
    pop.wait()
    assert resident(shm) == 64 * MIB
    assert pop.populated_bytes == 64 * MIB and not pop.error and states.all_ready
    (part,) = pop.part_statistics()
    assert part["populated_bytes"] == 64 * MIB and part["populate_threads"] == 2
    assert sorted(started) == [address(shm) + i * 16 * MIB for i in range(4)]


def test_pieces_are_taken_in_region_order(shm: mmap.mmap) -> None:
    plan = plan_region(64 * MIB, 32 * MIB, [Part(None, 0, frozenset())], 1, "off")
    started: list[int] = []

    def touch(addr: int, n: int) -> None:
        started.append(addr)
        populate_write(addr, n)

    pop = Populator(address(shm), plan, ChunkStates(2), touch=touch)
    pop.start()
    pop.wait()
    # pieces of at most 64 MiB, cut at chunk boundaries, in order
    assert started == [address(shm), address(shm) + 32 * MIB]


def test_extents_are_ready_before_their_whole_chunk(shm: mmap.mmap) -> None:
    """Scenario: one 64 MiB chunk of four 16 MiB extents, populated piece by piece;
    the third piece is slow: the first two extents are ready meanwhile."""
    plan = plan_region(64 * MIB, 64 * MIB, [Part(None, 0, frozenset())], 1, "off")
    states = ChunkStates(1, 4, 4)
    base = address(shm)
    gate = threading.Event()

    def touch(addr: int, n: int) -> None:
        if addr - base == 32 * MIB:
            gate.wait(DEADLINE_S)
        populate_write(addr, n)

    pop = Populator(base, plan, states, touch=touch, unit_bytes=16 * MIB, piece_bytes=16 * MIB)
    pop.start()
    try:
        assert wait_for(lambda: states.ready_units() == 2)
        assert [states.is_unit_ready(u) for u in range(4)] == [True, True, False, False]
        assert not states.populated[0]
    finally:
        gate.set()
    pop.wait()
    assert states.ready_units() == 4 and states.populated[0]


def wait_for(predicate: Callable[[], bool]) -> bool:
    """Poll with a deadline (the populate threads flip plain bytes, no condition)."""
    end = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def test_a_piece_on_a_kernel_without_populate_write_is_touched(shm: mmap.mmap) -> None:
    touch_pages(address(shm), 8 * MIB)
    assert resident(shm) == 8 * MIB
    shm[:4] = b"kept"
    touch_pages(address(shm), 4096)
    assert shm[:4] == b"kept"  # a touch keeps what is there


def test_pages_land_on_the_node_the_plan_names(shm: mmap.mmap) -> None:
    """Real placement on this machine: the part's node set with mbind (shared policy
    of the object), and every sampled page there by move_pages and get_mempolicy."""
    node = 0
    plan = one_part_plan(node, mbind=True)
    states = ChunkStates(len(plan.chunks))
    pop = Populator(address(shm), plan, states)
    pop.start()
    pop.wait()
    base = address(shm)
    mode, nodes = kernel.policy_at(base + 5 * MIB)
    if pop.placement == "mbind":
        assert (mode, nodes) == (kernel.MPOL_PREFERRED, [node])
    else:  # a seccomp filter refused mbind: the threads' first touch placed the pages
        assert pop.placement == "threads" or mode == kernel.MPOL_DEFAULT
    pages = [base + i * MIB for i in range(64)]
    assert kernel.nodes_of_pages(pages) == [node] * 64
    assert kernel.node_of_page(base + 63 * MIB) == node
    (part,) = pop.part_statistics()
    assert part["local_ratio"] == 1.0


def test_a_kept_region_is_found_resident_and_only_mapped(shm: mmap.mmap) -> None:
    """Scenario: a warm restart. Every chunk is ready for copies before the mapping
    pass touched a page; pinning follows the mapping pass, which the populate threads
    run, rather than faulting every page in on its own thread."""
    populate_write(address(shm), 64 * MIB)
    plan = one_part_plan()
    states = ChunkStates(len(plan.chunks))
    gate = threading.Event()

    def slow_touch(addr: int, n: int) -> None:
        gate.wait(DEADLINE_S)
        populate_write(addr, n)

    fake = FakeCuda()
    pinner = RegionPinner(fake, address(shm), plan.chunks, wait_chunk=states.wait_mapped)
    pop = Populator(address(shm), plan, states, recovered=True, touch=slow_touch)
    pop.start()
    pinner.start()
    for c in range(len(plan.chunks)):
        assert states.wait_populated(c, DEADLINE_S) is True
        assert states.is_ready(c)
    assert pop.populated_bytes == 0 and pop.resident_at_start_bytes == 64 * MIB
    assert states.wait_mapped(0, 0.05) is None and fake.registered == []
    gate.set()
    pop.wait()
    assert pinner.done.wait(DEADLINE_S) and pinner.fully_pinned
    assert pop.populated_bytes == 64 * MIB
    pinner.close()


def test_a_failure_stops_population_and_releases_waiters(shm: mmap.mmap) -> None:
    plan = one_part_plan(threads=1)
    states = ChunkStates(len(plan.chunks))
    calls = []

    def failing(addr: int, n: int) -> None:
        calls.append(addr)
        if len(calls) > 1:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        populate_write(addr, n)

    pop = Populator(address(shm), plan, states, touch=failing)
    pop.start()
    pop.wait()
    assert "Cannot allocate memory" in pop.error
    assert states.wait_populated(0, DEADLINE_S) is True  # its one piece was done
    assert states.wait_populated(3, DEADLINE_S) is False  # will never be: no hang


class CheckingCuda(FakeCuda):
    """Registers only what is populated (a real registration of an unpopulated range
    would fault it in on the pinning thread, one page at a time)."""

    def __init__(self, states: ChunkStates, plan: RegionPlan, base: int) -> None:
        super().__init__()
        self.states, self.plan, self.base = states, plan, base
        self.unpopulated = 0
        self.pinned = threading.Semaphore(0)

    def host_register(self, ptr: int, nbytes: int) -> None:
        chunk = [off for off, _ in self.plan.chunks].index(ptr - self.base)
        self.unpopulated += not self.states.populated[chunk]
        super().host_register(ptr, nbytes)
        self.pinned.release()


def test_pinning_follows_population_chunk_by_chunk(shm: mmap.mmap) -> None:
    """Scenario: chunk 2 is slow to populate. Chunks 0 and 1 are pinned meanwhile,
    chunk 2 and 3 only once populated; every chunk's timings are kept."""
    plan = one_part_plan(threads=1)
    states = ChunkStates(len(plan.chunks))
    base = address(shm)
    gate = threading.Event()

    def touch(addr: int, n: int) -> None:
        if addr - base >= 32 * MIB:
            gate.wait(DEADLINE_S)
        populate_write(addr, n)

    fake = CheckingCuda(states, plan, base)
    pinner = RegionPinner(
        fake,
        base,
        plan.chunks,
        wait_chunk=states.wait_mapped,
        on_pinned=states.mark_pinned,
        on_stopped=states.stop_pinning,
    )
    states.track_pinning()
    pop = Populator(base, plan, states, touch=touch)
    pop.start()
    pinner.start()
    assert fake.pinned.acquire(timeout=DEADLINE_S) and fake.pinned.acquire(timeout=DEADLINE_S)
    assert not fake.pinned.acquire(timeout=0.05)  # chunk 2 is not populated: no pin yet
    assert pinner.pinned_bytes == 32 * MIB and states.ready_units() == 2
    assert not states.all_ready
    gate.set()
    assert pinner.done.wait(DEADLINE_S) and pinner.fully_pinned
    assert fake.unpopulated == 0
    assert [p for p, _ in fake.registered] == [base + off for off, _ in plan.chunks]
    st = pinner.statistics()
    assert st["pinned_chunks"] == 4 and st["pin_chunk_bytes"] == 16 * MIB
    assert len(pinner.chunk_seconds) == 4 and st["pin_error"] == ""
    assert states.all_ready
    pop.wait()
    pinner.close()
    assert fake.registered == []


def test_a_pinner_closed_while_waiting_for_population_stops(shm: mmap.mmap) -> None:
    plan = one_part_plan(threads=1)
    states = ChunkStates(len(plan.chunks))
    fake = FakeCuda()
    pinner = RegionPinner(fake, address(shm), plan.chunks, wait_chunk=states.wait_mapped)
    pinner.start()  # nothing is being populated: it waits on chunk 0
    pinner.close()
    assert pinner.done.is_set() and pinner.pinned_bytes == 0 and fake.registered == []
