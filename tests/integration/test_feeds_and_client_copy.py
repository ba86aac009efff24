"""Per-connection event feeds, key snapshots, client-copy workers and cache subsets,
against a real daemon."""

from __future__ import annotations

import numpy as np
import torch
from engines import FACTOR, PAGES, keys, layout, wait_done

import kvoffload
from kvoffloadbench.launch import DaemonProcess


def _store(ns: kvoffload.Namespace, w: kvoffload.Worker, ks: list[bytes], job: int) -> None:
    plan = ns.prepare_store(ks)
    assert plan is not None
    ids = np.arange(len(plan.keys_to_store) * FACTOR)
    assert w.submit_store(job, ids, plan.slots), w.last_error
    assert wait_done(w, job).success
    ns.complete_store(ks)


def test_every_connection_sees_every_event_and_snapshots_are_exact(
    daemon: DaemonProcess,
) -> None:
    a, b = kvoffload.connect(daemon.socket_path), kvoffload.connect(daemon.socket_path)
    ns_a, ns_b = a.namespace("ev", layout()), b.namespace("ev", layout())
    w = ns_a.attach_worker([kvoffload.shared_kv_cache(64, p) for p in PAGES])
    first = keys(b"e", 3)
    _store(ns_a, w, first, 1)
    # both engines get the store: the one that made it and the one that shares it
    assert [(e.keys, e.removed) for e in ns_a.take_events()] == [(first, False)]
    assert [(e.keys, e.removed) for e in ns_b.take_events()] == [(first, False)]
    assert ns_b.take_events() == []
    assert sorted(ns_b.sync_keys()) == sorted(first)
    assert a.evict("ev", keys=[first[0]]) == 1
    second = keys(b"f", 2)
    _store(ns_a, w, second, 2)
    events, lost = ns_b.read_feed()
    assert not lost
    mirror = set(first)
    for e in events:
        mirror = mirror - set(e.keys) if e.removed else mirror | set(e.keys)
    assert mirror == set(first[1:] + second) == set(ns_a.sync_keys())
    w.close()
    a.close()
    b.close()


def test_plain_cpu_tensors_copy_through_the_region_byte_for_byte(daemon: DaemonProcess) -> None:
    """Client-copy mode: a storer with plain tensors, a loader with plain tensors."""
    rng = np.random.default_rng(5)
    src = [torch.from_numpy(rng.integers(-128, 128, (64, p), dtype=np.int8)) for p in PAGES]
    c = kvoffload.connect(daemon.socket_path)
    ns = c.namespace("cc", layout())
    w = ns.attach_worker(src)
    assert w.copy_mode == "client"
    ks = keys(b"c", 4)
    _store(ns, w, ks, 1)
    dst = [torch.zeros(64, p, dtype=torch.int8) for p in PAGES]
    loader = ns.attach_worker(dst, copy_mode="client")
    plan = ns.prepare_load(ks)
    ids = np.arange(10, 10 + len(ks) * FACTOR - 1)
    assert loader.submit_load(1, plan.slots, ids, skip=1), loader.last_error
    r = wait_done(loader, 1)
    ns.complete_load(ks)
    assert r.success and r.nbytes == ids.size * sum(PAGES)
    for s_t, d_t in zip(src, dst):
        assert torch.equal(d_t[10 : 10 + ids.size], s_t[1 : 1 + ids.size])
        assert not d_t[:10].any() and not d_t[10 + ids.size :].any()
    # a slot nobody leased is refused before any byte moves
    assert not loader.submit_load(2, [plan.slots[0]], np.arange(FACTOR))
    assert isinstance(loader.last_error, kvoffload.NotLeasedError)
    loader.close()
    w.close()
    c.close()


def test_a_load_can_copy_a_subset_of_the_caches_a_store_writes_them_all(
    daemon: DaemonProcess,
) -> None:
    """vLLM's KV cache groups load only their own tensors; a store writes its slots
    whole (a store of some caches would leave bytes of the slot's last owner in it)."""
    c = kvoffload.connect(daemon.socket_path)
    ns = c.namespace("sub", layout())
    src = [kvoffload.shared_kv_cache(64, p) for p in PAGES]
    for i, t in enumerate(src):
        t.fill_(i + 1)
    w = ns.attach_worker(src)
    ks = keys(b"s", 1)
    plan = ns.prepare_store(ks)
    assert plan is not None
    assert not w.submit_store(1, [0, 1], plan.slots, caches=[2])
    assert isinstance(w.last_error, kvoffload.InvalidArgumentError)
    assert not w.submit_store(1, [0, 1], plan.slots, caches=[1])
    assert "slots whole" in str(w.last_error)
    assert w.submit_store(1, [0, 1], plan.slots) and wait_done(w, 1).success
    ns.complete_store(ks)
    dst = [kvoffload.shared_kv_cache(64, p) for p in PAGES]
    loader = ns.attach_worker(dst)
    lp = ns.prepare_load(ks)
    assert loader.submit_load(1, lp.slots, [4, 5], caches=[1])
    r = wait_done(loader, 1)
    ns.complete_load(ks)
    assert r.success and r.nbytes == 2 * PAGES[1]
    assert not dst[0].any() and bool((dst[1][4:6] == 2).all())
    loader.close()
    w.close()
    c.close()
