"""Warm restart: rebuild namespaces and their indexes from a kept region's tables.

A daemon that stops with ``keep_region`` or dies (even by SIGKILL) leaves the region
and its tables behind. The next daemon of the same instance reads them back:

- every namespace of the namespace table comes back with its name, fingerprint and
  layout, and owns the same extents in the same chunks (holes included: an extent
  given back from the middle leaves one), so slot ids are unchanged;
- every slot whose record says READY is a completed store: its key becomes visible
  again, in the order stores completed (``seq``), which is the LRU order;
- a slot whose record says WRITING or LEASED held a store in flight when the daemon
  went away: its bytes cannot be trusted, so the record is cleared and the slot is
  free; so is a GRAVE (an evicted block kept for key mirrors): its key may have been
  stored again elsewhere, and recovering both would duplicate it.

Completion order makes this safe: a record turns READY only after every rank's copy
into the slot finished, and only on the loop thread, after the copy threads reported.

Nothing read back is trusted. The tables are shared memory that trusted copiers map
read-write, and a crash or a bug can leave anything there, so every record is checked
against the geometry and the other records before use, and one that fails is dropped
whole, never half used (the daemon starts either way):

- an extent, namespace or READY slot record must match its CRC-32 (``regionfmt``);
  the checks below then hold even against a record written whole with wrong values;
- a namespace record needs a UTF-8 name and fingerprint, a layout that decodes, passes
  the checks of an open (``slot_bytes_of``, from the namespace table) and hashes to
  its fingerprint, and a slot size that fits an extent; a name that two records hold
  is dropped from both;
- an extent counts for a namespace only if its record names a recovered namespace,
  that namespace's slot size and a chunk below the region's extent count; the chunks
  between are holes, as the allocator left them; an extent whose chunk another holds
  too moves to the first free chunk (its records still pair each key with its bytes),
  so the daemon and the workers' ``SlotMap`` agree; every other owned extent goes back
  to the pool, its slot records cleared;
- a READY record counts only inside its namespace's extent (below its slots per
  extent), with its namespace's id, a key of 1..64 bytes and a sequence number in
  1..``MAX_SEQ`` (a store in flight has 0); a key READY in two slots of one namespace
  is dropped from both, since which one holds its bytes is unknown; every record that
  is not recovered is cleared, and the sequence resumes after the highest kept;
- one error line says what was dropped and why.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from kvoffload.datapath.regionfmt import (
    FREE_OWNER,
    MAX_NAMESPACES,
    SLOT_DTYPE,
    SLOT_READY,
    extent_crc,
    ready_crc,
)
from kvoffload.protocol.errors import KVOffloadError
from kvoffload.protocol.messages import MAX_KEY_BYTES, KVLayout
from kvoffloadd.region.region import SharedOffloadRegion

log = logging.getLogger(__name__)

MAX_SEQ = 1 << 62  # far beyond any real count of stores, far below the u64 field's end

# The namespace table's checks for a recovered record: its slot size, or an exception.
SlotBytesOf = Callable[[str, KVLayout], int]


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


@dataclass(frozen=True)
class _Entry:
    name: str
    fingerprint: str
    layout: KVLayout
    slot_bytes: int
    creator_uid: int


def read_namespaces(
    region: SharedOffloadRegion, slot_bytes_of: SlotBytesOf
) -> list[RecoveredNamespace]:
    """What a kept region says about its namespaces, checked record by record; clears
    in-flight and corrupt records and frees the extents no recovered namespace owns."""
    dropped: Counter[str] = Counter()
    entries = _namespace_entries(region, slot_bytes_of, dropped)
    owned = _claim_extents(region, entries, dropped)
    out = []
    last_seq = 0
    for ns_id, e in entries.items():
        blocks = _ready_blocks(region, ns_id, e.slot_bytes, owned.get(ns_id, []), dropped)
        last_seq = max([last_seq] + [seq for seq, _, _ in blocks])
        out.append(
            RecoveredNamespace(
                ns_id,
                e.name,
                e.fingerprint,
                e.layout,
                e.slot_bytes,
                owned.get(ns_id, []),
                [(slot, key) for _, slot, key in blocks],
                e.creator_uid,
            )
        )
    region.resume_seq(last_seq)
    if dropped:
        log.error(
            "the kept region held corrupt records, dropped: %s",
            "; ".join(f"{n} {why}" for why, n in sorted(dropped.items())),
        )
    return out


def _namespace_entries(
    region: SharedOffloadRegion, slot_bytes_of: SlotBytesOf, dropped: Counter[str]
) -> dict[int, _Entry]:
    extent_bytes = region.geometry.extent_bytes
    entries: dict[int, _Entry] = {}
    for ns_id in range(MAX_NAMESPACES):
        try:
            record = region.namespace_record(ns_id)
            if record is None:
                continue
            name, fingerprint, raw_layout, uid = record
            layout = msgspec.msgpack.decode(raw_layout, type=KVLayout)
            if layout.fingerprint() != fingerprint:
                raise ValueError("layout does not match its fingerprint")
            slot_bytes = slot_bytes_of(name, layout)
            if not 0 < slot_bytes <= extent_bytes:
                raise ValueError("slot larger than an extent")
        except (ValueError, KVOffloadError) as exc:  # msgspec's errors are ValueErrors
            dropped[f"namespace records ({_reason(exc)})"] += 1
            region.unregister_namespace(ns_id)
            continue
        entries[ns_id] = _Entry(name, fingerprint, layout, slot_bytes, uid)
    held = Counter(e.name for e in entries.values())
    for ns_id in [i for i, e in entries.items() if held[e.name] > 1]:
        dropped["namespace records (a name held twice)"] += 1
        region.unregister_namespace(ns_id)
        del entries[ns_id]
    return entries


def _reason(exc: Exception) -> str:
    if isinstance(exc, msgspec.MsgspecError):
        return "unreadable layout"
    if isinstance(exc, UnicodeError):
        return "not UTF-8"
    if isinstance(exc, KVOffloadError):
        return "refused by the namespace rules"
    return str(exc)


def _claim_extents(
    region: SharedOffloadRegion, entries: dict[int, _Entry], dropped: Counter[str]
) -> dict[int, list[int | None]]:
    """Each recovered namespace's extents by chunk (None: a hole); every other owned
    extent is given back to the pool."""
    table = region.extent_records()
    claims: dict[int, list[tuple[int, int]]] = {}
    for ext in range(region.geometry.num_extents):
        owner, slot_bytes, chunk, crc = (int(v) for v in table[ext])
        if owner == FREE_OWNER:
            continue
        entry = entries.get(owner)
        why = ""
        if crc != extent_crc(ext, owner, slot_bytes, chunk):
            why = "CRC mismatch"
        elif entry is None:
            why = "no recovered owner"
        elif slot_bytes != entry.slot_bytes:
            why = "a wrong slot size"
        elif not 0 <= chunk < region.geometry.num_extents:
            why = "a chunk past the region"
        if why:
            dropped[f"extents ({why})"] += 1
            region.pool.give_back(ext)
            continue
        claims.setdefault(owner, []).append((chunk, ext))
    owned: dict[int, list[int | None]] = {}
    for ns_id, chunks in claims.items():
        chunks.sort()
        by_chunk: list[int | None] = [None] * (chunks[-1][0] + 1)
        moved: list[int] = []
        for chunk, ext in chunks:
            if by_chunk[chunk] is None:
                by_chunk[chunk] = ext
            else:  # a chunk claimed twice: its slot records still hold their keys
                moved.append(ext)
        free = 0  # no chunk below it is free: one pass over by_chunk for all moves
        for ext in moved:  # into the first free chunk; keys keep their bytes
            dropped["extents (a chunk claimed twice: moved)"] += 1
            while free < len(by_chunk) and by_chunk[free] is not None:
                free += 1
            if free == len(by_chunk):
                by_chunk.append(None)
            by_chunk[free] = ext
            region.renumber_extent(ext, free)
        owned[ns_id] = by_chunk
    return owned


def _ready_blocks(
    region: SharedOffloadRegion,
    ns_id: int,
    slot_bytes: int,
    extents: list[int | None],
    dropped: Counter[str],
) -> list[tuple[int, int, bytes]]:
    """(seq, slot, key) of the namespace's valid READY records, oldest first; every
    other record of its extents is cleared."""
    g = region.geometry
    spe = g.extent_bytes // slot_bytes
    table = region.slot_table
    found: list[tuple[int, int, bytes]] = []
    where: dict[bytes, list[int]] = {}  # key -> record indexes
    for chunk, ext in enumerate(extents):
        if ext is None:
            continue  # a hole
        base = ext * g.slots_per_extent_max
        recs = table[base : base + g.slots_per_extent_max]
        ready = recs["state"] == SLOT_READY
        keep = ready & (recs["ns"] == ns_id)
        keep &= (recs["key_len"] >= 1) & (recs["key_len"] <= MAX_KEY_BYTES)
        keep &= (recs["seq"] >= 1) & (recs["seq"] <= MAX_SEQ)
        keep[spe:] = False
        if n := int((ready & ~keep).sum()):
            dropped["slot records (READY outside the rules)"] += n
        for j in np.flatnonzero(keep).tolist():
            rec = recs[j]
            key, seq = bytes(rec["key"])[: int(rec["key_len"])], int(rec["seq"])
            if int(rec["crc"]) != ready_crc(ns_id, seq, key):
                dropped["slot records (CRC mismatch)"] += 1
                keep[j] = False
                continue
            found.append((seq, chunk * spe + j, key))
            where.setdefault(key, []).append(base + j)
        clear = np.flatnonzero(~keep)
        recs[clear] = np.zeros(clear.size, SLOT_DTYPE)
    twice = {key for key, at in where.items() if len(at) > 1}
    if twice:
        for key in twice:
            dropped["slot records (a key READY twice)"] += len(where[key])
            for i in where[key]:
                table[i] = np.zeros(1, SLOT_DTYPE)[0]
        found = [f for f in found if f[2] not in twice]
    found.sort()
    return found
