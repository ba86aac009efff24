"""The Mooncake tier's own rules against a fake Mooncake client (no master needed):
objects with their headers, verification, the view, and the hold on slots after a
transfer that failed mid-way. The real master is in tests/integration."""

from __future__ import annotations

import ctypes
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvoffloadd.tiers.base import TierJob, TierNamespace, TierResult, WakeFd
from kvoffloadd.tiers.mooncake_tier import HEADER_BYTES, MooncakeSettings, MooncakeTier

BLOCK = 4096
NS = TierNamespace.of("llama", "fp", BLOCK)


class FakeStore:
    """MooncakeDistributedStore's calls the tier uses, over a dict of objects.
    ``fail_next``: codes the next get or put answers per key, instead of moving bytes."""

    objects: dict[str, bytes] = {}
    fail_next: list[int] = []
    healthy = 0
    instances: list[FakeStore] = []

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.closed = False
        FakeStore.instances.append(self)

    def setup(self, *args: Any) -> int:
        return 0

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


@pytest.fixture
def tier() -> Iterator[tuple[MooncakeTier, WakeFd, np.ndarray]]:
    FakeStore.objects, FakeStore.fail_next, FakeStore.healthy = {}, [], 0
    FakeStore.instances = []
    wake = WakeFd()
    # the tier knocks on the master's and the metadata server's ports before setup
    ports = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    master, meta = (p.getsockname()[1] for p in ports)
    settings = MooncakeSettings(
        f"127.0.0.1:{master}", f"http://127.0.0.1:{meta}/metadata", refresh_s=0.01
    )
    settings = MooncakeSettings(**{**settings.__dict__, "timeout_s": 0.3, "threads": 2})
    t = MooncakeTier("mooncake", settings, 0, wake, client_class=FakeStore)
    region = np.zeros(16 * BLOCK, np.uint8)
    t.attach_region(region.ctypes.data, region.nbytes)
    t.open_namespace(NS)
    settle(t, wake, lambda: t.healthy and FakeStore.instances)
    yield t, wake, region
    t.close()
    wake.close()
    for p in ports:
        p.close()


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
    bad[100] ^= 0xFF  # one flipped byte: the CRC in the header no longer matches
    FakeStore.objects[name] = bytes(bad)
    r, _ = job(t, wake, region, False, [8, 9], [b"a", b"b"])
    assert r.ok == [False, True]
    assert t.lookup(NS, [b"a", b"b"]) == [False, True]


def test_an_object_in_the_format_before_is_not_loaded(tier: Any) -> None:
    """KVOMC001 objects carried a CRC32C: a daemon of this version reads them as misses."""
    t, wake, region = tier
    region[:BLOCK] = 5
    job(t, wake, region, True, [0], [b"old"])
    name = t.object_name((NS.tier_id, b"old"))
    obj = bytearray(FakeStore.objects[name])
    assert obj[BLOCK : BLOCK + 8] == b"KVOMC002"
    obj[BLOCK : BLOCK + 8] = b"KVOMC001"
    FakeStore.objects[name] = bytes(obj)
    r, _ = job(t, wake, region, False, [3], [b"old"])
    assert r.ok == [False]
    assert t.lookup(NS, [b"old"]) == [False]


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
            MooncakeTier("m", MooncakeSettings("h:1", "http://h:2/metadata"), 0, wake)
    finally:
        wake.close()


def test_reachable_knocks_on_host_ports_and_urls_and_skips_the_rest() -> None:
    from kvoffloadd.tiers.mooncake_tier import reachable

    with socket.create_server(("127.0.0.1", 0)) as up:
        port = up.getsockname()[1]
        assert reachable(f"127.0.0.1:{port}", 1.0)
        assert reachable(f"http://127.0.0.1:{port}/metadata", 1.0)
    assert not reachable(f"127.0.0.1:{port}", 0.5)  # closed now
    assert not reachable(f"http://127.0.0.1:{port}/metadata", 0.5)
    assert reachable("P2PHANDSHAKE", 0.5)  # nothing to knock on
    assert reachable("redis://somewhere:1", 0.5)  # not a scheme it checks
