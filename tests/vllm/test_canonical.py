"""vLLM's canonical layout: one pool across tensor-parallel sizes, MLA stored once.

Engines are built by vLLM 0.33's own config derivation and canonical mapping code
(canonical_rig.py). A Llama model's 4 KV heads are sharded over TP 1, 2 or 4 ranks;
every head a TP=2 engine stored must reach a TP=1 and a TP=4 engine byte for byte.
An MLA model's latent is held whole by every rank: one copy goes to the region,
whatever the TP size, and every rank loads it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext, make_offload_key

import kvoffload
from kvoffloadbench.canonical_rig import Rank
from kvoffloadbench.launch import DaemonProcess, drop_kept_region
from kvoffloadbench.redis_server import RedisServer

CTX = ReqContext(req_id="r")
HEADS = 4  # the GQA model's KV heads


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess("128MiB", "--log-level", "warning") as d:
        yield d


def engine(model: str, tp: int, d: DaemonProcess, name: str, **kw: object) -> list[Rank]:
    return [Rank(model, tp, r, d.socket_path, name, **kw) for r in range(tp)]  # type: ignore[arg-type]


def finish(w: object, job: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if any(r.job_id == job and r.success for r in w.get_finished()):  # type: ignore[attr-defined]
            return
        time.sleep(0.001)
    raise TimeoutError(f"job {job} did not finish")


def store(ranks: list[Rank], keys: list[bytes], gpu: list[int], job: int) -> object:
    """The scheduler plans one store; every rank copies its part."""
    mgr = ranks[0].spec.get_manager()
    out = mgr.prepare_store(keys, CTX)
    assert out is not None
    for r in ranks:
        assert r.worker.submit_store(job, GPULoadStoreSpec(gpu, [len(gpu)], [0]), out.store_spec)
    for r in ranks:
        finish(r.worker, job)
    mgr.complete_store(keys, CTX)
    mgr.on_schedule_end(None)  # the step ends: its batch (the commit) goes out
    return mgr


def load(ranks: list[Rank], keys: list[bytes], gpu: list[int], job: int) -> None:
    mgr = ranks[0].spec.get_manager()
    deadline = time.monotonic() + 20
    while not all(mgr.lookup(k, CTX) == LookupResult.HIT for k in keys):
        assert time.monotonic() < deadline, "the blocks never became visible here"
        mgr.on_schedule_end(None)
        time.sleep(0.002)
    spec = mgr.prepare_load(keys, CTX)
    for r in ranks:
        assert r.worker.submit_load(job, spec, GPULoadStoreSpec(gpu, [len(gpu)], [0]))
    for r in ranks:
        finish(r.worker, job)
    mgr.complete_load(keys, CTX)


def heads_of(rank: Rank) -> range:
    per = HEADS // rank.tp
    return range(rank.rank * per, (rank.rank + 1) * per)


def fill_gqa(ranks: list[Rank], kv: dict[str, torch.Tensor], blocks: list[int]) -> None:
    """Each rank's caches hold its heads of the full per-layer KV ``kv``."""
    for r in ranks:
        for name, t in r.caches.items():
            h = heads_of(r)
            t[blocks] = kv[name][:, h.start : h.stop]


@pytest.mark.parametrize(
    ("layout", "memfd"),
    [("LBHNC", True), ("LBNHC", True), ("LBNHC", False)],  # heads whole or by token; who copies
)
def test_gqa_blocks_stored_at_tp2_load_at_tp1_and_tp4(
    daemon: DaemonProcess, layout: str, memfd: bool
) -> None:
    tp2 = engine("llama", 2, daemon, "tp2", layout=layout, memfd=memfd)
    assert {r.worker.worker.copy_mode for r in tp2} == {"daemon" if memfd else "client"}
    assert all(r.spec.canonical for r in tp2)
    n, src = 6, list(range(3, 9))
    shape = tuple(tp2[0].caches[next(iter(tp2[0].caches))].shape)  # (blocks, heads/2, bs, 2hd)
    kv = {
        name: torch.randint(-100, 100, (n, HEADS, *shape[2:])).to(torch.bfloat16)
        for name in tp2[0].caches
    }
    fill_gqa(tp2, kv, src)
    keys = [make_offload_key(b"gqa%d" % i, 0) for i in range(n)]
    store(tp2, keys, src, job=1)
    for tp in (1, 4):
        other = engine("llama", tp, daemon, f"tp{tp}", layout=layout, memfd=memfd)
        assert other[0].spec.namespace_name == tp2[0].spec.namespace_name
        dst = list(range(40, 40 + n))
        load(other, keys, dst, job=2)
        for r in other:  # every head of every token, against what the TP=2 ranks held
            for name, t in r.caches.items():
                h = heads_of(r)
                assert torch.equal(t[dst], kv[name][:, h.start : h.stop]), (tp, r.rank, name)
                assert not t[: dst[0]].any()  # nothing outside the loaded blocks
        for r in other:
            r.shutdown()
    with kvoffload.connect(daemon.socket_path) as c:
        (ns,) = c.stats()["namespaces"].values()
    assert ns["stored_blocks"] == n  # one namespace, one copy per block, all TP sizes
    for r in tp2:
        r.shutdown()


