"""How far the region has come up, as the stats report it: population, readiness,
NUMA placement and pinning, for the region and per node.

Rules:
- Pure reads of what the populate and pin threads publish (plain counters and flags:
  no lock, a value one call stale at worst) and of the extent pool (loop thread).
- Field names carry their unit; a figure the region does not have (no population
  planned, no node) is 0, "" or None, never missing: every series exists from the
  first scrape.
"""

from __future__ import annotations

from typing import Any

from kvoffloadd.region.allocator import ExtentPool
from kvoffloadd.region.placement import ChunkStates, RegionPlan
from kvoffloadd.region.populate import Populator
from kvoffloadd.region.segment import Geometry


def population_statistics(
    plan: RegionPlan,
    states: ChunkStates,
    pop: Populator | None,
    pool: ExtentPool,
    g: Geometry,
) -> dict[str, Any]:
    """The population fields of the ``region`` stats section."""
    return {
        "populated_bytes": pop.populated_bytes if pop else 0,
        "populate_done": pop.done if pop else False,
        "ready_bytes": states.ready_units() * g.extent_bytes,
        "page_bytes": g.page_bytes,
        "populate_chunk_bytes": plan.chunk_bytes,
        "populate_threads": sum(plan.threads) if pop is not None else 0,
        "populate_seconds": round(pop.elapsed_s, 3) if pop else 0.0,
        "populate_rate_bytes_per_s": round(pop.rate_bytes_per_s()) if pop else 0,
        "populate_first_chunk_s": round(pop.first_chunk_s, 3) if pop else 0.0,
        "populate_error": pop.error if pop else "",
        "resident_at_start_bytes": pop.resident_at_start_bytes if pop else 0,
        "huge_page_bytes": pop.huge_page_bytes if pop else 0,
        "numa": plan.numa,
        "numa_placement": pop.placement if pop else "none",
        "numa_fallback_extents_total": pool.fallback_extents_total,
        "unready_extents_total": pool.unready_extents_total,
    }


def node_statistics(
    plan: RegionPlan,
    states: ChunkStates,
    pop: Populator | None,
    pool: ExtentPool,
    extents_of_part: list[list[int]],
) -> dict[str, dict[str, Any]]:
    """Per NUMA part (keyed by its node, "all" without placement): bytes, populated,
    ready and pinned bytes, GPUs, free extents, threads, rate and local share."""
    per_part = pop.part_statistics() if pop else None
    out: dict[str, dict[str, Any]] = {}
    for p, part in enumerate(plan.parts):
        mine = [i for i, q in enumerate(plan.part_of_chunk) if q == p]
        st: dict[str, Any] = {
            "bytes": sum(plan.chunks[i][1] for i in mine),
            "populated_bytes": 0,
            "ready_bytes": states.ready_units(extents_of_part[p]) * pool.extent_bytes,
            "pinned_bytes": sum(plan.chunks[i][1] for i in mine if i < states.pinned),
            "gpus": part.gpus,
            "free_extents": pool.free_in_part(p),
            "populate_threads": 0,
            "populate_rate_bytes_per_s": 0,
            "local_ratio": None,
        }
        if per_part is not None:
            st.update(per_part[p])
        out["all" if part.node is None else str(part.node)] = st
    return out
