"""Workers and their copy jobs: registration and validated submission.

Rules:
- Runs on the loop thread only, as part of the service; it builds on ``JobBook``
  (completions.py: the workers and jobs in flight, and how jobs end) and reads the
  service's namespaces and sessions.
- A transfer is validated completely (slots leased to the namespace in the right
  state, no slot twice, engine block ids inside the registered caches, quotas) before
  any address reaches a copier (invariant 4); then its slots are marked busy so they
  cannot be freed under the copy.
- A store writes each of its slots whole (``check_whole_store``: every registered
  cache, every engine block), so a block never becomes visible over bytes of the
  slot's earlier owner (invariant 12).
- What a job holds is charged to its connection (jobs and the copies they expand
  to, ledger.py) before it starts. The loop validates a job and hands over its plan:
  copiers build its runs (a tiny CPU job is copied at once, on the loop).
- A store names its engine's lease token: only slots leased to that token may be
  written (invariant 9); a job arriving after its ``deadline_ns`` is not started. A
  load that names its keys reads each key wherever its block is now.
- Client-copy workers (trusted uids only, see access.py) get the region's descriptor.
  Blocking ones get, per submitted job, the copy runs the daemon validated and end the
  job with ``ClientCopyDone``; push ones plan their copies themselves from the region's
  tables and report stores with ``Wrote``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from kvoffload.datapath.canonical import check_copy_count
from kvoffload.datapath.copyplan import (
    JobPlan,
    check_transfer,
    check_whole_store,
    has_duplicates,
)
from kvoffload.datapath.runs import JobRuns
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import (
    InvalidArgumentError,
    NotLeasedError,
    PermissionDeniedError,
    QuotaExceededError,
    TimedOutError,
)
from kvoffload.protocol.packing import pack_ids, unpack_ids, unpack_keys
from kvoffloadd.access import AccessPolicy
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import ChecksumCheck, Completion, CpuCopier
from kvoffloadd.copies.fdcopy import FdCopier, is_descriptor
from kvoffloadd.copies.gpu import GpuRuntime
from kvoffloadd.copies.workers import (
    AttachedWorker,
    ClientJob,
)
from kvoffloadd.index.index import NamespaceIndex
from kvoffloadd.ledger import Ledger
from kvoffloadd.region.region import SharedOffloadRegion
from kvoffloadd.service.attach import Attacher
from kvoffloadd.service.completions import CopyJob, JobBook
from kvoffloadd.service.session import Session

log = logging.getLogger(__name__)


class Transfers(JobBook):
    """Workers attached and their jobs validated and started (see the module's rules)."""

    def __init__(
        self,
        config: DaemonConfig,
        region: SharedOffloadRegion,
        copier: CpuCopier,
        gpu: GpuRuntime | None,
        gpu_unavailable: str,
        namespaces: dict[int, NamespaceIndex],
        sessions: dict[int, Session],
        count_error: Callable[[str], None],
        access: AccessPolicy,
        ledger: Ledger,
    ) -> None:
        super().__init__(
            config,
            copier,
            int(region.buffer.ctypes.data),  # numpy's .ctypes is slow: read once
            namespaces,
            sessions,
            count_error,
            ledger,
        )
        self.region = region
        self.gpu = gpu
        self.gpu_unavailable = gpu_unavailable
        self.access = access
        self.fd_copier: FdCopier | None = None  # started by the first memfd_io job
        self.attacher = Attacher(
            ledger, copier, gpu, gpu_unavailable, access, region, namespaces, sessions,
            self._tokens, self._add, self._close_off_loop,
        )  # fmt: skip

    @property
    def inflight_jobs(self) -> int:
        return len(self._jobs) + self.sealer.pending + self.attacher.importing

    def worker(self, s: Session, worker_id: int) -> AttachedWorker:
        w = self.workers.get(worker_id)
        if w is None or w.session_id != s.session_id or w.closing:
            raise InvalidArgumentError(f"worker {worker_id} is not attached on this connection")
        return w

    def attach(self, s: Session, r: m.AttachWorker) -> m.Reply | None:
        return self.attacher.attach(s, r)

    def _add(self, s: Session, w: AttachedWorker) -> None:
        self.workers[w.worker_id] = w
        s.workers.add(w.worker_id)
        self.sealer.add(w.worker_id, w.placements)

    def submit(
        self,
        s: Session,
        r: m.SubmitStore | m.SubmitLoad,
        slots: np.ndarray,
        block_ids: np.ndarray,
        skip: int,
        is_store: bool,
    ) -> m.Reply | None:
        """Validate and start one job; the reply for a blocking submit, None for a
        one-way one (its result is pushed)."""
        w = self.worker(s, r.worker)
        index = self.namespaces[w.ns_id]
        if r.job_id in w.active_jobs:
            raise InvalidArgumentError(f"job {r.job_id} is already in flight")
        if not self.jobs.room(s.session_id):
            raise QuotaExceededError(
                f"this client has {self.jobs.held(s.session_id)} jobs in flight or "
                f"finished and not taken; one more would pass {self.jobs.over(s.session_id, 1)} "
                "(take results with get_finished; limits.jobs in the daemon config)"
            )
        if has_duplicates(slots):
            raise InvalidArgumentError("a transfer names the same slot twice")
        if not index.slots.is_valid(slots):
            raise_not_leased(index, slots)
        if isinstance(r, m.SubmitStore):
            if w.ns_id not in s.writable:
                raise PermissionDeniedError(
                    f"uid {s.uid} may read namespace {index.name!r} but not store into it"
                )
            index.check_store_slots(slots, s.session_id, r.lease)
        elif r.keys:
            keys = unpack_keys(r.keys, r.key_bytes)
            if len(keys) != slots.size:
                raise InvalidArgumentError(f"{len(keys)} keys for {slots.size} slots")
            slots = np.asarray(index.resolve_load(keys, slots.tolist()), dtype=np.int64)
            if has_duplicates(slots):
                raise InvalidArgumentError("a load names the same key twice")
        else:
            index.check_load_slots(slots)
        if r.deadline_ns and time.monotonic_ns() > r.deadline_ns:
            raise TimedOutError(f"job {r.job_id} arrived after its deadline; not started")
        chosen = w.chosen(r.caches)
        caches = chosen.caches
        if is_store:
            check_whole_store(index.layout, len(w.caches), len(caches), slots.size, block_ids.size)
        check_transfer(index.layout, slots.size, block_ids, skip, chosen.geometries)
        check_copy_count(block_ids.size, chosen.placements)
        plan = JobPlan(
            index.layout,
            w.area,
            index.slots.region_offsets(slots),
            block_ids,
            skip,
            chosen.geometries,
            chosen.placements,
            slots if is_store else None,
            self._region_addr,
            chosen.bases,
        )
        if not self.copies.take(s.session_id, plan.copies):
            raise QuotaExceededError(
                f"this job expands to {plan.copies} copies; with the "
                f"{self.copies.held(s.session_id)} this client has in flight that passes "
                "what one client, its uid or all clients may have; wait for some jobs"
            )
        self.pages_planned += block_ids.size * len(caches)
        token = next(self._tokens)
        self._jobs[token] = CopyJob(
            r.worker, r.job_id, w.ns_id, slots.copy(), is_store, r.deadline_ns, plan.copies
        )
        index.slots.mark_busy(slots, is_store)
        w.active_jobs.add(r.job_id)
        self.jobs.add(s.session_id, 1)
        # Parts of one canonical slot land from several ranks: no rank's copy sees the
        # whole page, so its checksum is taken once every part has landed (_sum_whole).
        check = (
            None
            if is_store and w.parts > 1
            else self._checksum_check(index, w.area, slots, is_store)
        )
        if w.client_copy:  # a trusted peer: its runs are built here
            runs = plan.runs()
            self.runs_planned += runs.region.size
            return self._client_plan(w, r, token, runs, chosen.indices, check)
        if w.device is not None and self.gpu is not None:
            self.gpu.submit(w.device, token, plan, w.store_event, check)
        elif caches and is_descriptor(caches[0]):  # unsealable memfds: never mapped
            fdc = self.fd_copier = self.fd_copier or FdCopier(
                self.config.copy_threads, self.copier.sink, self.region.open_fd(), self._region_addr
            )
            fdc.submit_planned(token, plan, caches, r.deadline_ns, check)  # type: ignore[arg-type]
        else:  # built by the copier threads, a piece at a time
            self.copier.submit_planned(token, plan, check)
        return m.OkReply(r.rid) if r.rid else None

    def _client_plan(
        self,
        w: AttachedWorker,
        r: m.SubmitStore | m.SubmitLoad,
        token: int,
        runs: JobRuns,
        chosen: list[int],
        check: ChecksumCheck | None,
    ) -> m.Reply:
        """The runs a client-copy worker copies itself; a load whose blocks fail their
        checksum gets no runs and fails when the client reports it done."""
        corrupt = check.mismatches() if check is not None and check.expected else []
        w.client_jobs[r.job_id] = ClientJob(
            token, runs.total_bytes, time.perf_counter(), check, corrupt
        )
        if corrupt:
            empty = b""
            return m.CopyPlanReply(r.rid, empty, empty, empty, empty)
        which = np.array(chosen, dtype=np.int64)[runs.which]
        return m.CopyPlanReply(
            r.rid,
            pack_ids(runs.region),
            pack_ids(runs.cache),
            pack_ids(runs.nbytes),
            pack_ids(which),
        )

    def on_completions(self, done: list[Completion]) -> list[tuple[int, m.Reply]]:
        """Apply what the copiers finished (imports for attaches, copies, seals,
        unmappings); returns deferred replies and pushed results as (session id,
        message). An import's reply comes first: no job of its worker can be among
        them, as none is started before the attach is answered; replies to other
        requests of the connection may come in another order than their completions,
        as deferred replies always could (clients match replies by request id)."""
        replies: list[tuple[int, m.Reply]] = []
        rest = []
        for c in done:
            if self.attacher.is_import(c.token):
                replies.extend(self.attacher.imported(c))
            else:
                rest.append(c)
        return replies + self.completed(rest)

    def wrote(self, s: Session, r: m.Wrote) -> None:
        """A push client-copy worker copied a store into its engine's leased slots."""
        w = self.worker(s, r.worker)
        index = self.namespaces[w.ns_id]
        if w.ns_id not in s.writable:
            raise PermissionDeniedError(
                f"uid {s.uid} may read namespace {index.name!r} but not store into it"
            )
        slots = unpack_ids(r.slots)
        if not index.slots.is_valid(slots):
            raise_not_leased(index, slots)
        index.check_store_slots(slots, s.session_id, r.lease)
        if r.success:
            self._written(index, w, slots.tolist())
        else:
            index.void(slots.tolist())

    def client_copy_done(self, s: Session, r: m.ClientCopyDone) -> None:
        """A client-copy worker finished a job: complete it like a daemon copy."""
        w = self.worker(s, r.worker)
        job = w.client_jobs.pop(r.job_id, None)
        if job is None:
            raise InvalidArgumentError(f"job {r.job_id} is not a client copy in flight")
        self._post_client_done(job, r.success)


def raise_not_leased(index: NamespaceIndex, slots: np.ndarray) -> None:
    bad = slots[(slots < 0) | (slots >= index.slots.capacity)][:1].tolist()
    raise NotLeasedError(f"slot {bad[0] if bad else '?'} of namespace {index.name!r} is not leased")
