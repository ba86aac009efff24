"""KVOffloadSpec.get_manager() against a live daemon: vLLM's CPU manager story."""

from __future__ import annotations

import os
import pathlib
import tempfile
import time
from collections.abc import Iterator

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    PrepareStoreOutput,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm_config import offloading_config

import kvoffload
from kvoffload.vllm import KVOffloadSpec
from kvoffloadctl.launch import DaemonProcess

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
CTX = ReqContext(req_id="r")
SLOT_BYTES = 16 * 1024  # a 4 KiB block rounds up to the daemon's minimum slot


def k(*ids: int) -> list[bytes]:
    return [make_offload_key(str(i).encode(), 0) for i in ids]


@pytest.fixture
def four_block_daemon() -> Iterator[DaemonProcess]:
    """A daemon whose vLLM namespaces hold 4 blocks, like vLLM's manager test."""
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(f'[[namespace_quotas]]\npattern = "vllm/*"\nmax_region_size = {4 * SLOT_BYTES}\n')
    with DaemonProcess("64MiB", "--config", f.name, "--log-level", "warning") as d:
        yield d
        assert d.stop() == 0
    os.unlink(f.name)


# vLLM resolves spec_name + spec_module_path the same way as a registered spec, but
# first logs a warning whose import chain needs all of vLLM's dependencies. Registering
# the name takes the same loader (import the module, getattr the class) without it.
if "KVOffloadSpec" not in OffloadingSpecFactory._registry:
    OffloadingSpecFactory.register_spec("KVOffloadSpec", "kvoffload.vllm", "KVOffloadSpec")


_workers: dict[int, OffloadingWorker] = {}


def manager(d: DaemonProcess, **kw: object) -> OffloadingManager:
    """The scheduler side of one vLLM instance; its rank-0 worker (plain CPU tensors,
    client copies) does the stores, so completions are real."""
    spec = OffloadingSpecFactory.create_spec(offloading_config(d.socket_path, **kw))  # type: ignore[arg-type]
    assert isinstance(spec, KVOffloadSpec) and isinstance(spec, OffloadingSpec)
    mgr = spec.get_manager()
    tensor = torch.zeros(64, 4096, dtype=torch.int8)
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(tensor, 4096)], [[CanonicalKVCacheRef(0, 4096)]])
    _workers[id(mgr)] = spec.get_worker(kv)
    return mgr


def written(mgr: OffloadingManager, out: PrepareStoreOutput | None) -> None:
    """Copy the blocks of a store plan, as the engine's worker would."""
    assert out is not None
    w = _workers[id(mgr)]
    n = len(out.keys_to_store)
    assert w.submit_store(1, GPULoadStoreSpec(list(range(n)), [n], [0]), out.store_spec)
    deadline = time.monotonic() + 20
    while not any(r.job_id == 1 and r.success for r in w.get_finished()):
        assert time.monotonic() < deadline
        time.sleep(0.001)


def results(mgr: OffloadingManager, *ids: int) -> list[LookupResult]:
    with mgr.lock:
        return [mgr.lookup(key, CTX) for key in k(*ids)]


def events(mgr: OffloadingManager) -> list[tuple[set[bytes], bool]]:
    return [(set(e.keys), e.removed) for e in mgr.take_events()]


