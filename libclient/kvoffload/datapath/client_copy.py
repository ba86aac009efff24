"""Copies a worker runs itself, through its own mapping of the region.

Client-copy workers (plain CPU tensors, vLLM's CPU backend) copy every job this way;
daemon-copy workers of trusted uids hold a mapping too, as the fallback that lets a
planned load complete while the daemon is away (the region outlives the daemon).

Rules:
- Only uids the daemon's config trusts (``client_copy_uids``/``client_copy_gids``) get
  the region's descriptor: a process that maps it can read and write every block.
- The daemon still owns all metadata. A blocking client-copy job is validated by the
  daemon, which answers with the copy runs (``run_plan``). A local job plans its runs
  itself from the region's own tables (``kvoffload.datapath.regionfmt``) and checks the slot
  records: a store writes only slots whose record says LEASED or WRITING under the
  engine's lease token; a load reads only slots whose record holds its key, READY or
  GRAVE, and checks the record again after copying (``SlotChanged`` otherwise, and the
  bytes copied must not be used).
- Engine block ids are bounds-checked against the caches before any copy.
- Copies run in the calling thread (``kvoffload.datapath.memruns``: the GIL is released), or with
  ``copy`` when given (CUDA caches: driver copies from the mapping).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.datapath.canonical import CanonicalPart
from kvoffload.datapath.copyplan import check_transfer, select_caches
from kvoffload.datapath.memruns import copy_runs
from kvoffload.datapath.regionfmt import (
    SLOT_GRAVE,
    SLOT_LEASED,
    SLOT_READY,
    SLOT_WRITING,
    RegionFormatError,
    RegionTables,
    SlotMap,
    keys_match,
)
from kvoffload.datapath.runs import CacheGeometry, Placement, build_runs
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import InvalidArgumentError, KVOffloadError
from kvoffload.protocol.messages import KVLayout
from kvoffload.protocol.packing import unpack_ids

I64 = npt.NDArray[np.int64]
CopyFn = Callable[[I64, I64, I64], None]  # (dst addresses, src addresses, lengths)


class SlotChanged(KVOffloadError):
    """A slot no longer holds what the job was planned for."""


def describe_plain_cache(tensor: Any) -> tuple[m.CacheDesc, int]:
    """(descriptor, base address) of a plain 2-D CPU tensor with contiguous rows."""
    if getattr(tensor, "is_cuda", False) or tensor.device.type != "cpu":
        raise InvalidArgumentError("client-copy mode takes CPU tensors only")
    if tensor.dim() != 2 or tensor.stride(1) != 1:
        raise InvalidArgumentError(
            "a KV cache must be a 2-D (num_blocks, page) view with contiguous rows"
        )
    esize = tensor.element_size()
    desc = m.CacheDesc(
        kind="client",
        num_blocks=int(tensor.shape[0]),
        page_bytes=int(tensor.shape[1]) * esize,
        row_stride_bytes=int(tensor.stride(0)) * esize,
    )
    return desc, int(tensor.data_ptr())


class RegionMapping:
    """The region, mapped from the descriptor the daemon sent with ``WorkerAttached``."""

    def __init__(self, fd: int, region_bytes: int) -> None:
        try:
            if os.fstat(fd).st_size < region_bytes:
                raise InvalidArgumentError("the region descriptor is smaller than the region")
            self._mm = mmap.mmap(fd, region_bytes)
        finally:
            os.close(fd)
        self._view = np.frombuffer(self._mm, dtype=np.uint8)
        self.base_address = int(self._view.ctypes.data)
        self.tables = RegionTables(self._view)

    def run_plan(self, plan: m.CopyPlanReply, cache_bases: list[int], is_store: bool) -> int:
        """Execute the runs of one daemon-validated job; returns the bytes copied."""
        region = unpack_ids(plan.region) + self.base_address
        which = unpack_ids(plan.cache_index)
        bases = np.asarray(cache_bases, dtype=np.int64)
        cache = unpack_ids(plan.cache) + (bases[which] if which.size else 0)
        nbytes = unpack_ids(plan.nbytes)
        dst, src = (region, cache) if is_store else (cache, region)
        copy_runs(dst, src, nbytes)
        return int(nbytes.sum())


class LocalCopies:
    """One worker's copies planned and run on its side of the region."""

    def __init__(
        self,
        layout: KVLayout,
        rank: int,
        geometries: list[CacheGeometry],
        bases: list[int],
        ns_id: int,
        slot_bytes: int,
        region: RegionMapping,
        copy: CopyFn = copy_runs,
        canonical: Sequence[CanonicalPart] = (),
    ) -> None:
        from kvoffload.datapath.copyplan import place_caches

        self.layout, self.rank, self.region = layout, rank, region
        self._geometries, self._bases = geometries, np.asarray(bases, dtype=np.int64)
        pages = [g.page_bytes for g in geometries]
        self._placements: list[Placement] = place_caches(layout, pages, canonical)
        self._slots = SlotMap(region.tables, ns_id, slot_bytes)
        self._copy = copy

    def _runs(
        self, slots: I64, ids: I64, skip: int, caches: Sequence[int], store: bool = False
    ) -> tuple[I64, I64, I64]:
        chosen = select_caches(len(self._geometries), list(caches))
        geoms = [self._geometries[i] for i in chosen]
        check_transfer(self.layout, slots.size, ids, skip, geoms)
        try:
            offsets = self._slots.offsets(slots)
        except RegionFormatError as exc:
            raise SlotChanged(str(exc)) from None
        placements = [self._placements[i] for i in chosen]
        runs = build_runs(
            self.layout, self.rank, offsets, ids, skip, geoms, placements, slots if store else None
        )
        cache = runs.cache + self._bases[chosen][runs.which]
        return runs.region + self.region.base_address, cache, runs.nbytes

    def store(self, slots: I64, ids: I64, caches: Sequence[int], lease: int) -> int:
        """Copy engine blocks into leased slots; SlotChanged if a slot is not ours."""
        region, cache, nbytes = self._runs(slots, ids, 0, caches, store=True)
        recs = self._records(slots)
        state = recs["state"]
        mine = ((state == SLOT_LEASED) | (state == SLOT_WRITING)) & (recs["lease"] == lease)
        if lease == 0 or not bool(mine.all()):
            raise SlotChanged("a slot of this store is no longer leased to its engine")
        self._copy(region, cache, nbytes)
        return int(nbytes.sum())

    def load(
        self, slots: I64, ids: I64, skip: int, caches: Sequence[int], keys: list[bytes]
    ) -> int:
        """Copy the keys' blocks into engine blocks; SlotChanged if a slot does not hold
        its key before the copy or was rewritten during it."""
        region, cache, nbytes = self._runs(slots, ids, skip, caches)
        before = self._holding(slots, keys)
        self._copy(cache, region, nbytes)
        after = self._holding(slots, keys)
        if not np.array_equal(before["seq"], after["seq"]):
            raise SlotChanged("a slot was rewritten while it was being read")
        return int(nbytes.sum())

    def _records(self, slots: I64) -> npt.NDArray[np.void]:
        try:
            return self._slots.records(slots)
        except RegionFormatError as exc:  # its extent went back to the pool
            raise SlotChanged(str(exc)) from None

    def _holding(self, slots: I64, keys: list[bytes]) -> npt.NDArray[np.void]:
        recs = self._records(slots)
        state = recs["state"]
        held = ((state == SLOT_READY) | (state == SLOT_GRAVE)) & keys_match(recs, keys)
        if not bool(held.all()):
            self._slots.refresh()  # an extent may have moved: look once more
            recs = self._records(slots)
            state = recs["state"]
            held = ((state == SLOT_READY) | (state == SLOT_GRAVE)) & keys_match(recs, keys)
            if not bool(held.all()):
                raise SlotChanged("a slot no longer holds the key it was planned for")
        return recs
