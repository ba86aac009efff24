"""The region's on-memory format, shared by the daemon and by trusted client-copy workers.

The daemon owns the region and writes every table (``kvoffloadd.region.region``); a worker
that maps it (client-copy mode, or a daemon-copy worker's fallback for planned loads)
only reads the header, the extent table and slot records, to find where a slot lives
and to check, before and after copying, that the slot still holds what its lease or
its key says (``SlotCheck``). Layout, all little-endian::

    0                 header (4 KiB): magic, version, geometry, owner pid
    extent_table      num_extents x 16 B: owning namespace (u32, FREE=0xffffffff),
                      slot_bytes (u32), index among the owner's extents (u32), CRC (u32)
    namespace_table   max_namespaces x 2 KiB: name (256 B), fingerprint (64 B), layout
                      length (u32), creator uid (u32), layout (msgpack KVLayout), and
                      the record's CRC in its last 4 bytes
    slot_table        num_extents * slots_per_extent_max x 96 B records
    data              num_extents x extent_bytes, 2 MiB aligned

A slot record says what its slot holds:

- ``FREE``: nothing; ``LEASED``: handed to an engine for a store it has not claimed
  yet (``lease`` is the engine's lease token); ``WRITING``: a store of ``key`` in
  flight (``lease`` as well); ``READY``: the completed block of ``key``, ``seq`` its
  completion order; ``GRAVE``: an evicted block kept readable for engines whose key
  mirrors have not seen the eviction yet (never recovered after a restart).
- ``seq`` changes whenever a slot becomes READY, so a reader that sees the same
  READY/GRAVE record (key and seq) before and after its copy read bytes nobody
  rewrote in between: a slot is only rewritten after its record left READY/GRAVE.
  A store in flight has ``seq`` 0; a FREE record is all zeros.
- Every record a later daemon recovers carries a CRC-32 (``extent_crc``,
  ``namespace_crc``, ``ready_crc``: a slot's is written when it turns READY), so a
  record that changed since it was written is dropped, never believed.

Pure: no daemon import, no I/O beyond the mapping it is given.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

MAGIC = b"KVOFFLD\0"
FORMAT_VERSION = 3  # 3: CRCs in the extent, namespace and slot records
HEADER_BYTES = 4096
EXTENT_RECORD_BYTES = 16
NAMESPACE_RECORD_BYTES = 2048
NAMESPACE_LAYOUT_OFFSET = 328
SLOT_RECORD_BYTES = 96
MAX_NAMESPACES = 256
DATA_ALIGN_BYTES = 2 * 1024 * 1024
FREE_OWNER = 0xFFFFFFFF

# magic, version, header_bytes, region_bytes, extent_bytes, num_extents,
# slots_per_extent_max, min_slot_bytes, max_namespaces, extent_table, namespace_table,
# slot_table, slot_record_bytes, data_offset, owner_pid, created_ns
HEADER = struct.Struct("<8sIIQQIIIIQQQIQIQ")

SLOT_FREE, SLOT_WRITING, SLOT_READY, SLOT_LEASED, SLOT_GRAVE = 0, 1, 2, 3, 4
SLOT_DTYPE = np.dtype(
    [
        ("state", "u1"),
        ("key_len", "u1"),
        ("pad", "u2"),
        ("ns", "<u4"),
        ("seq", "<u8"),
        ("key", "V64"),
        ("lease", "<u8"),
        ("crc", "<u4"),
        ("reserved", "V4"),
    ]
)
assert SLOT_DTYPE.itemsize == SLOT_RECORD_BYTES
NAMESPACE_CRC_OFFSET = NAMESPACE_RECORD_BYTES - 4
MAX_LAYOUT_BYTES = NAMESPACE_CRC_OFFSET - NAMESPACE_LAYOUT_OFFSET
_EXTENT = struct.Struct("<IIII")
_READY = struct.Struct("<IQB")


def extent_crc(ext: int, owner: int, slot_bytes: int, chunk: int) -> int:
    """The CRC of an extent record: its fields and the extent's own index."""
    return zlib.crc32(_EXTENT.pack(ext, owner, slot_bytes, chunk))


def namespace_crc(record: bytes) -> int:
    """The CRC of a namespace record: every byte before the CRC itself."""
    return zlib.crc32(record[:NAMESPACE_CRC_OFFSET])


def ready_crc(ns: int, seq: int, key: bytes) -> int:
    """The CRC of a READY slot record: namespace, completion order and key."""
    return zlib.crc32(key, zlib.crc32(_READY.pack(ns, seq, len(key))))


I64 = npt.NDArray[np.int64]


class RegionFormatError(ValueError):
    """The mapping is not a region this library can read."""


