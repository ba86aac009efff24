"""An engine's scheduler-side view of a namespace: every answer is local.

vLLM asks its offloading manager thousands of questions per scheduler step and waits
for none of them to travel. The view answers from local state the daemon keeps
current by pushes, and sends what changed once per step, one-way:

- ``ready``: key -> slot of every stored block (a snapshot at connect, then the pushed
  feed, applied at the first call of each step only, so a step sees one consistent
  view: a lookup HIT and the ``prepare_load`` after it agree);
- ``leases``: empty slots the daemon granted ahead of need; ``prepare_store`` takes
  them and the batch claims them. Only an empty pool falls back to a blocking
  ``PrepareStore`` (counted in ``blocking_calls_total``);
- ``writing`` (stores in flight, HIT_PENDING as in vLLM's own manager, bounded by the
  worker's store deadline) and ``committing`` (completed here, not yet seen in the
  feed: MISS, never HIT, because a store the worker had to drop is never committed,
  and never a wait on a commit that may not come; not stored again meanwhile, for at
  most ``COMMIT_WAIT_S``);
- ``pins``: loads planned here, sent as pins before the batch's feed ack, so the
  daemon keeps every block this engine may still read (kvoffloadd.index.graves).

While the daemon is away the view is empty: lookups MISS at once and stores have
nothing to do (an empty plan, which vLLM treats as "stored", so it neither retries
nor logs). On reconnect it restarts from a snapshot and re-sends its pins.

Alone, a view reads its pushes at the first call of each step and sends its batch at
the end of each step. An owner with several views on one connection (an engine with
several namespaces) drives both instead (``begin_step(poll=False)``,
``end_step(flush=False)``): one read and one write for all of them, and only every
few milliseconds (``low`` says when the lease pool cannot wait). The lease wish is
``WISH_SENDS`` times the most slots used between two sends: the grant a send asks for
comes back while the engine goes on storing, and is read at the next send (or once the
pool runs low), so the pool covers two send intervals and a daemon whose turn comes
late, on a loaded machine, still finds the engine holding slots.

Not thread-safe: the owner serialises calls (vLLM holds ``manager.lock``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from enum import IntEnum

from kvoffload.namespace import Namespace, Snapshot
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import DaemonUnavailableError
from kvoffload.protocol.messages import MAX_KEYS_PER_MESSAGE
from kvoffload.protocol.packing import id_list, pack_ids, unpack_keys

log = logging.getLogger(__name__)

COMMIT_WAIT_S = 60.0  # twice the daemon's default commit_timeout_s
WISH_SENDS = 4  # the lease wish: this many times the most slots used between two sends


class KeyState(IntEnum):
    MISS = 0
    HIT = 1  # stored and ready
    HIT_PENDING = 2  # being stored: ask again
    RETRY = 3  # being promoted from a secondary tier: ask again


class _Batch:
    """What one step changed, in the order the daemon applies it."""

    FIELDS = ("claims", "pins", "unpins", "commits", "fails", "touches")

    def __init__(self) -> None:
        self.key_bytes = 0
        self.claims: list[bytes] = []
        self.claim_slots: list[int] = []
        self.pins: list[bytes] = []
        self.unpins: list[bytes] = []
        self.commits: list[bytes] = []
        self.fails: list[bytes] = []
        self.touches: list[bytes] = []

    def __bool__(self) -> bool:  # FIELDS, spelled out: asked twice per step end
        return bool(
            self.claims or self.pins or self.unpins or self.commits or self.fails or self.touches
        )

    def message(self, ns: int, ack_seq: int, want: int) -> m.StepBatch:
        j = b"".join
        return m.StepBatch(
            0,
            ns,
            self.key_bytes,
            j(self.claims),
            pack_ids(self.claim_slots),
            j(self.pins),
            j(self.unpins),
            j(self.commits),
            j(self.fails),
            j(self.touches),
            ack_seq,
            want,
        )


class EngineView:
    def __init__(
        self,
        ns: Namespace,
        lease_blocks: int = 64,
        max_lease_blocks: int = 4096,
        keep_events: bool = False,
    ) -> None:
        self.ns = ns
        self.min_lease_blocks = lease_blocks
        self.max_lease_blocks = max_lease_blocks
        self.keep_events = keep_events
        self.ready: dict[bytes, int] = {}
        self.writing: dict[bytes, int] = {}
        self.committing: OrderedDict[bytes, float] = OrderedDict()  # key -> give up at
        self.leases: list[int] = []
        self.pins: Counter[bytes] = Counter()
        self.connected = False
        self.seq = 0
        self.events: list[tuple[list[bytes], bool]] = []  # (keys, removed) for vLLM
        self._acked = self._sent_want = -1
        self.want = lease_blocks
        self._used = 0
        self._recent_use: deque[int] = deque(maxlen=64)
        self._batch = _Batch()
        self._in_step = False
        self._resync = False
        # statistics
        self.steps_total = self.blocking_calls_total = self.lease_fallbacks_total = 0
        self.resyncs_total = self.batches_total = 0
        if ns.attach_view(self):  # connected already: start from a snapshot now
            self.connected = True
            self._snapshot()
            self.blocking_calls_total = self.resyncs_total = 0  # start-up, not a step
            self.flush()

    # ------------------------------------------------------------ daemon side

    def adopt(self, snapshot: Snapshot) -> None:
        """A (new) connection's snapshot: start over, and pin again what we read."""
        self._replace(snapshot)
        self.writing.clear()
        self.committing.clear()
        self.leases.clear()
        self._batch = _Batch()
        self._acked = self._sent_want = -1
        self.connected = True
        for key in self.pins.elements():
            self._add("pins", key)
        self.flush()  # the lease wish (and pins) go out now: grants arrive before need

    def _replace(self, snapshot: Snapshot) -> None:
        new = dict(zip(snapshot.keys, snapshot.slots))
        if self.keep_events:  # what changed unseen, so event consumers stay exact
            if gone := self.ready.keys() - new.keys():
                self.events.append((list(gone), True))
            if came := new.keys() - self.ready.keys():
                self.events.append((list(came), False))
        self.ready = new
        self.seq = snapshot.seq

    def lost(self) -> None:
        self.connected = False
        self.writing.clear()
        self.committing.clear()
        self.leases.clear()
        self._batch = _Batch()

    def on_push(self, msg: m.Reply) -> None:
        if isinstance(msg, m.LeaseGrant):
            self.leases.extend(id_list(msg.slots))
            return
        if isinstance(msg, m.LeaseRevoke):  # unused too long: no longer ours to claim
            gone = set(id_list(msg.slots))
            self.leases = [slot for slot in self.leases if slot not in gone]
            self._sent_want = -1  # wish again with the next batch
            return
        assert isinstance(msg, m.FeedPush)
        ready, committing = self.ready, self.committing
        for e in msg.events:
            keys = unpack_keys(e.keys, e.key_bytes)
            if e.removed:
                for key in keys:
                    ready.pop(key, None)
            else:
                ready.update(zip(keys, id_list(e.slots)))
                for key in keys:
                    committing.pop(key, None)
            if self.keep_events:
                self.events.append((keys, e.removed))
        self.seq = msg.seq
        if msg.lost:
            self._resync = True

    def begin_step(self, poll: bool = True) -> None:
        """A scheduler step begins: read what the daemon pushed (unless the owner of
        the connection did), resync from a snapshot if the feed had a gap."""
        self._in_step = True
        self.steps_total += 1
        if poll:
            self.ns.poll()
        if self._resync and self.connected:
            self._snapshot()

    _begin_step = begin_step

    @property
    def low(self) -> bool:
        """The lease pool is below a quarter of the wish: send and read now."""
        return self.connected and len(self.leases) < self.want // 4

    def _snapshot(self) -> None:
        """Our feed had a gap: a fresh snapshot on the same connection (blocking)."""
        self.resyncs_total += 1
        self.blocking_calls_total += 1
        try:
            snap = self.ns.snapshot()
        except DaemonUnavailableError:
            return  # the namespace told the client; the view is reset on reconnect
        self._resync = False
        self._replace(snap)
        for key in self.ready.keys() & self.committing.keys():
            del self.committing[key]

    # ------------------------------------------------------------ the manager contract

    def lookup(self, key: bytes) -> KeyState:
        if not self._in_step:
            self._begin_step()
        if key in self.ready:
            return KeyState.HIT if self.connected else KeyState.MISS
        if key in self.writing:
            return KeyState.HIT_PENDING
        return KeyState.MISS

    def prepare_store(self, keys: Sequence[bytes]) -> tuple[list[bytes], list[int]] | None:
        """(keys to store, their slots); ([], []) when there is nothing to do or no
        daemon; None when there is no space."""
        if not self._in_step:
            self._begin_step()
        if not self.connected:
            return [], []
        busy = (self.ready, self.writing, self.committing)
        todo = [k for k in dict.fromkeys(keys) if not any(k in s for s in busy)]
        if not todo:
            return [], []
        n = len(todo)
        self._used += n
        if len(self.leases) < n:
            self._top_up(n)
        if len(self.leases) >= n:
            slots = self.leases[-n:]
            del self.leases[-n:]
            for key, slot in zip(todo, slots):
                self.writing[key] = slot
                self._add("claims", key)
                self._batch.claim_slots.append(slot)
            return todo, slots
        self.blocking_calls_total += 1  # no room for a grant: the daemon plans this one
        plan = self.ns.prepare_store(todo)
        if plan is None:
            return None if self.connected else ([], [])
        self.writing.update(zip(plan.keys_to_store, plan.slots))
        return plan.keys_to_store, plan.slots

    def _top_up(self, n: int) -> None:
        """The pool ran dry within a step: one blocking round trip sends the batch so far
        with a larger wish and brings the grant back (counted)."""
        self.lease_fallbacks_total += 1
        self.blocking_calls_total += 1
        self.want = min(self.max_lease_blocks, max(self.want, WISH_SENDS * (self._used + n)))
        msg = self._batch.message(self.ns.ns_id, self.seq, self.want)
        self._batch = _Batch()
        self._acked, self._sent_want = self.seq, self.want
        self.ns.send_and_wait(msg)

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        writing, give_up_s = self.writing, time.monotonic() + COMMIT_WAIT_S
        for key in keys:
            if writing.pop(key, None) is None:
                continue  # not ours, or of an earlier connection
            if success:
                self.committing[key] = give_up_s
                self._add("commits", key)
            else:
                self._add("fails", key)

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Slots of the keys (pinned here; -1 where unknown: the load reads by key)."""
        ready = self.ready
        for key in keys:
            self.pins[key] += 1
            self._add("pins", key)
        return [ready.get(k, -1) for k in keys]

    def complete_load(self, keys: Sequence[bytes]) -> None:
        pins = self.pins
        for key in keys:
            if pins[key] <= 0:
                continue
            pins[key] -= 1
            if not pins[key]:
                del pins[key]
            self._add("unpins", key)

    def touch(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._add("touches", key)

    def end_step(self, flush: bool = True) -> None:
        """The scheduler step is over: send what changed (unless the owner of the
        connection decides when), adapt the lease pool."""
        if not self._in_step:
            self._begin_step()
        self._in_step = False
        committing = self.committing
        if committing:
            now = time.monotonic()
            while committing and next(iter(committing.values())) < now:
                committing.popitem(last=False)  # never confirmed: the daemon dropped it
        if flush:
            self.flush()

    def flush(self, send: bool = True) -> None:
        """Queue the batch (one-way) if anything changed since the last one, and send
        it now unless ``send`` is False (the owner of the connection sends it). The
        slots used since the last flush set the lease wish."""
        if not self.connected:
            return
        self._recent_use.append(self._used)
        self._used = 0
        peak = max(self._recent_use)
        self.want = max(self.min_lease_blocks, min(WISH_SENDS * peak, self.max_lease_blocks))
        self._queue(send)

    def _queue(self, send: bool) -> None:
        if not self._batch and self.seq == self._acked and self.want == self._sent_want:
            return
        msg = self._batch.message(self.ns.ns_id, self.seq, self.want)
        self._batch = _Batch()
        self._acked, self._sent_want = self.seq, self.want
        self.batches_total += 1
        self.ns.post(msg, flush=send)

    def _add(self, field: str, key: bytes) -> None:
        if not self.connected:
            return  # a new connection starts from a snapshot and the pins
        b = self._batch
        keys: list[bytes] = getattr(b, field)
        if len(key) != b.key_bytes or len(keys) >= MAX_KEYS_PER_MESSAGE:
            if b:  # one key length per batch, a bounded number of keys: queue it first
                self._queue(send=False)
                b = self._batch
                keys = getattr(b, field)
            b.key_bytes = len(key)
        keys.append(key)
