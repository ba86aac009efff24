"""Warm restart: rebuild namespaces and their indexes from a kept region's tables.

A daemon that stops with ``keep_region`` or dies (even by SIGKILL) leaves the region
and its tables behind. The next daemon of the same instance reads them back:

- every namespace of the namespace table comes back with its name, fingerprint and
  layout, and owns the same extents in the same order, so slot ids are unchanged;
- every slot whose record says READY is a completed store: its key becomes visible
  again, in the order stores completed (``seq``), which is the LRU order;
- a slot whose record says WRITING or LEASED held a store in flight when the daemon
  went away: its bytes cannot be trusted, so the record is cleared and the slot is
  free; so is a GRAVE (an evicted block kept for key mirrors): its key may have been
  stored again elsewhere, and recovering both would duplicate it.

Completion order makes this safe: a record turns READY only after every rank's copy
into the slot finished, and only on the loop thread, after the copy threads reported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
import numpy as np

from kvoffload.protocol.messages import KVLayout
from kvoffload.regionfmt import (
    FREE_OWNER,
    MAX_NAMESPACES,
    SLOT_FREE,
    SLOT_READY,
)

from .region import SharedOffloadRegion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveredNamespace:
    ns_id: int
    name: str
    fingerprint: str
    layout: KVLayout
    slot_bytes: int
    extents: list[int | None]  # by chunk (slot-id order); None: a hole
    blocks: list[tuple[int, bytes]]  # (slot, key) in completion order
    creator_uid: int = 0


def read_namespaces(region: SharedOffloadRegion) -> list[RecoveredNamespace]:
    """Everything a kept region says about its namespaces; clears in-flight records."""
    g = region.geometry
    extents = region.extent_records()
    table = region.slot_table
    out = []
    for ns_id in range(MAX_NAMESPACES):
        record = region.namespace_record(ns_id)
        if record is None:
            continue
        name, fingerprint, raw_layout, creator_uid = record
        try:
            layout = msgspec.msgpack.decode(raw_layout, type=KVLayout)
        except msgspec.DecodeError:
            log.warning("namespace %s: unreadable layout record, its blocks are dropped", name)
            continue
        mine = [e for e in range(g.num_extents) if extents[e, 0] == ns_id != FREE_OWNER]
        mine.sort(key=lambda e: int(extents[e, 2]))
        slot_bytes = int(extents[mine[0], 1]) if mine else 0
        by_chunk: list[int | None] = [None] * (int(extents[mine[-1], 2]) + 1 if mine else 0)
        for ext in mine:
            by_chunk[int(extents[ext, 2])] = ext
        blocks: list[tuple[int, int, bytes]] = []
        if mine:
            spe = g.extent_bytes // slot_bytes
            for chunk, ext in ((c, e) for c, e in enumerate(by_chunk) if e is not None):
                base = ext * g.slots_per_extent_max
                recs = table[base : base + spe]
                stale = np.flatnonzero((recs["state"] != SLOT_READY) & (recs["state"] != SLOT_FREE))
                table["state"][base + stale] = SLOT_FREE
                for j in np.flatnonzero((recs["state"] == SLOT_READY) & (recs["ns"] == ns_id)):
                    rec = recs[j]
                    key = bytes(rec["key"])[: int(rec["key_len"])]
                    blocks.append((int(rec["seq"]), chunk * spe + int(j), key))
        blocks.sort()
        out.append(
            RecoveredNamespace(
                ns_id,
                name,
                fingerprint,
                layout,
                slot_bytes,
                by_chunk,
                [(slot, key) for _, slot, key in blocks],
                creator_uid,
            )
        )
    return out
