"""Two engines (and a third) on one daemon, byte-exact, through a daemon killed mid-copy.

The part of ``gpu_check`` that re-verifies the mission's data path: engine A (TP 2:
ranks A0, A1) stores, engine B (TP 2) and engine C (TP 1) load, each rank in its own
spawned process with its KV caches allocated as vLLM does (per layer, views of one
buffer from torch's caching allocator on ``cuda:0``; ``shared_kv_cache`` memfds with
``device="cpu"``, the CPU side of the check). This process is the engines' scheduler
(prepare, complete, lookup). Layouts (a GQA layer: K and V of 16 tokens x 4 heads x 64
dims x 2 bytes, a 16 KiB canonical page per layer):

- per-rank pages, NHD and HND (world size 2: each rank its own 8 KiB page);
- canonical pages, NHD and HND (world size 1: each TP 2 rank writes its heads'
  fragments, 256-byte pieces in NHD, 4 KiB in HND; a TP 1 engine reads whole pages).

Every loaded byte is compared with the truth, a function of (case, key, layer). Then
the daemon is SIGKILLed while stores are in flight, the engines meet misses and failed
jobs (no exception, no hang), a new daemon starts on the kept region, the engines
reconnect by themselves, the blocks stored before the kill load byte-exact, the
killed stores never became visible, and new stores work.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import kvoffload
from kvoffload.datapath.canonical import CanonicalPart

from .launch import DaemonProcess

LAYERS, TOKENS, HEADS, DIMS, ELEM = 4, 16, 4, 64, 2
CANON_PAGE = 2 * TOKENS * HEADS * DIMS * ELEM  # 16 KiB
NUM_BLOCKS = 64
STORED = 24
DEADLINE_S = 60.0


@dataclass(frozen=True)
class Case:
    name: str
    canonical: bool
    layout: str  # "NHD" or "HND"

    def namespace(self) -> str:
        return f"{'canon' if self.canonical else 'rank'}-{self.layout.lower()}"

    def kv_layout(self, tp: int) -> kvoffload.KVLayout:
        if self.canonical:
            return kvoffload.KVLayout([CANON_PAGE] * LAYERS, 1, 1, model="two-engines")
        return kvoffload.KVLayout([CANON_PAGE // tp] * LAYERS, tp, 1, model="two-engines")


CASES = [
    Case("per-rank NHD", False, "NHD"),
    Case("per-rank HND", False, "HND"),
    Case("canonical NHD", True, "NHD"),
    Case("canonical HND", True, "HND"),
]


def head_fragments(
    layout: str, tokens: int, heads: int, dims: int, elem_bytes: int, tp: int, rank: int
) -> np.ndarray:
    """(local offset, canonical offset, bytes) of rank ``rank`` of ``tp`` in one layer's
    canonical page: K and V, each [tokens][heads][dims] (NHD) or [heads][tokens][dims]
    (HND); the rank holds heads ``rank * heads/tp ..`` (vLLM's GQA sharding)."""
    mine = heads // tp
    row = dims * elem_bytes
    rows = []
    local = 0
    for kv in range(2):
        base = kv * tokens * heads * row
        if layout == "NHD":
            for t in range(tokens):
                rows.append((local, base + (t * heads + rank * mine) * row, mine * row))
                local += mine * row
        else:
            rows.append((local, base + rank * mine * tokens * row, mine * tokens * row))
            local += mine * tokens * row
    return np.array(rows, dtype=np.int64)


def fragments(layout: str, tp: int, rank: int) -> np.ndarray:
    return head_fragments(layout, TOKENS, HEADS, DIMS, ELEM, tp, rank)


def truth(case: Case, key: int, layer: int) -> np.ndarray:
    """The canonical page of one layer of one stored block."""
    seed = zlib.crc32(f"{case.name}/{key}/{layer}".encode())
    return np.random.default_rng(seed).integers(0, 256, CANON_PAGE, dtype=np.uint8)


def rank_page(case: Case, canon: np.ndarray, tp: int, rank: int) -> np.ndarray:
    if tp == 1:
        return canon
    return np.concatenate([canon[c : c + n] for _, c, n in fragments(case.layout, tp, rank)])


def keys_of(case: Case, first: int, n: int) -> list[bytes]:
    return [b"%s-%06d" % (case.namespace().encode(), i) for i in range(first, first + n)]


# ------------------------------------------------------------------ one engine rank


class _Rank:
    """Runs in its own process: one rank's caches, workers per case, and commands."""

    def __init__(self, sock: str, tp: int, rank: int, device: str) -> None:
        import torch

        self.torch: Any = torch
        self.tp, self.rank, self.device = tp, rank, device
        if device == "cuda":
            self.torch.cuda.init()
        self.client = kvoffload.connect(sock, timeout_s=2.0)
        self.caches: dict[str, list[Any]] = {}
        self.workers: dict[str, kvoffload.Worker] = {}

    def attach(self, case: Case) -> None:
        torch, page = self.torch, CANON_PAGE // self.tp
        if self.device == "cuda":  # one buffer, a view per layer (vLLM's allocation)
            buf = torch.zeros(LAYERS * NUM_BLOCKS * page, dtype=torch.int8, device="cuda")
            caches = list(buf.view(LAYERS, NUM_BLOCKS, page).unbind(0))
        else:
            caches = [kvoffload.shared_kv_cache(NUM_BLOCKS, page) for _ in range(LAYERS)]
        ns = self.client.namespace(case.namespace(), case.kv_layout(self.tp))
        if case.canonical:
            part = CanonicalPart(CANON_PAGE, fragments(case.layout, self.tp, self.rank))
            w = ns.attach_worker(caches, self.rank, canonical=[part] * LAYERS, parts=self.tp)
        else:
            w = ns.attach_worker(caches, self.rank)
        self.caches[case.name], self.workers[case.name] = caches, w

    def fill(self, case: Case, key_ids: list[int], rows: list[int]) -> None:
        torch = self.torch
        for layer, cache in enumerate(self.caches[case.name]):
            pages = [rank_page(case, truth(case, k, layer), self.tp, self.rank) for k in key_ids]
            data = torch.from_numpy(np.stack(pages).view(np.int8))
            cache[torch.tensor(rows)] = data.to(cache.device)
        if self.device == "cuda":
            torch.cuda.synchronize()

    def hold_stream(self, case: Case | None, seconds: float) -> None:
        """Queue ``seconds`` of GPU sleep on the current stream (a long kernel): a store
        submitted next waits for it on the daemon's stream (the store fence)."""
        if self.device == "cuda":
            self.torch.cuda._sleep(int(seconds * 2e9))

    def submit(
        self, case: Case, job: int, store: bool, rows: list[int], slots: list[int], lease: int = 0
    ) -> bool:
        """Submit as an engine step does (adopting a new connection first); a submit
        refused because the daemon is away is tried again once it is back."""
        w = self.workers[case.name]
        end = time.monotonic() + DEADLINE_S
        while True:
            self.client.adopt()
            if store:
                ok = w.submit_store(job, rows, slots, lease=lease)
            else:
                ok = w.submit_load(job, slots, rows)
            away = isinstance(w.last_error, kvoffload.DaemonUnavailableError)
            if ok or not away or time.monotonic() > end:
                return ok
            w.last_error = None
            self.client.wait_connected(1.0)
            time.sleep(0.05)

    def wait(self, case: Case, jobs: list[int]) -> list[bool]:
        w = self.workers[case.name]
        w.wait(jobs)
        end = time.monotonic() + DEADLINE_S
        done: dict[int, bool] = {}
        while len(done) < len(jobs) and time.monotonic() < end:
            done.update((r.job_id, r.success) for r in w.get_finished())
            if len(done) < len(jobs):
                time.sleep(0.01)
        return [done.get(j, False) for j in jobs]

    def bad_bytes(self, case: Case, key_ids: list[int], rows: list[int]) -> int:
        bad = 0
        for layer, cache in enumerate(self.caches[case.name]):
            got = cache[self.torch.tensor(rows)].cpu().numpy().view(np.uint8)
            for g, k in zip(got, key_ids):
                want = rank_page(case, truth(case, k, layer), self.tp, self.rank)
                bad += int((g != want).sum())
        return bad


def _rank_main(conn: Connection, sock: str, tp: int, rank: int, device: str) -> None:
    r = _Rank(sock, tp, rank, device)
    cases = {c.name: c for c in CASES}
    while True:
        cmd, args = conn.recv()
        if cmd == "quit":
            conn.send(None)
            return
        try:
            args = (cases.get(args[0]), *args[1:])
            conn.send(("ok", getattr(r, cmd)(*args)))
        except Exception as exc:  # reported to the scheduler, the rank carries on
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Engine:
    """One engine: ``tp`` rank processes, driven over pipes."""

    def __init__(self, name: str, sock: str, tp: int, device: str) -> None:
        ctx = mp.get_context("spawn")
        self.name, self.tp = name, tp
        self._conns: list[Connection] = []
        self._procs = []
        for rank in range(tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(child, sock, tp, rank, device), daemon=True)
            p.start()
            self._conns.append(parent)
            self._procs.append(p)

    def call(self, cmd: str, *args: Any) -> list[Any]:
        """Send a command to every rank, then collect every answer; an error in a rank
        raises here. The first argument is a case's name (or None)."""
        for c in self._conns:
            c.send((cmd, args))
        out = []
        for i, c in enumerate(self._conns):
            if not c.poll(DEADLINE_S * 2):
                raise TimeoutError(f"engine {self.name} rank {i}: no answer to {cmd}")
            status, value = c.recv()
            if status != "ok":
                raise RuntimeError(f"engine {self.name} rank {i}: {cmd}: {value}")
            out.append(value)
        return out

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        for c, p in zip(self._conns, self._procs):
            if p.is_alive():
                c.send(("quit", ()))
                c.poll(10)
            p.join(10)
            if p.is_alive():
                p.kill()


# ------------------------------------------------------------------ the scheduler


class Scheduler:
    def __init__(self, sock: str) -> None:
        self.client = kvoffload.connect(sock, timeout_s=2.0)
        self.ns: dict[str, kvoffload.Namespace] = {}
        self.job = 0

    def namespace(self, case: Case) -> kvoffload.Namespace:
        if case.name not in self.ns:
            self.ns[case.name] = self.client.namespace(case.namespace(), case.kv_layout(2))
        return self.ns[case.name]

    def next_job(self) -> int:
        self.job += 1
        return self.job

    def store(self, engine: Engine, case: Case, first: int, n: int, rows: list[int]) -> None:
        ns = self.namespace(case)
        keys = keys_of(case, first, n)
        plan = ns.prepare_store(keys)
        assert plan is not None and plan.keys_to_store == keys, "no space for the store"
        engine.call("fill", case.name, list(range(first, first + n)), rows)
        job = self.next_job()
        accepted = engine.call("submit", case.name, job, True, rows, plan.slots, plan.lease)
        done = engine.call("wait", case.name, [job])
        ok = all(accepted) and all(d[0] for d in done)
        ns.complete_store(keys, success=ok)
        assert ok, f"{engine.name} could not store {case.name}: {accepted} {done}"

    def load(self, engine: Engine, case: Case, first: int, n: int, rows: list[int]) -> int:
        """Bad bytes over every rank of ``engine`` after loading keys first.. at rows."""
        ns = self.namespace(case)
        keys = keys_of(case, first, n)
        assert ns.lookup(keys) == n, f"{case.name}: stored keys not all found"
        plan = ns.prepare_load(keys)
        job = self.next_job()
        accepted = engine.call("submit", case.name, job, False, rows, list(plan.slots))
        done = engine.call("wait", case.name, [job])
        ns.complete_load(keys)
        assert all(accepted) and all(d[0] for d in done), f"{engine.name} load failed"
        return sum(engine.call("bad_bytes", case.name, list(range(first, first + n)), rows))

    def close(self) -> None:
        self.client.close()


def _rows(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).permutation(NUM_BLOCKS)[:n]]


