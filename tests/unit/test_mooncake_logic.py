"""The Mooncake tier's own rules against a fake Mooncake client (no master needed):
objects with their headers, verification, the view, the hold on slots after a
transfer that failed mid-way, and promotions from the daemon's own segment. The real
master is in tests/integration."""

from __future__ import annotations

import contextlib
import ctypes
import pathlib
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvoffloadd.copies.crc import crc32
from kvoffloadd.tiers.base import TierJob, TierNamespace, TierResult, WakeFd
from kvoffloadd.tiers.blockauth import BlockMac
from kvoffloadd.tiers.mooncake_local import FIRST_ASK, read_own_segment, segment_span
from kvoffloadd.tiers.mooncake_tier import HEADER_BYTES, MooncakeSettings, MooncakeTier
from kvoffloadd.tiers.spread import TierThreads

BLOCK = 4096
NS = TierNamespace.of("llama", "fp", BLOCK)
MAC = BlockMac(bytes(range(32)))
SEGMENT_BYTES = 8 << 20  # the fake's own segment: one warm-up object of 4 MiB


class ReplicateConfig:
    """Mooncake's placement options, as the tier's warm-up uses them."""

    preferred_segment = ""


def replica(address: int, size: int, endpoint: str, status: str = "COMPLETE") -> Any:
    """A ReplicaDescriptor of a memory replica, as ``batch_get_replica_desc`` answers."""
    buffer = SimpleNamespace(buffer_address=address, size=size, transport_endpoint=endpoint)
    memory = SimpleNamespace(buffer_descriptor=buffer)
    return SimpleNamespace(
        is_memory_replica=lambda: True,
        status=SimpleNamespace(name=status),
        get_memory_descriptor=lambda: memory,
    )