@pytest.mark.parametrize("tp", [2, 4])
def test_mla_latent_is_stored_once_and_every_rank_loads_it(daemon: DaemonProcess, tp: int) -> None:
    ranks = engine("mla", tp, daemon, f"mla{tp}")
    assert all(r.spec.canonical and r.spec.replicated_layout for r in ranks)
    n, src = 8, list(range(8))
    names = list(ranks[0].caches)
    shape = tuple(ranks[0].caches[names[0]].shape)
    latent = {name: torch.randint(-100, 100, (n, *shape[1:])).to(torch.bfloat16) for name in names}
    for r in ranks:  # the same latent on every rank, as TP replicates it
        for name, t in r.caches.items():
            t[src] = latent[name]
    keys = [make_offload_key(b"mla%d" % i, 0) for i in range(n)]
    store(ranks, keys, src, job=1)
    with kvoffload.connect(daemon.socket_path) as client:
        stats = client.stats()
    ns = stats["namespaces"][ranks[0].spec.namespace_name]
    page = ranks[0].worker.worker.canonical[0].canonical_page_bytes
    local_page = shape[1] * shape[2] * shape[3] * 2  # bytes of one rank's page per layer
    assert page == local_page  # the canonical page of a latent is one rank's page
    assert ns["stored_blocks"] == n
    slot_bytes = ranks[0].worker.groups[0].layout.block_bytes
    assert slot_bytes == len(names) * page  # one copy per block, not tp copies
    copied = stats["copies"]["stored_bytes_total"]
    assert copied == n * slot_bytes  # each block written once, by one rank in turn
    for r in ranks:
        for t in r.caches.values():
            t.zero_()
    dst = list(range(50, 50 + n))
    load(ranks, keys, dst, job=2)
    for r in ranks:
        for name, t in r.caches.items():
            assert torch.equal(t[dst], latent[name]), (r.rank, name)
    for r in ranks:
        r.shutdown()


