"""The slot table as a namespace's journal: every slot state change, written into the
region as it happens, so that a later daemon can rebuild the index (recovery.py).

Rules:
- A slot's record lies at ``extent * slots_per_extent_max + slot_in_extent`` of the
  region's slot table (``kvoffload.datapath.regionfmt.SLOT_DTYPE``); a slot in a hole
  of its namespace is a broken invariant (AssertionError), and a batch with one wrong
  slot or key writes nothing.
- Records are written straight into the mapping, whole (a FREE record names no key a
  corrupt state byte could revive), on the loop thread only.
- A READY record's sequence number and CRC go in before its state byte: a daemon killed
  part way leaves each record either still in flight or whole.
- Where the C writer was built (``_slotrecords``, optional at install) a batch is one
  call; elsewhere (or with ``KVOFFLOAD_NO_NATIVE_JOURNAL=1``) Python writes the same
  bytes, a struct pack and a mapping write per record.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvoffload.datapath.regionfmt import (
    SLOT_DTYPE,
    SLOT_GRAVE,
    SLOT_LEASED,
    SLOT_READY,
    SLOT_RECORD_BYTES,
    SLOT_WRITING,
    ready_crc,
)
from kvoffloadd.region.segment import Geometry
from kvoffloadd.region.slots import SlotJournal, SlotPool

try:
    from kvoffloadd.region import _slotrecords
except ImportError as exc:  # built where a compiler was found at install time
    logging.getLogger(__name__).info("no C slot records (%s): the Python path writes them", exc)
    _slotrecords = None  # type: ignore[assignment]

BUILT = _slotrecords is not None  # whether the C writer was built
NATIVE = BUILT and not os.environ.get("KVOFFLOAD_NO_NATIVE_JOURNAL")

_EMPTY_RECORD = bytes(SLOT_RECORD_BYTES)
# SLOT_DTYPE's layout (state, key_len, pad, ns, seq, key, lease, crc, reserved), packed
_WRITING_RECORD = struct.Struct("<BBxxI8x64sQ8x")  # seq 0, key padded with NULs
_LEASED_RECORD = struct.Struct("<BxxxI8x64xQ8x")
assert _WRITING_RECORD.size == _LEASED_RECORD.size == SLOT_RECORD_BYTES == SLOT_DTYPE.itemsize
_FIELDS = SLOT_DTYPE.fields
assert _FIELDS is not None
_SEQ_FIELD, _SEQ_OFFSET = struct.Struct("<Q"), int(_FIELDS["seq"][1])
_CRC_FIELD, _CRC_OFFSET = struct.Struct("<I"), int(_FIELDS["crc"][1])
_READY_LOOP_MAX = 32  # records a READY batch writes one by one; numpy's per field above
if _slotrecords is not None:  # the C writer's record is this one
    assert _slotrecords.RECORD_BYTES == SLOT_RECORD_BYTES
    assert SLOT_DTYPE["key"].itemsize == _slotrecords.KEY_BYTES_MAX
    for _name in ("key_len", "ns", "seq", "key", "lease", "crc"):
        assert getattr(_slotrecords, "OFF_" + _name.upper()) == _FIELDS[_name][1], _name


class SlotTable(Protocol):
    """What a journal writes through (the region)."""

    geometry: Geometry
    slot_table: npt.NDArray[np.void]

    @property
    def mapping(self) -> mmap.mmap: ...
    def next_seqs(self, n: int) -> int: ...


def for_namespace(region: SlotTable, ns_id: int, slots: SlotPool) -> SlotJournal:
    """The journal of namespace ``ns_id`` (slots cut from its extents by ``slots``)."""
    cls = NativeJournal if NATIVE else RegionJournal
    return cls(region, ns_id, slots)


class RegionJournal(SlotJournal):
    """Writes one namespace's slot state changes into the region's slot table."""

    def __init__(self, region: SlotTable, ns_id: int, slots: SlotPool) -> None:
        self._region = region
        self._ns = ns_id
        self._slots = slots
        self._spe_max = region.geometry.slots_per_extent_max
        self._table_offset = region.geometry.slot_table

    def _record(self, slot: int) -> int:
        spe = self._slots.slots_per_extent
        ext = self._slots.extents[slot // spe]
        assert ext is not None, f"slot {slot} lies in a hole"
        return ext * self._spe_max + slot % spe

    def _records(self, slots: Sequence[int]) -> list[int]:
        """``_record`` of each slot, in one loop without a call per slot."""
        spe, exts, spe_max = self._slots.slots_per_extent, self._slots.extents, self._spe_max
        out = []
        for slot in slots:
            ext = exts[slot // spe]
            assert ext is not None, f"slot {slot} lies in a hole"
            out.append(ext * spe_max + slot % spe)
        return out

    def leased(self, slot: int, lease: int) -> None:
        self.leased_many((slot,), lease)

    def leased_many(self, slots: Sequence[int], lease: int) -> None:
        records = self._records(slots)
        self._write(records, [_LEASED_RECORD.pack(SLOT_LEASED, self._ns, lease)] * len(records))

    def writing(self, slot: int, key: bytes, lease: int = 0) -> None:
        self.writing_many((slot,), (key,), lease)

    def writing_many(self, slots: Sequence[int], keys: Sequence[bytes], lease: int = 0) -> None:
        pack, ns = _WRITING_RECORD.pack, self._ns
        self._write(self._records(slots), [pack(SLOT_WRITING, len(k), ns, k, lease) for k in keys])

    def _write(self, records: list[int], payloads: list[bytes]) -> None:
        """Whole records, straight into the mapping: a bytes copy each, no numpy call
        (the region's slot table is the same memory)."""
        mm, base, size = self._region.mapping, self._table_offset, SLOT_RECORD_BYTES
        for rec, payload in zip(records, payloads):
            at = base + rec * size
            mm[at : at + size] = payload

    def ready(self, slot: int, key: bytes) -> None:
        self.ready_many((slot,), (key,))

    def ready_many(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        """Each record's sequence number and CRC, then its state byte."""
        records = self._records(slots)
        ns, first = self._ns, self._region.next_seqs(len(records))
        if len(records) > _READY_LOOP_MAX:  # each field for the whole batch, state last
            table = self._region.slot_table
            seqs = range(first, first + len(records))
            table["seq"][records] = seqs
            table["crc"][records] = [ready_crc(ns, seq, key) for seq, key in zip(seqs, keys)]
            table["state"][records] = SLOT_READY
            return
        # an engine step's few records: straight into the mapping, no numpy call
        mm, base, size = self._region.mapping, self._table_offset, SLOT_RECORD_BYTES
        put_seq, put_crc = _SEQ_FIELD.pack_into, _CRC_FIELD.pack_into
        for seq, (rec, key) in enumerate(zip(records, keys), first):
            at = base + rec * size
            put_seq(mm, at + _SEQ_OFFSET, seq)
            put_crc(mm, at + _CRC_OFFSET, ready_crc(ns, seq, key))
            mm[at] = SLOT_READY

    def buried(self, slot: int) -> None:
        self._region.slot_table["state"][self._record(slot)] = SLOT_GRAVE

    def freed(self, slot: int) -> None:
        self.freed_many((slot,))

    def freed_many(self, slots: Sequence[int]) -> None:
        records = self._records(slots)
        self._write(records, [_EMPTY_RECORD] * len(records))


class NativeJournal(RegionJournal):
    """The same records, a batch per call of the C writer."""

    def __init__(self, region: SlotTable, ns_id: int, slots: SlotPool) -> None:
        super().__init__(region, ns_id, slots)
        assert _slotrecords is not None, "the C slot record writer is not built"
        self._c = _slotrecords

    def _table(self) -> tuple[mmap.mmap, int, int, list[int | None], int]:
        """Where the namespace's records lie: the C writer's first arguments."""
        pool = self._slots
        return (self._region.mapping, self._table_offset, pool.slots_per_extent,
                pool.extents, self._spe_max)  # fmt: skip

    def leased_many(self, slots: Sequence[int], lease: int) -> None:
        self._c.leased(*self._table(), slots, self._ns, lease)

    def writing_many(self, slots: Sequence[int], keys: Sequence[bytes], lease: int = 0) -> None:
        self._c.writing(*self._table(), slots, keys, self._ns, lease)

    def ready_many(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        first = self._region.next_seqs(len(slots))
        self._c.ready(*self._table(), slots, keys, self._ns, first)

    def freed_many(self, slots: Sequence[int]) -> None:
        self._c.freed(*self._table(), slots)
