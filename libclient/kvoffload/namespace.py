"""A namespace on the scheduler side: vLLM's OffloadingManager contract, one call each.

Rules (invariant 7):
- Every call is one blocking round trip with a timeout; a lost daemon turns into
  misses: ``lookup`` -> 0, ``prepare_store`` -> None, completions and ``touch`` ->
  no-ops, ``take_events`` -> []. Only ``prepare_load`` raises, because a load cannot
  be planned without the daemon; callers treat that as a failed load.
- Engines that must not wait per call use a ``kvoffload.engine.view.EngineView`` over the
  namespace instead: the view is attached here (``view``), gets its snapshot on every
  (re)connect and the namespace's pushes (feed, leases).
- After a reconnect the namespace has a new id and lease token; calls made with the
  old ones belong to a closed connection and changed nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

from kvoffload.link.transport import Transport
from kvoffload.plans import LoadPlan, OffloadEvent, StorePlan
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import (
    DaemonUnavailableError,
    InvalidArgumentError,
    KVOffloadError,
    NoSpaceError,
    QuotaExceededError,
)
from kvoffload.protocol.messages import MAX_STATE_KEYS, KVLayout
from kvoffload.protocol.packing import id_list, pack_keys, unpack_ids, unpack_keys
from kvoffload.worker import Worker

if TYPE_CHECKING:
    from kvoffload.datapath.canonical import CanonicalPart
from kvoffload.link.channel import Channel

R = TypeVar("R", bound=m.Reply)


@dataclass(frozen=True)
class Snapshot:
    """Every ready key of a namespace with its slot, and the feed position it is at."""

    keys: list[bytes]
    slots: list[int]
    seq: int


class View(Protocol):
    """What a namespace needs from an engine view attached to it."""

    want: int  # empty slots it wants leased (read by the keeper thread's handshake)

    def adopt(self, snapshot: Snapshot) -> None: ...
    def lost(self) -> None: ...
    def on_push(self, msg: m.Reply) -> None: ...


class Namespace:
    """Scheduler-side view of one namespace: vLLM's OffloadingManager contract."""

    def __init__(
        self,
        client: Channel,
        name: str,
        layout: KVLayout,
        subscribe: bool = True,
        join: bool = False,
    ) -> None:
        self.client = client
        self.name = name
        self.layout = layout  # with ``join``: unknown here (what the workers registered)
        self.subscribe = subscribe
        self.join = join
        self.ns_id = -1
        self.slot_bytes = 0
        self.fingerprint = ""
        self.tiers = 0  # secondary tiers below the daemon's region
        self.lease = 0  # this connection's lease token in the namespace
        self.last_error: KVOffloadError | None = None  # why prepare_store gave None
        self.view: View | None = None

    # ------------------------------------------------------------ connection

    def _handshake(self, t: Transport, ns_ids: dict[int, int]) -> tuple[Any, ...]:
        rid = self.client.next_rid
        req = m.OpenNamespace(rid(), self.name, self.layout, self.subscribe, self.join)
        reply = t.request(req)
        assert isinstance(reply, m.NamespaceOpened)
        ns_ids[id(self)] = reply.ns
        snapshot = None
        if self.view is not None:
            snapshot = fetch_snapshot(t, rid, reply.ns)
            # The first lease grant comes with the connection: an engine's first step
            # on it plans stores without a round trip (the grant waits in t.pushed).
            want = max(0, self.view.want)
            t.request(m.StepBatch(rid(), reply.ns, 0, ack_seq=snapshot.seq, want_leases=want))
        return reply, snapshot

    def _adopt(self, state: tuple[Any, ...]) -> None:
        reply, snapshot = state
        self.ns_id, self.slot_bytes, self.fingerprint = (
            reply.ns,
            reply.slot_bytes,
            reply.fingerprint,
        )
        self.tiers, self.lease = reply.tiers, reply.lease
        if self.view is not None:
            self.client.route(Namespace, self.ns_id, self)
            if snapshot is None:  # the view came after this connection's handshake
                with contextlib.suppress(DaemonUnavailableError):
                    snapshot = self.snapshot()
            if snapshot is not None:
                self.view.adopt(snapshot)

    def _lost(self) -> None:
        if self.view is not None:
            self.view.lost()

    def _on_push(self, msg: m.Reply) -> None:
        if self.view is not None:
            self.view.on_push(msg)

    # ------------------------------------------------------------ for engine views

    def attach_view(self, view: View) -> bool:
        """Route this namespace's pushes to ``view``; True when already connected (the
        view then takes a snapshot), False when it gets one on connecting."""
        self.view = view
        return self.client.route_if_connected(Namespace, self.ns_id, self)

    def poll(self) -> None:
        """Deliver what the daemon pushed (to the view) without blocking."""
        self.client.poll()

    def post(self, msg: m.Request, flush: bool = True) -> bool:
        """Send a one-way request now (or with the connection's next write, unless
        ``flush``), without blocking; False when disconnected."""
        sent = self.client.post(msg)
        if sent and flush:
            self.client.flush()
        return sent

    def send_and_wait(self, msg: m.StepBatch) -> bool:
        """Send a step batch as a blocking request: what it causes (a lease grant) has
        been delivered when this returns. False when disconnected."""
        try:
            self.client.call(lambda rid: msgspec.structs.replace(msg, rid=rid), m.OkReply)
        except DaemonUnavailableError:
            return False
        return True

    def snapshot(self) -> Snapshot:
        """Every ready key with its slot, restarting the pushed feed there (blocking).
        Raises DaemonUnavailableError."""
        rid = self.client.next_rid
        return self.client.exchange(lambda t: fetch_snapshot(t, rid, self.ns_id))

    def _keys_call(
        self, cls: Callable[..., m.Request], keys: Sequence[bytes], expect: type[R], *extra: Any
    ) -> R:
        packed, kb = pack_checked(keys)
        return self.client.call(lambda rid: cls(rid, self.ns_id, packed, kb, *extra), expect)

    # ------------------------------------------------------------ the contract

    def lookup(self, keys: Sequence[bytes]) -> int | None:
        """Number of leading keys stored and ready; 0 when the daemon is unavailable."""
        if not keys:
            return 0
        try:
            return self._keys_call(m.Lookup, keys, m.LookupReply).hits
        except DaemonUnavailableError:
            return 0

    def probe(self, keys: Sequence[bytes]) -> list[int]:
        """Per key ``KEY_READY``, ``KEY_PROMOTING`` or ``KEY_ABSENT``, up to and including
        the first absent key; keys a secondary tier holds start their promotion. Empty
        when the daemon is unavailable."""
        if not keys:
            return []
        try:
            return list(self._keys_call(m.Probe, keys, m.ProbeReply).states)
        except DaemonUnavailableError:
            return []

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        """Lease slots for the keys not stored yet; None when there is no space.

        None also when the namespace's quota is full and nothing of its own can be
        evicted (``QUOTA_EXCEEDED``); the reason stays in ``last_error``. More than
        ``MAX_STATE_KEYS`` keys go in several calls, all or nothing: a part that
        finds no space fails the parts planned before it.
        """
        if len(keys) <= MAX_STATE_KEYS:  # one call (the usual): nothing to undo if it fails
            try:
                r = self._keys_call(m.PrepareStore, keys, m.StorePlanReply)
            except (NoSpaceError, QuotaExceededError, DaemonUnavailableError) as exc:
                self.last_error = exc
                return None
            evicted = unpack_keys(r.evicted_keys, r.key_bytes) if r.evicted_keys else []
            return StorePlan(unpack_keys(r.keys, r.key_bytes), id_list(r.slots), evicted, r.lease)
        plans: list[m.StorePlanReply] = []
        try:  # a part that fails leaves the parts before it in ``plans``
            plans.extend(
                self._keys_call(m.PrepareStore, part, m.StorePlanReply) for part in _parts(keys)
            )
        except (NoSpaceError, QuotaExceededError, DaemonUnavailableError) as exc:
            self.last_error = exc
            planned = [k for r in plans for k in unpack_keys(r.keys, r.key_bytes)]
            self.complete_store(planned, success=False)
            return None
        except BaseException:
            planned = [k for r in plans for k in unpack_keys(r.keys, r.key_bytes)]
            self.complete_store(planned, success=False)
            raise
        return StorePlan(
            [k for r in plans for k in unpack_keys(r.keys, r.key_bytes)],
            [s for r in plans for s in id_list(r.slots)],
            [k for r in plans for k in unpack_keys(r.evicted_keys, r.key_bytes)],
            plans[-1].lease if plans else 0,
        )

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        # Without the daemon there is nothing to complete: it failed these stores when
        # the connection dropped.
        try:
            for part in (keys,) if 0 < len(keys) <= MAX_STATE_KEYS else _parts(keys):
                self._keys_call(m.CompleteStore, part, m.OkReply, success)
        except DaemonUnavailableError:
            pass

    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        """Pin the blocks and return their slots in key order (raises if not all
        ready; more than ``MAX_STATE_KEYS`` go in several calls, all or nothing)."""
        slots: list[int] = []
        done = 0
        try:
            for part in _parts(keys):
                r = self._keys_call(m.PrepareLoad, part, m.LoadPlanReply)
                slots += unpack_ids(r.slots).tolist()
                done += len(part)
        except BaseException:
            self.complete_load(keys[:done])
            raise
        return LoadPlan(slots)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        with contextlib.suppress(DaemonUnavailableError):  # pins died with it
            for part in _parts(keys):
                self._keys_call(m.CompleteLoad, part, m.OkReply)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Refresh recency; sent without waiting for the reply."""
        if keys:
            packed, kb = pack_checked(keys)
            self.client.send_nowait(lambda rid: m.Touch(rid, self.ns_id, packed, kb))

    def take_events(self) -> list[OffloadEvent]:
        """Events of this namespace since the last take on this connection: stores that
        completed (by any engine) and evictions. [] when the daemon is unavailable."""
        try:
            return self.read_feed()[0]
        except DaemonUnavailableError:
            return []

    def read_feed(self) -> tuple[list[OffloadEvent], bool]:
        """(events, lost): like ``take_events``; ``lost`` says the daemon dropped some
        (its per-connection queue overflowed), so a mirror must ``sync_keys`` again.
        Raises DaemonUnavailableError."""
        r = self.client.call(lambda rid: m.TakeEvents(rid, self.ns_id), m.EventsReply)
        return [event_of(e) for e in r.events], r.lost

    def sync_keys(self) -> list[bytes]:
        """Every key ready in the namespace now, and the event feed restarted at that
        instant: keys + later ``read_feed`` events are exact. Raises
        DaemonUnavailableError."""
        rid = self.client.next_rid
        return self.client.exchange(lambda t: fetch_snapshot(t, rid, self.ns_id, push=False).keys)

    def attach_worker(
        self,
        caches: Sequence[Any],
        rank: int = 0,
        stream: int | None = None,
        copy_mode: str = "auto",
        canonical: Sequence[CanonicalPart] = (),
        parts: int = 1,
    ) -> Worker:
        """Register this rank's KV caches.

        ``caches`` are ``shared_kv_cache`` CPU tensors or CUDA tensors (one GPU per
        worker, exported by IPC handle), which the daemon copies; or, with
        ``copy_mode`` "client" (or "auto" when the caches cannot be exported), plain CPU
        tensors that the worker copies itself through a mapping of the region, which
        the daemon allows only for trusted uids. For CUDA, stores wait on work queued on
        ``stream`` (a raw ``cudaStream_t``; default: PyTorch's current stream). In a
        canonical namespace, each of an engine's ``parts`` ranks gives how its page of
        each cache maps into the canonical page (``canonical``, kvoffload.datapath.canonical).
        """
        return Worker(self, caches, rank, stream, copy_mode, canonical, parts)


def event_of(e: m.EventMsg) -> OffloadEvent:
    slots = unpack_ids(e.slots).tolist() if e.slots else None
    return OffloadEvent(unpack_keys(e.keys, e.key_bytes), e.removed, slots)


def fetch_snapshot(t: Transport, rid: Callable[[], int], ns: int, push: bool = True) -> Snapshot:
    """Page through a key snapshot on ``t`` (restarting the namespace's feed there)."""
    keys: list[bytes] = []
    slots: list[int] = []
    offset, seq = 0, 0
    while offset >= 0:
        page = t.request(m.SyncKeys(rid(), ns, offset, push))
        assert isinstance(page, m.KeysPage)
        keys.extend(page.keys)
        slots.extend(unpack_ids(page.slots).tolist())
        if offset == 0:
            seq = page.seq
        offset = page.next_offset
    return Snapshot(keys, slots, seq)


def _parts(keys: Sequence[bytes]) -> list[Sequence[bytes]]:
    """``keys`` in calls of at most ``MAX_STATE_KEYS`` (none for no keys)."""
    return [keys[i : i + MAX_STATE_KEYS] for i in range(0, len(keys), MAX_STATE_KEYS)]


def pack_checked(keys: Sequence[bytes]) -> tuple[bytes, int]:
    try:
        return pack_keys(keys if isinstance(keys, (list, tuple)) else list(keys))
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None
