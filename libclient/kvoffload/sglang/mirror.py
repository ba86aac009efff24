"""A local mirror of one namespace's ready keys, for SGLang's hit queries.

SGLang asks ``batch_exists`` for every request it may prefetch, 128 keys at a time,
and the answer is all-reduced across ranks before anything else happens: it should
cost microseconds, not a daemon round trip. The mirror answers from a set of keys
the daemon keeps current:

- a snapshot of the ready keys on every (re)connect (``SyncKeys`` with ``push``), then
  the namespace's event feed, pushed (``FeedPush``: stores that completed, by any
  engine, and evictions), read without blocking at each query;
- the feed position is acknowledged (a one-way ``StepBatch`` carrying ``ack_seq`` only),
  so the daemon reuses an evicted block's slot only once this mirror has seen the
  eviction (or after its ``mirror_grace_s``);
- keys this instance stored are held as soon as the daemon confirmed them (on the
  backup connection), so its own next query never races the feed that carries them;
- while the daemon is away the mirror is empty: every key misses at once.

A key the mirror holds may be gone by the time it is loaded (another engine's
pressure evicted it): the load then reports those pages missing, never other bytes
(``link``). Keys a secondary tier holds are not in the mirror: with tiers, a query
the mirror does not answer in full asks the daemon (``Probe``), which also starts
their promotion.

Not thread-safe: the owner holds the query role's lock.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence

from kvoffload.namespace import Namespace, Snapshot
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import DaemonUnavailableError
from kvoffload.protocol.packing import unpack_keys

log = logging.getLogger(__name__)


class KeyMirror:
    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self.keys: set[bytes] = set()
        self.want = 0  # a mirror leases no slots (SGLang's backups prepare their stores)
        self.seq = 0
        self.connected = False
        self._acked = -1
        self._resync = False
        self._noted: deque[bytes] = deque()  # stored by this instance, any thread
        self.snapshots_total = 0
        if ns.attach_view(self):  # connected already: start from a snapshot now
            self._snapshot()

    # ------------------------------------------------------------ daemon side

    def adopt(self, snapshot: Snapshot) -> None:
        self._noted.clear()  # noted under an earlier connection: the snapshot knows
        self.keys = set(snapshot.keys)
        self.seq = snapshot.seq
        self._acked = -1
        self.connected = True
        self.snapshots_total += 1

    def lost(self) -> None:
        self.connected = False
        self.keys = set()
        self._noted.clear()

    def on_push(self, msg: m.Reply) -> None:
        if not isinstance(msg, m.FeedPush):
            return
        keys = self.keys
        for e in msg.events:
            batch = unpack_keys(e.keys, e.key_bytes)
            if e.removed:
                keys.difference_update(batch)
            else:
                keys.update(batch)
        self.seq = msg.seq
        if msg.lost:
            self._resync = True

    def _snapshot(self) -> None:
        try:
            self.adopt(self.ns.snapshot())
        except DaemonUnavailableError:
            self.lost()

    # ------------------------------------------------------------ queries

    def note_stored(self, keys: Iterable[bytes]) -> None:
        """Keys this instance just stored (the daemon confirmed the commit on another
        connection): held at once, so this instance's next query does not race the
        feed that carries them (thread-safe: a deque)."""
        self._noted.extend(keys)

    def refresh(self) -> None:
        """Take what the daemon pushed (without blocking) and acknowledge it."""
        self.ns.poll()
        noted = self._noted
        while noted:
            key = noted.popleft()
            if self.connected:
                self.keys.add(key)
        if self._resync or (not self.connected and self.ns.client.connected):
            # the feed overflowed, or a connection came up before this mirror was
            # attached to it: start over from a snapshot
            self._resync = False
            self._snapshot()
        if self.connected and self.seq != self._acked:
            self._acked = self.seq
            self.ns.post(m.StepBatch(0, self.ns.ns_id, 0, ack_seq=self.seq))

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored and ready, as far as the mirror knows."""
        self.refresh()
        held = self.keys
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n
