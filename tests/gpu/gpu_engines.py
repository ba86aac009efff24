"""GPU engine processes for tests/gpu (spawned: CUDA does not survive fork).

Each engine allocates its KV caches on the GPU the way vLLM does (one int8 buffer
per canonical tensor, or views into one shared buffer), fills them from a seed, and
drives the daemon through the public client API. A loader regenerates the expected
bytes from the seed, so nothing but the daemon moves KV between processes.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import torch

import kvoffload

NUM_ENGINE_BLOCKS = 96


def layout(pages: list[int], factor: int) -> kvoffload.KVLayout:
    return kvoffload.KVLayout(tensor_page_bytes=pages, block_size_factor=factor, model="gpu")


def keys(prefix: bytes, n: int) -> list[bytes]:
    return [prefix + i.to_bytes(4, "big") for i in range(n)]


def make_caches(pages: list[int], seed: int | None, shared_buffer: bool) -> list[torch.Tensor]:
    """Canonical ``(blocks, page)`` int8 tensors on cuda:0, seeded or zero.

    ``shared_buffer`` puts every tensor in one allocation (as vLLM's canonical views
    of one KV buffer do), so the daemon must share one IPC import between them.
    """
    gen = torch.Generator(device="cuda").manual_seed(seed) if seed is not None else None

    def fill(t: torch.Tensor) -> torch.Tensor:
        if gen is not None:
            t.copy_(torch.randint(-128, 128, t.shape, generator=gen, device="cuda").to(t.dtype))
        return t

    if shared_buffer:
        total = sum(pages) * NUM_ENGINE_BLOCKS
        buf = torch.zeros(total + 4096, dtype=torch.int8, device="cuda")
        out, off = [], 4096  # an offset inside the allocation on purpose
        for p in pages:
            view = buf[off : off + p * NUM_ENGINE_BLOCKS].view(NUM_ENGINE_BLOCKS, p)
            out.append(fill(view))
            off += p * NUM_ENGINE_BLOCKS
        return out
    return [fill(torch.zeros(NUM_ENGINE_BLOCKS, p, dtype=torch.int8, device="cuda")) for p in pages]


def wait_copy_paths(client: kvoffload.Client, deadline_s: float = 60.0) -> str:
    """Until the daemon's copy paths on GPU 0 are settled (kernel loaded and calibrated,
    or DMA only); returns their state."""
    import time

    end = time.monotonic() + deadline_s
    while True:
        paths = client.stats()["gpu"].get("copy_paths", {}).get("0", {})
        state = str(paths.get("state", ""))
        if state and state != "calibrating":
            return state
        assert time.monotonic() < end, f"copy paths not settled after {deadline_s} s: {paths}"
        time.sleep(0.05)


def wait_done(w: kvoffload.Worker, job_id: int) -> kvoffload.TransferResult:
    """The job's result, waited for by the daemon (Worker.wait has its own deadline)."""
    w.wait([job_id])
    done = [r for r in w.get_finished() if r.job_id == job_id]
    assert done, f"job {job_id} did not finish"
    return done[0]


def store(
    sock: str,
    ns_name: str,
    pages: list[int],
    factor: int,
    n_blocks: int,
    seed: int,
    shared_buffer: bool = False,
    late_write: bool = False,
    settle_paths: bool = False,
) -> None:
    """Store n_blocks offloaded blocks from engine blocks 0.. of seeded GPU caches.

    ``late_write`` queues a long GPU sleep and then the real KV write on the current
    stream right before ``submit_store`` without synchronising: the daemon's copy must
    wait for it (the store fence), or it would store the stale zeros.
    """
    torch.cuda.init()
    client = kvoffload.connect(sock)
    ns = client.namespace(ns_name, layout(pages, factor))
    if late_write:
        caches = make_caches(pages, None, shared_buffer)
        final = make_caches(pages, seed, shared_buffer)
        torch.cuda.synchronize()
    else:
        caches = make_caches(pages, seed, shared_buffer)
        torch.cuda.synchronize()
    w = ns.attach_worker(caches)
    if settle_paths:
        wait_copy_paths(client)
    ks = keys(ns_name.encode(), n_blocks)
    plan = ns.prepare_store(ks)
    assert plan is not None and plan.keys_to_store == ks
    if late_write:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the write
        for c, f in zip(caches, final):
            c.copy_(f)
    assert w.submit_store(1, np.arange(n_blocks * factor), plan.slots), w.last_error
    assert wait_done(w, 1).success
    ns.complete_store(ks)
    w.close()
    client.close()


def load_and_compare(
    sock: str,
    ns_name: str,
    pages: list[int],
    factor: int,
    n_blocks: int,
    seed: int,
    skip: int,
    shared_buffer: bool = False,
) -> int:
    """Load the blocks back at other engine block ids, skipping ``skip``; count bad bytes."""
    torch.cuda.init()
    client = kvoffload.connect(sock)
    ns = client.namespace(ns_name, layout(pages, factor))
    expected = make_caches(pages, seed, shared_buffer)
    dst = make_caches(pages, None, shared_buffer)
    torch.cuda.synchronize()
    w = ns.attach_worker(dst)
    ks = keys(ns_name.encode(), n_blocks)
    assert ns.lookup(ks) == n_blocks
    plan = ns.prepare_load(ks)
    n_ids = n_blocks * factor - skip
    shift = min(7, NUM_ENGINE_BLOCKS - n_ids)  # other engine blocks than the stored ones
    target = torch.arange(n_ids) + shift
    assert w.submit_load(2, plan.slots, target.numpy(), skip=skip), w.last_error
    assert wait_done(w, 2).success
    ns.complete_load(ks)
    bad = 0
    for e, d in zip(expected, dst):
        bad += int((e[skip : skip + n_ids] != d[shift : shift + n_ids]).sum().item())
    w.close()
    client.close()
    return bad


def transfer_then_die(sock: str, ns_name: str, pages: list[int], load: bool, ready: Any) -> None:
    """Start a large store (or load) of GPU blocks, tell the parent, die by SIGKILL."""
    torch.cuda.init()
    client = kvoffload.connect(sock)
    ns = client.namespace(ns_name, layout(pages, 1))
    w = ns.attach_worker(make_caches(pages, 3, False))
    ks = keys(ns_name.encode(), NUM_ENGINE_BLOCKS)
    if load:
        plan = ns.prepare_load(ks)
        w.submit_load(1, plan.slots, np.arange(NUM_ENGINE_BLOCKS))
    else:
        splan = ns.prepare_store(ks)
        assert splan is not None
        w.submit_store(1, np.arange(NUM_ENGINE_BLOCKS), splan.slots)
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


def attach_error(sock: str) -> str:
    """Register caches allocated with expandable segments; return the refusal."""
    torch.cuda.init()
    client = kvoffload.connect(sock)
    ns = client.namespace("expandable", layout([4096], 1))
    cache = torch.zeros(64, 4096, dtype=torch.int8, device="cuda")
    try:
        ns.attach_worker([cache])
    except kvoffload.KVOffloadError as exc:
        return str(exc)
    finally:
        client.close()
    return ""
