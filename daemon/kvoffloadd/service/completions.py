"""Copy jobs in flight and how they end: completions applied to the index, results
handed out, waits answered, and a drained worker's mappings closed off the loop.

Rules:
- Runs on the loop thread only. ``JobBook`` is the lower half of ``Transfers``
  (transfers.py validates and starts jobs on it); it owns the attached workers, the
  jobs in flight and the tokens that name them to the copiers.
- What a job holds is charged to its connection: its copies until it completes, the
  job itself until its result is taken (at once for push workers and for a worker
  that is going away).
- A completion updates the index (written ranks, checksums, corrupt blocks), the
  counters and the worker's results, and answers the waits it ends. Push workers
  (engines that never wait for a reply) get their results pushed.
- A store's copy that ended after its ``deadline_ns`` (when the engine may reuse its
  blocks) or whose worker went away is void: never committed. A canonical part's
  slots are written once their parts' fragments cover every page (seals.py); the
  job that completed such a slot gets its result only after its check.
- A detached worker (or one whose client died) keeps its mappings until its copies
  have drained; only then are they closed, by a copier thread (unmapping is
  page-table work: never on the loop), and its charges given back once they are
  (invariant 5). Its client-copy jobs fail.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvoffload.protocol import messages as m
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import ChecksumCheck, Completion, CpuCopier, finished
from kvoffloadd.copies.seals import Sealer
from kvoffloadd.copies.workers import AttachedWorker, ClientJob
from kvoffloadd.index.index import NamespaceIndex
from kvoffloadd.ledger import Ledger
from kvoffloadd.service.session import Session

log = logging.getLogger(__name__)

SUM_JOB = -1  # a CopyJob's worker id when it only takes checksums of whole canonical slots


@dataclass
class CopyJob:
    worker_id: int
    job_id: int
    ns_id: int
    slots: np.ndarray
    is_store: bool
    deadline_ns: int = 0
    copies: int = 0  # charged to its connection until it completes


class JobBook:
    """The workers, their jobs in flight and how jobs end (see the module's rules)."""

    def __init__(
        self,
        config: DaemonConfig,
        copier: CpuCopier,
        region_address: int,
        namespaces: dict[int, NamespaceIndex],
        sessions: dict[int, Session],
        count_error: Callable[[str], None],
        ledger: Ledger,
    ) -> None:
        self.config = config
        self.copier = copier
        self._region_addr = region_address
        self.namespaces = namespaces
        self.sessions = sessions
        self._count_error = count_error
        self.ledger = ledger
        # copy jobs in flight (and results not yet taken), the copies they expand to
        self.jobs, self.copies = ledger["jobs"], ledger["copies"]
        self.workers: dict[int, AttachedWorker] = {}
        self._jobs: dict[int, CopyJob] = {}
        self._tokens = itertools.count(1)
        self._unmapping: dict[int, tuple[int, dict[str, int]]] = {}  # token -> its charges
        self.bytes_stored = self.bytes_loaded = 0
        self.jobs_failed = 0
        self.store_seconds = self.load_seconds = 0.0
        # Engine pages planned and the copy runs they merged into: pages / runs is the
        # mean run length (contiguous engine blocks into contiguous slots merge).
        self.pages_planned = self.runs_planned = 0
        self.sealer = Sealer(copier, self._tokens, namespaces, self._sum_whole)

    def _written(self, index: NamespaceIndex, w: AttachedWorker, slots: list[int]) -> int:
        """A store copy of ``w`` into ``slots`` landed; returns the token of the seal
        its canonical slots wait for (0: none)."""
        if not self.sealer.is_canonical(w.worker_id):
            index.mark_written(slots, w.area)
            return 0
        return self.sealer.parts_landed(index, slots, w.rank, w.parts, w.worker_id)

    def _post_client_done(self, job: ClientJob, ok: bool) -> None:
        check = job.check if job.check is not None and job.check.expected is None else None
        done = finished(job.token, ok, job.nbytes, job.started_s, check, job.corrupt)
        self.copier.sink.post(done)

    def _checksum_check(
        self, index: NamespaceIndex, rank: int, slots: np.ndarray, is_store: bool
    ) -> ChecksumCheck | None:
        if not self.config.verify_checksums:
            return None
        rank_bytes = index.layout.rank_bytes
        base = self._region_addr + rank * rank_bytes
        areas = (index.slots.region_offsets(slots) + base).tolist()
        expected = None if is_store else index.sums.expected(slots.tolist(), rank)
        return ChecksumCheck(areas, rank_bytes, expected)

    def completed(self, done: list[Completion]) -> list[tuple[int, m.Reply]]:
        """Apply finished copies, seals and unmappings; returns the deferred replies
        and pushed results as (session id, message)."""
        replies: list[tuple[int, m.Reply]] = []
        pushed: dict[int, list[m.JobResult]] = {}
        now_ns = time.monotonic_ns()
        for c in done:
            if (unmapped := self._unmapping.pop(c.token, None)) is not None:
                self.ledger.give(*unmapped)  # a no-op once its connection left
                continue
            if self.sealer.is_seal(c.token):
                for held_job, held in self.sealer.sealed(c):
                    self._finish_job(held_job, held, replies, pushed)
                continue
            job = self._jobs.pop(c.token)
            if job.worker_id == SUM_JOB:
                if (summed := self.namespaces.get(job.ns_id)) is not None:
                    self._summed(summed, job, c)
                continue
            index = self.namespaces[job.ns_id]
            index.slots.unmark_busy(job.slots, job.is_store)
            w = self.workers[job.worker_id]
            seal = 0
            if job.is_store:
                # A copy that ended after the engine may reuse its blocks, or whose
                # worker went away, may have read reused memory: never commit it.
                late = bool(job.deadline_ns) and now_ns > job.deadline_ns
                if c.success and not late and not w.closing:
                    if c.checksums is not None:
                        index.sums.set(job.slots.tolist(), w.area, c.checksums)
                    seal = self._written(index, w, job.slots.tolist())
                else:
                    index.void(job.slots.tolist())
            if c.corrupt:
                bad = index.mark_corrupt([int(job.slots[i]) for i in c.corrupt])
                self._count_error("CHECKSUM_MISMATCH")
                log.error(
                    "namespace %s: %d blocks failed their checksum on load and are evicted",
                    index.name,
                    len(bad),
                )
            if seal:  # its result waits for the check of what the slots' parts covered
                self.sealer.hold(seal, (job, c))
            else:
                self._finish_job(job, c, replies, pushed)
        for wid, results in pushed.items():
            replies.append((self.workers[wid].session_id, m.JobsDone(0, wid, results)))
        return replies

    def _finish_job(
        self,
        job: CopyJob,
        c: Completion,
        replies: list[tuple[int, m.Reply]],
        pushed: dict[int, list[m.JobResult]],
    ) -> None:
        """A job is over: count it, hand out its result, end the waits on it, and
        unmap a closing worker's caches after its last job."""
        w = self.workers[job.worker_id]
        w.active_jobs.discard(job.job_id)
        self.copies.give(w.session_id, job.copies)
        self.runs_planned += c.runs
        self._account(w, job, c)
        if w.push or w.closing:  # else its result holds the job's charge until taken
            self.jobs.give(w.session_id, 1)
        if w.closing:
            if not w.active_jobs:
                self._unmap(w)
                if w.session_id in self.sessions:
                    replies.extend((w.session_id, m.OkReply(r)) for r in w.detach_rids)
            return
        result = m.JobResult(job.job_id, c.success, c.nbytes, c.seconds)
        if w.push:
            pushed.setdefault(w.worker_id, []).append(result)
        else:
            w.finished.append(result)
        replies.extend(self._resolve_waits(w, job.job_id))

    def _sum_whole(self, index: NamespaceIndex, slots: list[int]) -> None:
        """Canonical slots whose parts all landed: their checksum is taken now, by a
        copier thread (no rank's copy saw the whole page)."""
        if not slots or not self.config.verify_checksums:
            return
        arr = np.asarray(slots, dtype=np.int64)
        check = self._checksum_check(index, 0, arr, True)
        token = next(self._tokens)
        self._jobs[token] = CopyJob(SUM_JOB, 0, index.ns_id, arr, True)
        index.slots.mark_busy(arr)  # not reused while it is read
        empty = np.zeros(0, dtype=np.int64)
        self.copier.submit(token, empty, empty, empty, check)

    def _summed(self, index: NamespaceIndex, job: CopyJob, c: Completion) -> None:
        """A canonical slot's checksum, kept unless its block went meanwhile."""
        slots = job.slots.tolist()
        if c.success and c.checksums is not None:
            keep = [i for i, slot in enumerate(slots) if index.holds_ready(slot)]
            index.sums.set([slots[i] for i in keep], 0, [c.checksums[i] for i in keep])
        index.slots.unmark_busy(job.slots)

    def _account(self, w: AttachedWorker, job: CopyJob, c: Completion) -> None:
        if not c.success:
            self.jobs_failed += 1
            return
        s = self.sessions.get(w.session_id)
        if job.is_store:
            self.bytes_stored += c.nbytes
            self.store_seconds += c.seconds
            if s is not None:
                s.bytes_stored += c.nbytes
        else:
            self.bytes_loaded += c.nbytes
            self.load_seconds += c.seconds
            if s is not None:
                s.bytes_loaded += c.nbytes

    def _resolve_waits(self, w: AttachedWorker, job_id: int) -> list[tuple[int, m.Reply]]:
        """End the waits on a finished job (only those: they are found by job)."""
        s = self.sessions.get(w.session_id)
        if s is None:
            return []
        waits = s.waits.pop((w.worker_id, job_id), None)
        if not waits:
            return []
        self.ledger.give(s.session_id, {"waits": len(waits)})
        out: list[tuple[int, m.Reply]] = []
        for wait in waits:
            wait.pending.discard(job_id)
            if not wait.pending:
                out.append((s.session_id, m.OkReply(wait.rid)))
        return out

    def take_results(self, w: AttachedWorker) -> list[m.JobResult]:
        """The worker's finished results, handed to its client: their charge goes."""
        results, w.finished = w.finished, []
        self.jobs.give(w.session_id, len(results))
        return results

    def detach(self, w: AttachedWorker) -> None:
        w.closing = True
        self.take_results(w)  # nobody will take them now
        for job in w.client_jobs.values():  # nobody will finish these copies now
            self._post_client_done(job, False)
        w.client_jobs.clear()
        s = self.sessions.get(w.session_id)
        if s is not None:
            s.workers.discard(w.worker_id)
            for key in [k for k in s.waits if k[0] == w.worker_id]:
                self.ledger.give(s.session_id, {"waits": len(s.waits.pop(key))})
        if not w.active_jobs:
            self._unmap(w)

    def _unmap(self, w: AttachedWorker) -> None:
        """Forget a worker whose copies drained; a copier thread unmaps its caches and
        closes its imports (unmapping what copies touched costs page-table work in
        proportion: never on the loop), and its charges go once that is done."""
        del self.workers[w.worker_id]
        self.sealer.remove(w.worker_id)
        self._close_off_loop(w.session_id, w.charges, w.close)

    def _close_off_loop(
        self, session_id: int, charges: dict[str, int], close: Callable[[], None]
    ) -> None:
        """Run ``close`` (unmapping, closing imports) on a copier thread; ``charges`` go
        back to the connection once it has run."""
        token = next(self._tokens)
        self._unmapping[token] = (session_id, charges)
        self.copier.run_task(token, close)
