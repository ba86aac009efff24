"""A tier's threads (tiers/spread.py): its job threads run jobs in order and never hold
up a stop or the process's exit; how a job's blocks spread over its promotion threads,
results by block, blocks that fail on any thread failing closed, closing; and a disk
tier promoting on several threads, where a block whose MAC fails is a counted miss."""

from __future__ import annotations

import os
import pathlib
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from kvoffloadd.tiers.base import TierJob, TierNamespace, TierResult, WakeFd
from kvoffloadd.tiers.blockauth import PIECE_BYTES, SEAL, BlockMac
from kvoffloadd.tiers.disk import DiskTier
from kvoffloadd.tiers.spread import TAKE_BYTES, JobThreads, TierThreads, take_blocks

MIB = 1 << 20
DEADLINE_S = 10.0


class Done:
    """A spread's ``done``: its results, and how often it was called."""

    def __init__(self) -> None:
        self.calls: list[list[object]] = []
        self.event = threading.Event()

    def __call__(self, results: list[object]) -> None:
        self.calls.append(list(results))
        self.event.set()

    def wait(self) -> list[object]:
        assert self.event.wait(DEADLINE_S), "the spread did not finish"
        assert len(self.calls) == 1
        return self.calls[0]


@pytest.fixture
def two() -> Iterator[TierThreads]:
    threads = TierThreads(2, "test")
    yield threads
    assert threads.close(DEADLINE_S)


def test_job_threads_run_jobs_in_order_and_survive_one_that_raises() -> None:
    jobs = JobThreads(1, "t")
    ran: list[int] = []
    done = threading.Event()

    def boom() -> None:
        raise RuntimeError("a tier fault")

    jobs.submit(ran.append, 1)
    jobs.submit(boom)
    jobs.submit(ran.append, 2)
    jobs.submit(done.set)
    assert done.wait(DEADLINE_S) and ran == [1, 2]
    assert jobs.close(DEADLINE_S)


