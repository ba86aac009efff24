"""One shard namespace on one connection: hit queries, page stores and page loads,
each finished or given up by a deadline.

Rules (the backend's calls run on SGLang's storage threads, and a stalled call there
stalls every rank):
- Every daemon round trip is bounded by the call's ``Deadline`` (the transport gives
  up after twice the timeout it is given, so it is given half of what is left); a
  lost, hung or refusing daemon makes the call fail, never raise past ``PageLink``.
- A store is visible (``CompleteStore``) only after the daemon reported its copy
  finished on this connection; a store that fails or runs out of time is completed
  unsuccessfully (or dies with the connection), so the daemon never commits it. The
  daemon's copy carries the job's deadline and is never committed after it.
- A load reports pages loaded only when its copy finished under the pins of the same
  connection (``PrepareLoad`` to the job's result); anything else reports nothing
  loaded. The load names its keys, so the daemon reads exactly their bytes. A
  daemon copy into the host pool carries ``job_deadline_ns``: the daemon starts no
  write after it, and the call gives up only ``guard`` later, so no daemon write
  lands in pages SGLang took back (the one exception: a daemon process stopped, or
  starved, for longer than the guard between its deadline check and its write).
- Client-copy workers (the default allocator) copy through their own mapping of the
  region under the daemon's validated plan, in the calling thread and, for a large
  job, one helper thread; the call returns after both finished.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvoffload.client import Client
from kvoffload.datapath.client_copy import RegionMapping, describe_plain_cache
from kvoffload.datapath.memruns import copy_runs, populate_async
from kvoffload.link.transport import Transport
from kvoffload.namespace import Namespace, pack_checked
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import KVOffloadError, NoSpaceError, NotFoundError
from kvoffload.protocol.messages import KEY_READY
from kvoffload.protocol.packing import pack_ids, unpack_ids, unpack_keys

log = logging.getLogger(__name__)
R = TypeVar("R", bound=m.Reply)

COPY_THREADS = 2  # a client copy of at least PARALLEL_MIN_BYTES runs on two threads
PARALLEL_MIN_BYTES = 8 * 1024 * 1024
FULL_RETRY_S = 0.005


@dataclass(frozen=True)
class Deadline:
    """A backend call's time limit (monotonic seconds) and, for daemon copies into
    the host pool, the earlier limit the daemon's writes keep to."""

    at_s: float
    job_at_s: float

    @staticmethod
    def after(budget_s: float, guard: float = 0.25) -> Deadline:
        now = time.monotonic()
        return Deadline(now + budget_s, now + budget_s * (1.0 - guard))

    def left_s(self) -> float:
        return self.at_s - time.monotonic()

    def timeout_s(self) -> float:
        """A round trip's timeout: the transport may take twice what it is given."""
        return max(0.001, self.left_s() / 2)

    @property
    def job_ns(self) -> int:
        return int(self.job_at_s * 1e9)


