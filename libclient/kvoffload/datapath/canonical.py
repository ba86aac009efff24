"""Canonical pages: one copy of a block, whatever the engine's tensor-parallel size.

vLLM's canonical layout (``canonical_layout`` in ``kv_connector_extra_config``) defines,
per layer, the page of an offloaded block *without* parallelism: all KV heads, all
tokens. Each rank maps its own page into byte ranges of it (vLLM's
``CanonicalPageMapping``); ranks holding the same bytes (replicated KV heads, the MLA
latent) take turns writing them, block by block.

A canonical namespace has ``world_size`` 1: a slot holds one canonical page per cache
(``place_caches`` over the canonical page sizes). The engine's ``parts`` workers each
copy their fragments of every block (``expand``); a block is visible once all of an
engine's parts have reported it (non-writers of a block report too), so readers of
any TP size see whole pages only.

Rules:
- ``CanonicalPart.frags`` is an (n, 3) int64 array: local offset in the worker's page,
  offset in the canonical page, bytes. Every fragment lies inside both pages
  (``check``); a worker never writes outside its cache's canonical page.
- On a store, a cache with ``writers`` > 1 copies only the blocks whose page id
  (``slot * block_size_factor + sub-block``) is ``writer`` modulo ``writers``: the
  same slots go to every rank of a store, so exactly one of the ranks holding those
  bytes writes each block. Loads always copy every fragment.
- A stored page is whole only when the fragments its writers actually copied cover
  every byte of every cache's canonical page (``covers_pages``): parts that report a
  block but copied less, or that overlap and leave a hole, never make it visible.
- Pure: numpy only, unit-tested without a daemon.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.messages import MAX_FRAGMENTS  # per cache: a page's rows times its regions

I64 = npt.NDArray[np.int64]
MAX_PARTS = 64  # ranks of one engine writing one slot (a bit each)
# Copies one transfer may expand to (blocks x fragments, before merging): the planner's
# arrays for them are built on the daemon's loop, about 24 bytes each.
MAX_JOB_COPIES = 1 << 23


@dataclass(frozen=True)
class CanonicalPart:
    """How one worker's page of a cache scatters into the cache's canonical page."""

    canonical_page_bytes: int
    frags: I64  # (n, 3): local offset, canonical offset, bytes
    writers: int = 1  # ranks holding these bytes (they take turns by block)
    writer: int = 0  # this worker's turn among them

    def pack(self) -> bytes:
        return np.ascontiguousarray(self.frags, dtype="<i8").tobytes()

    @cached_property
    def spans(self) -> I64:
        """The canonical bytes this part writes: sorted, merged (start, end) rows."""
        start = self.frags[:, 1]
        order = np.argsort(start, kind="stable")
        lo, hi = start[order], (start + self.frags[:, 2])[order]
        reach = np.maximum.accumulate(hi)
        new = np.ones(lo.size, dtype=bool)
        new[1:] = lo[1:] > reach[:-1]
        first = np.flatnonzero(new)
        last = np.append(first[1:], lo.size) - 1
        return np.stack((lo[first], reach[last]), axis=1)

    def writes(self, page_id: int) -> bool:
        """Whether this part copies the block with this page id on a store."""
        return self.writers == 1 or page_id % self.writers == self.writer

    @staticmethod
    def unpack(canonical_page_bytes: int, frags: bytes, writers: int, writer: int) -> CanonicalPart:
        if len(frags) % 24:
            raise InvalidArgumentError("canonical fragments must be int64 triples")
        arr = np.frombuffer(frags, dtype="<i8").astype(np.int64).reshape(-1, 3)
        return CanonicalPart(canonical_page_bytes, arr, writers, writer)


def check(part: CanonicalPart, local_page_bytes: int, parts: int) -> None:
    """InvalidArgumentError unless every fragment lies inside both pages."""
    f = part.frags
    if not part.canonical_page_bytes > 0 or not 0 < len(f) <= MAX_FRAGMENTS:
        raise InvalidArgumentError(
            f"a canonical mapping needs a positive page and 1..{MAX_FRAGMENTS} fragments"
        )
    if not 1 <= part.writers <= parts or not 0 <= part.writer < part.writers:
        raise InvalidArgumentError(
            f"writer {part.writer} of {part.writers} does not fit an engine of {parts} parts"
        )
    local, canon, n = f[:, 0], f[:, 1], f[:, 2]
    if (
        int(n.min()) <= 0
        or int(local.min()) < 0
        or int(canon.min()) < 0
        or int((local + n).max()) > local_page_bytes
        or int((canon + n).max()) > part.canonical_page_bytes
    ):
        raise InvalidArgumentError(
            f"canonical fragments reach outside the {local_page_bytes}-byte page or the "
            f"{part.canonical_page_bytes}-byte canonical page"
        )


def check_copy_count(blocks: int, placements: Sequence[Any]) -> None:
    """InvalidArgumentError if one transfer would expand to more than MAX_JOB_COPIES
    copies (``placements``: the chosen caches' copyplan placements)."""
    per_block = sum(1 if p.canon is None else len(p.canon.frags) for p in placements)
    if blocks * per_block > MAX_JOB_COPIES:
        raise InvalidArgumentError(
            f"{blocks} blocks of {per_block} fragments each are more than the "
            f"{MAX_JOB_COPIES} copies one transfer may take; submit fewer blocks per job"
        )


def covered(spans: Sequence[I64], page_bytes: int) -> bool:
    """Whether the union of (start, end) rows covers ``[0, page_bytes)``."""
    rows = [s for s in spans if s.size]
    if not rows:
        return False
    a = np.concatenate(rows)
    a = a[np.argsort(a[:, 0], kind="stable")]
    reach = np.maximum.accumulate(a[:, 1])
    return bool(a[0, 0] <= 0 and not (a[1:, 0] > reach[:-1]).any() and reach[-1] >= page_bytes)


def covers_pages(parts: Sequence[Sequence[CanonicalPart]], first_page_id: int, f: int) -> bool:
    """Whether the parts of one store (each the list of one worker's caches, in order)
    together write every byte of every cache's canonical page, for each of the ``f``
    pages from ``first_page_id``: only the fragments of the parts whose turn a page is
    count (``CanonicalPart.writes``)."""
    if not parts or len({len(p) for p in parts}) != 1:
        return False
    distinct = min(f, turn_period(parts))  # pages further on repeat these turns
    for c in range(len(parts[0])):
        page_bytes = parts[0][c].canonical_page_bytes
        if any(p[c].canonical_page_bytes != page_bytes for p in parts):
            return False
        for page in range(first_page_id, first_page_id + distinct):
            if not covered([p[c].spans for p in parts if p[c].writes(page)], page_bytes):
                return False
    return True


def turn_period(parts: Sequence[Sequence[CanonicalPart]]) -> int:
    """Page ids equal modulo this have the same writers (``covers_pages`` agrees)."""
    return math.lcm(*(c.writers for p in parts for c in p)) if parts else 1


def area_of(rank: int, parts: int) -> int:
    """The rank area a worker copies to and from: its own with per-rank pages, the
    one area of a canonical slot when it writes one of ``parts`` parts."""
    return rank if parts == 1 else 0


def check_parts(rank: int, parts: int) -> None:
    if not 1 <= parts <= MAX_PARTS or not 0 <= rank < parts:
        raise InvalidArgumentError(f"rank {rank} of {parts} parts is not in 0..{MAX_PARTS - 1}")


def expand(
    part: CanonicalPart,
    region: I64,
    cache: I64,
    page_ids: I64 | None,
) -> tuple[I64, I64, I64]:
    """Per-fragment copies for blocks at ``region`` (canonical page starts) and
    ``cache`` (local page starts); ``page_ids`` given for a store: only this worker's
    turns are kept."""
    if page_ids is not None and part.writers > 1:
        keep = page_ids % part.writers == part.writer
        region, cache = region[keep], cache[keep]
    local, canon, n = part.frags[:, 0], part.frags[:, 1], part.frags[:, 2]
    out_region = (region[:, None] + canon[None, :]).ravel()
    out_cache = (cache[:, None] + local[None, :]).ravel()
    out_n = np.broadcast_to(n, (region.size, n.size)).ravel()
    return out_region, out_cache, np.ascontiguousarray(out_n)