def _until(predicate: Any, what: str, deadline_s: float = DEADLINE_S) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > deadline_s:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


def run(
    device: str, region: str = "1GiB", daemon_settings: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The whole scenario; raises on the first wrong byte or failed expectation."""
    out: dict[str, Any] = {"device": device, "cases": {}}
    args = ("--log-level", "warning")
    d1 = DaemonProcess(region, *args, settings=daemon_settings).start()
    sched = Scheduler(d1.socket_path)
    engines = {
        "A": Engine("A", d1.socket_path, 2, device),
        "B": Engine("B", d1.socket_path, 2, device),
        "C": Engine("C", d1.socket_path, 1, device),
    }
    d2: DaemonProcess | None = None
    try:
        for case in CASES:
            readers = [engines["B"]] + ([engines["C"]] if case.canonical else [])
            for e in [engines["A"], *readers]:
                e.call("attach", case.name)
            sched.store(engines["A"], case, 0, STORED, _rows(1, STORED))
            bad = {e.name: sched.load(e, case, 0, STORED, _rows(2, STORED)) for e in readers}
            out["cases"][case.name] = {"blocks": STORED, "bad_bytes": bad}
            assert not any(bad.values()), f"{case.name}: wrong bytes loaded {bad}"
        out["kill"] = kill_mid_copy(sched, engines, d1)
        d2 = DaemonProcess(
            region,
            *args,
            instance=d1.instance,
            socket_path=d1.socket_path,
            settings=daemon_settings,
        ).start()
        out["restart"] = after_restart(sched, engines)
        out["engines_alive"] = all(e.alive for e in engines.values())
        assert out["engines_alive"], "an engine process died"
        with kvoffload.connect(d2.socket_path) as c:
            out["gpu_stats"] = c.stats()["gpu"]
    finally:
        for e in engines.values():
            e.close()
        sched.close()
        d1.kill()
        if d2 is not None and d2.alive():
            d2.stop()
        from .launch import drop_kept_region

        drop_kept_region(d1.socket_path, d1.instance)
    return out


def kill_mid_copy(sched: Scheduler, engines: dict[str, Engine], d: DaemonProcess) -> dict[str, Any]:
    """Stores from A of every case in flight, then SIGKILL; the engines carry on. On a
    GPU the engine's stream is busy (a long kernel) when it submits, so the daemon's
    copies wait on the store fence: the kill lands while they are in flight."""
    a = engines["A"]
    plans = []
    for case in CASES:
        keys = keys_of(case, 1000, NUM_BLOCKS // 2)
        plan = sched.namespace(case).prepare_store(keys)
        assert plan is not None
        rows = _rows(3, NUM_BLOCKS // 2)
        a.call("fill", case.name, list(range(1000, 1000 + len(keys))), rows)
        plans.append((case, rows, plan.slots, plan.lease))
    a.call("hold_stream", None, 3.0)
    jobs = []
    for case, rows, slots, lease in plans:
        job = sched.next_job()
        a.call("submit", case.name, job, True, rows, slots, lease)
        jobs.append((case, job))
    inflight = sched.client.stats()["copies"]["inflight_jobs"]
    d.kill()
    results = {case.name: [r[0] for r in a.call("wait", case.name, [job])] for case, job in jobs}
    misses = {c.name: sched.namespace(c).lookup(keys_of(c, 0, STORED)) for c in CASES}
    return {
        "inflight_jobs_at_kill": inflight,
        "job_results": results,
        "lookups_while_down": misses,
        "engines_alive": all(e.alive for e in engines.values()),
    }


def after_restart(sched: Scheduler, engines: dict[str, Engine]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    first = CASES[0]
    out["reconnect_s"] = _until(
        lambda: sched.namespace(first).lookup(keys_of(first, 0, STORED)) == STORED,
        "the kept blocks to be visible after the restart",
    )
    for case in CASES:
        ns = sched.namespace(case)
        _until(lambda ns=ns, case=case: ns.lookup(keys_of(case, 0, STORED)) == STORED, case.name)
        killed = ns.lookup(keys_of(case, 1000, NUM_BLOCKS // 2))
        assert killed == 0, f"{case.name}: a store killed in flight became visible"
        readers = [engines["B"]] + ([engines["C"]] if case.canonical else [])
        bad = {e.name: sched.load(e, case, 0, STORED, _rows(4, STORED)) for e in readers}
        sched.store(engines["A"], case, 2000, 8, _rows(5, 8))
        bad_new = {e.name: sched.load(e, case, 2000, 8, _rows(6, 8)) for e in readers}
        out[case.name] = {"kept_bad_bytes": bad, "new_bad_bytes": bad_new}
        assert not any(bad.values()) and not any(bad_new.values()), out[case.name]
    return out
