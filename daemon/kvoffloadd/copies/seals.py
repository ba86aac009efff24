"""Canonical stores: the parts of one engine each write some fragments of a slot.

In a canonical namespace an engine's ranks (its parts) each copy their fragments of
every block into the one canonical page per cache (``kvoffload.datapath.canonical``). A slot
becomes written only when what its parts copied covers every byte of every page
(invariant 12): parts that report a block but copied less, or that overlap and leave
a hole, never make it visible.

Rules:
- A worker's parts are registered at attach (``canonical_placements`` checks each
  fragment lies inside both pages) and kept until its mappings close.
- Once all of a slot's parts reported (``NamespaceIndex.mark_parts``) the union of
  their fragments is checked, per page turn (writers take turns by page id). The
  verdict is memoised per (set of workers, first page id modulo their turn period),
  so an engine pays it once; a new set is checked on a copier thread (``run_task``)
  and its slots wait (``start_seal``), and the caller holds back the result of the
  job that completed them until the verdict is in.
- A slot whose parts do not cover its pages fails its store (counted, logged).
- Loop thread only, as part of the transfers.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvoffload.datapath.canonical import (
    CanonicalPart,
    check,
    check_parts,
    covers_pages,
    turn_period,
)
from kvoffload.datapath.copyplan import place_caches
from kvoffload.datapath.runs import Placement
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.messages import KVLayout
from kvoffloadd.copies.copier import Completion, CpuCopier
from kvoffloadd.index.index import NamespaceIndex

log = logging.getLogger(__name__)

MAX_COVERAGE_MEMO = 4096  # verdicts kept; cleared when it grows past

# (workers in part order, first page id modulo their turn period)
CoverageKey = tuple[tuple[int, ...], int]


@dataclass
class _Seal:
    """A coverage check running on a copier thread, and what waits for it."""

    ns_id: int
    keys: dict[int, CoverageKey]  # slot -> its set of workers and page turn
    held: list[Any] = field(default_factory=list)  # the caller's, handed back


def canonical_placements(layout: KVLayout, r: m.AttachWorker, pages: list[int]) -> list[Placement]:
    """Placements of one rank's caches in a canonical namespace's slots (each cache's
    canonical page), once its parts and fragments are sane."""
    if layout.world_size != 1:
        raise InvalidArgumentError(
            "canonical parts need a namespace of world size 1 (one canonical page per slot), "
            f"not {layout.world_size}"
        )
    check_parts(r.rank, r.parts)
    if len(r.canonical) != len(r.caches):
        raise InvalidArgumentError(
            f"{len(r.canonical)} canonical mappings for {len(r.caches)} caches"
        )
    parts = [CanonicalPart.unpack(d.page_bytes, d.frags, d.writers, d.writer) for d in r.canonical]
    for part, page in zip(parts, pages):
        check(part, page, r.parts)
    return place_caches(layout, pages, parts)


class Sealer:
    def __init__(
        self,
        copier: CpuCopier,
        tokens: itertools.count[int],
        namespaces: dict[int, NamespaceIndex],
        on_written: Callable[[NamespaceIndex, list[int]], None],
    ) -> None:
        self._copier = copier
        self._tokens = tokens
        self._namespaces = namespaces
        self._on_written = on_written  # canonical slots that became written (checksums)
        self._parts: dict[int, tuple[CanonicalPart, ...]] = {}  # worker -> its caches' parts
        self._verdicts: dict[CoverageKey, bool] = {}
        # workers of a slot's parts -> their turn period (cleared when a worker goes)
        self._periods: dict[tuple[int, ...], int] = {}
        self._seals: dict[int, _Seal] = {}  # seal token -> its check
        self.stores_not_covered = 0

    def add(self, worker_id: int, placements: list[Placement]) -> None:
        parts = tuple(at.canon for at in placements if at.canon is not None)
        if parts:
            self._parts[worker_id] = parts

    def remove(self, worker_id: int) -> None:
        self._parts.pop(worker_id, None)
        self._periods.clear()

    def is_canonical(self, worker_id: int) -> bool:
        return worker_id in self._parts

    def is_seal(self, token: int) -> bool:
        return token in self._seals

    def hold(self, token: int, item: Any) -> None:
        """Keep ``item`` (a completion) until seal ``token`` is in."""
        self._seals[token].held.append(item)

    def parts_landed(
        self, index: NamespaceIndex, slots: list[int], part: int, parts: int, worker: int
    ) -> int:
        """A part's store copy into ``slots`` landed; returns the token of the seal
        the slots it completed wait for (0: none)."""
        whole = index.mark_parts(slots, part, parts, worker)
        return self._seal(index, whole) if whole else 0

    def _key(self, slot: int, f: int, workers: tuple[int, ...]) -> CoverageKey | None:
        period = self._periods.get(workers)
        if period is None:
            parts = [self._parts[w] for w in workers if w in self._parts]
            if len(parts) != len(workers):
                return None  # a part's worker is gone: nothing vouches for its copy
            if len(self._periods) >= MAX_COVERAGE_MEMO:
                self._periods.clear()
            period = self._periods[workers] = turn_period(parts)
        return workers, slot * f % period

    def _seal(self, index: NamespaceIndex, whole: list[tuple[int, tuple[int, ...]]]) -> int:
        f = index.layout.block_size_factor
        ok: list[int] = []
        bad: list[int] = []
        todo: dict[int, CoverageKey] = {}
        first: dict[CoverageKey, int] = {}
        for slot, workers in whole:
            key = self._key(slot, f, workers)
            verdict = self._verdicts.get(key) if key is not None else False
            if verdict is None and key is not None:
                todo[slot] = key
                first.setdefault(key, slot * f)
            else:
                (ok if verdict else bad).append(slot)
        self._apply(index, ok, bad)
        if not todo:
            return 0
        token = next(self._tokens)
        index.start_seal(list(todo), token)
        self._seals[token] = _Seal(index.ns_id, todo)
        parts = {key: [self._parts[w] for w in key[0]] for key in first}
        self._copier.run_task(
            token, lambda: {k: covers_pages(parts[k], page, f) for k, page in first.items()}
        )
        return token

    def _apply(self, index: NamespaceIndex, ok: list[int], bad: list[int], token: int = 0) -> None:
        applied = index.seal(ok, bad, token)
        if bad:
            self.stores_not_covered += len(bad)
            log.warning(
                "namespace %s: %d canonical stores failed: their parts' fragments do not "
                "cover every page",
                index.name,
                len(bad),
            )
        self._on_written(index, applied)

    def sealed(self, c: Completion) -> list[Any]:
        """A seal task finished: apply its verdicts; returns what it held."""
        seal = self._seals.pop(c.token)
        verdicts: dict[CoverageKey, bool] = c.result if c.success else {}
        if len(self._verdicts) + len(verdicts) > MAX_COVERAGE_MEMO:
            self._verdicts.clear()
        self._verdicts.update(verdicts)
        index = self._namespaces.get(seal.ns_id)
        if index is not None:
            ok = [slot for slot, key in seal.keys.items() if verdicts.get(key)]
            bad = [slot for slot, key in seal.keys.items() if not verdicts.get(key)]
            self._apply(index, ok, bad, c.token)
        return seal.held

    @property
    def pending(self) -> int:
        return len(self._seals)

    @property
    def memo_size(self) -> int:
        return len(self._verdicts)
