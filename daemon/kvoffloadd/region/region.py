"""SharedOffloadRegion: one POSIX shared-memory segment holding every offloaded block.

The format (header, extent, namespace and slot tables, data area; the slot record
states FREE, LEASED, WRITING, READY and GRAVE) is ``kvoffload.datapath.regionfmt``, shared with
the workers that map the region. A slot's record lives at
``extent * slots_per_extent_max + slot_in_extent``. The tables describe every
completed store, so a later daemon can rebuild the index from the segment alone (warm
restart); records are written on the loop thread when a slot changes state.

Rules:
- One daemon per region: the daemon holds an exclusive ``flock`` on the segment itself
  for its lifetime (trust.py). A segment found under the name without the lock held
  belongs to a daemon that stopped or died.
- The daemon maps the segment regionstate.py found or made under its private name,
  checked and held (segment.py). Given only a name (tests, tools), a found segment is
  checked on the descriptor it is used through: only a regular file owned by the
  daemon's uid with no group or other permission is ever adopted (an attacker's
  pre-created segment is refused, or dropped with ``discard``). It is recovered when
  its header and size match this format and geometry (warm restart, see
  ``recovery.py``), refused otherwise unless ``discard``.
- Workers get a fresh open of the daemon's own descriptor, never of the name, and
  nobody opens the segment with a size: that would ftruncate it under everybody else
  (research/stack.md section 5).
- Populating (pre-faulting) runs in background threads (populate.py), chunk by chunk
  as placement.py plans them, so start-up does not wait; the extent pool hands out
  ready chunks first and pinning (pinning.py) follows population chunk by chunk.
- ``close()`` drops every view before closing the map, then unlinks the name unless
  asked to keep it for the next daemon.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import posix_ipc

from kvoffload.cuda.driver import CudaApi
from kvoffload.datapath.regionfmt import (
    FREE_OWNER,
    HEADER,
    MAX_LAYOUT_BYTES,
    MAX_NAMESPACES,
    NAMESPACE_CRC_OFFSET,
    NAMESPACE_LAYOUT_OFFSET,
    NAMESPACE_RECORD_BYTES,
    SLOT_DTYPE,
    SLOT_RECORD_BYTES,
    extent_crc,
    namespace_crc,
)
from kvoffloadd.region import journal, kernel, segment
from kvoffloadd.region.allocator import ExtentPool
from kvoffloadd.region.pinning import RegionPinner
from kvoffloadd.region.placement import (
    ChunkStates,
    ExtentPlacement,
    Part,
    RegionPlan,
    chunk_size,
    plan_region,
)
from kvoffloadd.region.populate import Populator
from kvoffloadd.region.progress import node_statistics, population_statistics
from kvoffloadd.region.segment import Geometry, RegionError, default_extent_bytes, header_fields
from kvoffloadd.region.slots import SlotJournal, SlotPool
from kvoffloadd.region.topology import Topology
from kvoffloadd.trust import UntrustedError

__all__ = ["Geometry", "RegionError", "SharedOffloadRegion", "default_extent_bytes"]

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 2 << 30


class Segment(Protocol):
    """An open region file (segment.SegmentFile, or posix_ipc's SharedMemory)."""

    @property
    def fd(self) -> int: ...
    def close_fd(self) -> None: ...
    def unlink(self) -> None: ...


def single_plan(g: Geometry, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> RegionPlan:
    """One part, one populate thread: no NUMA placement."""
    chunk = chunk_size(chunk_bytes, g.extent_bytes, g.page_bytes)
    return plan_region(g.data_bytes, chunk, [Part(None, 0, frozenset())], 1, "off")


class SharedOffloadRegion:
    """The daemon's mapping of the region, its tables and the extent pool."""

    def __init__(
        self,
        name: str,
        geometry: Geometry,
        *,
        recover: bool = True,
        discard: bool = False,
        found: tuple[Segment, bool] | None = None,
        plan: RegionPlan | None = None,
        topology: Topology | None = None,
    ) -> None:
        """Map the segment ``found`` (held, checked: regionstate.py) and whether it is
        recovered; without it, adopt or create the segment under ``name``. ``plan``:
        how the data area is placed and populated (default: one part)."""
        self.name = name
        self.geometry = g = geometry
        self.plan = plan or single_plan(g)
        self._shm, self.recovered = found or _open_by_name(name, g, recover, discard)
        try:
            self._mm = mmap.mmap(self._shm.fd, g.region_bytes)
        except BaseException:
            self._shm.close_fd()
            if not self.recovered:
                self._shm.unlink()
            raise
        self.buffer: npt.NDArray[np.uint8] = np.frombuffer(self._mm, dtype=np.uint8)
        self.slot_table: npt.NDArray[np.void] = np.frombuffer(
            self._mm,
            dtype=SLOT_DTYPE,
            count=g.num_extents * g.slots_per_extent_max,
            offset=g.slot_table,
        )
        self._extent_table = np.frombuffer(
            self._mm, dtype="<u4", count=g.num_extents * 4, offset=g.extent_table
        ).reshape(g.num_extents, 4)
        if not self.recovered:
            self._extent_table[:, 0] = FREE_OWNER
        self._write_header()
        owners: list[int | None] = [
            None if o == FREE_OWNER else int(o) for o in self._extent_table[:, 0].tolist()
        ]
        self.chunk_states = ChunkStates(
            len(self.plan.chunks), self.plan.chunk_bytes // g.extent_bytes, g.num_extents
        )
        self.chunk_states.assume_populated()  # until a population is planned
        self.placement = ExtentPlacement(
            self.plan, g.extent_bytes, g.num_extents, self.chunk_states, topology
        )
        self._extents_of_part = [
            [e for e, q in enumerate(self.placement.part_of_extent) if q == p]
            for p in range(len(self.plan.parts))
        ]
        self.pool = ExtentPool(
            g.num_extents,
            g.extent_bytes,
            g.data_offset,
            self.record_extent,
            owners,
            placement=self.placement,
        )
        self._seq = 0  # recovery resumes it (recovery.py)
        self.populator: Populator | None = None
        self.pinner: RegionPinner | None = None

    # ------------------------------------------------------------ lifecycle

    def _write_header(self) -> None:
        self._mm[: HEADER.size] = HEADER.pack(*header_fields(self.geometry))

    @property
    def data_address(self) -> int:
        return int(self.buffer.ctypes.data) + self.geometry.data_offset

    def prepare_populate(self, *, huge_advise: bool = False) -> Populator:
        """Plan population (started by ``start_populate``): until then no chunk counts
        as populated, and a pinner waits for each. Without it every chunk counts as
        populated (``prefault = false``: pages are faulted as copies reach them)."""
        g = self.geometry
        base = int(self.buffer.ctypes.data)
        # mincore sees a tmpfs file's pages wherever they are mapped, hugetlbfs pages
        # only where this process maps them: a whole file needs no asking
        whole = segment.allocated_bytes(self._shm) >= g.region_bytes
        self.chunk_states.reset()
        self.populator = Populator(
            base + g.data_offset,
            self.plan,
            self.chunk_states,
            page_bytes=g.page_bytes,
            recovered=self.recovered,
            huge_advise=huge_advise,
            tail=(base, g.data_offset),
            unit_bytes=g.extent_bytes,
            resident=(lambda address, n: n) if whole else kernel.resident_bytes,
        )
        return self.populator

    def start_populate(self, *, huge_advise: bool = False) -> None:
        """Populate the data area in the background (then the tables), as planned."""
        if self.populator is None:
            self.prepare_populate(huge_advise=huge_advise)
        assert self.populator is not None
        self.populator.start()

    def start_prefault(self) -> None:
        self.start_populate()

    @property
    def prefaulted_bytes(self) -> int:
        return self.populator.populated_bytes if self.populator is not None else 0

    @property
    def prefaulting(self) -> bool:
        return self.populator is not None and self.populator.running

    def wait_prefault(self) -> None:
        """Block until the background population (if any) has finished or stopped."""
        if self.populator is not None:
            self.populator.wait()

    def wait_chunk(self, chunk: int, timeout_s: float | None = None) -> bool | None:
        """Until ``chunk`` is populated and mapped (True); False if it will not be;
        None: timeout. Without population, every chunk counts as populated (pinning
        faults it in)."""
        if self.populator is None:
            return True
        return self.chunk_states.wait_mapped(chunk, timeout_s)

    def make_pinner(self, api: CudaApi) -> RegionPinner:
        """A pinner of the data area in the plan's chunks, following population."""
        states = self.chunk_states
        self.pinner = RegionPinner(
            api,
            self.data_address,
            self.plan.chunks,
            wait_chunk=self.wait_chunk,
            on_pinned=states.mark_pinned,
            on_stopped=states.stop_pinning,
        )
        return self.pinner

    def start_pinning(self) -> None:
        """Pin in the background; until a chunk is pinned, it is not ready."""
        assert self.pinner is not None
        self.chunk_states.track_pinning()
        self.pinner.start()

    def statistics(self) -> dict[str, Any]:
        """The population fields of the ``region`` stats section (progress.py)."""
        return population_statistics(
            self.plan, self.chunk_states, self.populator, self.pool, self.geometry
        )

    def node_statistics(self) -> dict[str, dict[str, Any]]:
        """Per NUMA part: its node's bytes, populated, ready and pinned, and rates."""
        return node_statistics(
            self.plan, self.chunk_states, self.populator, self.pool, self._extents_of_part
        )

    def open_fd(self) -> int:
        """A new descriptor of the region, for a trusted client-copy worker to map.

        A fresh open, never a ``dup``: a dup shares the open file description and
        with it the region's lock, so a client's mapping would keep the region
        locked after the daemon died and block the warm restart. It opens the
        daemon's own descriptor (``/proc/self/fd``), never the name: whatever a name
        leads to by now, the worker gets the segment the daemon maps.
        """
        return os.open(f"/proc/self/fd/{self._shm.fd}", os.O_RDWR | os.O_CLOEXEC)

    def close(self, unlink: bool = True) -> None:
        if self.populator is not None:
            self.populator.stop()
        del self.buffer, self.slot_table, self._extent_table
        try:
            self._mm.close()
        except BufferError:
            log.warning("region views still exist; the mapping goes with the process")
        self._shm.close_fd()
        if unlink:
            with contextlib.suppress(FileNotFoundError, posix_ipc.ExistentialError):
                self._shm.unlink()
        else:
            log.info("kept region %s for the next daemon", self.name)

    # ------------------------------------------------------------ tables

    def register_namespace(
        self, ns_id: int, name: str, fingerprint: str, layout: bytes, uid: int = 0
    ) -> None:
        if ns_id >= MAX_NAMESPACES:
            raise RegionError(f"more than {MAX_NAMESPACES} namespaces")
        if len(layout) > MAX_LAYOUT_BYTES:
            raise RegionError(f"namespace layout of {len(layout)} bytes does not fit its record")
        self.placement.forget(ns_id)
        off = self.geometry.namespace_table + ns_id * NAMESPACE_RECORD_BYTES
        record = (
            name.encode()[:256].ljust(256, b"\0")
            + fingerprint.encode()[:64].ljust(64, b"\0")
            + struct.pack("<II", len(layout), uid)
            + layout
        ).ljust(NAMESPACE_CRC_OFFSET, b"\0")
        record += struct.pack("<I", namespace_crc(record))
        self._mm[off : off + NAMESPACE_RECORD_BYTES] = record

    def unregister_namespace(self, ns_id: int) -> None:
        off = self.geometry.namespace_table + ns_id * NAMESPACE_RECORD_BYTES
        self._mm[off : off + NAMESPACE_RECORD_BYTES] = bytes(NAMESPACE_RECORD_BYTES)

    def namespace_record(self, ns_id: int) -> tuple[str, str, bytes, int] | None:
        """(name, fingerprint, msgpack layout, creator uid) of a namespace table entry;
        ``ValueError`` for one that cannot be read back as written (recovery drops it)."""
        off = self.geometry.namespace_table + ns_id * NAMESPACE_RECORD_BYTES
        raw = self._mm[off : off + NAMESPACE_RECORD_BYTES]
        if not raw.strip(b"\0"):
            return None
        if struct.unpack_from("<I", raw, NAMESPACE_CRC_OFFSET)[0] != namespace_crc(raw):
            raise ValueError("CRC mismatch")
        name = raw[:256].split(b"\0", 1)[0].decode()
        n, uid = struct.unpack_from("<II", raw, 320)
        if n > MAX_LAYOUT_BYTES:
            raise ValueError("layout longer than its record")
        layout = raw[NAMESPACE_LAYOUT_OFFSET : NAMESPACE_LAYOUT_OFFSET + n]
        return name, raw[256:320].rstrip(b"\0").decode(), layout, uid

    def extent_records(self) -> npt.NDArray[np.uint32]:
        """(owner, slot_bytes, chunk index, CRC) per extent (a copy)."""
        table: npt.NDArray[np.uint32] = self._extent_table.copy()
        return table

    def record_extent(self, ext: int, owner: int | None, slot_bytes: int, chunk: int) -> None:
        """An extent changes hands: its slot records are cleared both ways, so no owner
        inherits a record (even one a corrupt table left in a free extent)."""
        g = self.geometry
        start = g.slot_table + ext * g.slots_per_extent_max * SLOT_RECORD_BYTES
        self.buffer[start : start + g.slots_per_extent_max * SLOT_RECORD_BYTES] = 0
        self._write_extent(ext, FREE_OWNER if owner is None else owner, slot_bytes, chunk)

    def renumber_extent(self, ext: int, chunk: int) -> None:
        """Recovery: the extent's place among its owner's, records kept."""
        owner, slot_bytes = (int(v) for v in self._extent_table[ext, :2])
        self._write_extent(ext, owner, slot_bytes, chunk)

    def _write_extent(self, ext: int, owner: int, slot_bytes: int, chunk: int) -> None:
        crc = extent_crc(ext, owner, slot_bytes, chunk)
        self._extent_table[ext] = (owner, slot_bytes, chunk, crc)

    @property
    def mapping(self) -> mmap.mmap:
        """The segment's mapping (the journal writes slot records straight into it)."""
        return self._mm

    def journal_for(self, ns_id: int, slots: SlotPool) -> SlotJournal:
        return journal.for_namespace(self, ns_id, slots)

    def next_seq(self) -> int:
        return self.next_seqs(1)

    def next_seqs(self, n: int) -> int:
        """Take ``n`` completion numbers in a row; returns the first."""
        first = self._seq + 1
        self._seq += n
        return first

    def resume_seq(self, last: int) -> None:
        """Recovery: completion order goes on after the highest recovered record."""
        self._seq = last


def _open_by_name(name: str, g: Geometry, recover: bool, discard: bool) -> tuple[Segment, bool]:
    """Adopt the segment under ``name`` if it is ours and a region of ``g``, or create
    it; one that is not is refused, or dropped with ``discard`` (tests and tools: the
    daemon finds its region through its private state, regionstate.py)."""
    old = None
    try:
        old = segment.find(name)
        if old is not None:
            segment.check_ours(old, name)
    except UntrustedError as exc:
        if old is not None:
            old.close_fd()
            old = None
        if not discard:
            raise RegionError(str(exc)) from None
        log.warning("discarding %s: %s", name, exc)
        try:
            segment.drop(name)
        except PermissionError:
            raise RegionError(f"{exc}; and this daemon may not remove it") from None
    if old is not None:
        segment.lock(old, name)  # a live daemon's region is never touched
        why = segment.problem(old, g)
        if recover and why is None:
            return old, True
        old.close_fd()
        if not (discard or not recover):
            raise RegionError(
                f"{name} {why}, which this daemon cannot reuse with "
                f"region_size={g.region_bytes} and extent_size={g.extent_bytes}; start "
                "with the old sizes to keep its blocks, or with --discard-region to drop it"
            )
        log.warning("discarding %s: it %s", name, why or "is not recovered")
        segment.drop(name)
    return segment.create(name, g), False