def test_a_job_stuck_in_io_holds_neither_close_nor_the_exit() -> None:
    """Scenario: a job never returns (a hung filesystem, a C call that does not come
    back). ``close`` gives up after its timeout and drops the jobs queued behind it,
    and the process still exits: the threads are daemon threads."""
    code = """
import threading, time
from kvoffloadd.tiers.spread import JobThreads
jobs = JobThreads(1, "stuck")
started = threading.Event()
jobs.submit(lambda: (started.set(), threading.Event().wait()))
jobs.submit(lambda: print("a queued job ran"))
assert started.wait(10)
began = time.monotonic()
assert jobs.close(0.2) is False
assert time.monotonic() - began < 5
print("closed")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE_S * 3
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "closed\n"


@pytest.mark.parametrize(
    ("n", "block_bytes", "threads", "take"),
    [
        (128, 2 * MIB, 2, 1),  # a 2 MiB block is a take of its own
        (128, 2 * MIB, 64, 1),
        (1000, 4096, 2, TAKE_BYTES // 4096),  # small blocks: 1 MiB a take
        (8, 4096, 4, 2),  # ... but every thread gets some
        (3, 4096, 8, 1),
        (0, 4096, 2, 1),
    ],
)
def test_a_take_is_a_mebibyte_of_blocks_unless_that_leaves_a_thread_idle(
    n: int, block_bytes: int, threads: int, take: int
) -> None:
    assert take_blocks(n, block_bytes, threads) == take


def test_the_blocks_of_one_job_run_on_every_thread_at_once(two: TierThreads) -> None:
    both = threading.Barrier(2, timeout=DEADLINE_S)  # broken unless two threads wait at once
    ran_on: dict[int, int] = {}

    def work(i: int) -> int:
        ran_on[i] = threading.get_ident()
        if i < 2:
            both.wait()
        return i * i

    done = Done()
    two.spread(6, 2 * MIB, work, done)
    assert done.wait() == [0, 1, 4, 9, 16, 25]
    assert ran_on[0] != ran_on[1] and threading.get_ident() not in ran_on.values()


def test_a_block_that_raises_on_its_thread_fails_closed_and_the_rest_finish(
    two: TierThreads,
) -> None:
    def work(i: int) -> bool:
        if i in (1, 4):
            raise OSError("the disk went away")
        return True

    assert two.run(6, 2 * MIB, work) == [True, None, True, True, None, True]


def test_blocks_are_taken_only_once_released(two: TierThreads) -> None:
    ran: list[int] = []
    first_two = threading.Event()

    def work(i: int) -> int:
        ran.append(i)
        if len(ran) == 2:
            first_two.set()
        return i

    done = Done()
    spread = two.spread(4, 4096, work, done, ready=0)
    spread.release(2)  # two received; two still on their way
    assert first_two.wait(DEADLINE_S)
    assert not done.calls
    spread.release(4)
    assert done.wait() == [0, 1, 2, 3] and sorted(ran) == [0, 1, 2, 3]


def test_closing_fails_what_is_queued_and_what_is_released_later() -> None:
    one = TierThreads(1, "test")
    go = threading.Event()
    started = threading.Event()

    def slow(i: int) -> str:
        started.set()
        assert go.wait(DEADLINE_S)
        return "copied"

    busy, queued, late = Done(), Done(), Done()
    one.spread(1, 2 * MIB, slow, busy)
    assert started.wait(DEADLINE_S)
    one.spread(3, 2 * MIB, lambda i: "copied", queued)
    later = one.spread(2, 2 * MIB, lambda i: "copied", late, ready=0)
    assert not one.close(0.0)  # the busy thread is left to finish
    assert queued.wait() == [None, None, None]
    later.release(2)
    assert late.wait() == [None, None]
    assert one.run(2, 2 * MIB, lambda i: "copied") == [None, None]  # no thread waits
    go.set()
    assert busy.wait() == ["copied"]
    assert one.close(DEADLINE_S)


def test_a_spread_of_no_blocks_is_done_at_once(two: TierThreads) -> None:
    done = Done()
    two.spread(0, 2 * MIB, lambda i: True, done)
    assert done.calls == [[]]


# ---------------------------------------------------------------- a disk tier

BLOCK = 64 << 10
NS = TierNamespace.of("llama", "f" * 32, BLOCK)
MAC = BlockMac(bytes(range(32)))


def finish(tier: DiskTier, wake: WakeFd, job_id: int) -> TierResult:
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        select.select([wake.fd], [], [], 0.05)
        wake.clear()
        for r in tier.get_finished():
            if r.job_id == job_id:
                return r
    raise AssertionError("the tier's job did not finish")


def test_a_block_whose_mac_fails_on_any_thread_is_a_counted_miss(tmp_path: pathlib.Path) -> None:
    wake = WakeFd()
    tier = DiskTier("disk", str(tmp_path / "d"), 64 * BLOCK, wake, mac=MAC, tier_threads=4)
    try:
        keys = [b"key-%d" % i for i in range(16)]
        blocks = [memoryview(bytearray([i]) * BLOCK) for i in range(16)]
        tier.submit_store(TierJob(1, NS, keys, blocks))
        assert all(finish(tier, wake, 1).ok)
        forged = (3, 6, 9, 14)  # one in each take of 4 blocks
        for i in forged:
            with open(tier._file((NS.tier_id, keys[i])), "r+b") as f:
                f.seek(SEAL.size + BLOCK // 2)
                f.write(b"\xff")
        slots = [memoryview(bytearray(BLOCK)) for _ in keys]
        spread_over: set[int] = set()
        together = threading.Barrier(2, timeout=DEADLINE_S)  # two takes at once
        read = tier._read

        def read_on_threads(ns: TierNamespace, e: tuple[str, bytes], out: memoryview) -> bool:
            spread_over.add(threading.get_ident())
            if e[1] in (keys[0], keys[4]):
                together.wait()
            return read(ns, e, out)

        tier._read = read_on_threads  # type: ignore[method-assign]
        tier.submit_load(TierJob(2, NS, keys, slots))
        r = finish(tier, wake, 2)
        assert r.ok == [i not in forged for i in range(16)]
        assert r.nbytes == (16 - len(forged)) * BLOCK
        assert len(spread_over) > 1
        for i, slot in enumerate(slots):
            if i not in forged:
                assert bytes(slot) == bytes([i]) * BLOCK
        stats = tier.statistics()
        assert stats["auth_bad_mac_total"] == len(forged) and stats["tier_threads"] == 4
        assert stats["load_failures_total"] == len(forged)
        assert tier.lookup(NS, keys) == [i not in forged for i in range(16)]  # dropped
    finally:
        tier.close()
        wake.close()


def test_a_read_hashes_what_landed_and_a_short_file_fails(tmp_path: pathlib.Path) -> None:
    """``read_and_hash`` (the disk tier's promotion, and the benchmark's measure of it):
    the tag of the bytes read into the slot, over pieces; a file that ends first fails
    closed, and a block whose file is cut is a miss."""
    size = 3 * PIECE_BYTES + 1000  # a last piece shorter than the others
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    path = tmp_path / "b"
    path.write_bytes(b"s" * 7 + data)
    fd = os.open(path, os.O_RDONLY)
    try:
        slot = memoryview(bytearray(size))
        assert MAC.read_and_hash(NS, b"k", slot, fd, 7) == MAC.tag(NS, b"k", data)
        assert bytes(slot) == data
        assert MAC.read_and_hash(NS, b"k", memoryview(bytearray(size + 1)), fd, 7) is None
    finally:
        os.close(fd)
    wake = WakeFd()
    tier = DiskTier("disk", str(tmp_path / "d"), 64 * BLOCK, wake, mac=MAC)
    try:
        keys = [b"whole", b"cut"]
        tier.submit_store(TierJob(1, NS, keys, [memoryview(bytes([1]) * BLOCK)] * 2))
        assert all(finish(tier, wake, 1).ok)
        os.truncate(tier._file((NS.tier_id, b"cut")), SEAL.size + BLOCK - 1)
        slots = [memoryview(bytearray(BLOCK)) for _ in keys]
        assert finish_load(tier, wake, TierJob(2, NS, keys, slots)).ok == [True, False]
        assert tier.lookup(NS, keys) == [True, False]  # dropped
    finally:
        tier.close()
        wake.close()


def finish_load(tier: DiskTier, wake: WakeFd, job: TierJob) -> TierResult:
    tier.submit_load(job)
    return finish(tier, wake, job.job_id)
