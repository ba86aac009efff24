"""Where the region's memory goes and when each part of it is ready.

The data area is cut into chunks of at most ``chunk_bytes`` (a multiple of the extent
size): the unit that is populated, page-locked and placed. On a machine with several
NUMA nodes the region is split into one part per node, sized by the GPUs on that node
(the node of a GPU: its PCI device in sysfs, topology.py). A part is a set of whole
chunks spread through the region in a smooth weighted round robin, so that every
node's threads populate from the start of the region at once and the pinning thread,
which registers chunks in order, never waits on one node while another has work ready:

    chunk:   0    1    2    3    4    5    6    7   ...     weights 6:2
    node:    0    0    1    0    0    0    1    0   ...

Rules:
- ``numa = "off"`` or a machine with one memory node: one part, no binding. Nodes
  without memory never get a part; without any GPU, every memory node weighs the same.
- A namespace whose GPU workers all sit on one node takes its extents from that node's
  part (``ExtentPlacement.preferred_part``); any other namespace interleaves.
- An extent is ready once populated and, while a pinner runs, its chunk pinned; the
  extent pool hands out ready extents first (allocator.py). Populate and pin threads write the
  chunk states; the loop only reads them (single values, no lock needed there).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvoffloadd.region.topology import Topology


@dataclass(frozen=True)
class Part:
    node: int | None  # None: not placed (numa off)
    gpus: int
    cpus: frozenset[int]  # CPUs its populate threads are bound to; empty: not bound


@dataclass(frozen=True)
class RegionPlan:
    """How the data area is cut, placed and populated."""

    chunk_bytes: int
    chunks: list[tuple[int, int]]  # (offset in the data area, bytes), in order
    part_of_chunk: list[int]
    parts: list[Part]
    threads: list[int]  # populate threads per part
    mbind: bool  # set each part's memory policy (where the kernel lets us)
    numa: str  # what was decided, for stats and the log: "off", "one node", "2 nodes"

    @property
    def part_bytes(self) -> list[int]:
        out = [0] * len(self.parts)
        for (_, n), p in zip(self.chunks, self.part_of_chunk):
            out[p] += n
        return out


def chunk_size(chunk_bytes: int, extent_bytes: int, page_bytes: int = 4096) -> int:
    """The configured chunk size rounded down to whole extents and pages (at least one)."""
    unit = extent_bytes
    while unit % page_bytes:
        unit += extent_bytes
    return max(unit, chunk_bytes // unit * unit)


def plan_chunks(data_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(off, min(chunk_bytes, data_bytes - off)) for off in range(0, data_bytes, chunk_bytes)]


def plan_parts(topology: Topology, numa: str, allowed_cpus: set[int]) -> tuple[list[Part], str]:
    """One part per GPU-carrying memory node (all memory nodes if no GPU has one)."""
    memory = topology.memory_nodes
    if numa == "off":
        return [Part(None, len(topology.gpus), frozenset())], "off"
    if len(memory) <= 1:
        node = memory[0].node if memory else 0
        return [Part(node, len(topology.gpus), frozenset())], "one node"
    with_gpus = [n for n in memory if topology.gpus_on(n.node)]
    chosen = with_gpus or memory
    parts = [
        Part(n.node, len(topology.gpus_on(n.node)), frozenset(n.cpus & allowed_cpus))
        for n in chosen
    ]
    if len(parts) == len(memory):
        return parts, f"{len(parts)} nodes"
    return parts, f"{len(parts)} of {len(memory)} nodes"


def assign_chunks(num_chunks: int, weights: list[int]) -> list[int]:
    """The part of each chunk: a smooth weighted round robin (nginx's), so every
    prefix of the region is split close to the weights."""
    w = [max(0, x) for x in weights]
    if not any(w):
        w = [1] * len(weights)
    current = [0] * len(w)
    total = sum(w)
    out = []
    for _ in range(num_chunks):
        for i, x in enumerate(w):
            current[i] += x
        best = max(range(len(w)), key=lambda i: current[i])
        current[best] -= total
        out.append(best)
    return out


def split_threads(total: int, part_bytes: list[int]) -> list[int]:
    """Threads per part in proportion to its bytes, at least one each (with bytes)."""
    live = [i for i, b in enumerate(part_bytes) if b]
    out = [0] * len(part_bytes)
    if not live:
        return out
    total = max(total, len(live))
    whole = sum(part_bytes)
    for i in live:
        out[i] = max(1, total * part_bytes[i] // whole)
    while sum(out) < total:  # the remainder to the part with the most bytes per thread
        i = max(live, key=lambda j: part_bytes[j] / out[j])
        out[i] += 1
    while sum(out) > total:
        i = max(live, key=lambda j: out[j])
        out[i] -= 1
    return out


def plan_region(
    data_bytes: int,
    chunk_bytes: int,
    parts: list[Part],
    threads: int,
    numa: str,
    mbind: bool = True,
) -> RegionPlan:
    chunks = plan_chunks(data_bytes, chunk_bytes)
    if len(parts) > 1:
        part_of = assign_chunks(len(chunks), [p.gpus for p in parts])
    else:
        part_of = [0] * len(chunks)
    sizes = [0] * len(parts)
    for (_, n), p in zip(chunks, part_of):
        sizes[p] += n
    max_threads = max(1, -(-data_bytes // (1 << 30)))  # >= 1 GiB per thread
    return RegionPlan(
        chunk_bytes,
        chunks,
        part_of,
        parts,
        split_threads(min(threads, max_threads), sizes),
        mbind and numa not in ("off", "one node"),
        numa,
    )


class ChunkStates:
    """Per chunk: populated (its pages exist), mapped (this process's page tables
    reach them: what pinning waits for) and pinned (by the pinner, in order); per
    unit (an extent: what the pool hands out), populated.

    A new region's chunk is populated and mapped by the same pass, unit by unit (so
    the first extents are ready before their whole chunk is); a kept region's resident
    chunks are populated at once, and mapped by the pass that follows."""

    def __init__(self, num_chunks: int, units_per_chunk: int = 1, num_units: int = -1) -> None:
        self.populated = bytearray(num_chunks)
        self.mapped = bytearray(num_chunks)
        self.units_per_chunk = units_per_chunk
        self.units = bytearray(num_chunks * units_per_chunk if num_units < 0 else num_units)
        self.pinned = 0  # chunks registered: a prefix
        self.pinning = False  # a pinner runs and readiness waits for it
        self.all_ready = num_chunks == 0
        self._cv = threading.Condition()
        self._stopped = False

    def assume_populated(self) -> None:
        """Nothing populates the region: every chunk counts as populated and mapped."""
        with self._cv:
            for flags in (self.populated, self.mapped, self.units):
                flags[:] = b"\x01" * len(flags)
            self._settle()
            self._cv.notify_all()

    def reset(self) -> None:
        """A population is planned: nothing is populated until it says so."""
        with self._cv:
            for flags in (self.populated, self.mapped, self.units):
                flags[:] = bytes(len(flags))
            self._stopped = False
            self._settle()

    def mark_unit(self, unit: int) -> None:
        """One unit of a chunk being populated is done (a single byte: no lock)."""
        self.units[unit] = 1

    def _units_of(self, chunk: int) -> range:
        upc = self.units_per_chunk
        return range(chunk * upc, min((chunk + 1) * upc, len(self.units)))

    def mark_resident(self, chunk: int) -> None:
        """A kept region's chunk: its pages are there, not yet mapped here."""
        with self._cv:
            self.populated[chunk] = 1
            for u in self._units_of(chunk):
                self.units[u] = 1
            self._settle()
            self._cv.notify_all()

    def mark_populated(self, chunk: int) -> None:
        with self._cv:
            self.populated[chunk] = self.mapped[chunk] = 1
            for u in self._units_of(chunk):
                self.units[u] = 1
            self._settle()
            self._cv.notify_all()

    def mark_pinned(self, chunks: int) -> None:
        self.pinned = chunks
        self._settle()

    def stop_pinning(self) -> None:
        """The pinner stopped (an error, or closing): readiness stops waiting for it."""
        self.pinning = False
        self._settle()

    def track_pinning(self) -> None:
        self.pinning = True
        self.all_ready = False
        self._settle()

    def _settle(self) -> None:
        n = len(self.populated)
        self.all_ready = all(self.populated) and (not self.pinning or self.pinned >= n)

    def is_ready(self, chunk: int) -> bool:
        if not self.populated[chunk]:
            return False
        return not self.pinning or chunk < self.pinned

    def is_unit_ready(self, unit: int) -> bool:
        if not self.units[unit]:
            return False
        return not self.pinning or unit // self.units_per_chunk < self.pinned

    def wait_populated(self, chunk: int, timeout_s: float | None = None) -> bool | None:
        """Block until ``chunk`` is populated (True), populating ended without it
        (False), or ``timeout_s`` passed (None)."""
        return self._wait(self.populated, chunk, timeout_s)

    def wait_mapped(self, chunk: int, timeout_s: float | None = None) -> bool | None:
        """As ``wait_populated``, until the chunk is populated and mapped here."""
        return self._wait(self.mapped, chunk, timeout_s)

    def _wait(self, flags: bytearray, chunk: int, timeout_s: float | None) -> bool | None:
        with self._cv:
            self._cv.wait_for(lambda: flags[chunk] or self._stopped, timeout_s)
            if flags[chunk]:
                return True
            return False if self._stopped else None

    def release_waiters(self) -> None:
        """Populating ended, finished or not: nobody waits for a chunk any more."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def ready_units(self, units: range | list[int] | None = None) -> int:
        """How many of ``units`` (default: all) are ready."""
        if self.all_ready and units is None:
            return len(self.units)
        return sum(
            1
            for u in (units if units is not None else range(len(self.units)))
            if self.is_unit_ready(u)
        )


class ExtentPlacement:
    """What the extent pool asks: each extent's part, whether it is ready, and the
    part a namespace's extents should come from."""

    def __init__(
        self,
        plan: RegionPlan,
        extent_bytes: int,
        num_extents: int,
        states: ChunkStates,
        topology: Topology | None = None,
    ) -> None:
        self.plan = plan
        self.states = states
        self.num_parts = len(plan.parts)
        per_chunk = plan.chunk_bytes // extent_bytes
        assert states.units_per_chunk == per_chunk, "one readiness unit per extent"
        self.chunk_of_extent = [e // per_chunk for e in range(num_extents)]
        self.part_of_extent = [plan.part_of_chunk[c] for c in self.chunk_of_extent]
        self._part_of_node = {p.node: i for i, p in enumerate(plan.parts) if p.node is not None}
        self._topology = topology
        self._owner_parts: dict[int, set[int | None]] = {}

    @property
    def all_ready(self) -> bool:
        return self.states.all_ready

    def is_ready(self, ext: int) -> bool:
        return self.states.is_unit_ready(ext)

    def preferred_part(self, owner: int) -> int | None:
        parts = self._owner_parts.get(owner)
        if not parts or len(parts) != 1 or self.num_parts == 1:
            return None
        (part,) = parts
        return part

    def gpu_worker(self, owner: int, uuid: bytes) -> None:
        """A GPU worker of namespace ``owner`` attached: its GPU's node counts."""
        if self._topology is None or self.num_parts == 1:
            return
        node = self._topology.node_of_gpu(uuid)
        part = self._part_of_node.get(node) if node is not None else None
        self._owner_parts.setdefault(owner, set()).add(part)

    def forget(self, owner: int) -> None:
        """A namespace id is given to a new namespace: its workers are new too."""
        self._owner_parts.pop(owner, None)
