"""Request handlers: the daemon's metadata and what each message does to it.

Rules:
- Runs on the loop thread only; it owns namespaces and sessions, its ``members``
  (membership.py) who has which namespace open, and its ``transfers``
  (transfers.py, completions.py) the workers and their copy jobs.
- A handler returns the reply, or ``None`` when the reply is deferred (``WaitJobs``)
  or there is none (one-way requests, rid 0). Client mistakes raise
  ``KVOffloadError`` and become an ``ErrorReply`` for that request, or, for a one-way
  request, a pushed failure (``refuse_one_way``); nothing is changed by a request
  that fails validation.
- Engines' per-step batches and the pushes they get back are the engine channel's
  (engines.py); messages to push go into ``Session.pushes``.
- Admin requests (``Evict``, ``GetConfig``, ``DropNamespace``) are refused
  ``PERMISSION_DENIED`` to peers outside ``admin_uids``/``admin_gids``.
- Copies are validated in full before any address reaches a copier (invariant 4).
- A session that goes away fails its stores, drops its pins and detaches its workers;
  their mappings close once their copies have drained (invariant 5).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import (
    ErrorCode,
    InvalidArgumentError,
    NoSpaceError,
    NotFoundError,
    PermissionDeniedError,
    ShuttingDownError,
    VersionMismatchError,
)
from kvoffload.protocol.messages import MAX_STATE_KEYS
from kvoffload.protocol.packing import pack_ids, pack_keys, unpack_ids, unpack_keys
from kvoffloadd import __version__
from kvoffloadd.access import Peer, peer_groups
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.closer import close_fds
from kvoffloadd.copies.copier import Completion, CpuCopier
from kvoffloadd.copies.gpu import GpuRuntime
from kvoffloadd.copies.workers import AttachedWorker
from kvoffloadd.index.events import EventFeed, FeedBudget
from kvoffloadd.index.index import NamespaceIndex
from kvoffloadd.ledger import Ledger, Limits, configured
from kvoffloadd.region.region import SharedOffloadRegion
from kvoffloadd.service.budgets import Budgets
from kvoffloadd.service.engines import EngineChannel
from kvoffloadd.service.membership import Membership, deny
from kvoffloadd.service.namespaces import NamespaceTable
from kvoffloadd.service.session import Session, Wait
from kvoffloadd.service.stats import LoopTurns, clients_for, stats_for
from kvoffloadd.service.transfers import Transfers
from kvoffloadd.tiers.tiering import Tiering
from kvoffloadd.trust import raise_fd_limit

log = logging.getLogger(__name__)

CRON_EXPIRY_KEYS = 4096  # pinned keys and commits expired per housekeeping call, in all
CRON_EXPIRY_MIN_KEYS = 16  # each namespace's least share of them

PAGE_BYTES = 4096
EVICT_PER_REQUEST = m.MAX_STATE_KEYS  # blocks one Evict request evicts at most
_SERVED_WHILE_STOPPING = (m.GetStats, m.Ping, m.ListClients)


class Service:
    def __init__(
        self,
        config: DaemonConfig,
        region: SharedOffloadRegion,
        copier: CpuCopier,
        gpu: GpuRuntime | None = None,
        gpu_unavailable: str = "no GPU support was set up",
        tiering: Tiering | None = None,
    ) -> None:
        self.config = config
        self.region = region
        self.copier = copier
        self.gpu = gpu
        self.gpu_unavailable = gpu_unavailable
        self.tiering = tiering
        self.access = config.access_policy()
        self.budgets = Budgets(config.max_clients, raise_fd_limit())
        # what each connection holds, per uid and in total (ledger.py)
        self.ledger = Ledger(configured(config.limit_overrides(), self._derived_limits()))
        self.feeds = FeedBudget()  # every namespace's event log together
        self.table = NamespaceTable(  # takes back only once namespaces are opened
            config,
            region,
            self._namespace_new,
            self._namespace_dropped,
            lambda index: self.members.revoke(index),
            self.copies_in,
        )
        self.namespaces: dict[int, NamespaceIndex] = self.table.by_id
        self.sessions: dict[int, Session] = {}
        self.errors_by_code: dict[str, int] = {}
        self.transfers = Transfers(
            config,
            region,
            copier,
            gpu,
            gpu_unavailable,
            self.namespaces,
            self.sessions,
            self.count_error,
            self.access,
            self.ledger,
        )
        self.engines = EngineChannel(self.namespaces, config.max_frame_bytes, self.ledger)
        tiers = tiering.count if tiering is not None else 0
        self.members = Membership(
            self.table, self.sessions, self.ledger, self.access, self.engines, self.transfers, tiers
        )
        self.loop = LoopTurns()
        self.shutting_down = False
        self.started_s = time.monotonic()
        self.requests_total = 0
        self._handlers = self._make_handlers()
        if region.recovered:
            self.table.recover()

    def _derived_limits(self) -> dict[str, Limits]:
        """Ledger limits that follow from the machine: connections and descriptors
        from the descriptor limit, leased bytes from the region's size."""
        b, g = self.budgets, self.region.geometry
        data_bytes = g.num_extents * g.extent_bytes
        per_uid_clients = max(1, min(b.max_clients, max(64, b.max_clients // 4)))
        return {
            "connections": Limits(1, per_uid_clients, b.max_clients),
            "descriptors": Limits(256, max(256, b.fd_budget // 4), b.fd_budget),
            # leased ahead of need: one uid at most 1/8 of the region across all its
            # namespaces, everyone 1/4
            "leased_bytes": Limits(data_bytes // 8, data_bytes // 8, data_bytes // 4),
        }

    # ------------------------------------------------------------ dispatch

    def refusal(self, s: Session, code: ErrorCode = ErrorCode.PERMISSION_DENIED) -> str:
        if code == ErrorCode.QUOTA_EXCEEDED:
            line = self.ledger["connections"]
            return (
                f"uid {s.uid} holds {line.held_by_uid(s.uid)} connections to kvoffloadd "
                f"(a uid may hold {line.limits.per_uid}, everyone {line.limits.total}); "
                "close some, or raise limits.connections in the daemon config"
            )
        return (
            f"uid {s.uid} may not connect to kvoffloadd; list it in allow_uids or "
            "allow_gids of the daemon config"
        )

    def handle(self, s: Session, req: m.Request) -> m.Reply | None:
        self.requests_total += 1
        if not s.allowed:
            raise PermissionDeniedError(self.refusal(s))
        if self.shutting_down and type(req) not in _SERVED_WHILE_STOPPING:
            raise ShuttingDownError("kvoffloadd is shutting down")
        return self._handlers[type(req)](s, req)

    def _make_handlers(self) -> dict[type, Callable[[Session, Any], m.Reply | None]]:
        return {
            m.Lookup: self._on_lookup,
            m.Probe: self._on_probe,
            m.PrepareStore: self._on_prepare_store,
            m.CompleteStore: self._on_complete_store,
            m.PrepareLoad: self._on_prepare_load,
            m.CompleteLoad: self._on_complete_load,
            m.Touch: self._on_touch,
            m.SubmitStore: self._on_submit_store,
            m.SubmitLoad: self._on_submit_load,
            m.GetFinished: self._on_get_finished,
            m.WaitJobs: self._on_wait,
            m.TakeEvents: self._on_take_events,
            m.SyncKeys: lambda s, r: self.engines.snapshot_page(
                s, self.members.readable(s, r.ns), r
            ),
            m.StepBatch: self._on_step,
            m.Wrote: self._on_wrote,
            m.ClientCopyDone: self._on_client_copy_done,
            m.Ping: lambda s, r: m.Pong(r.rid),
            m.OpenNamespace: lambda s, r: self.members.open(
                s, r.rid, r.name, r.layout, r.subscribe, r.join
            ),
            m.AttachWorker: lambda s, r: self.transfers.attach(s, r),
            m.DetachWorker: self._on_detach,
            m.Hello: self._on_hello,
            m.Evict: self._on_evict,
            m.DropNamespace: self._on_drop_namespace,
            m.GetConfig: self._on_get_config,
            m.GetStats: lambda s, r: m.StatsReply(r.rid, stats_for(self, s.peer)),
            m.ListClients: lambda s, r: m.ClientsReply(r.rid, clients_for(self, s.peer)),
        }

    def _on_lookup(self, s: Session, r: m.Lookup) -> m.Reply:
        index = self.members.readable(s, r.ns)
        hits = index.lookup_packed(r.keys, r.key_bytes)  # probed where the keys lie
        if self.tiering is None or hits * r.key_bytes == len(r.keys):
            return m.LookupReply(r.rid, hits)
        keys = unpack_keys(r.keys, r.key_bytes)
        return m.LookupReply(r.rid, self.tiering.lookup_rest(index, keys, hits))

    def _on_probe(self, s: Session, r: m.Probe) -> m.Reply:
        index = self.members.readable(s, r.ns)
        if self.tiering is None:
            hits = index.lookup_packed(r.keys, r.key_bytes)
            states = [m.KEY_READY] * hits + [m.KEY_ABSENT] * (hits * r.key_bytes < len(r.keys))
        else:
            states = self.tiering.probe(index, unpack_keys(r.keys, r.key_bytes))
        return m.ProbeReply(r.rid, bytes(states))

    def _on_prepare_store(self, s: Session, r: m.PrepareStore) -> m.Reply:
        return self._prepare_store(s, r.rid, self.members.writable(s, r.ns), state_keys(r))

    def _on_complete_store(self, s: Session, r: m.CompleteStore) -> m.Reply:
        self.members.writable(s, r.ns).complete_store(state_keys(r), r.success, s.session_id)
        return m.OkReply(r.rid)

    def _on_prepare_load(self, s: Session, r: m.PrepareLoad) -> m.Reply:
        slots = self.members.readable(s, r.ns).prepare_load(state_keys(r), s.session_id)
        return m.LoadPlanReply(r.rid, pack_ids(slots))

    def _on_complete_load(self, s: Session, r: m.CompleteLoad) -> m.Reply:
        self.members.readable(s, r.ns).complete_load(state_keys(r), s.session_id)
        return m.OkReply(r.rid)

    def _on_touch(self, s: Session, r: m.Touch) -> m.Reply:
        self.members.readable(s, r.ns).touch(unpack_keys(r.keys, r.key_bytes))
        return m.OkReply(r.rid)

    def _on_submit_store(self, s: Session, r: m.SubmitStore) -> m.Reply | None:
        return self.transfers.submit(s, r, unpack_ids(r.slots), unpack_ids(r.block_ids), 0, True)

    def _on_submit_load(self, s: Session, r: m.SubmitLoad) -> m.Reply | None:
        slots, ids = unpack_ids(r.slots), unpack_ids(r.block_ids)
        return self.transfers.submit(s, r, slots, ids, r.skip, False)

    def _on_step(self, s: Session, r: m.StepBatch) -> m.Reply | None:
        index = self.members.readable(s, r.ns)
        if r.ns not in s.writable and (r.claim_keys or r.commit_keys or r.fail_keys):
            self.engines.refused_claims_total += len(r.claim_keys) // max(1, r.key_bytes)
            r = msgspec.structs.replace(r, claim_keys=b"", claim_slots=b"", commit_keys=b"",
                                        fail_keys=b"")  # fmt: skip
        self.engines.apply(s, index, r)
        return m.OkReply(r.rid) if r.rid else None

    def _on_wrote(self, s: Session, r: m.Wrote) -> m.Reply | None:
        self.transfers.wrote(s, r)
        return m.OkReply(r.rid) if r.rid else None

    def refuse_one_way(self, s: Session, req: m.Request, code: int, message: str) -> None:
        """A one-way request failed: a submit's job fails (its result is pushed), any
        other request gets a notice. The connection goes on either way."""
        if isinstance(req, (m.SubmitStore, m.SubmitLoad)) and req.worker in s.workers:
            result = m.JobResult(req.job_id, False, 0, 0.0, code)
            s.pushes.append(m.JobsDone(0, req.worker, [result]))
        else:
            s.pushes.append(m.Notice(0, code, message))

    def _on_client_copy_done(self, s: Session, r: m.ClientCopyDone) -> m.Reply:
        self.transfers.client_copy_done(s, r)
        return m.OkReply(r.rid)

    def _on_get_finished(self, s: Session, r: m.GetFinished) -> m.Reply:
        w = self.transfers.worker(s, r.worker)
        return m.FinishedReply(r.rid, self.transfers.take_results(w))

    def _on_wait(self, s: Session, r: m.WaitJobs) -> m.Reply | None:
        w = self.transfers.worker(s, r.worker)
        pending = set(r.job_ids) & w.active_jobs
        if not pending:
            return m.OkReply(r.rid)
        # charged per job it names: what it holds, and what finishing its jobs walks
        self.ledger.require(s.session_id, {"waits": len(pending)}, "wait for jobs")
        wait = Wait(r.rid, pending)
        for job_id in pending:
            s.waits.setdefault((r.worker, job_id), []).append(wait)
        return None  # answered by on_completions

    def _on_take_events(self, s: Session, r: m.TakeEvents) -> m.Reply:
        events, lost = self.members.readable(s, r.ns).take_feed(s.session_id)
        return m.EventsReply(r.rid, events, lost)

    def _require_admin(self, s: Session, what: str) -> None:
        if not self.access.may_administer(s.peer):
            raise deny(s, what, "list it in admin_uids or admin_gids of the daemon config")

    def _on_evict(self, s: Session, r: m.Evict) -> m.Reply:
        self._require_admin(s, "evict")
        return m.EvictReply(r.rid, self.evict(r.namespace, r.keys, r.key_bytes, r.key_prefix))

    def _on_drop_namespace(self, s: Session, r: m.DropNamespace) -> m.Reply:
        self._require_admin(s, f"drop namespace {r.namespace!r}")
        blocks, connections = self.drop_namespace(r.namespace, s.uid)
        return m.NamespaceDropped(r.rid, blocks, connections)

    def _on_get_config(self, s: Session, r: m.GetConfig) -> m.Reply:
        self._require_admin(s, "read the config")
        return m.ConfigReply(r.rid, self.config.effective())

    def _on_detach(self, s: Session, r: m.DetachWorker) -> m.Reply | None:
        w = self.transfers.worker(s, r.worker)
        self.transfers.detach(w)
        if w.worker_id in self.workers:  # copies still running: answer once drained, so
            w.detach_rids.append(r.rid)  # the engine frees its caches only after them
            return None
        return m.OkReply(r.rid)

    def _on_hello(self, s: Session, r: m.Hello) -> m.Reply:
        if r.protocol_version != m.PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"client speaks protocol {r.protocol_version}, kvoffloadd speaks "
                f"{m.PROTOCOL_VERSION}; upgrade the older side"
            )
        s.name = r.client_name
        g = self.region.geometry
        return m.Welcome(
            r.rid,
            m.PROTOCOL_VERSION,
            __version__,
            self.config.instance,
            os.getpid(),
            self.region.name,
            g.region_bytes,
        )

    def count_error(self, code: str) -> None:
        self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1

    # ------------------------------------------------------------ namespaces

    def _namespace_new(self, index: NamespaceIndex) -> None:
        index.pin_ledger = self.ledger["pins"]
        index.lease_ledger = self.ledger["leased_bytes"]
        index.lease_timeout_s = self.config.lease_timeout_s
        index.uid_of = self.uid_of
        index.events = EventFeed(budget=self.feeds)
        if self.tiering is not None:
            self.tiering.namespace_opened(index)

    def _namespace_dropped(self, index: NamespaceIndex) -> None:
        index.events.close()
        if self.tiering is not None:
            self.tiering.namespace_dropped(index)

    def uid_of(self, session_id: int) -> int:
        """A connection's uid; the daemon's own clients (tiers) count as uids of
        their own (negative)."""
        s = self.sessions.get(session_id)
        return s.uid if s is not None else -1 - session_id

    def _prepare_store(
        self, s: Session, rid: int, index: NamespaceIndex, keys: list[bytes]
    ) -> m.Reply:
        token = s.leases[index.ns_id]
        plan = index.prepare_store(keys, s.session_id, token)
        if plan is None:
            raise NoSpaceError(
                f"namespace {index.name!r}: no space for {len(keys)} blocks "
                "(the rest is pinned or being written)"
            )
        kp, kb = pack_keys(plan.keys_to_store)
        evicted = pack_keys(plan.evicted_keys)[0]
        return m.StorePlanReply(rid, kp, kb, pack_ids(plan.slots), evicted, token)

    def evict(
        self,
        namespace: str | None,
        keys: bytes | None = None,
        key_bytes: int = 0,
        prefix: bytes | None = None,
    ) -> int:
        by_name = self.table.by_name
        if namespace is not None and namespace not in by_name:
            raise InvalidArgumentError(f"no namespace named {namespace!r}")
        targets = [by_name[namespace]] if namespace else list(self.namespaces.values())
        key_list = unpack_keys(keys, key_bytes) if keys is not None else None
        n = 0
        for ns in targets:  # at most EVICT_PER_REQUEST: the client asks again for more
            n += ns.evict(key_list, prefix, EVICT_PER_REQUEST - n)
            if n >= EVICT_PER_REQUEST:
                break
        log.info("admin evicted %d blocks from %s", n, namespace or "all namespaces")
        return n

    def drop_namespace(self, name: str, admin_uid: int) -> tuple[int, int]:
        """An admin's drop: every connection that has the namespace open loses it, as
        when the table takes it back, then it is dropped. Refused, with nothing
        changed, while copies run in its slots (engines' or a tier's: they would land
        in extents another namespace may own next). Returns (blocks it held,
        connections that lost it)."""
        index = self.table.by_name.get(name)
        if index is None:
            raise NotFoundError(f"no namespace named {name!r}")
        if self.copies_in(index):
            raise NoSpaceError(
                f"namespace {name!r} has copies running in its slots (engines' or a "
                "secondary tier's); nothing was dropped: try again once they finish "
                "(stop its engines if they never pause)"
            )
        connections = self.members.revoke(index, dropped_by=admin_uid)
        blocks = self.table.drop(index, f"by an admin (uid {admin_uid})")
        return blocks, connections

    def copies_in(self, index: NamespaceIndex) -> bool:
        """Whether copies run in the namespace's slots, an engine's or a tier thread's:
        it may not leave the table under them (its extents may go to another next)."""
        tiering = self.tiering
        return index.slots.any_busy() or (tiering is not None and tiering.busy_with(index) > 0)

    # ------------------------------------------------------------ sessions

    def open_session(self, session_id: int, pid: int, uid: int, gid: int) -> Session:
        s = Session(session_id, pid, uid, gid)
        s.peer = Peer(pid, uid, peer_groups(pid, gid))
        s.allowed = self.access.may_connect(s.peer)
        if not s.allowed:
            log.warning("refused connection from uid %d gid %d (pid %d)", uid, gid, pid)
        self.sessions[session_id] = s
        self.ledger.join(session_id, uid)
        return s

    def close_session(self, s: Session, budget: int = 1 << 62) -> bool:
        """Invariant 5: fail stores, drop pins, detach workers (unmapped after drain),
        at most ``budget`` stores and pinned keys per namespace a call; whether all is
        released (else call again: a leaver's release is loop work in slices)."""
        for ns_id in list(s.namespaces):
            if not self.members.leave(s, ns_id, budget):
                return False
        for wid in list(s.workers):
            self.transfers.detach(self.workers[wid])
        close_fds(s.fds)  # descriptors no message claimed
        s.fds = []
        del self.sessions[s.session_id]
        # Released above, or (copies, mappings) draining, charged to nobody from now.
        self.ledger.leave(s.session_id)
        return True

    def on_completions(self, done: list[Completion]) -> list[tuple[int, m.Reply]]:
        """Apply finished copies; returns deferred replies as (session id, reply)."""
        return self.transfers.on_completions(done)

    def cron(self) -> bool:
        """Housekeeping: expiries, compaction, leases taken back. What expires is
        bounded per call (``CRON_EXPIRY_KEYS`` in all, shared by the namespaces): a
        peer that let hundreds of thousands of pins age held the loop half a second
        at once. Returns whether some is left for the next call, which comes soon."""
        now = time.monotonic()
        share = max(CRON_EXPIRY_MIN_KEYS, CRON_EXPIRY_KEYS // max(1, len(self.namespaces)))
        left = False
        for ns in self.namespaces.values():
            ns.events.compact()
            if expired := ns.expire_pins(now, share):
                log.warning("namespace %s: %d pins held too long were dropped", ns.name, expired)
            ns.free_graves()
            self.members.take_back_leases(ns, now)
            if late := ns.expire_commits(now, share):
                log.warning(
                    "namespace %s: %d committed stores never got their copies", ns.name, late
                )
            ns.slots.release_free_tail()
            left = left or ns.pins_due(now) or late == share
        if self.tiering is not None:
            self.tiering.check_stalls(now)
        return left

    @property
    def pushes_due(self) -> set[int]:
        """Connections told something outside a request; the server sends their
        pushes at housekeeping and clears this."""
        return self.members.pushes_due

    @property
    def inflight_jobs(self) -> int:
        return self.transfers.inflight_jobs

    @property
    def workers(self) -> dict[int, AttachedWorker]:
        return self.transfers.workers


def state_keys(r: m.PrepareStore | m.CompleteStore | m.PrepareLoad | m.CompleteLoad) -> list[bytes]:
    """The keys of a request that changes blocks' state: at most ``MAX_STATE_KEYS``, so
    no one request holds the loop long (a client library splits larger calls)."""
    if len(r.keys) > MAX_STATE_KEYS * max(1, r.key_bytes):
        raise InvalidArgumentError(
            f"{len(r.keys) // max(1, r.key_bytes)} keys in one {type(r).__name__}; at most "
            f"{MAX_STATE_KEYS} (split the call)"
        )
    return unpack_keys(r.keys, r.key_bytes)