@dataclass(frozen=True)
class RegionHeader:
    region_bytes: int
    extent_bytes: int
    num_extents: int
    slots_per_extent_max: int
    extent_table: int
    slot_table: int
    data_offset: int

    @staticmethod
    def parse(raw: bytes | memoryview) -> RegionHeader:
        if len(raw) < HEADER.size:
            raise RegionFormatError("the region is shorter than its header")
        f = HEADER.unpack_from(raw, 0)
        if f[0] != MAGIC:
            raise RegionFormatError("not a kvoffload region (bad magic)")
        if f[1] != FORMAT_VERSION:
            raise RegionFormatError(f"region format {f[1]}, this library reads {FORMAT_VERSION}")
        if f[12] != SLOT_RECORD_BYTES:
            raise RegionFormatError(f"slot records of {f[12]} bytes, expected {SLOT_RECORD_BYTES}")
        return RegionHeader(
            region_bytes=f[3],
            extent_bytes=f[4],
            num_extents=f[5],
            slots_per_extent_max=f[6],
            extent_table=f[9],
            slot_table=f[11],
            data_offset=f[13],
        )


class RegionTables:
    """Read-only views of a mapped region's extent and slot tables."""

    def __init__(self, buffer: npt.NDArray[np.uint8]) -> None:
        self.header = h = RegionHeader.parse(memoryview(buffer)[: HEADER.size])  # type: ignore[arg-type]
        if len(buffer) < h.region_bytes:
            raise RegionFormatError("the mapping is smaller than the region")
        self.extents: npt.NDArray[np.uint32] = np.frombuffer(
            buffer, dtype="<u4", count=h.num_extents * 4, offset=h.extent_table
        ).reshape(h.num_extents, 4)
        self.slots: npt.NDArray[np.void] = np.frombuffer(
            buffer,
            dtype=SLOT_DTYPE,
            count=h.num_extents * h.slots_per_extent_max,
            offset=h.slot_table,
        )

    def namespace_extents(self, ns: int) -> I64:
        """The namespace's extent of each of its chunks (-1: a hole, a chunk whose
        extent went back to the pool)."""
        owned = np.flatnonzero(self.extents[:, 0] == ns)
        chunks = self.extents[owned, 2].astype(np.int64)
        result: I64 = np.full(int(chunks.max()) + 1 if chunks.size else 0, -1, dtype=np.int64)
        result[chunks] = owned
        return result


class SlotMap:
    """Where one namespace's slots live in a region, as a client derives it.

    The map is rebuilt from the extent table whenever a slot lies beyond it (the
    namespace grew) or a record check fails (an extent moved).
    """

    def __init__(self, tables: RegionTables, ns: int, slot_bytes: int) -> None:
        self.tables = tables
        self.ns = ns
        self.slot_bytes = slot_bytes
        h = tables.header
        self.slots_per_extent = h.extent_bytes // slot_bytes
        self._extents: I64 = np.zeros(0, dtype=np.int64)

    def refresh(self) -> None:
        self._extents = self.tables.namespace_extents(self.ns)

    def _chunks(self, slots: I64) -> I64:
        chunks: I64 = slots // self.slots_per_extent
        if slots.size and not self._inside(slots, chunks):
            self.refresh()
            if not self._inside(slots, chunks):
                raise RegionFormatError(
                    f"slot {int(slots.max())} is outside namespace {self.ns}'s extents"
                )
        return chunks

    def _inside(self, slots: I64, chunks: I64) -> bool:
        if int(slots.min()) < 0 or int(chunks.max()) >= self._extents.size:
            return False
        return bool((self._extents[chunks] >= 0).all())

    def offsets(self, slots: I64) -> I64:
        """Byte offset of each slot from the region's start."""
        h = self.tables.header
        chunks = self._chunks(slots)  # may refresh the extent list
        ext = self._extents[chunks]
        result: I64 = (
            h.data_offset + ext * h.extent_bytes + (slots % self.slots_per_extent) * self.slot_bytes
        )
        return result

    def records(self, slots: I64) -> npt.NDArray[np.void]:
        """A copy of each slot's record."""
        chunks = self._chunks(slots)
        ext = self._extents[chunks]
        index = ext * self.tables.header.slots_per_extent_max + slots % self.slots_per_extent
        rows: npt.NDArray[np.void] = self.tables.slots[index]  # fancy indexing copies
        return rows


def keys_match(records: npt.NDArray[np.void], keys: list[bytes]) -> npt.NDArray[np.bool_]:
    """Which records hold exactly these keys (in order)."""
    out = np.zeros(len(keys), dtype=np.bool_)
    for i, (rec, key) in enumerate(zip(records, keys)):
        out[i] = int(rec["key_len"]) == len(key) and bytes(rec["key"])[: len(key)] == key
    return out
