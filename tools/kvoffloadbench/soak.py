"""``make soak``: many engine processes against one daemon for a long time.

Every engine shares one namespace and does random stores, loads, admin evictions and
disconnects. A block's bytes are a function of its key alone, so any engine can check
any block it loads against what must have been stored: every loaded block is compared
(CRC32 and byte by byte) with the expected bytes. Prints operations, bytes moved,
errors by code and the number of wrong bytes, which must be 0 (exit status 1 if not,
or if the daemon died).

    python -m kvoffloadbench.soak [--clients 8] [--minutes 10] [--region-size 64MiB]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import time
import zlib
from collections import Counter
from typing import Any

import numpy as np

import kvoffload

from .launch import DaemonProcess

PAGES = [8192, 4096]
ENGINE_BLOCKS = 256
KEY_SPACE = 20_000


def content(key: bytes, page: int) -> np.ndarray:
    """The bytes every engine stores for ``key`` in a tensor of ``page`` bytes."""
    seed = hashlib.blake2b(key + page.to_bytes(4, "little"), digest_size=64).digest()
    return np.resize(np.frombuffer(seed, dtype=np.int8), page)


class Engine:
    def __init__(self, sock: str, seed: int) -> None:
        self.sock = sock
        self.rng = np.random.default_rng(seed)
        self.stats: Counter[str] = Counter()
        self.job = 0
        self._open()

    def _open(self) -> None:
        self.client = kvoffload.connect(self.sock, lazy=True)  # survives a daemon restart
        self.ns = self.client.namespace("soak", kvoffload.KVLayout(tensor_page_bytes=PAGES))
        self.caches = [kvoffload.shared_kv_cache(ENGINE_BLOCKS, p) for p in PAGES]
        self.worker = self.ns.attach_worker(self.caches)

    def _keys(self) -> list[bytes]:
        first = int(self.rng.integers(0, KEY_SPACE - 32))
        return [b"soak-%08d" % (first + i) for i in range(int(self.rng.integers(1, 32)))]

    def _run_job(self, submit: Any) -> bool:
        self.job += 1
        if not submit(self.job):
            self.stats[f"refused_{self._code(self.worker.last_error)}"] += 1
            return False
        self.worker.wait([self.job])
        done = [r for r in self.worker.get_finished() if r.job_id == self.job]
        if not done or not done[0].success:
            self.stats["jobs_failed"] += 1
            return False
        self.stats["bytes_moved"] += done[0].nbytes
        return True

    @staticmethod
    def _code(exc: BaseException | None) -> str:
        code = getattr(exc, "code", None)
        return code.name if code is not None else type(exc).__name__

    def store(self) -> None:
        keys = self._keys()
        plan = self.ns.prepare_store(keys)
        if plan is None:
            self.stats[f"error_{self._code(self.ns.last_error)}"] += 1
            return
        if not plan.keys_to_store:
            return
        ids = self.rng.choice(ENGINE_BLOCKS, len(plan.keys_to_store), replace=False)
        for cache, page in zip(self.caches, PAGES):
            arr = cache.numpy()
            for key, b in zip(plan.keys_to_store, ids):
                arr[b] = content(key, page)
        ok = self._run_job(lambda j: self.worker.submit_store(j, ids, plan.slots))
        fail = not ok or self.rng.random() < 0.05  # sometimes give a store up
        self.ns.complete_store(plan.keys_to_store, success=not fail)
        self.stats["stores" if not fail else "stores_abandoned"] += 1

    def load(self) -> None:
        keys = self._keys()
        hits = self.ns.lookup(keys)
        if not hits:
            self.stats["misses"] += 1
            return
        keys = keys[:hits]
        try:
            plan = self.ns.prepare_load(keys)
        except kvoffload.KVOffloadError as exc:  # evicted since the lookup
            self.stats[f"error_{self._code(exc)}"] += 1
            return
        ids = self.rng.choice(ENGINE_BLOCKS, len(keys), replace=False)
        if self._run_job(lambda j: self.worker.submit_load(j, plan.slots, ids)):
            for cache, page in zip(self.caches, PAGES):
                arr = cache.numpy()
                for key, b in zip(keys, ids):
                    want = content(key, page)
                    if zlib.crc32(arr[b].tobytes()) != zlib.crc32(want.tobytes()):
                        self.stats["wrong_bytes"] += int((arr[b] != want).sum())
                        self.stats["wrong_blocks"] += 1
            self.stats["blocks_verified"] += len(keys)
        self.ns.complete_load(keys)
        self.stats["loads"] += 1

    def evict(self) -> None:
        self.client.evict("soak", keys=self._keys())
        self.stats["evictions"] += 1

    def reconnect(self) -> None:
        if not self.client.connected:  # still connecting: dropping it now would
            return  # only start another handshake, never finishing one
        old_client, old_worker = self.client, self.worker
        self._open()  # raises while the daemon is down: keep the old connection then
        old_worker.close()
        old_client.close()
        self.stats["reconnects"] += 1

    def step(self) -> None:
        r = self.rng.random()
        try:
            if r < 0.45:
                self.store()
            elif r < 0.93:
                self.load()
            elif r < 0.98:
                self.evict()
            else:
                self.reconnect()
        except kvoffload.KVOffloadError as exc:
            self.stats[f"error_{self._code(exc)}"] += 1
        self.stats["operations"] += 1


def engine_main(sock: str, seed: int, seconds: float, out: Any, stop: Any = None) -> None:
    eng = Engine(sock, seed)
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (stop is not None and stop.is_set()):
        eng.step()
    eng.worker.close()
    eng.client.close()
    out.put(dict(eng.stats))


def soak(sock: str, clients: int, seconds: float, stop: Any = None) -> Counter[str]:
    """Run ``clients`` engines for ``seconds``, or until ``stop`` (a multiprocessing
    Event of the spawn context) is set."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=engine_main, args=(sock, 1000 + i, seconds, out, stop))
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    total: Counter[str] = Counter()
    for _ in procs:
        total.update(out.get(timeout=seconds + 300))
    for p in procs:
        p.join(60)
    total["engines_failed"] = sum(1 for p in procs if p.exitcode != 0)
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvoffloadbench.soak")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--region-size", default="64MiB")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    with DaemonProcess(args.region_size, "--log-level", "warning") as d:
        total = soak(d.socket_path, args.clients, args.minutes * 60)
        alive = d.alive()
        stats = kvoffload.connect(d.socket_path).stats()
        rc = d.stop()
    minutes = (time.monotonic() - t0) / 60
    print(f"soak: {args.clients} engines for {minutes:.1f} min against one kvoffloadd")
    for key in sorted(total):
        print(f"  {key:24s} {total[key]}")
    print(f"  {'daemon_errors_by_code':24s} {stats['errors']}")
    print(f"  {'daemon_evicted_blocks':24s} {stats['eviction']['evicted_blocks_total']}")
    print(f"  {'daemon_exit_status':24s} {rc}")
    bad = total["wrong_bytes"] or total["engines_failed"] or not alive or rc != 0
    print("soak: FAILED" if bad else "soak: passed (0 wrong bytes)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