def test_cpu_manager_story(four_block_daemon: DaemonProcess) -> None:
    mgr = manager(four_block_daemon)
    other = manager(four_block_daemon, engine_id="e1")  # a second vLLM instance

    out = mgr.prepare_store(k(1, 2), CTX)
    assert out is not None and (out.keys_to_store, out.evicted_keys) == (k(1, 2), [])
    assert len(set(out.store_spec.block_ids.tolist())) == 2
    assert results(mgr, 1, 2, 3) == [PENDING, PENDING, MISS]  # not readable yet
    written(mgr, out)
    assert events(mgr) == []

    mgr.complete_store(k(1, 2), CTX)
    assert results(mgr, 1, 2, 3) == [HIT, HIT, MISS]
    assert events(mgr) == [(set(k(1, 2)), False)]

    out = mgr.prepare_store(k(2, 3, 4, 5), CTX)
    assert out is not None and (out.keys_to_store, out.evicted_keys) == (k(3, 4, 5), k(1))
    assert results(mgr, 1) == [MISS]
    assert mgr.prepare_store(k(1, 6), CTX) is None  # only 2 is evictable, 2 are needed
    written(mgr, out)
    mgr.complete_store(k(3, 4, 5), CTX)

    spec = mgr.prepare_load(k(2, 3), CTX)  # pinned blocks are never evicted
    assert len(spec.block_ids) == 2 and not spec.failed
    assert mgr.prepare_store(k(6, 7, 8), CTX) is None
    mgr.complete_load(k(2, 3), CTX)
    out = mgr.prepare_store(k(6, 7, 8), CTX)
    assert out is not None and out.evicted_keys == k(2, 3, 4)
    written(mgr, out)
    mgr.complete_store(k(6, 7, 8), CTX)

    mgr.touch(k(5, 6, 7), CTX)
    out = mgr.prepare_store(k(9), CTX)
    assert out is not None and out.evicted_keys == k(8)
    mgr.complete_store(k(7, 9), CTX, success=False)
    assert results(mgr, 7, 9) == [HIT, MISS]
    assert events(mgr) == [
        (set(k(1)), True),
        (set(k(3, 4, 5)), False),
        (set(k(2, 3, 4)), True),
        (set(k(6, 7, 8)), False),
        (set(k(8)), True),
    ]
    # the other instance shares the pool: it sees the same blocks, and its events
    # report them (its first lookup took a snapshot of the pool as it was)
    assert results(other, 5, 6, 7, 8, 9) == [HIT, HIT, HIT, MISS, MISS]
    assert events(other) == [(set(k(5, 6, 7)), False)]
    for m_ in (mgr, other):
        _workers.pop(id(m_)).shutdown()
        m_.shutdown()


def test_a_hit_that_races_an_eviction_still_loads_its_bytes(
    four_block_daemon: DaemonProcess,
) -> None:
    """Instance B's mirror says HIT; before B's prepare_load, the block is evicted.
    The daemon keeps it loadable until B's mirror has seen the eviction."""
    a = manager(four_block_daemon)
    b = manager(four_block_daemon, engine_id="e1")
    src = _workers[id(a)].worker.caches[0]
    src.copy_(torch.arange(64 * 4096, dtype=torch.int64).to(torch.int8).view(64, 4096))
    out = a.prepare_store(k(1), CTX)
    written(a, out)
    a.complete_store(k(1), CTX)
    assert results(b, 1) == [HIT]
    admin = kvoffload.connect(four_block_daemon.socket_path)
    assert admin.evict(keys=k(1)) == 1  # another engine's pressure, between lookup and load
    assert results(a, 1) == [MISS]  # new lookups miss at once
    spec = b.prepare_load(k(1), CTX)
    assert not spec.failed
    w = _workers[id(b)]
    assert w.submit_load(9, spec, GPULoadStoreSpec([10], [1], [0]))
    deadline = time.monotonic() + 20
    while not (done := [r for r in w.get_finished() if r.job_id == 9]):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert done[0].success
    assert torch.equal(w.worker.caches[0][10], src[0])
    b.complete_load(k(1), CTX)
    b.on_schedule_end(None)  # b's mirror sees the eviction; the slot is free again
    assert results(b, 1) == [MISS]
    admin.close()
    for m_ in (a, b):
        _workers.pop(id(m_)).shutdown()
        m_.shutdown()


