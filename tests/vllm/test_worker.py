"""KVOffloadSpec.get_worker(): the KV caches vLLM registers, stored and loaded end to end.

Ranks are planned and registered by vLLM itself (``canonical_rig.Rank``: the
connector's ``register_kv_caches`` over vLLM's own KV cache views). The worker never
reports a failure to vLLM (vLLM 0.33 asserts on it): every result here succeeds, and
the one load that cannot complete raises ``LoadLostError``.
"""

from __future__ import annotations

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
    ReqContext,
    make_offload_key,
)

import kvoffload
from kvoffload.protocol.errors import LayoutMismatchError, LoadLostError
from kvoffload.vllm.identity import VllmIdentity
from kvoffload.vllm.transfer import canonical_parts
from kvoffloadbench.canonical_rig import Rank
from kvoffloadbench.launch import DaemonProcess

CTX = ReqContext(req_id="r")


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess("64MiB", "--log-level", "warning") as d:
        yield d


def rank(
    d: DaemonProcess, engine: str, model: str = "tiny", f: int = 1, memfd: bool = True
) -> Rank:
    extra = {"blocks_per_chunk": f}
    return Rank(model, 1, 0, d.socket_path, engine, canonical=False, memfd=memfd, extra=extra)


def fill(r: Rank, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in r.caches.values():
        t.copy_(torch.randint(-100, 100, tuple(t.shape), generator=gen).to(t.dtype))


def finish(worker: object, job: int) -> object:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for r in worker.get_finished():  # type: ignore[attr-defined]
            if r.job_id == job:
                return r
        time.sleep(0.001)
    raise TimeoutError


def committed(keys: list[bytes], *managers: OffloadingManager) -> None:
    """Scheduler steps until the store is visible to every manager given."""
    deadline = time.monotonic() + 20
    for m in managers:
        while not all(m.lookup(k, CTX) == LookupResult.HIT for k in keys):
            assert time.monotonic() < deadline, "the store never became visible"
            m.on_schedule_end(None)
            time.sleep(0.001)


@pytest.mark.parametrize("memfd", [True, False], ids=["daemon-copies", "client-copies"])
@pytest.mark.parametrize(("f", "first"), [(1, 0), (3, 0), (3, 4)])
def test_store_then_load_is_byte_identical(
    daemon: DaemonProcess, memfd: bool, f: int, first: int
) -> None:
    a, b = rank(daemon, "a", f=f, memfd=memfd), rank(daemon, "b", f=f, memfd=memfd)
    assert a.worker.worker.copy_mode == ("daemon" if memfd else "client")
    fill(a, 1)
    mgr, mgr_b = a.spec.get_manager(), b.spec.get_manager()
    chunks = 4
    keys = [make_offload_key(b"h%d" % i, 0) for i in range(chunks)]
    committed([], mgr)  # a step: the connection and its first leases
    out = mgr.prepare_store(keys, CTX)
    assert out is not None and out.keys_to_store == keys
    gpu = list(range(5, 5 + chunks * f))
    assert a.worker.submit_store(1, GPULoadStoreSpec(gpu, [len(gpu)], [0]), out.store_spec)
    page = sum(t[0].numel() * t.element_size() for t in a.caches.values())
    r = finish(a.worker, 1)
    assert r.success and r.transfer_size == len(gpu) * page  # type: ignore[attr-defined]
    mgr.complete_store(keys, CTX)
    mgr.on_schedule_end(None)

    # the other engine loads from logical block `first` on (maybe inside a chunk)
    committed(keys, mgr, mgr_b)
    need = keys[first // f :]
    spec = mgr_b.prepare_load(need, CTX)
    n = chunks * f - first
    targets = list(range(20, 20 + n))
    assert b.worker.submit_load(7, spec, GPULoadStoreSpec(targets, [n], [first]))
    r = finish(b.worker, 7)
    assert r.success and r.transfer_size == n * page  # type: ignore[attr-defined]
    mgr_b.complete_load(need, CTX)
    for name, src in a.caches.items():
        dst = b.caches[name]
        assert torch.equal(dst[20 : 20 + n], src[5 + first : 5 + chunks * f])
        assert not dst[:20].any() and not dst[20 + n :].any()
    a.shutdown()
    b.shutdown()


def test_hybrid_groups_store_whole_slots_and_null_blocks_keep_their_places(
    daemon: DaemonProcess,
) -> None:
    """A model of three sliding window groups and a full one (the third group uses one
    of the two tensors): each group has a namespace of its own, sized for its tensors.
    A sliding window chunk whose first block vLLM left out (null) is stored whole: the
    null block fills its place, the others land where they belong, and a load that
    skips it reads exactly the stored blocks."""
    f = 2
    a, b = rank(daemon, "a", "gemma3", f), rank(daemon, "b", "gemma3", f)
    groups = a.worker.groups
    assert len(groups) == 4 and len({g.namespace for g in groups}) == 4
    assert [len(g.caches) for g in groups] == [2, 2, 1, 2]
    assert groups[2].layout.tensor_page_bytes == groups[0].layout.tensor_page_bytes[:1]
    fill(a, 3)
    mgr, mgr_b = a.spec.get_manager(), b.spec.get_manager()
    keys = [make_offload_key(b"c%d" % i, g.group_id) for g in groups for i in range(2)]
    committed([], mgr)
    out = mgr.prepare_store(keys, CTX)
    assert out is not None and out.keys_to_store == keys
    # groups 0, 1, 3: two whole chunks each; group 2: its first chunk's first block
    # fell out of the sliding window (null), so 3 blocks start at logical block 1
    ids = [[2, 3, 4, 5], [6, 7, 8, 9], [11, 12, 13], [14, 15, 16, 17]]
    gpu = GPULoadStoreSpec([i for g in ids for i in g], [4, 4, 3, 4], [0, 0, 1, 0])
    assert a.worker.submit_store(1, gpu, out.store_spec)
    assert finish(a.worker, 1).success  # type: ignore[attr-defined]
    assert a.worker.stores_dropped_total == 0  # every slot whole: the daemon took all
    mgr.complete_store(keys, CTX)
    mgr.on_schedule_end(None)
    committed(keys, mgr, mgr_b)

    spec = mgr_b.prepare_load(keys, CTX)
    # group 2 loads from logical block 0: the null block's bytes, then its own three
    dst = [[30, 31, 32, 33], [34, 35, 36, 37], [40, 41, 42, 43], [44, 45, 46, 47]]
    assert b.worker.submit_load(
        2, spec, GPULoadStoreSpec([i for g in dst for i in g], [4] * 4, [0] * 4)
    )
    assert finish(b.worker, 2).success  # type: ignore[attr-defined]
    mgr_b.complete_load(keys, CTX)
    sources = [[2, 3, 4, 5], [6, 7, 8, 9], [0, 11, 12, 13], [14, 15, 16, 17]]
    layers = {g: b.kv_cache_config.kv_cache_groups[g].layer_names for g in range(4)}
    for g in range(4):
        for layer in layers[g]:
            assert torch.equal(b.caches[layer][dst[g]], a.caches[layer][sources[g]]), (g, layer)
    with kvoffload.connect(daemon.socket_path) as admin:
        sections = admin.stats()["namespaces"]
    assert [sections[g.namespace]["stored_blocks"] for g in groups] == [2, 2, 2, 2]
    a.shutdown()
    b.shutdown()


def test_a_load_whose_blocks_are_gone_stops_the_engine_with_one_error(
    daemon: DaemonProcess,
) -> None:
    """Never silently: vLLM must not compute with KV that was not loaded."""
    r = rank(daemon, "a")
    mgr = r.spec.get_manager()
    lspec = mgr.prepare_load([make_offload_key(b"never", 0)], CTX)
    assert r.worker.submit_load(3, lspec, GPULoadStoreSpec([0], [1], [0]))  # accepted
    with pytest.raises(LoadLostError, match=r"cannot complete: .*gone"):
        finish(r.worker, 3)
    assert not any(t.any() for t in r.caches.values())
    r.shutdown()


def test_a_rank_whose_pages_cannot_match_the_namespace_is_refused_at_start(
    daemon: DaemonProcess,
) -> None:
    """Two engines told to share one name whose pages differ: the second one's rank
    stops at start, the daemon's refusal naming both layouts; nothing is shared."""
    extra = {"namespace": "team"}
    first = Rank("tiny", 1, 0, daemon.socket_path, "a", canonical=False, extra=extra)
    with pytest.raises(LayoutMismatchError, match=r"exists with another layout .*sent"):
        Rank("llama", 1, 0, daemon.socket_path, "b", canonical=False, extra=extra)
    first.shutdown()


def test_a_rank_without_a_certified_mapping_cannot_write_canonical_pages() -> None:
    """The scheduler chose the canonical layout from vLLM's static certification; a
    rank vLLM then gives no certified mapping stops at start naming both layouts."""
    tensor = torch.zeros(4, 64, dtype=torch.int8)
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(tensor, 64)], [[CanonicalKVCacheRef(0, 64)]])
    identity = VllmIdentity("m", "bfloat16", 1, (16,), 16, canonical_format="v1-hnd")
    with pytest.raises(RuntimeError, match=r"canonical layout v1-hnd .* rank 3 .* per-rank pages"):
        canonical_parts(caches, [0], identity, rank=3)


