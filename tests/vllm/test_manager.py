"""KVOffloadSpec.get_manager() against a live daemon: vLLM's CPU manager story."""

from __future__ import annotations

import pathlib
import time

import torch
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    PrepareStoreOutput,
    ReqContext,
    make_offload_key,
)
from vllm_config import offloading_configs

import kvoffload
from kvoffload.vllm import KVOffloadSpec
from kvoffloadbench.canonical_rig import Rank
from kvoffloadbench.launch import DaemonProcess

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
CTX = ReqContext(req_id="r")
SLOT_BYTES = 16 * 1024  # a 4 KiB block rounds up to the daemon's minimum slot


def k(*ids: int) -> list[bytes]:
    return [make_offload_key(str(i).encode(), 0) for i in ids]


_workers: dict[int, Rank] = {}


def manager(d: DaemonProcess, engine_id: str = "e0") -> OffloadingManager:
    """The scheduler side of one vLLM engine (the tiny model, TP=1, planned by vLLM),
    after its rank-0 worker (plain CPU tensors, client copies) registered, as in vLLM;
    the worker does the stores, so completions are real."""
    rank = Rank(
        "tiny", 1, 0, d.socket_path, engine_id, canonical=False, memfd=False, kv_events=True
    )
    spec = rank.spec
    assert isinstance(spec, KVOffloadSpec) and isinstance(spec, OffloadingSpec)
    mgr = spec.get_manager()
    _workers[id(mgr)] = rank
    return mgr


def written(mgr: OffloadingManager, out: PrepareStoreOutput | None) -> None:
    """Copy the blocks of a store plan, as the engine's worker would."""
    assert out is not None
    w = _workers[id(mgr)].worker
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


def step(*managers: OffloadingManager) -> None:
    """The end of a scheduler step, for each manager: its batch goes, pushes come in."""
    for m_ in managers:
        m_.on_schedule_end(None)


def settled(mgr: OffloadingManager, ids: tuple[int, ...], want: list[LookupResult]) -> None:
    deadline = time.monotonic() + 20
    while results(mgr, *ids) != want:
        assert time.monotonic() < deadline, f"{results(mgr, *ids)} never became {want}"
        step(mgr)
        time.sleep(0.001)


def test_the_manager_contract_with_no_round_trip_per_call(daemon: DaemonProcess) -> None:
    """vLLM's manager contract, answered locally: stores plan from leased slots, loads
    from the mirrored slots, completions go one-way with the step's batch."""
    mgr = manager(daemon)
    other = manager(daemon, engine_id="e1")  # a second vLLM engine, one pool
    settled_leases(mgr)

    out = mgr.prepare_store(k(1, 2), CTX)
    assert out is not None and (out.keys_to_store, out.evicted_keys) == (k(1, 2), [])
    assert len(set(out.store_spec.block_ids.tolist())) == 2
    assert results(mgr, 1, 2, 3) == [PENDING, PENDING, MISS]  # not readable yet
    assert mgr.prepare_store(k(1, 2), CTX).keys_to_store == []  # already being stored
    step(mgr)  # the claims go out
    written(mgr, out)
    mgr.complete_store(k(1, 2), CTX)
    assert results(mgr, 1, 2) == [MISS, MISS]  # never a hit until the daemon confirms
    step(mgr)
    settled(mgr, (1, 2, 3), [HIT, HIT, MISS])
    settled(other, (1, 2, 3), [HIT, HIT, MISS])
    assert mgr.prepare_store(k(1, 2), CTX).keys_to_store == []  # stored: nothing to do

    spec = other.prepare_load(k(2, 1), CTX)  # slots in key order, from the mirror
    assert spec.block_ids.tolist() == out.store_spec.block_ids.tolist()[::-1]
    assert spec.keys == k(2, 1)
    other.complete_load(k(2, 1), CTX)
    step(other)

    admin = kvoffload.connect(daemon.socket_path)
    assert admin.evict(keys=k(1)) == 1
    admin.close()
    settled(other, (1, 2), [MISS, HIT])
    settled(mgr, (1, 2), [MISS, HIT])
    assert events(mgr) == [(set(k(1, 2)), False), (set(k(1)), True)]
    assert events(other) == [(set(k(1, 2)), False), (set(k(1)), True)]
    for m_ in (mgr, other):
        assert m_.view.blocking_calls_total == 0
        _workers.pop(id(m_)).shutdown()
        m_.shutdown()


def test_one_step_end_in_an_interval_writes_and_reads(daemon: DaemonProcess) -> None:
    """What steps change goes out at the end of the first step of each
    ``batch_interval_s`` together with the read of the pushes; the steps in between
    make no system call to the daemon, however much they change."""
    rank = Rank(
        "tiny",
        1,
        0,
        daemon.socket_path,
        "e-io",
        canonical=False,
        memfd=False,
        extra={"batch_interval_s": 3600.0},
    )
    mgr = rank.spec.get_manager()
    client = mgr.client
    settled_leases(mgr)  # the first step end was due: it wrote and read
    writes, reads = client.writes_total, client.reads_total
    for i in range(5):  # a store, and its completion, in every step
        out = mgr.prepare_store(k(40 + i), CTX)
        assert out is not None and out.keys_to_store == k(40 + i)
        mgr.complete_store(k(40 + i), CTX)
        step(mgr)
    assert (client.writes_total, client.reads_total) == (writes, reads)
    mgr._io_at = 0.0  # the interval is over
    step(mgr)
    assert (client.writes_total, client.reads_total) == (writes + 1, reads + 1)
    assert mgr.blocking_calls_total == 0
    rank.shutdown()


