"""Worker side: one engine rank's caches registered with the daemon, and its transfers.

Rules:
- ``submit_store``/``submit_load`` return True when the daemon accepted the job and
  False otherwise; the reason is kept in ``last_error`` (a typed KVOffloadError) and
  logged. They never raise for daemon-side problems, as vLLM's offloading worker
  expects.
- Jobs in flight when the connection is lost are reported by ``get_finished`` as
  failed: their leases died with the connection. (Engines that must never see a
  failure use ``kvoffload.engine.streaming.StreamingWorker``.)
- Engine block ids and slots travel packed (int64).
- CUDA caches are exported by IPC handle (``cuda_export``); each store first records
  the worker's store fence on the engine's current CUDA stream (or ``stream``), so
  the daemon never reads KV the engine has not finished writing. A load's completion
  (``get_finished``/``wait``) means the bytes are on the GPU.
- ``close`` returns only after the daemon stopped using the caches, so the engine may
  free them right after.
- Copy modes (``copy_mode``): "daemon" — the daemon copies through exported caches
  (CUDA IPC, ``shared_kv_cache`` memfds); "client" — the worker copies itself through
  a mapping of the region (``client_copy``), for plain CPU tensors and trusted uids;
  "auto" (default) picks daemon copies whenever the caches can be exported.
- ``caches`` on a submit selects which registered caches a job copies (vLLM's KV
  cache groups each use their own tensors); the default is all of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from kvoffload.cache import describe_cache
from kvoffload.cuda.driver import CudaApi
from kvoffload.cuda.export import StoreFence, current_stream, export_cuda_caches, require_driver
from kvoffload.datapath.canonical import CanonicalPart
from kvoffload.datapath.client_copy import RegionMapping, describe_plain_cache
from kvoffload.datapath.runs import CacheGeometry
from kvoffload.link.transport import Transport
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import DaemonUnavailableError, InvalidArgumentError, KVOffloadError
from kvoffload.protocol.packing import pack_ids

if TYPE_CHECKING:
    from kvoffload.link.channel import NamespaceHandle

log = logging.getLogger(__name__)

WAIT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TransferResult:
    job_id: int
    success: bool
    nbytes: int
    seconds: float


COPY_MODES = ("auto", "daemon", "client")


class Worker:
    push = False  # one-way submits, pushed results (StreamingWorker)
    want_region = False  # map the region when trusted, for copies of our own

    def __init__(
        self,
        ns: NamespaceHandle,
        caches: Sequence[Any],
        rank: int,
        stream: int | None = None,
        copy_mode: str = "auto",
        canonical: Sequence[CanonicalPart] = (),
        parts: int = 1,
    ) -> None:
        if copy_mode not in COPY_MODES:
            raise InvalidArgumentError(f"copy_mode must be one of {COPY_MODES}, not {copy_mode!r}")
        self.ns = ns
        self.rank = rank
        self.canonical = list(canonical)  # one per cache: its page in canonical pages
        self.parts = parts  # the engine's ranks writing parts of each canonical slot
        self.caches = list(caches)
        self._stream = stream
        self._fence: StoreFence | None = None
        self._cuda: CudaApi | None = None
        self._device_uuid = b""
        self._fds: list[int] = []
        self._region: RegionMapping | None = None
        self._cache_bases: list[int] = []
        self.copy_mode = "daemon"
        if self.caches and all(getattr(c, "is_cuda", False) for c in self.caches):
            if copy_mode == "client":
                raise InvalidArgumentError("client-copy mode takes CPU tensors only")
            api = self._cuda = require_driver()
            export = export_cuda_caches(self.caches, api)
            self._descs = export.descs
            self._device_uuid = export.device_uuid
            self._fence = StoreFence(api, export.ordinal)
        elif (described := _memfd_caches(self.caches, copy_mode)) is not None:
            self._fds = [fd for _, fd in described]
            self._descs = [
                m.CacheDesc(
                    d.kind, d.num_blocks, d.page_bytes, i, d.offset_bytes, d.row_stride_bytes
                )
                for i, (d, _) in enumerate(described)
            ]
        else:
            described_plain = [describe_plain_cache(c) for c in self.caches]
            self._descs = [d for d, _ in described_plain]
            self._cache_bases = [base for _, base in described_plain]
            self.copy_mode = "client"
        self.worker_id = -1
        self.epoch = 0  # connections this worker was attached on
        self.last_error: KVOffloadError | None = None
        self._inflight: set[int] = set()
        self._failed_locally: list[TransferResult] = []
        ns.client.register(self)

    @property
    def geometries(self) -> list[CacheGeometry]:
        """Each cache's rows as this process addresses them (base: ``bases``)."""
        return [
            CacheGeometry(d.num_blocks, d.page_bytes, 0, d.row_stride_bytes or d.page_bytes)
            for d in self._descs
        ]

    @property
    def bases(self) -> list[int]:
        return [int(c.data_ptr()) for c in self.caches]

    def _handshake(
        self, t: Transport, ns_ids: dict[int, int]
    ) -> tuple[m.WorkerAttached, list[int]]:
        fence = self._fence.handle if self._fence is not None else b""
        client_copy = self.copy_mode == "client"
        req = m.AttachWorker(
            self.ns.client.next_rid(),
            ns_ids.get(id(self.ns), self.ns.ns_id),
            self.rank,
            self._descs,
            self._device_uuid,
            fence,
            client_copy,
            self.push,
            self.want_region,
            self.parts,
            [
                m.CanonicalDesc(c.canonical_page_bytes, c.pack(), c.writers, c.writer)
                for c in self.canonical
            ],
        )
        reply = t.request(req, fds=self._fds)
        assert isinstance(reply, m.WorkerAttached)
        return reply, t.take_fds()

    def _adopt(self, state: tuple[m.WorkerAttached, list[int]]) -> None:
        reply, fds = state
        for extra in fds[1:]:
            os.close(extra)
        # The mapping of an earlier region (a cold restart) stays alive as long as a
        # job planned against it holds it.
        self._region = RegionMapping(fds[0], reply.region_bytes) if fds else None
        if self._region is None and self.copy_mode == "client":
            log.error("kvoffloadd sent no region descriptor to a client-copy worker")
        self.worker_id = reply.worker
        self.epoch += 1
        if self.push:
            self.ns.client.route(m.JobsDone, self.worker_id, self)

    def _discard(self, state: tuple[m.WorkerAttached, list[int]]) -> None:
        """A handshake that will not be adopted: close the descriptors it brought."""
        for fd in state[1]:
            os.close(fd)

    def _lost(self) -> None:
        self._failed_locally.extend(TransferResult(j, False, 0, 0.0) for j in self._inflight)
        self._inflight.clear()

    def _on_push(self, msg: m.Reply) -> None:
        return

    def _submit(self, job_id: int, make: Any, is_store: bool) -> bool:
        client = self.ns.client
        try:
            with client.lock:  # the copy and its report stay with this connection
                if self.copy_mode == "daemon":
                    client.call(make, m.OkReply)
                else:
                    self._copy_myself(job_id, client.call(make, m.CopyPlanReply), is_store)
        except KVOffloadError as exc:
            self.last_error = exc
            log.warning("job %d refused: %s", job_id, exc)
            return False
        self._inflight.add(job_id)
        return True

    def _copy_myself(self, job_id: int, plan: m.CopyPlanReply, is_store: bool) -> None:
        """Client-copy mode: run the validated copies, then tell the daemon."""
        assert self._region is not None
        ok = True
        try:
            self._region.run_plan(plan, self._cache_bases, is_store)
        except (OSError, ValueError) as exc:
            log.error("job %d: client copy failed: %s", job_id, exc)
            ok = False
        self.ns.client.send_nowait(lambda rid: m.ClientCopyDone(rid, self.worker_id, job_id, ok))

    def submit_store(
        self,
        job_id: int,
        engine_block_ids: npt.ArrayLike,
        slots: npt.ArrayLike,
        caches: Sequence[int] = (),
        lease: int = 0,
    ) -> bool:
        """Copy engine blocks into leased slots (block_size_factor blocks per slot).
        Slots another connection prepared (the engine's scheduler) need that plan's
        ``lease``; 0 names slots this connection prepared."""
        ids, sl, sel = pack_ids(engine_block_ids), pack_ids(slots), list(caches)
        if self._fence is not None:
            ordinal = self._fence.ordinal
            self._fence.record(
                self._stream if self._stream is not None else current_stream(ordinal)
            )
        return self._submit(
            job_id,
            lambda rid: m.SubmitStore(rid, self.worker_id, job_id, ids, sl, sel, lease),
            True,
        )

    def submit_load(
        self,
        job_id: int,
        slots: npt.ArrayLike,
        engine_block_ids: npt.ArrayLike,
        skip: int = 0,
        caches: Sequence[int] = (),
    ) -> bool:
        """Copy pinned slots into engine blocks, skipping ``skip`` sub-blocks of the first."""
        ids, sl, sel = pack_ids(engine_block_ids), pack_ids(slots), list(caches)
        return self._submit(
            job_id,
            lambda rid: m.SubmitLoad(rid, self.worker_id, job_id, sl, ids, skip, sel),
            False,
        )

    def get_finished(self) -> list[TransferResult]:
        out, self._failed_locally = self._failed_locally, []
        if not self._inflight:
            return out
        try:
            reply = self.ns.client.call(
                lambda rid: m.GetFinished(rid, self.worker_id), m.FinishedReply
            )
        except DaemonUnavailableError:
            out.extend(self._failed_locally)
            self._failed_locally = []
            return out
        for r in reply.results:
            self._inflight.discard(r.job_id)
            out.append(TransferResult(r.job_id, r.success, r.nbytes, r.seconds))
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs finished (results stay for ``get_finished``)."""
        pending = [j for j in job_ids if j in self._inflight]
        if not pending:
            return
        # A lost daemon ends the wait: the jobs are then reported failed.
        with contextlib.suppress(DaemonUnavailableError):
            self.ns.client.call(
                lambda rid: m.WaitJobs(rid, self.worker_id, pending),
                m.OkReply,
                timeout_s=WAIT_TIMEOUT_S,
            )

    def close(self) -> None:
        client = self.ns.client
        client.unregister(self)
        if client.connected:
            try:
                client.call(lambda rid: m.DetachWorker(rid, self.worker_id), m.OkReply)
            except KVOffloadError as exc:
                log.debug("detach: %s", exc)
        if self._fence is not None:
            self._fence.close()
            self._fence = None
        self._region = None  # unmapped once no job holds it


def _memfd_caches(caches: list[Any], copy_mode: str) -> list[tuple[m.CacheDesc, int]] | None:
    """(descriptor, memfd) of each cache when all are ``shared_kv_cache`` views the
    daemon can map; None when the worker copies itself instead ("client", or "auto"
    with a cache that cannot be exported). "daemon" raises for such a cache."""
    if copy_mode == "client":
        return None
    try:
        return [describe_cache(c) for c in caches]
    except InvalidArgumentError:
        if copy_mode == "daemon":
            raise
        return None
