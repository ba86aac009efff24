"""``make bench-submit``: what the daemon's loop spends on one submitted job, per block.

The loop thread validates every transfer before an address reaches a copier
(invariant 4): slots leased to the engine's token or pinned, no slot twice, engine
block ids inside the caches, then the copy plan and the busy marks. This measures
that work alone, on an in-process ``Service`` (no socket, no copy wait), for the
three shapes an engine sends, each with one cache and with one cache per layer of a
32-layer model (``LAYERS``: a vLLM worker registers each layer's KV tensor as a
part of its page, and the plan covers every part):

- ``store``: a store into slots the engine claimed from its lease (the engine path);
- ``load-keys``: a load naming its keys (the engine path; resolved wherever they are);
- ``load-slots``: a load of slots pinned by ``prepare_load`` (the blocking API).

Each figure is the median over repeats of one ``handle()`` call, in µs per block, and
the mean copy-run length the planner produced (engine blocks are contiguous and slots
come from the lease pool, so it also shows whether allocation kept them contiguous).

    python -m kvoffloadbench.bench_submit [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from typing import Any

import msgspec
import numpy as np

import kvoffload
from kvoffload.cache import describe_cache
from kvoffload.protocol import messages as m
from kvoffload.protocol.packing import pack_ids, pack_keys, unpack_ids
from kvoffloadbench.inproc import handle_now
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import Completion, CpuCopier
from kvoffloadd.region.region import Geometry, SharedOffloadRegion
from kvoffloadd.service.service import Service
from kvoffloadd.service.session import Session

PAGE_BYTES = 16384  # per block: 16 blocks are past the copier's inline size, not timed
LAYERS = 32  # caches of the layered shape, PAGE_BYTES // LAYERS bytes of page each
SIZES = (16, 256, 1024)


class _LoopCopier(CpuCopier):
    """The CPU copier with its copies run when drained, on the caller's thread: a
    copy thread waking up mid-``handle()`` would be timed as loop work."""

    def __init__(self) -> None:
        super().__init__(0)

    def drain(self) -> list[Completion]:
        self._queue.put(None)
        self._run()
        return super().drain()


class _Rig:
    """One Service over a small region, one engine session with a lease and a worker
    with ``caches`` caches that tile one page of PAGE_BYTES."""

    def __init__(self, caches: int) -> None:
        settings = {"instance": f"b{uuid.uuid4().hex[:8]}", "region_size": "256MiB"}
        settings["max_writing_fraction"] = 1.0  # type: ignore[assignment]
        cfg = msgspec.convert(settings, DaemonConfig).validate()
        geometry = Geometry.plan(cfg.region_bytes, cfg.extent_bytes, PAGE_BYTES)
        self.region = SharedOffloadRegion(cfg.region_name, geometry)
        self.copier = _LoopCopier()
        self.svc = Service(cfg, self.region, self.copier)
        self.s: Session = self.svc.open_session(1, os.getpid(), 0, 0)
        opened = self.svc.handle(self.s, m.OpenNamespace(2, "bench", m.KVLayout([PAGE_BYTES])))
        assert isinstance(opened, m.NamespaceOpened)
        self.ns, self.token = opened.ns, opened.lease
        self.caches = [
            kvoffload.shared_kv_cache(max(SIZES), PAGE_BYTES // caches) for _ in range(caches)
        ]
        descs: list[m.CacheDesc] = []
        for cache in self.caches:
            d, fd = describe_cache(cache)
            self.s.fds.append(os.dup(fd))  # the service closes what it is sent
            descs.append(
                m.CacheDesc(
                    d.kind,
                    d.num_blocks,
                    d.page_bytes,
                    len(descs),
                    d.offset_bytes,
                    d.row_stride_bytes,
                )
            )
        attached = handle_now(self.svc, self.s, m.AttachWorker(3, self.ns, 0, descs))
        assert isinstance(attached, m.WorkerAttached)
        self.worker = attached.worker
        self.pool: list[int] = []  # granted, not claimed (an engine's lease pool)
        self.last_slots: list[int] = []
        self.job = 0

    def close(self) -> None:
        self.copier.close()
        self.region.close()

    def leased(self, n: int) -> list[int]:
        """``n`` slots from this session's lease pool, as an engine's batch claims them."""
        self.svc.handle(self.s, m.StepBatch(0, self.ns, 8, want_leases=n))
        grants = [p for p in self.s.pushes if isinstance(p, m.LeaseGrant)]
        self.s.pushes.clear()
        self.pool.extend(s for g in grants for s in unpack_ids(g.slots).tolist())
        assert len(self.pool) >= n, f"a lease pool of {n} slots holds {len(self.pool)}"
        slots = self.pool[-n:]  # what kvoffload.engine.view takes
        del self.pool[-n:]
        return slots

    def timed(self, msg: m.SubmitStore | m.SubmitLoad) -> float:
        t0 = time.perf_counter()
        self.svc.handle(self.s, msg)
        took = time.perf_counter() - t0
        w = self.svc.workers[self.worker]
        deadline = time.monotonic() + 30.0
        while msg.job_id in w.active_jobs:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {msg.job_id} did not finish in 30 s")
            self.svc.on_completions(self.copier.drain())
        return took

    def one_round(self, n: int, rep: int) -> dict[str, float]:
        keys = [b"%06d%06d%04d" % (n, rep, i) for i in range(n)]
        kp, kb = pack_keys(keys)
        slots = self.leased(n)
        self.last_slots = slots
        self.svc.handle(
            self.s, m.StepBatch(0, self.ns, kb, claim_keys=kp, claim_slots=pack_ids(slots))
        )
        self.job += 1
        ids = pack_ids(np.arange(n))
        store = m.SubmitStore(0, self.worker, self.job, ids, pack_ids(slots), lease=self.token)
        out = {"store": self.timed(store) / n}
        self.svc.handle(self.s, m.StepBatch(0, self.ns, kb, commit_keys=kp))
        self.job += 1
        by_key = m.SubmitLoad(0, self.worker, self.job, pack_ids(slots), ids, keys=kp, key_bytes=kb)
        out["load-keys"] = self.timed(by_key) / n
        lp = self.svc.handle(self.s, m.PrepareLoad(7, self.ns, kp, kb))
        assert isinstance(lp, m.LoadPlanReply)
        self.job += 1
        by_slot = m.SubmitLoad(0, self.worker, self.job, lp.slots, ids)
        out["load-slots"] = self.timed(by_slot) / n
        self.svc.handle(self.s, m.CompleteLoad(9, self.ns, kp, kb))
        self.svc.namespaces[self.ns].evict(keys)
        return out


def mean_run_blocks(slots: list[int]) -> float:
    """Mean run length, in blocks, of a store of engine blocks 0..n-1 into ``slots``."""
    if not slots:
        return 0.0
    a = np.asarray(slots)
    breaks = int(np.count_nonzero(np.diff(a) != 1))
    return len(slots) / (breaks + 1)


def run_submit(quick: bool = False) -> dict[str, Any]:
    repeats = 15 if quick else 101
    rows = []
    for caches in (1, LAYERS):
        rig = _Rig(caches)
        try:
            for n in SIZES:
                samples: dict[str, list[float]] = {}
                for rep in range(repeats):
                    for kind, v in rig.one_round(n, rep).items():
                        samples.setdefault(kind, []).append(v)
                row: dict[str, Any] = {"caches": caches, "blocks": n}
                row.update({k: statistics.median(v) * 1e6 for k, v in samples.items()})
                row["lease_run_blocks"] = mean_run_blocks(rig.last_slots)
                rows.append(row)
        finally:
            rig.close()
    return {"rows": rows, "repeats": repeats}


def submit_table(r: dict[str, Any]) -> str:
    out = [
        "| caches | blocks/job | store | load, keys named | load, slots named "
        "| leased slots: run length |",
        "|---|---|---|---|---|---|",
    ]
    out.extend(
        f"| {x.get('caches', 1)} | {x['blocks']} | {x['store']:.2f} µs | {x['load-keys']:.2f} µs | "
        f"{x['load-slots']:.2f} µs | {x['lease_run_blocks']:.1f} |"
        for x in r["rows"]
    )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    r = run_submit(args.quick)
    print("daemon loop time per submitted block (median of one handle() call):")
    print(submit_table(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
