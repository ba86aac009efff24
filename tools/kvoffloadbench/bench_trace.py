"""Shared pool against private pools: the same trace, the same total CPU memory.

N engine processes replay one synthetic chat trace (trace.py), each request routed to
a random engine. Every engine does what vLLM's offloading connector does per request:
look the prompt's blocks up, load the leading hits into its KV cache, store the blocks
it had to compute. Two set-ups with the same memory:

- shared: one kvoffloadd with ``total_bytes`` of region, all N engines in one namespace;
- private: N kvoffloadd instances with ``total_bytes / N`` each, one per engine (the
  per-engine CPU offloading that vLLM has built in, with equal memory).

Requests run strictly in trace order (a shared counter hands them out), so the figures
are deterministic for a seed: hit rates differ because of the pool, not of timing. The
engines' own GPU prefix caches are left out: every prompt block either comes from the
offload pool or is recomputed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from typing import Any

import numpy as np

import kvoffload

from .launch import DaemonProcess
from .trace import Request, TraceConfig, generate, route, unique_blocks

BLOCK_BYTES = 16 * 1024
NAMESPACE = "trace"


def _engine(
    sock: str,
    mine: list[tuple[int, list[bytes]]],
    counter: Any,
    turn: Any,
    out: Any,
) -> None:
    client = kvoffload.connect(sock)
    ns = client.namespace(NAMESPACE, kvoffload.KVLayout(tensor_page_bytes=[BLOCK_BYTES]))
    longest = max((len(k) for _, k in mine), default=1)
    cache = kvoffload.shared_kv_cache(longest, BLOCK_BYTES)
    w = ns.attach_worker([cache])
    hit_blocks = total_blocks = loaded = stored = job = 0
    for seq, keys in mine:
        with turn:
            turn.wait_for(lambda s=seq: counter.value == s, timeout=120)
        hits = ns.lookup(keys) or 0
        if hits:
            plan = ns.prepare_load(keys[:hits])
            job += 1
            assert w.submit_load(job, plan.slots, np.arange(hits)), w.last_error
            w.wait([job])
            ok = all(r.success for r in w.get_finished())
            ns.complete_load(keys[:hits])
            loaded += hits * BLOCK_BYTES if ok else 0
        sp = ns.prepare_store(keys[hits:])
        if sp is not None and sp.keys_to_store:
            first = keys.index(sp.keys_to_store[0])
            ids = [keys.index(k, first) for k in sp.keys_to_store]
            job += 1
            assert w.submit_store(job, ids, sp.slots), w.last_error
            w.wait([job])
            ok = all(r.success for r in w.get_finished())
            ns.complete_store(sp.keys_to_store, success=ok)
            stored += len(sp.keys_to_store) * BLOCK_BYTES if ok else 0
        hit_blocks += hits
        total_blocks += len(keys)
        with turn:
            counter.value += 1
            turn.notify_all()
    w.close()
    client.close()
    out.put((hit_blocks, total_blocks, loaded, stored))


def replay(
    requests: list[Request], engines: int, shared: bool, total_bytes: int, seed: int
) -> dict[str, Any]:
    """Replay the trace on ``engines`` engine processes; returns the totals."""
    per = total_bytes if shared else total_bytes // engines
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        # exact pool sizes: a quota in blocks, in regions with room to spare
        f.write(f'[[namespace_quotas]]\npattern = "{NAMESPACE}"\nmax_region_size = {per}\n')
    region = f"{(per >> 20) + 16}MiB"
    daemons = [
        DaemonProcess(region, "--config", f.name, "--log-level", "warning", "--no-prefault")
        for _ in range(1 if shared else engines)
    ]
    for d in daemons:
        d.start()
    try:
        pool_bytes = len(daemons) * (per // BLOCK_BYTES) * BLOCK_BYTES
        ctx = mp.get_context("fork")
        counter, turn, out = ctx.Value("q", 0), ctx.Condition(), ctx.Queue()
        where = route(requests, engines, seed)
        work: list[list[tuple[int, list[bytes]]]] = [[] for _ in range(engines)]
        for seq, (r, e) in enumerate(zip(requests, where)):
            work[e].append((seq, r.keys))
        t0 = time.perf_counter()
        procs = [
            ctx.Process(
                target=_engine,
                args=(daemons[0 if shared else e].socket_path, work[e], counter, turn, out),
            )
            for e in range(engines)
        ]
        for p in procs:
            p.start()
        totals = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
        wall_s = time.perf_counter() - t0
        pages = runs = 0
        for d in daemons:
            with kvoffload.connect(d.socket_path) as c:
                copies = c.stats()["copies"]
            pages += copies["planned_pages_total"]
            runs += copies["planned_runs_total"]
    finally:
        for d in daemons:
            d.stop()
        os.unlink(f.name)
    hit, total, loaded, stored = (sum(t[i] for t in totals) for i in range(4))
    tpb = TraceConfig().tokens_per_block
    return {
        "engines": engines,
        "pool": "shared" if shared else "private",
        "pool_bytes": pool_bytes,
        "hit_tokens": hit * tpb,
        "prompt_tokens": total * tpb,
        "hit_rate": hit / total if total else 0.0,
        "bytes_loaded": loaded,
        "bytes_stored": stored,
        "wall_s": wall_s,
        "mean_run_pages": pages / runs if runs else 0.0,
    }


def run_trace(
    quick: bool, total_mib: int = 48, engine_counts: tuple[int, ...] = (2, 4, 8)
) -> dict[str, Any]:
    cfg = TraceConfig(conversations=200 if quick else 600)
    requests = generate(cfg)
    rows = [
        replay(requests, n, shared, total_mib << 20, cfg.seed)
        for n in engine_counts
        for shared in (True, False)
    ]
    return {
        "trace": {
            "seed": cfg.seed,
            "requests": len(requests),
            "conversations": cfg.conversations,
            "system_prompts": cfg.system_prompts,
            "unique_blocks": unique_blocks(requests),
            "block_bytes": BLOCK_BYTES,
            "tokens_per_block": cfg.tokens_per_block,
            "total_pool_mib": total_mib,
        },
        "rows": rows,
    }