def test_blocks_on_a_disk_tier_come_back_through_retry(tmp_path: pathlib.Path) -> None:
    """vLLM's tiering contract: a lookup of a block that left the region but sits on
    the disk tier answers RETRY while it is promoted (the request's other keys go in
    one batch at the step's end), then HIT; the load returns the stored bytes."""
    cfg = tmp_path / "d.toml"
    cfg.write_text(
        f'[[namespace_quotas]]\npattern = "vllm/*"\nmax_region_size = {4 * SLOT_BYTES}\n'
        f'[[tiers]]\ntype = "disk"\npath = "{tmp_path / "disk"}"\ncapacity = "1MiB"\n'
    )
    with DaemonProcess("64MiB", "--config", str(cfg), "--log-level", "warning") as d:
        mgr = manager(d)
        w = _workers[id(mgr)]
        src = w.worker.caches[0]
        src.copy_(torch.randint(-128, 128, (64, 4096), dtype=torch.int8))
        first = src[:4].clone()
        written(mgr, mgr.prepare_store(k(1, 2, 3, 4), CTX))
        mgr.complete_store(k(1, 2, 3, 4), CTX)
        admin = kvoffload.connect(d.socket_path)

        def tier_stores() -> int:
            return int(admin.stats()["tiers"]["disk"]["stores_total"])

        deadline = time.monotonic() + 20
        while tier_stores() < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert admin.evict() == 4  # the region forgets them; the disk keeps them
        mgr.on_schedule_end(None)
        # 1 is probed alone; the rest of the request waits for one batch at step end
        assert results(mgr, 1, 2, 3, 4, 5) == [LookupResult.RETRY] * 5
        mgr.on_schedule_end(None)  # probes 1..5 together: 2..4 promote as one batch
        assert results(mgr, 5) == [MISS]  # found nowhere: remembered, no round trip
        while results(mgr, 1, 2, 3, 4) != [HIT] * 4:
            assert time.monotonic() < deadline
            mgr.on_schedule_end(None)
            time.sleep(0.01)
        spec = mgr.prepare_load(k(1, 2, 3, 4), CTX)
        assert w.submit_load(9, spec, GPULoadStoreSpec(list(range(10, 14)), [4], [0]))
        while not (done := [r for r in w.get_finished() if r.job_id == 9]):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert done[0].success and torch.equal(src[10:14], first)
        mgr.complete_load(k(1, 2, 3, 4), CTX)
        assert admin.stats()["tiers"]["disk"]["promoted_blocks_total"] == 4
        admin.close()
        _workers.pop(id(mgr)).shutdown()
        mgr.shutdown()
        assert d.stop() == 0


def test_a_daemon_that_goes_away_turns_lookups_into_retry_then_miss() -> None:
    d = DaemonProcess("64MiB", "--log-level", "warning").start()
    mgr = manager(d, retry_s=0.3, mirror_max_age_s=0.0)
    out = mgr.prepare_store(k(1), CTX)
    written(mgr, out)
    mgr.complete_store(k(1), CTX)
    assert results(mgr, 1) == [HIT]
    assert d.stop() == 0
    assert results(mgr, 1, 2) == [LookupResult.RETRY, LookupResult.RETRY]
    time.sleep(0.35)
    assert results(mgr, 1) == [MISS]
    assert mgr.prepare_store(k(2), CTX) is None
    _workers.pop(id(mgr)).shutdown()
    mgr.shutdown()


def test_namespace_identity_comes_from_the_vllm_config(tmp_path: object) -> None:
    def name(**kw: object) -> str:
        spec = KVOffloadSpec(offloading_config("/nonexistent", **kw))  # type: ignore[arg-type]
        return spec.namespace_name

    assert name() == name(engine_id="other", rank=0)  # two instances of one model share
    assert name() != name(model="test/other")
    assert name() != name(cache_salt="v2")
    assert name() != name(blocks_per_chunk=2)
    assert name() != name(worker_kv_bytes_per_block=8192)
    assert name(namespace="team-a") == "team-a"
