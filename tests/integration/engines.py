"""Engine processes for integration tests (spawned; importable by the children).

Each engine derives its KV bytes from a seed, so a loader can check exactly what a
storer wrote without shipping the data around.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import torch

import kvoffload

PAGES = [4096, 8192]  # two canonical tensors
FACTOR = 2  # two engine blocks per offloaded block
NUM_ENGINE_BLOCKS = 64
DEADLINE_S = 20.0


def layout() -> kvoffload.KVLayout:
    return kvoffload.KVLayout(tensor_page_bytes=PAGES, block_size_factor=FACTOR, model="test")


def keys(prefix: bytes, n: int) -> list[bytes]:
    return [prefix + i.to_bytes(4, "big") for i in range(n)]


def filled_caches(seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    caches = []
    for page in PAGES:
        t = kvoffload.shared_kv_cache(NUM_ENGINE_BLOCKS, page)
        t.copy_(torch.from_numpy(rng.integers(-128, 128, t.shape, dtype=np.int8)))
        caches.append(t)
    return caches


def wait_done(w: kvoffload.Worker, job_id: int) -> kvoffload.TransferResult:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        for r in w.get_finished():
            if r.job_id == job_id:
                return r
        time.sleep(0.001)
    raise TimeoutError(f"job {job_id} did not finish")


def store(sock: str, ns_name: str, prefix: bytes, n_blocks: int, seed: int) -> list[int]:
    """Store n_blocks offloaded blocks from engine blocks 0.. of seeded caches."""
    client = kvoffload.connect(sock)
    ns = client.namespace(ns_name, layout())
    caches = filled_caches(seed)
    w = ns.attach_worker(caches)
    ks = keys(prefix, n_blocks)
    plan = ns.prepare_store(ks)
    assert plan is not None and plan.keys_to_store == ks
    assert w.submit_store(1, np.arange(n_blocks * FACTOR), plan.slots), w.last_error
    assert wait_done(w, 1).success
    ns.complete_store(ks)
    client.close()
    return plan.slots


def load_and_compare(sock: str, ns_name: str, prefix: bytes, n_blocks: int, seed: int) -> int:
    """Load every block back at other engine block ids, skipping one sub-block; count bad bytes."""
    client = kvoffload.connect(sock)
    ns = client.namespace(ns_name, layout())
    expected = filled_caches(seed)
    dst = [kvoffload.shared_kv_cache(NUM_ENGINE_BLOCKS, p) for p in PAGES]
    w = ns.attach_worker(dst)
    ks = keys(prefix, n_blocks)
    deadline = time.monotonic() + DEADLINE_S
    while ns.lookup(ks) != n_blocks:
        assert time.monotonic() < deadline, "blocks never became visible"
        time.sleep(0.005)
    plan = ns.prepare_load(ks)
    n_ids = n_blocks * FACTOR - 1
    target = np.arange(n_ids) + 20
    assert w.submit_load(2, plan.slots, target, skip=1), w.last_error
    assert wait_done(w, 2).success
    ns.complete_load(ks)
    bad = 0
    for e, d in zip(expected, dst):
        bad += int((e[1 : 1 + n_ids] != d[20 : 20 + n_ids]).sum())
    client.close()
    return bad


def store_then_die(sock: str, ns_name: str, prefix: bytes, n_blocks: int, ready: Any) -> None:
    """Prepare a store, start the copy, tell the parent, then die by SIGKILL."""
    client = kvoffload.connect(sock)
    ns = client.namespace(ns_name, layout())
    w = ns.attach_worker(filled_caches(7))
    plan = ns.prepare_store(keys(prefix, n_blocks))
    assert plan is not None
    w.submit_store(1, np.arange(n_blocks * FACTOR), plan.slots)
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


def load_then_die(sock: str, ns_name: str, prefix: bytes, n_blocks: int, ready: Any) -> None:
    """Pin blocks for a load, start the copy, tell the parent, then die by SIGKILL."""
    client = kvoffload.connect(sock)
    ns = client.namespace(ns_name, layout())
    w = ns.attach_worker([kvoffload.shared_kv_cache(NUM_ENGINE_BLOCKS, p) for p in PAGES])
    plan = ns.prepare_load(keys(prefix, n_blocks))
    w.submit_load(1, plan.slots, np.arange(n_blocks * FACTOR))
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)