def test_an_uncertified_configuration_keeps_per_rank_blocks(
    daemon: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """Pipeline parallelism: vLLM's V1 runner certifies it, but derives no canonical
    mapping for it, so each rank's pages are stored as they are, one namespace per
    stage, which a canonical engine never meets, and the log says why."""
    caplog.set_level(logging.INFO, logger="kvoffload.vllm.spec")
    pp = Rank("llama", 1, 0, daemon.socket_path, "pp", pp=2)
    assert pp.offloading.parallel.is_parallelism_agnostic  # vLLM's static answer
    pp.spec.get_manager()
    assert "per-rank layout (tp=1, pp=2, pcp=1, dcp=1; world size 2)" in caplog.text
    assert "every rank holds every layer (no pipeline parallelism)" in caplog.text
    assert not pp.spec.canonical and pp.worker.groups[0].layout.world_size == 1
    assert pp.spec.namespace_name.endswith("/pp0")
    plain = Rank("llama", 2, 0, daemon.socket_path, "plain", canonical=False)
    assert not plain.spec.canonical and plain.worker.groups[0].layout.world_size == 2
    canonical = Rank("llama", 2, 0, daemon.socket_path, "canon")
    assert canonical.worker.groups[0].layout.world_size == 1
    names = {r.spec.namespace_name for r in (pp, plain, canonical)}
    assert len(names) == 3  # nobody shares with the canonical namespace
    for r in (pp, plain, canonical):
        r.shutdown()


def test_a_canonical_block_cascaded_by_one_daemon_loads_at_another_tp_elsewhere(
    tmp_path: Path, redis_server_name: str
) -> None:
    """Two nodes share a Redis (or Valkey) tier: a TP=2 engine's blocks, cascaded by its
    daemon, are promoted by another daemon for a TP=1 engine, byte for byte."""
    with RedisServer(name=redis_server_name) as redis:
        cfg = tmp_path / "tier.toml"
        cfg.write_text(
            f'tier_secret_file = "{tmp_path / "tier-secret"}"\n'  # both daemons: one secret
            f'[[tiers]]\ntype = "redis"\nurl = "{redis.url}"\nrefresh_s = 0.05\n'
        )
        args = ("--config", str(cfg), "--log-level", "warning")
        with DaemonProcess("64MiB", *args) as a, DaemonProcess("64MiB", *args) as b:
            tp2 = engine("llama", 2, a, "tp2")
            n, src = 4, list(range(4))
            shape = tuple(tp2[0].caches[next(iter(tp2[0].caches))].shape)
            kv = {
                name: torch.randint(-100, 100, (n, HEADS, *shape[2:])).to(torch.bfloat16)
                for name in tp2[0].caches
            }
            fill_gqa(tp2, kv, src)
            keys = [make_offload_key(b"tier%d" % i, 0) for i in range(n)]
            store(tp2, keys, src, job=1)
            with kvoffload.connect(a.socket_path) as c:
                deadline = time.monotonic() + 20
                while c.stats()["tiers"]["redis"]["stores_total"] < n:
                    assert time.monotonic() < deadline, "the cascade to Redis never ran"
                    time.sleep(0.01)
            tp1 = engine("llama", 1, b, "tp1")
            probe = tp1[0].spec.get_manager()
            deadline = time.monotonic() + 20
            while probe.lookup(keys[0], CTX) != LookupResult.HIT:  # promotes from Redis
                assert time.monotonic() < deadline, "the other daemon never promoted"
                probe.on_schedule_end(None)
                time.sleep(0.01)
            dst = list(range(20, 20 + n))
            load(tp1, keys, dst, job=2)
            for name, t in tp1[0].caches.items():
                assert torch.equal(t[dst], kv[name])
            for r in (*tp2, *tp1):
                r.shutdown()


def test_canonical_blocks_survive_a_warm_restart_and_load_at_another_tp() -> None:
    """A TP=2 engine's blocks, kept in the region by a clean --keep-region stop,
    are found by the next daemon and loaded by a TP=4 engine."""
    args = ("--log-level", "warning", "--keep-region")
    d1 = DaemonProcess("64MiB", *args).start()
    tp2 = engine("llama", 2, d1, "tp2")
    n, src = 3, list(range(3))
    shape = tuple(tp2[0].caches[next(iter(tp2[0].caches))].shape)
    kv = {
        name: torch.randint(-100, 100, (n, HEADS, *shape[2:])).to(torch.bfloat16)
        for name in tp2[0].caches
    }
    fill_gqa(tp2, kv, src)
    keys = [make_offload_key(b"warm%d" % i, 0) for i in range(n)]
    store(tp2, keys, src, job=1)
    load(tp2, keys, list(range(10, 10 + n)), job=2)  # committed before the stop
    for r in tp2:
        r.shutdown()
    assert d1.stop() == 0
    with DaemonProcess("64MiB", *args, instance=d1.instance, socket_path=d1.socket_path) as d2:
        tp4 = engine("llama", 4, d2, "tp4")
        dst = list(range(30, 30 + n))
        load(tp4, keys, dst, job=1)
        for r in tp4:
            for name, t in r.caches.items():
                h = heads_of(r)
                assert torch.equal(t[dst], kv[name][:, h.start : h.stop])
            r.shutdown()
    drop_kept_region(d1.socket_path, d1.instance)


def test_a_canonical_load_planned_before_the_daemon_dies_completes_from_the_region() -> None:
    """Invariant 8 with canonical pages: the daemon is SIGKILLed between a TP=1
    engine's load plan and its submit; the worker reads the canonical page from its
    own mapping of the region, byte-exact, and vLLM sees a success."""
    d = DaemonProcess("64MiB", "--log-level", "warning").start()
    try:
        tp2 = engine("llama", 2, d, "tp2")
        n, src = 3, list(range(3))
        shape = tuple(tp2[0].caches[next(iter(tp2[0].caches))].shape)
        kv = {
            name: torch.randint(-100, 100, (n, HEADS, *shape[2:])).to(torch.bfloat16)
            for name in tp2[0].caches
        }
        fill_gqa(tp2, kv, src)
        keys = [make_offload_key(b"die%d" % i, 0) for i in range(n)]
        store(tp2, keys, src, job=1)
        tp1 = engine("llama", 1, d, "tp1")
        mgr = tp1[0].spec.get_manager()
        deadline = time.monotonic() + 20
        while not all(mgr.lookup(k, CTX) == LookupResult.HIT for k in keys):
            assert time.monotonic() < deadline, "the blocks never became visible"
            mgr.on_schedule_end(None)
            time.sleep(0.002)
        spec = mgr.prepare_load(keys, CTX)
        mgr.on_schedule_end(None)  # the pins go out with the step, as in vLLM
        d.kill()
        dst = list(range(30, 30 + n))
        assert tp1[0].worker.submit_load(2, spec, GPULoadStoreSpec(dst, [n], [0]))
        finish(tp1[0].worker, 2)
        assert tp1[0].worker.worker.loads_recovered_total >= 1
        for name, t in tp1[0].caches.items():
            assert torch.equal(t[dst], kv[name])
        for r in (*tp2, *tp1):
            r.shutdown()
    finally:
        d.stop()
        drop_kept_region(d.socket_path, d.instance)