def settled_leases(mgr: OffloadingManager) -> None:
    deadline = time.monotonic() + 20
    while not mgr.view.leases:
        assert time.monotonic() < deadline, "no lease grant"
        step(mgr)
        time.sleep(0.001)


def test_a_store_the_worker_could_not_make_is_never_a_hit(daemon: DaemonProcess) -> None:
    """vLLM completes every store (its worker reports success). One whose copy never
    landed stays invisible and is not offered again while its commit may still come."""
    mgr = manager(daemon)
    settled_leases(mgr)
    out = mgr.prepare_store(k(5), CTX)
    assert out is not None
    step(mgr)
    mgr.complete_store(k(5), CTX)  # no copy was ever made
    for _ in range(3):
        step(mgr)
        assert results(mgr, 5) == [MISS]
        assert mgr.prepare_store(k(5), CTX).keys_to_store == []
    _workers.pop(id(mgr)).shutdown()
    mgr.shutdown()


def test_blocks_on_a_disk_tier_come_back_through_retry(tmp_path: pathlib.Path) -> None:
    """vLLM's tiering contract: a lookup of a block that left the region but sits on
    the disk tier answers RETRY while it is promoted (the request's other keys go in
    one batch at the step's end), then HIT; the load returns the stored bytes."""
    cfg = tmp_path / "d.toml"
    cfg.write_text(
        f'tier_secret_file = "{tmp_path / "tier-secret"}"\n'
        f'[[namespace_quotas]]\npattern = "vllm/*"\nmax_region_size = {8 * SLOT_BYTES}\n'
        f'[[tiers]]\ntype = "disk"\npath = "{tmp_path / "disk"}"\ncapacity = "1MiB"\n'
    )
    with DaemonProcess("64MiB", "--config", str(cfg), "--log-level", "warning") as d:
        mgr = manager(d)
        w = _workers[id(mgr)].worker
        src = w.worker.caches[0]
        src.copy_(torch.randint(-128, 128, tuple(src.shape), dtype=torch.int8))
        first = src[:4].clone()
        settled_leases(mgr)
        out = mgr.prepare_store(k(1, 2, 3, 4), CTX)
        step(mgr)
        written(mgr, out)
        mgr.complete_store(k(1, 2, 3, 4), CTX)
        settled(mgr, (1, 2, 3, 4), [HIT] * 4)
        admin = kvoffload.connect(d.socket_path)

        def tier_stores() -> int:
            return int(admin.stats()["tiers"]["disk"]["stores_total"])

        deadline = time.monotonic() + 20
        while tier_stores() < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert admin.evict() == 4  # the region forgets them; the disk keeps them
        while k(1)[0] in mgr.view.ready:
            assert time.monotonic() < deadline
            step(mgr)
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


def test_a_daemon_that_goes_away_costs_hits_never_waits() -> None:
    d = DaemonProcess("64MiB", "--log-level", "warning").start()
    mgr = manager(d)
    settled_leases(mgr)
    out = mgr.prepare_store(k(1), CTX)
    step(mgr)
    written(mgr, out)
    mgr.complete_store(k(1), CTX)
    settled(mgr, (1,), [HIT])
    assert d.stop() == 0
    # The hang-up is seen by the client's keeper thread, or by a step's I/O (at most one
    # per batch interval): steps until then still answer from the mirror.
    deadline = time.monotonic() + 20
    while mgr.connected:
        assert time.monotonic() < deadline, "the manager never saw the daemon go"
        step(mgr)
        time.sleep(0.001)
    assert results(mgr, 1, 2) == [MISS, MISS]  # at once, no RETRY: nothing to wait for
    plan = mgr.prepare_store(k(2), CTX)
    assert plan is not None and plan.keys_to_store == []  # nothing to do, nothing to warn
    _workers.pop(id(mgr)).shutdown()
    mgr.shutdown()


def test_namespace_identity_is_one_for_the_scheduler_and_every_rank() -> None:
    """PP=3 over 4 layers splits them 1/2/1: the ranks register different pages, the
    scheduler sees rank 0's only. All of them name the same namespaces (one per
    stage), as does every engine of the same model and shape."""

    def names(config: object) -> list[str]:
        spec = KVOffloadSpec(config)
        return [spec.namespace(0, s) for s in range(spec.stages)]

    scheduler, ranks = offloading_configs("/nonexistent", "llama", pp=3)
    assert [r.worker_kv_bytes_per_block for r in ranks] == [4096, 8192, 4096]
    assert len(set(names(scheduler))) == 3
    assert all(names(r) == names(scheduler) for r in ranks)
    other_engine, _ = offloading_configs("/nonexistent", "llama", pp=3, engine_id="e9")
    assert names(other_engine) == names(scheduler)
    one = names(offloading_configs("/nonexistent", "llama")[0])
    for other in (
        offloading_configs("/nonexistent", "tiny")[0],
        offloading_configs("/nonexistent", "llama", tp=2)[0],
        offloading_configs("/nonexistent", "llama", cache_salt="v2")[0],
        offloading_configs("/nonexistent", "llama", blocks_per_chunk=2)[0],
    ):
        assert names(other) != one
    assert names(offloading_configs("/nonexistent", "llama", namespace="team-a")[0]) == ["team-a"]