class FakeStore:
    """MooncakeDistributedStore's calls the tier uses, over a dict of objects.
    ``fail_next``: codes the next get or put answers per key, instead of moving bytes.
    ``batch_get_replica_desc`` places the objects asked for in this client's own segment
    (or, with ``elsewhere``, says they lie in another node's). ``gets``: keys read
    through Mooncake's copy."""

    objects: dict[str, bytes] = {}
    fail_next: list[int] = []
    healthy = 0
    elsewhere = False
    gets = 0
    instances: list[FakeStore] = []

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.closed = False
        self.segment = np.zeros(0, np.uint8)
        self.next_offset = 0
        FakeStore.instances.append(self)

    def setup(self, host: str, metadata: str, segment_bytes: int, *rest: Any) -> int:
        self.segment = np.zeros(segment_bytes, np.uint8)
        return 0

    def get_hostname(self) -> str:
        return f"127.0.0.1:{id(self) % 60000}"

    def batch_put_from(
        self, names: list[str], ptrs: list[int], sizes: list[int], config: Any
    ) -> list[int]:
        assert config.preferred_segment == self.get_hostname()
        for name, p, n in zip(names, ptrs, sizes):
            self._check([p], [n])
            FakeStore.objects[name] = ctypes.string_at(p, n)
        return [0] * len(names)

    def batch_remove(self, names: list[str], force: bool) -> int:
        for name in names:
            FakeStore.objects.pop(name, None)
        return len(names)

    def batch_get_replica_desc(self, names: list[str]) -> dict[str, list[Any]]:
        out = {}
        for name in names:
            data = FakeStore.objects.get(name)
            if data is None:
                continue
            if self.next_offset + len(data) > self.segment.nbytes:
                self.next_offset = 0
            off, self.next_offset = self.next_offset, self.next_offset + len(data)
            self.segment[off : off + len(data)] = np.frombuffer(data, np.uint8)
            mine = "/warm/" in name or not FakeStore.elsewhere
            endpoint = self.get_hostname() if mine else "10.0.0.9:12345"
            out[name] = [replica(self.segment.ctypes.data + off, len(data), endpoint)]
        return out

    def register_buffer(self, address: int, nbytes: int) -> int:
        self.registered.append((address, nbytes))
        return 0

    def _check(self, ptrs: list[int], sizes: list[int]) -> None:
        for p, n in zip(ptrs, sizes):
            assert any(a <= p and p + n <= a + m for a, m in self.registered), "unregistered"

    def batch_put_from_multi_buffers(
        self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        if FakeStore.fail_next:
            out, FakeStore.fail_next = FakeStore.fail_next, []
            return out
        for name, p, n in zip(names, ptrs, sizes):
            self._check(p, n)
            FakeStore.objects.setdefault(
                name, b"".join(ctypes.string_at(a, k) for a, k in zip(p, n))
            )
        return [0] * len(names)

    def batch_get_into_multi_buffers(
        self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        FakeStore.gets += len(names)
        if FakeStore.fail_next:
            out, FakeStore.fail_next = FakeStore.fail_next, []
            return out
        out = []
        for name, p, n in zip(names, ptrs, sizes):
            self._check(p, n)
            data = FakeStore.objects.get(name)
            if data is None:
                out.append(-704)
                continue
            pos = 0
            for a, k in zip(p, n):
                ctypes.memmove(a, data[pos : pos + k], min(k, len(data) - pos))
                pos += k
            out.append(len(data))
        return out

    def batch_is_exist(self, names: list[str]) -> list[int]:
        return [int(n in FakeStore.objects) for n in names]

    def health_check(self) -> int:
        return FakeStore.healthy

    def close(self) -> int:
        self.closed = True
        return 0


@contextlib.contextmanager
def make_tier(**settings: Any) -> Iterator[tuple[MooncakeTier, WakeFd, np.ndarray]]:
    FakeStore.objects, FakeStore.fail_next, FakeStore.healthy = {}, [], 0
    FakeStore.instances, FakeStore.gets = [], 0
    wake = WakeFd()
    # the tier knocks on the master's and the metadata server's ports before setup
    ports = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    master, meta = (p.getsockname()[1] for p in ports)
    s = MooncakeSettings(f"127.0.0.1:{master}", f"http://127.0.0.1:{meta}/metadata")
    fields = {"refresh_s": 0.01, "timeout_s": 0.3, "threads": 2, "segment_bytes": SEGMENT_BYTES}
    fields["tier_threads"] = 2  # promoted blocks copied and verified on two threads
    s = MooncakeSettings(**{**s.__dict__, **fields, **settings})
    t = MooncakeTier("mooncake", s, 0, wake, mac=MAC, client_class=FakeStore)
    region = np.zeros(16 * BLOCK, np.uint8)
    t.attach_region(region.ctypes.data, region.nbytes)
    t.open_namespace(NS)
    settle(t, wake, lambda: t.healthy and FakeStore.instances)
    yield t, wake, region
    t.close()
    wake.close()
    for p in ports:
        p.close()


@pytest.fixture(params=[False, True], ids=["own-segment", "elsewhere"])
def tier(request: pytest.FixtureRequest) -> Iterator[tuple[MooncakeTier, WakeFd, np.ndarray]]:
    """The tier, with the blocks it reads in its own segment or in another node's."""
    FakeStore.elsewhere = request.param
    with make_tier() as t:
        yield t


def settle(t: MooncakeTier, wake: WakeFd, predicate: Any, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, "the tier did not settle"
        select.select([wake.fd], [], [], 0.02)
        wake.clear()
        t.get_finished()


def job(
    t: MooncakeTier,
    wake: WakeFd,
    region: np.ndarray,
    store: bool,
    slots: list[int],
    keys: list[bytes],
) -> tuple[TierResult, float]:
    mem = memoryview(region.data)
    bufs = [mem[s * BLOCK : (s + 1) * BLOCK] for s in slots]
    addrs = [region.ctypes.data + s * BLOCK for s in slots]
    j = TierJob(int(time.monotonic_ns()), NS, keys, bufs, addrs)
    t0 = time.monotonic()
    (t.submit_store if store else t.submit_load)(j)
    end = t0 + 10
    while not (got := t.get_finished()):
        assert time.monotonic() < end, "the job did not finish"
        select.select([wake.fd], [], [], 0.02)
        wake.clear()
    return got[0], time.monotonic() - t0


def test_blocks_round_trip_with_their_headers(tier: Any) -> None:
    t, wake, region = tier
    region[: 2 * BLOCK] = np.arange(2 * BLOCK) % 251
    ks = [b"k0", b"k1"]
    r, _ = job(t, wake, region, True, [0, 1], ks)
    assert r.ok == [True, True]
    assert all(len(v) == BLOCK + HEADER_BYTES for v in FakeStore.objects.values())
    assert t.lookup(NS, ks) == [True, True]
    r, _ = job(t, wake, region, False, [5, 6], ks)
    assert r.ok == [True, True] and r.nbytes == 2 * BLOCK
    assert np.array_equal(region[5 * BLOCK : 7 * BLOCK], region[: 2 * BLOCK])


def test_a_corrupt_object_fails_its_block_only_and_leaves_the_view(tier: Any) -> None:
    t, wake, region = tier
    region[: 2 * BLOCK] = 9
    job(t, wake, region, True, [0, 1], [b"a", b"b"])
    name = t.object_name((NS.tier_id, b"a"))
    bad = bytearray(FakeStore.objects[name])
    bad[100] ^= 0xFF  # one flipped byte: the MAC in the seal no longer verifies
    FakeStore.objects[name] = bytes(bad)
    r, _ = job(t, wake, region, False, [8, 9], [b"a", b"b"])
    assert r.ok == [False, True]
    assert t.lookup(NS, [b"a", b"b"]) == [False, True]
    assert t.statistics()["auth_bad_mac_total"] == 1


def test_an_object_in_the_format_before_is_not_loaded(tier: Any) -> None:
    """KVOMC002 objects carried a CRC-32 in a 32-byte header, which anyone can compute:
    a daemon of this version reads them as misses."""
    t, wake, region = tier
    region[:BLOCK] = 5
    job(t, wake, region, True, [0], [b"old"])
    name = t.object_name((NS.tier_id, b"old"))
    obj = bytearray(FakeStore.objects[name])
    assert obj[BLOCK : BLOCK + 8] == b"KVOMC003"
    old = struct.pack("<8sIQ", b"KVOMC002", crc32(bytes(obj[:BLOCK])), BLOCK)
    FakeStore.objects[name] = bytes(obj[:BLOCK]) + old.ljust(32, b"\0")
    r, _ = job(t, wake, region, False, [3], [b"old"])
    assert r.ok == [False]
    assert t.lookup(NS, [b"old"]) == [False]
    assert t.statistics()["auth_failures_total"] == 1


def test_a_miss_is_checked_against_the_store(tier: Any) -> None:
    """A block another daemon wrote: the first lookup misses, the poller finds it."""
    t, wake, region = tier
    region[:BLOCK] = 3
    job(t, wake, region, True, [0], [b"x"])
    FakeStore.objects[t.object_name((NS.tier_id, b"y"))] = FakeStore.objects.pop(
        t.object_name((NS.tier_id, b"x"))
    )
    assert t.lookup(NS, [b"y"]) == [False]
    settle(t, wake, lambda: t.lookup(NS, [b"y"]) == [True])


@pytest.mark.parametrize(("code", "held"), [(-704, False), (-900, False), (-800, True)])
def test_a_transfer_that_may_still_run_holds_its_slots(tier: Any, code: int, held: bool) -> None:
    """-800 (TRANSFER_FAIL) may leave I/O in flight: the job is reported only after
    timeout_s and the client is replaced (kept alive); rejections report at once."""
    t, wake, region = tier
    FakeStore.fail_next = [code]
    r, took_s = job(t, wake, region, False, [3], [b"gone"])
    assert r.ok == [False]
    assert (took_s >= 0.3) == held
    assert t.statistics()["poisoned_clients"] == int(held)
    if held:  # a fresh client takes over, the poisoned one is never closed
        settle(t, wake, lambda: t.healthy and len(FakeStore.instances) == 2)
        assert not FakeStore.instances[0].closed


def test_an_unhealthy_master_fails_jobs_at_once_and_recovers(tier: Any) -> None:
    t, wake, region = tier
    FakeStore.healthy = 2
    settle(t, wake, lambda: not t.healthy)
    assert t.lookup(NS, [b"k"]) == [False]
    r, _ = job(t, wake, region, True, [0], [b"k"])
    assert r.ok == [False]
    FakeStore.healthy = 0
    settle(t, wake, lambda: t.healthy)
    r, _ = job(t, wake, region, True, [0], [b"k"])
    assert r.ok == [True]


def test_without_mooncake_the_tier_refuses_to_start_saying_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from kvoffloadd.tiers.base import TierError

    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # as if not installed
    wake = WakeFd()
    try:
        with pytest.raises(TierError, match=r"kvoffload\[mooncake\].*libibverbs1"):
            MooncakeTier("m", MooncakeSettings("h:1", "http://h:2/metadata"), 0, wake, mac=MAC)
    finally:
        wake.close()


def test_reachable_knocks_on_host_ports_and_urls_and_skips_the_rest() -> None:
    from kvoffloadd.tiers.mooncake_listing import reachable

    with socket.create_server(("127.0.0.1", 0)) as up:
        port = up.getsockname()[1]
        assert reachable(f"127.0.0.1:{port}", 1.0)
        assert reachable(f"http://127.0.0.1:{port}/metadata", 1.0)
    assert not reachable(f"127.0.0.1:{port}", 0.5)  # closed now
    assert not reachable(f"http://127.0.0.1:{port}/metadata", 0.5)
    assert reachable("P2PHANDSHAKE", 0.5)  # nothing to knock on
    assert reachable("redis://somewhere:1", 0.5)  # not a scheme it checks


def test_blocks_in_the_own_segment_are_copied_by_the_tier_not_by_mooncake(tier: Any) -> None:
    t, wake, region = tier
    region[: 2 * BLOCK] = np.arange(2 * BLOCK) % 253
    job(t, wake, region, True, [0, 1], [b"k0", b"k1"])
    r, _ = job(t, wake, region, False, [5, 6], [b"k0", b"k1"])
    assert r.ok == [True, True]
    assert np.array_equal(region[5 * BLOCK : 7 * BLOCK], region[: 2 * BLOCK])
    own = t.statistics()["own_segment_reads_total"]
    assert (own, FakeStore.gets) == ((0, 2) if FakeStore.elsewhere else (2, 0))
    # A lookup's keys: one job while loads find their blocks here (the promotion
    # threads copy them), one per job thread while Mooncake copies them.
    assert t.promotion_jobs == (2 if FakeStore.elsewhere else 1)


def test_a_lookup_is_split_into_jobs_by_where_the_latest_load_found_its_blocks() -> None:
    FakeStore.elsewhere = False
    with make_tier() as (t, wake, region):
        assert t.promotion_jobs == 1  # a tier that lends a segment expects its own blocks
        job(t, wake, region, True, [0, 1], [b"a", b"b"])
        FakeStore.elsewhere = True
        job(t, wake, region, False, [4, 5], [b"a", b"b"])
        assert t.promotion_jobs == 2
        FakeStore.elsewhere = False
        job(t, wake, region, False, [6, 7], [b"a", b"b"])
        assert t.promotion_jobs == 1
    with make_tier(lease_ttl_s=0.0) as (t, wake, region):
        assert t.promotion_jobs == 2  # Mooncake copies every block


@pytest.mark.parametrize("settings", [{"lease_ttl_s": 1e-9}, {"lease_ttl_s": 0.0}])
def test_without_a_lease_to_cover_the_copies_mooncake_copies(
    settings: dict[str, Any],
) -> None:
    """Copies that outlast half the lease are redone by Mooncake (which checks its own
    lease); lease_ttl_s = 0 leaves every promotion to Mooncake."""
    FakeStore.elsewhere = False
    with make_tier(**settings) as (t, wake, region):
        region[: 2 * BLOCK] = 7
        job(t, wake, region, True, [0, 1], [b"a", b"b"])
        r, _ = job(t, wake, region, False, [8, 9], [b"a", b"b"])
        assert r.ok == [True, True]
        assert np.array_equal(region[8 * BLOCK : 10 * BLOCK], region[: 2 * BLOCK])
        assert t.statistics()["own_segment_reads_total"] == 0
        assert FakeStore.gets == 2


class Answering:
    """A client whose ``batch_get_replica_desc`` gives fixed replicas."""

    def __init__(self, answer: dict[str, list[Any]]) -> None:
        self.answer = answer

    def get_hostname(self) -> str:
        return "me:1"

    def batch_get_replica_desc(self, names: list[str]) -> dict[str, list[Any]]:
        return self.answer


def test_only_complete_replicas_of_the_right_size_inside_the_own_span_are_copied() -> None:
    n, h = BLOCK, HEADER_BYTES
    segment = np.arange(8 * (n + h), dtype=np.uint32).astype(np.uint8)
    base = segment.ctypes.data
    span = (base, base + 4 * (n + h))  # the own segment: its first half
    answer = {
        "good": [replica(base + (n + h), n + h, "me:1")],
        "other-node": [replica(base, n + h, "you:2")],
        "resized": [replica(base, n + h + 1, "me:1")],
        "unfinished": [replica(base, n + h, "me:1", status="PROCESSING")],
        "outside": [replica(base + 5 * (n + h), n + h, "me:1")],
        "both": [replica(base, n + h, "you:2"), replica(base + 2 * (n + h), n + h, "me:1")],
    }
    names = [*answer, "absent"]
    dest = np.zeros((len(names), n), np.uint8)
    headers = np.zeros((len(names), h), np.uint8)
    got = read_own_segment(
        Answering(answer),
        names,
        n,
        lambda j, src: MAC.copy_and_hash(NS, b"k", memoryview(dest[j]), dest[j].ctypes.data, src),
        [row.ctypes.data for row in headers],
        h,
        span,
        lease_ttl_s=10.0,
    )
    assert got.rest == [1, 2, 3, 4, 6]
    assert sorted(got.tags) == [0, 5]
    for j, at in ((0, n + h), (5, 2 * (n + h))):
        assert np.array_equal(dest[j], segment[at : at + n])
        assert np.array_equal(headers[j], segment[at + n : at + n + h])
        assert got.tags[j] == MAC.tag(NS, b"k", dest[j])
    assert not dest[1:5].any() and not dest[6].any()  # nothing copied for the others


def test_copies_that_end_after_half_the_lease_are_all_handed_back() -> None:
    n, h = BLOCK, HEADER_BYTES
    segment = np.ones(n + h, np.uint8)
    base = segment.ctypes.data
    dest, header = np.zeros(n, np.uint8), np.zeros(h, np.uint8)
    ticks = iter([100.0, 105.01])  # the question sent, the copies done: 5.01 s later
    got = read_own_segment(
        Answering({"a": [replica(base, n + h, "me:1")]}),
        ["a"],
        n,
        lambda j, src: MAC.copy_and_hash(NS, b"a", memoryview(dest.data), dest.ctypes.data, src),
        [header.ctypes.data],
        h,
        (base, base + n + h),
        lease_ttl_s=10.0,
        clock=lambda: next(ticks),
    )
    assert got.rest == [0] and got.tags == {}


class AskedInTurn(Answering):
    """``Answering`` that writes each question into ``events`` and fails the question
    numbered ``fail_at`` (from 0) with ConnectionError, setting ``failed``."""

    def __init__(self, answer: dict[str, list[Any]], events: list[Any], fail_at: int = -1):
        super().__init__(answer)
        self.events = events
        self.fail_at = fail_at
        self.failed = threading.Event()

    def batch_get_replica_desc(self, names: list[str]) -> dict[str, list[Any]]:
        asked = sum(1 for e in self.events if e[0] == "ask")
        self.events.append(("ask", list(names)))
        if asked == self.fail_at:
            self.failed.set()
            raise ConnectionError("the master went away")
        return {k: v for k, v in self.answer.items() if k in names}


def own_blocks(count: int) -> tuple[Any, dict[str, list[Any]], list[str]]:
    n, h = BLOCK, HEADER_BYTES
    segment = np.arange(count * (n + h), dtype=np.uint32).astype(np.uint8)
    base = segment.ctypes.data
    names = [f"b{j}" for j in range(count)]
    answer = {name: [replica(base + j * (n + h), n + h, "me:1")] for j, name in enumerate(names)}
    return segment, answer, names


def test_the_first_blocks_are_copied_while_the_master_is_asked_about_the_rest() -> None:
    count, n, h = FIRST_ASK + 3, BLOCK, HEADER_BYTES
    segment, answer, names = own_blocks(count)
    base, events = segment.ctypes.data, []
    dest = np.zeros((count, n), np.uint8)
    headers = np.zeros((count, h), np.uint8)

    def copy(j: int, src: int) -> bytes:
        events.append(("copy", j))
        return MAC.copy_and_hash(NS, b"k", memoryview(dest[j]), dest[j].ctypes.data, src)

    got = read_own_segment(
        AskedInTurn(answer, events),
        names,
        n,
        copy,
        [row.ctypes.data for row in headers],
        h,
        (base, base + segment.nbytes),
        lease_ttl_s=10.0,
    )
    assert events == [
        ("ask", names[:FIRST_ASK]),
        *(("copy", j) for j in range(FIRST_ASK)),
        ("ask", names[FIRST_ASK:]),
        *(("copy", j) for j in range(FIRST_ASK, count)),
    ]
    assert sorted(got.tags) == list(range(count)) and got.rest == []
    assert sorted(got.answer) == names
    for j in range(count):
        assert np.array_equal(dest[j], segment[j * (n + h) : j * (n + h) + n])


def test_a_question_that_fails_returns_only_once_no_copy_is_running() -> None:
    """The copies of the first blocks run on the promotion threads while the master is
    asked about the rest; that question fails, and the failure comes back only after
    those copies are done (their slots may be reused at once)."""
    count, n, h = FIRST_ASK + 2, BLOCK, HEADER_BYTES
    segment, answer, names = own_blocks(count)
    base = segment.ctypes.data
    events: list[Any] = []
    dest = np.zeros((count, n), np.uint8)
    gate, copied = threading.Event(), []
    threads = TierThreads(2, "test")

    def copy(j: int, src: int) -> bytes:
        assert gate.wait(timeout=30), "the test never opened the gate"
        copied.append(j)
        return MAC.copy_and_hash(NS, b"k", memoryview(dest[j]), dest[j].ctypes.data, src)

    raised: list[BaseException] = []
    client = AskedInTurn(answer, events, fail_at=1)

    def promote() -> None:
        try:
            read_own_segment(
                client,
                names,
                n,
                copy,
                [np.zeros(h, np.uint8).ctypes.data] * count,
                h,
                (base, base + segment.nbytes),
                lease_ttl_s=10.0,
                start=lambda k, work: threads.started(k, n, work),
            )
        except ConnectionError as exc:
            raised.append(exc)

    try:
        t = threading.Thread(target=promote)
        t.start()
        assert client.failed.wait(timeout=30), "the second question was never asked"
        t.join(timeout=0.05)
        assert t.is_alive(), "returned while a copy into a slot was still held up"
        gate.set()
        t.join(timeout=30)
        assert not t.is_alive() and len(raised) == 1
        assert sorted(copied) == list(range(FIRST_ASK))  # none past the failed question
    finally:
        gate.set()
        assert threads.close(timeout_s=10)


def test_the_segment_span_never_reaches_past_the_mapping_that_holds_it(
    tmp_path: pathlib.Path,
) -> None:
    a = np.zeros(1 << 20, np.uint8)
    lo, hi = segment_span(a.ctypes.data, 1 << 50) or (0, 0)
    assert lo == a.ctypes.data and a.ctypes.data + a.nbytes <= hi < a.ctypes.data + (1 << 50)
    assert segment_span(a.ctypes.data, 4096) == (a.ctypes.data, a.ctypes.data + 4096)
    maps = tmp_path / "maps"
    maps.write_text(
        "1000-3000 rw-p 00000000 00:00 0\n"
        "3000-4000 rw-p 00000000 00:00 0\n"  # split from the one before (madvise)
        "5000-6000 r--p 00000000 00:00 0 [x]\n"
        "6000-7000 ---p 00000000 00:00 0\n"  # a guard page
        "7000-8000 rw-p 00000000 00:00 0\n"
    )
    assert segment_span(0x2000, 1 << 20, str(maps)) == (0x2000, 0x4000)
    assert segment_span(0x2000, 0x1800, str(maps)) == (0x2000, 0x3800)
    assert segment_span(0x5800, 1 << 20, str(maps)) == (0x5800, 0x6000)  # not past the guard
    assert segment_span(0x4000, 16, str(maps)) is None  # not mapped: no own reads


def test_an_object_of_another_size_is_refused_before_any_transfer(tier: Any) -> None:
    """Scenario: another client puts an object of the wrong size under a block's name
    (the format before had a 32-byte header). Mooncake would fail the transfer mid-way
    and the tier would hold its slots and replace its client; the master's size says
    it cannot be a block, so it is refused first: one miss, nothing else."""
    t, wake, region = tier
    region[:BLOCK] = 4
    job(t, wake, region, True, [0], [b"k"])
    name = t.object_name((NS.tier_id, b"k"))
    FakeStore.objects[name] = FakeStore.objects[name][: BLOCK + 32]
    gets = FakeStore.gets
    r, _ = job(t, wake, region, False, [3], [b"k"])
    assert r.ok == [False] and FakeStore.gets == gets  # no transfer asked for
    st = t.statistics()
    assert st["poisoned_clients"] == 0 and st["auth_bad_seal_total"] == 1 and t.healthy


@contextlib.contextmanager
def listing_server(body: Callable[[], Iterator[bytes]]) -> Iterator[str]:
    """An admin server whose /get_all_keys answers with the chunks of ``body`` (made
    anew for each request) until the client goes away; its URL."""
    import http.server

    class Listing(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            with contextlib.suppress(OSError):  # the reader stopped reading
                for chunk in body():
                    self.wfile.write(chunk)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Listing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_listing_is_read_within_its_bounds(caplog: pytest.LogCaptureFixture) -> None:
    """Scenario: a flood of objects under the prefix (of our namespace and others, and
    lines too long to be names). One full read takes at most max_view_blocks of ours
    and MAX_LISTING_LINES lines; a listing cut short removes nothing from the view,
    and the tier says once that it was cut short."""
    lines = [f"kvoffload/{NS.tier_id}/{i:08x}".encode() for i in range(5000)]
    lines += [b"kvoffload/" + b"f" * 32 + b"/00", b"x" * 100_000, b"other/thing"]
    body = b"\n".join(lines) + b"\n"
    cut = "the view follows it partly"
    with listing_server(lambda: iter([body])) as url:
        with make_tier(admin_url=url, max_view_blocks=1000, full_sync_s=0.05) as (t, wake, _):
            present, complete = t._all_keys()
            assert len(present) == 1001 and not complete  # stopped past the cap
            settle(t, wake, lambda: t.statistics()["blocks"] == 1000)
            end = time.monotonic() + 0.3  # more full reads: the view stays at its cap
            settle(t, wake, lambda: time.monotonic() > end)
            assert t.statistics()["blocks"] == 1000
        assert sum(cut in r.getMessage() for r in caplog.records) == 1  # however many reads
        caplog.clear()
        with make_tier(admin_url=url) as (t, wake, _):
            present, complete = t._all_keys()
            assert len(present) == 5000 and complete  # the long line and others skipped
        assert not any(cut in r.getMessage() for r in caplog.records)


def test_an_endless_line_or_a_slow_listing_ends_the_read_incomplete() -> None:
    """Scenario: an admin server that answers one line without end, and one whose
    listing takes longer than the read may. Each read stops at its byte or time
    budget and says the listing was not read to its end (nothing is removed on it)."""
    from kvoffloadd.tiers.mooncake_listing import read_listing

    def ours(tid: str) -> str | None:
        return tid if tid == NS.tier_id else None

    def endless() -> Iterator[bytes]:
        while True:
            yield b"x" * 65536

    with listing_server(endless) as url:
        assert read_listing(url, "kvoffload", ours, 100, 5.0, max_bytes=1 << 20) == (set(), False)
    names = b"".join(b"kvoffload/%s/%08x\n" % (NS.tier_id.encode(), i) for i in range(5000))
    with listing_server(lambda: iter([names])) as url:
        ticks = iter(range(1 << 20))  # a clock one second on at every reading

        def clock() -> float:
            return float(next(ticks))

        present, complete = read_listing(
            url, "kvoffload", ours, 10_000, 5.0, max_s=3.0, clock=clock
        )
        assert not complete and len(present) == 3  # lines read at 1, 2 and 3 s; not at 4
        present, complete = read_listing(url, "kvoffload", ours, 10_000, 5.0)
        assert complete and len(present) == 5000  # the same listing, within the budgets


def test_a_listed_name_is_ours_only_under_our_prefix_tier_id_and_hex_key() -> None:
    from kvoffloadd.tiers.mooncake_listing import listed_entry

    def ours(tid: str) -> str | None:
        return tid if tid == "t1" else None

    lead = b"kvoffload/"
    assert listed_entry(b"kvoffload/t1/00ff", lead, ours) == ("t1", b"\x00\xff")
    assert listed_entry(b"other/t1/00ff", lead, ours) is None  # another prefix
    assert listed_entry(b"kvoffload/t2/00ff", lead, ours) is None  # a tier id not opened here
    assert listed_entry(b"kvoffload/t1/zz", lead, ours) is None  # not hex
    assert listed_entry(b"kvoffload/t1/" + b"00" * 64, lead, ours) == ("t1", bytes(64))
    assert listed_entry(b"kvoffload/t1/" + b"00" * 65, lead, ours) is None  # over 128 hex
    assert listed_entry(b"kvoffload/t1/", lead, ours) is None  # no key
    assert listed_entry(b"kvoffload/t1/\xff\xfe", lead, ours) is None  # not ASCII


@contextlib.contextmanager
def raw_server(answer: Callable[[socket.socket, threading.Event], None]) -> Iterator[str]:
    """A TCP server on loopback whose one connection ``answer`` writes to (raw bytes,
    whatever HTTP says) until told to stop; its http:// URL."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = srv.accept()
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)  # the request
            answer(conn, stop)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        srv.close()
        t.join(timeout=10)


def test_a_listing_that_never_ends_inside_the_http_client_is_cut_off_in_time() -> None:
    """Scenario: a master's admin server that answers interim responses without end
    (Python's HTTP client reads them in a loop of its own), or a body a byte at a time
    (every read returns within the timeout). Each read of the listing ends once its
    time is up, incomplete, and a server that answers an error says so."""
    from kvoffloadd.tiers.mooncake_listing import read_listing

    def interim(conn: socket.socket, stop: threading.Event) -> None:
        while not stop.is_set():
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")

    def trickle(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while not stop.wait(0.02):
            conn.sendall(b"k")

    def refuse(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")

    def read(url: str) -> Any:
        got: list[Any] = []

        def run() -> None:
            try:
                got.append(read_listing(url, "kvoffload", lambda tid: tid, 10, 0.3, max_s=0.3))
            except Exception as exc:  # the answer, whatever it is
                got.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout=30)  # a deadline for the test, far above the read's own 0.6 s
        assert not t.is_alive(), "the read of the listing did not end"
        return got[0]

    for answer in (interim, trickle):
        with raw_server(answer) as url:
            assert read(url) == (set(), False)
    with raw_server(refuse) as url:
        err = read(url)
    assert isinstance(err, Exception) and "404" in str(err)