def test_client_copies_and_their_write_happen_at_a_steps_first_call(
    daemon: DaemonProcess,
) -> None:
    """A store submitted in one step is copied, and its ``Wrote`` written, at the next
    step's first call (vLLM makes it before the forward pass, so the daemon's turn on
    it overlaps the forward pass); a step's result call after its submits writes
    nothing."""
    a = rank(daemon, "a", memfd=False)
    w = a.worker
    assert w.worker.copy_mode == "client"
    w.batch_interval_s = 0.0  # every step writes
    mgr = a.spec.get_manager()
    committed([], mgr)  # a step: the connection and its first leases
    keys = [make_offload_key(b"s%d" % i, 0) for i in range(2)]
    out = mgr.prepare_store(keys, CTX)
    assert out is not None and out.keys_to_store == keys
    spec = GPULoadStoreSpec([5, 6], [2], [0])
    assert w.submit_store(1, spec, out.store_spec)  # the step's first call
    writes = w.client.writes_total
    assert w.get_finished() == []  # not copied yet: nothing to write
    assert w.client.writes_total == writes
    results = w.get_finished()  # the next step's first call: copied, written
    assert [(r.job_id, r.success) for r in results] == [(1, True)]
    assert w.client.writes_total == writes + 1
    mgr.complete_store(keys, CTX)
    committed(keys, mgr)
    a.shutdown()