class PoolWorker:
    """The pool's pages of one shard, registered as a push worker (replayed on every
    reconnect). ``fd`` (owned here, a dup of SGLang's) is the pool's memfd for daemon
    copies; without it the caches are plain views the client copies itself."""

    push = True

    def __init__(self, ns: Namespace, caches: Sequence[Any], fd: int | None) -> None:
        self.ns = ns
        self.fd = fd
        self.client_copy = fd is None
        if self.client_copy:
            described = [describe_plain_cache(c) for c in caches]
            self.descs = [d for d, _ in described]
            self.bases = [b for _, b in described]
        else:
            self.descs, self.bases = list(caches), []
        self.worker_id = -1
        self.region: RegionMapping | None = None
        self.results: dict[int, m.JobResult] = {}
        self._jobs = itertools.count(1)
        self._pool: ThreadPoolExecutor | None = None
        self.populating: threading.Thread | None = None  # client copies: page tables
        ns.client.register(self)

    def _handshake(self, t: Transport, ns_ids: dict[int, int]) -> Any:
        req = m.AttachWorker(
            self.ns.client.next_rid(),
            ns_ids.get(id(self.ns), self.ns.ns_id),
            0,
            self.descs,
            client_copy=self.client_copy,
            push=True,
        )
        reply = t.request(req, fds=[self.fd] if self.fd is not None else None)
        assert isinstance(reply, m.WorkerAttached)
        return reply, t.take_fds()

    def _adopt(self, state: Any) -> None:
        reply, fds = state
        for extra in fds[1:]:
            os.close(extra)
        self.region = RegionMapping(fds[0], reply.region_bytes) if fds else None
        if self.region is not None and self.client_copy:
            self.populating = populate_async(self.region.base_address, reply.region_bytes)
        self.worker_id = reply.worker
        self.results.clear()
        self.ns.client.route(m.JobsDone, self.worker_id, self)

    def _discard(self, state: Any) -> None:
        for fd in state[1]:
            os.close(fd)

    def _lost(self) -> None:
        self.worker_id = -1

    def _on_push(self, msg: m.Reply) -> None:
        if isinstance(msg, m.JobsDone):
            for r in msg.results:
                self.results[r.job_id] = r

    def next_job(self) -> int:
        return next(self._jobs)

    def copy_plan(self, plan: m.CopyPlanReply, is_store: bool) -> None:
        """Client copy of a daemon-validated plan through the region mapping; a large
        one is cut by bytes over ``COPY_THREADS`` threads (each copy releases the GIL)."""
        assert self.region is not None
        region = unpack_ids(plan.region) + self.region.base_address
        which = unpack_ids(plan.cache_index)
        bases = np.asarray(self.bases, dtype=np.int64)
        cache = unpack_ids(plan.cache) + (bases[which] if which.size else 0)
        nbytes = unpack_ids(plan.nbytes)
        dst, src = (region, cache) if is_store else (cache, region)
        total = int(nbytes.sum())
        if total < PARALLEL_MIN_BYTES or nbytes.size < 2:
            copy_runs(dst, src, nbytes)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="kvoffload-copy")
        cut = int(np.searchsorted(np.cumsum(nbytes), total // 2)) + 1
        cut = min(max(cut, 1), nbytes.size - 1)
        half = self._pool.submit(copy_runs, dst[cut:], src[cut:], nbytes[cut:])
        copy_runs(dst[:cut], src[:cut], nbytes[:cut])
        half.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self.ns.client.unregister(self)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class PageLink:
    """One shard namespace (and its worker, for the data roles) on one client."""

    def __init__(self, ns: Namespace, worker: PoolWorker | None) -> None:
        self.ns = ns
        self.worker = worker
        self.client: Client = ns.client  # type: ignore[assignment]

    def _keys_call(
        self,
        cls: Callable[..., m.Request],
        packed: bytes,
        key_bytes: int,
        expect: type[R],
        deadline: Deadline,
        *extra: Any,
    ) -> R:
        """One request about keys of this namespace, within the call's deadline."""
        return self.client.call(
            lambda rid: cls(rid, self.ns.ns_id, packed, key_bytes, *extra),
            expect,
            timeout_s=deadline.timeout_s(),
        )

    # ------------------------------------------------------------ hit query

    def ready(self, keys: list[bytes], deadline: Deadline) -> int:
        """How many leading keys are stored and ready (0 on any failure)."""
        packed, kb = pack_checked(keys)
        try:
            r = self._keys_call(m.Probe, packed, kb, m.ProbeReply, deadline)
        except KVOffloadError as exc:
            log.debug("hit query failed: %s", exc)
            return 0
        states = np.frombuffer(r.states, dtype=np.uint8)
        not_ready = np.flatnonzero(states != KEY_READY)
        return int(not_ready[0]) if not_ready.size else min(int(states.size), len(keys))

    # ------------------------------------------------------------ stores

    def store(
        self,
        keys: list[bytes],
        block_ids: np.ndarray,
        deadline: Deadline,
        on_full: Callable[[], object] = lambda: None,
    ) -> list[bool]:
        """Store the pages; per key, whether it is stored (now or already).

        A full namespace whose evicted blocks are still held for engines' key mirrors
        (``NO_SPACE`` until they acknowledge the evictions, kvoffloadd.index.graves) is asked
        again every ``FULL_RETRY_S`` for the first half of the call's time, after
        ``on_full`` (which acknowledges this instance's own mirrors).
        """
        w = self.worker
        assert w is not None
        packed, kb = pack_checked(keys)
        retry_until = time.monotonic() + deadline.left_s() / 2
        while True:
            try:
                epoch = self.client.epoch
                plan = self._keys_call(m.PrepareStore, packed, kb, m.StorePlanReply, deadline)
                break
            except NoSpaceError as exc:
                if time.monotonic() + FULL_RETRY_S > retry_until:
                    log.debug("store not planned: %s", exc)
                    return [False] * len(keys)
                on_full()
                time.sleep(FULL_RETRY_S)
            except KVOffloadError as exc:
                log.debug("store not planned: %s", exc)
                return [False] * len(keys)
        todo = unpack_keys(plan.keys, plan.key_bytes)
        if not todo:
            return [True] * len(keys)
        where = {k: i for i, k in enumerate(keys)}
        ids = block_ids[[where[k] for k in todo]]
        ok = self._run(True, ids, unpack_ids(plan.slots), b"", 0, deadline, epoch)
        try:
            self._keys_call(m.CompleteStore, plan.keys, plan.key_bytes, m.OkReply, deadline, ok)
        except KVOffloadError as exc:  # the daemon dropped the store with the connection
            log.debug("store not completed: %s", exc)
            ok = False
        done = set(todo) if not ok else set()
        return [k not in done for k in keys]

    # ------------------------------------------------------------ loads

    def load(self, keys: list[bytes], block_ids: np.ndarray, deadline: Deadline) -> int:
        """Load the leading pages that are stored; how many were loaded."""
        w = self.worker
        assert w is not None
        epoch = self.client.epoch
        try:
            slots = self._pin(keys, deadline)
            if slots is None:
                n = self.ready(keys, deadline)
                keys = keys[:n]
                slots = self._pin(keys, deadline) if n else None
        except KVOffloadError as exc:
            log.debug("load not planned: %s", exc)
            return 0
        if slots is None:
            return 0
        kp, kb = pack_checked(keys)
        n = len(keys)
        ok = self._run(False, block_ids[:n], slots, kp, kb, deadline, epoch)
        if self.client.epoch == epoch:
            self.client.send_nowait(lambda rid: m.CompleteLoad(rid, self.ns.ns_id, kp, kb))
        return n if ok else 0

    def _pin(self, keys: list[bytes], deadline: Deadline) -> np.ndarray | None:
        packed, kb = pack_checked(keys)
        try:
            r = self._keys_call(m.PrepareLoad, packed, kb, m.LoadPlanReply, deadline)
        except NotFoundError:
            return None
        return unpack_ids(r.slots)

    # ------------------------------------------------------------ copies

    def _run(
        self,
        is_store: bool,
        ids: np.ndarray,
        slots: np.ndarray,
        keys: bytes,
        key_bytes: int,
        deadline: Deadline,
        epoch: int,
    ) -> bool:
        """Submit one job and wait for its result; True only when it succeeded on the
        connection the plan came from."""
        w = self.worker
        assert w is not None
        job = w.next_job()
        bids, sl = pack_ids(ids), pack_ids(slots)
        wid = w.worker_id
        try:
            if self.client.epoch != epoch or wid < 0:
                return False
            if is_store:
                msg: m.SubmitStore | m.SubmitLoad = m.SubmitStore(
                    0, wid, job, bids, sl, [], 0, deadline.job_ns
                )
            else:
                msg = m.SubmitLoad(0, wid, job, sl, bids, 0, [], keys, key_bytes, deadline.job_ns)
            if w.client_copy:
                self._copy_myself(msg, is_store, deadline)
            elif not self.client.post(msg):
                return False
            return self._wait(job, deadline, epoch)
        except KVOffloadError as exc:
            log.debug("job %d failed: %s", job, exc)
            return False

    def _copy_myself(
        self, msg: m.SubmitStore | m.SubmitLoad, is_store: bool, deadline: Deadline
    ) -> None:
        """Client copy: the daemon validates and answers with the runs; copy them
        through the region mapping, then say so (the job's result follows)."""
        w = self.worker
        assert w is not None and w.region is not None
        plan = self.client.call(
            lambda rid: msgspec_replace(msg, rid), m.CopyPlanReply, timeout_s=deadline.timeout_s()
        )
        ok = True
        try:
            w.copy_plan(plan, is_store)
        except (OSError, ValueError) as exc:
            log.error("kvoffload: copying through the region failed: %s", exc)
            ok = False
        job, wid = msg.job_id, w.worker_id
        self.client.send_nowait(lambda rid: m.ClientCopyDone(rid, wid, job, ok))

    def _wait(self, job: int, deadline: Deadline, epoch: int) -> bool:
        w = self.worker
        assert w is not None
        self.client.flush()
        while True:
            r = w.results.pop(job, None)
            if r is not None:
                return bool(r.success) and self.client.epoch == epoch
            left = deadline.left_s()
            if left <= 0 or self.client.epoch != epoch or not self.client.connected:
                return False
            self.client.poll(timeout_s=min(left, 0.05))


def msgspec_replace(msg: m.Request, rid: int) -> m.Request:
    import msgspec

    return msgspec.structs.replace(msg, rid=rid)
