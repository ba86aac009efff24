"""Workers' registrations: validated, charged, imported off the loop, then attached.

An ``AttachWorker`` names a namespace, a rank and the worker's caches (memfd descriptors,
CUDA IPC handles, or, for client-copy workers, only their geometry).

Rules:
- Charged before held: a registration's worker, caches, mappings, mapped bytes,
  descriptors and metadata (canonical fragment tables) are charged to the connection,
  its uid and everyone (``kvoffloadd.ledger``) before anything is unpacked, mapped or
  imported (caches over one file count one mapping: the loop groups them by file
  first), and given back when the worker is unmapped.
- Caches are imported by a copier thread, CPU ones mapped (``kvoffloadd.copies.imports``),
  CUDA ones opened by IPC handle (``kvoffloadd.copies.gpu``): nothing maps on the loop.
  The reply is deferred until the import lands, and a refusal then is an
  ``ErrorReply`` for that request only. The engine's descriptors are closed by the
  import, whatever happens.
- A registration is validated in full first (namespace open on this connection, rank,
  pages tiling the layout, canonical fragments inside their pages, client-copy trust)
  and a refused one holds nothing.
- A connection that leaves while its import runs gets nothing: the caches are closed
  when the import lands, by a copier thread, like every unmapping.
- Loop thread only, as part of the transfers (transfers.py).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvoffload.datapath.copyplan import place_caches
from kvoffload.datapath.runs import Placement
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import (
    ErrorCode,
    InvalidArgumentError,
    KVOffloadError,
    PermissionDeniedError,
)
from kvoffloadd.access import AccessPolicy
from kvoffloadd.copies.closer import close_fds
from kvoffloadd.copies.copier import Completion, CpuCopier
from kvoffloadd.copies.gpu import GpuRuntime
from kvoffloadd.copies.imports import check_desc, plan_import, run_import
from kvoffloadd.copies.seals import canonical_placements
from kvoffloadd.copies.workers import AttachedWorker, ClientCache, ImportedCache
from kvoffloadd.index.index import NamespaceIndex
from kvoffloadd.ledger import Ledger
from kvoffloadd.region.region import SharedOffloadRegion
from kvoffloadd.service.session import Session

log = logging.getLogger(__name__)

FRAGMENT_BYTES = 48  # a canonical fragment's row, and its merged span later
CACHE_METADATA_BYTES = 512  # a placement and its bookkeeping


@dataclass
class _Pending:
    """A registration whose caches a copier thread is importing."""

    session_id: int
    r: m.AttachWorker
    placements: list[Placement]
    charges: dict[str, int]


class Attacher:
    def __init__(
        self,
        ledger: Ledger,
        copier: CpuCopier,
        gpu: GpuRuntime | None,
        gpu_unavailable: str,
        access: AccessPolicy,
        region: SharedOffloadRegion,
        namespaces: dict[int, NamespaceIndex],
        sessions: dict[int, Session],
        tokens: itertools.count[int],
        add: Callable[[Session, AttachedWorker], None],
        close_off_loop: Callable[[int, dict[str, int], Callable[[], None]], None],
    ) -> None:
        self.ledger = ledger
        self.copier = copier
        self.gpu = gpu
        self.gpu_unavailable = gpu_unavailable
        self.access = access
        self.region = region
        self.namespaces = namespaces
        self.sessions = sessions
        self._tokens = tokens
        self._add = add
        self._close_off_loop = close_off_loop
        self._worker_ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}

    @property
    def importing(self) -> int:
        return len(self._pending)

    def attach(self, s: Session, r: m.AttachWorker) -> m.Reply | None:
        """Register a worker: its reply now (client-copy and GPU workers), or None
        while a copier thread imports its CPU caches (``imported`` answers)."""
        nfds = max((c.fd_index + 1 for c in r.caches), default=0)
        fds, s.fds = s.fds[:nfds], s.fds[nfds:]
        charges = {"workers": 1, "caches": len(r.caches), "metadata_bytes": _metadata(r)}
        try:
            self._check(s, r)
            plan = None
            if not (r.client_copy or r.device_uuid):
                plan = plan_import(r.caches, fds)
                charges.update(plan.charges())
            elif r.device_uuid:
                charges["mappings"] = len(r.caches)  # an IPC import each
            self.ledger.require(s.session_id, charges, "attach a worker")
        except BaseException:
            close_fds(fds)
            raise
        try:
            placements = self._placements(s, r)
        except BaseException:
            close_fds(fds)
            self.ledger.give(s.session_id, charges)
            raise
        if r.client_copy:
            close_fds(fds)
            return self._client_copy(s, r, placements, charges)
        token = next(self._tokens)
        self._pending[token] = _Pending(s.session_id, r, placements, charges)
        if plan is not None:
            self.copier.run_task(token, lambda: _imported_or_refused(lambda: run_import(plan)))
        else:
            close_fds(fds)
            gpu = self.gpu
            assert gpu is not None
            task = partial(gpu.attach, r.caches, r.device_uuid, r.store_event)
            self.copier.run_task(token, lambda: _imported_or_refused(task))
        return None

    def is_import(self, token: int) -> bool:
        return token in self._pending

    def imported(self, c: Completion) -> list[tuple[int, m.Reply]]:
        """An import landed: attach its worker and answer, or answer the refusal."""
        p = self._pending.pop(c.token)
        s = self.sessions.get(p.session_id)
        result: Any = c.result
        if s is None or isinstance(result, str) or result is None:
            if isinstance(result, (list, tuple)):  # unmapped off the loop, then given back
                self._close_off_loop(
                    p.session_id, p.charges, partial(_close_import, self.gpu, result)
                )
            else:
                self.ledger.give(p.session_id, p.charges)
            if s is None:
                return []
            why = result if isinstance(result, str) else "the caches could not be imported"
            return [(s.session_id, m.ErrorReply(p.r.rid, ErrorCode.INVALID_ARGUMENT, why))]
        if isinstance(result, tuple):  # CUDA caches: (ordinal, caches, store event)
            ordinal, caches, event = result
            gpu = self.gpu
            assert gpu is not None
            gpu.device_paths(ordinal)  # calibrated by the time copies come, mostly
            self.region.placement.gpu_worker(p.r.ns, p.r.device_uuid)  # NUMA: its node
            w = self._worker(s, p.r, p.placements, caches, p.charges)
            w.device, w.store_event = ordinal, event
            w.release = partial(gpu.release_event, ordinal, event)
        else:
            w = self._worker(s, p.r, p.placements, result, p.charges)
        return [(s.session_id, m.WorkerAttached(p.r.rid, w.worker_id, self._region_for(s, p.r)))]

    # ------------------------------------------------------------ helpers

    def _check(self, s: Session, r: m.AttachWorker) -> None:
        if r.ns not in s.namespaces:
            raise InvalidArgumentError(f"namespace id {r.ns} was not opened on this connection")
        if r.client_copy and not self.access.may_map_region(s.peer):
            raise PermissionDeniedError(
                f"uid {s.uid} may not map the region for client-copy mode; list it in "
                "client_copy_uids or client_copy_gids of the daemon config, or register "
                "exportable caches (kvoffload.shared_kv_cache or CUDA tensors)"
            )
        if r.device_uuid and self.gpu is None:
            raise InvalidArgumentError(
                f"this kvoffloadd cannot take GPU caches: {self.gpu_unavailable}"
            )

    def _placements(self, s: Session, r: m.AttachWorker) -> list[Placement]:
        """Where a registration's caches go in a slot, once its rank, cache pages and
        canonical fragments are acceptable."""
        layout = self.namespaces[r.ns].layout
        pages = [c.page_bytes for c in r.caches]
        if r.parts > 1 or r.canonical:
            return canonical_placements(layout, r, pages)
        if not 0 <= r.rank < layout.world_size:
            raise InvalidArgumentError(f"rank {r.rank} is not in 0..{layout.world_size - 1}")
        return place_caches(layout, pages)

    def _client_copy(
        self, s: Session, r: m.AttachWorker, placements: list[Placement], charges: dict[str, int]
    ) -> m.Reply:
        caches: list[ImportedCache] = [ClientCache(check_desc(d)) for d in r.caches]
        w = self._worker(s, r, placements, caches, charges)
        w.client_copy = True
        return m.WorkerAttached(r.rid, w.worker_id, self._region_for(s, r))

    def _worker(
        self,
        s: Session,
        r: m.AttachWorker,
        placements: list[Placement],
        caches: list[ImportedCache],
        charges: dict[str, int],
    ) -> AttachedWorker:
        w = AttachedWorker(next(self._worker_ids), s.session_id, r.ns, r.rank, caches, placements)
        w.push, w.parts, w.charges = r.push, r.parts, charges
        self._add(s, w)
        return w

    def _region_for(self, s: Session, r: m.AttachWorker) -> int:
        """Trusted workers get the region's descriptor with the reply; its size."""
        if r.client_copy or (r.want_region and self.access.may_map_region(s.peer)):
            s.out_fds.setdefault(r.rid, []).append(self.region.open_fd())
            return self.region.geometry.region_bytes
        return 0


def _metadata(r: m.AttachWorker) -> int:
    """Heap bytes a registration's placements keep for the worker's life."""
    frags = sum(len(c.frags) // 24 for c in r.canonical)
    return FRAGMENT_BYTES * frags + CACHE_METADATA_BYTES * len(r.caches)


def _imported_or_refused(run: Callable[[], Any]) -> Any:
    """An import, on a copier thread; a refusal comes back as its message."""
    try:
        return run()
    except KVOffloadError as exc:
        return str(exc.args[0])
    except OSError as exc:
        log.info("a worker's caches could not be mapped: %s", exc)
        return f"the caches could not be mapped: {exc.strerror}"


def _close_import(gpu: GpuRuntime | None, result: Any) -> None:
    """Undo an import nobody will use (its connection left meanwhile)."""
    if isinstance(result, tuple):
        ordinal, caches, event = result
        if gpu is not None:
            gpu.release_event(ordinal, event)
    else:
        caches = result
    for cache in caches:
        cache.close()
