"""Bringing a region up on this node: its backing, geometry and placement plan, the
check that it fits every limit, and the node readiness report (``kvoffloadctl check``).

Rules:
- Plain values in, so the daemon (from its config) and the admin CLI (from the same
  config file) plan exactly the same region; everything is read under ``root``.
- ``fit_check`` is called with the region's file before a page of it is taken
  (regionstate.open_region): over a limit it raises ``RegionError`` with the message
  limits.py writes, naming the limit and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvoffloadd.region import segment
from kvoffloadd.region.backing import Backing, resolve_backing, shmem_enabled
from kvoffloadd.region.hostfs import cgroup_dirs, read_text
from kvoffloadd.region.limits import (
    UNLIMITED_BYTES,
    Limit,
    Need,
    human,
    own_resident_bytes,
    refusal,
    region_limits,
)
from kvoffloadd.region.placement import RegionPlan, chunk_size, plan_parts, plan_region
from kvoffloadd.region.regionstate import BeforeMap
from kvoffloadd.region.segment import Geometry, RegionError, SegmentFile
from kvoffloadd.region.topology import Topology, read_topology, usable_cpus


@dataclass(frozen=True)
class RegionSetup:
    backing: Backing
    geometry: Geometry
    topology: Topology
    plan: RegionPlan


def plan_setup(
    region_bytes: int,
    extent_bytes: int,
    min_slot_bytes: int,
    *,
    huge_pages: str = "off",
    region_dir: str = "",
    numa: str = "auto",
    populate_threads: int = 0,
    chunk_bytes: int = 2 << 30,
    root: str = "/",
) -> RegionSetup:
    """``BackingError`` (a ``RegionError``) when the huge pages asked for cannot be had."""
    backing = resolve_backing(huge_pages, region_dir, root)
    g = Geometry.plan(region_bytes, extent_bytes, min_slot_bytes, backing.page_bytes)
    topology = read_topology(root)
    allowed = set(os.sched_getaffinity(0))
    parts, mode = plan_parts(topology, numa, allowed)
    threads = populate_threads or usable_cpus(root, allowed)
    chunk = chunk_size(chunk_bytes, g.extent_bytes, g.page_bytes)
    plan = plan_region(g.data_bytes, chunk, parts, threads, mode)
    return RegionSetup(backing, g, topology, plan)


def need_of(
    setup: RegionSetup, resident_bytes: int, headroom_bytes: int, own_bytes: int = 0
) -> Need:
    plan = setup.plan
    nodes = {p.node: b for p, b in zip(plan.parts, plan.part_bytes) if p.node is not None}
    g = setup.geometry
    return Need(g.region_bytes, resident_bytes, headroom_bytes, setup.backing, nodes, own_bytes)


def fit_check(setup: RegionSetup, headroom_bytes: int, root: str = "/") -> BeforeMap:
    """A check of the region's file against every limit, before it is mapped."""

    def check(shm: SegmentFile, recovered: bool) -> None:
        resident = segment.allocated_bytes(shm) if recovered else 0
        need = need_of(setup, resident, headroom_bytes, own_resident_bytes(root))
        why = refusal(region_limits(need, root), need)
        if why is not None:
            raise RegionError(why)

    return check


def node_report(
    setup: RegionSetup, headroom_bytes: int, resident_bytes: int = 0, root: str = "/"
) -> dict[str, Any]:
    """Everything ``kvoffloadctl check`` prints: limits, page settings, NUMA nodes and
    GPUs, the plan, and whether the configured region fits."""
    need = need_of(setup, resident_bytes, headroom_bytes)
    limits = region_limits(need, root)
    why = refusal(limits, need)
    g, plan, topo = setup.geometry, setup.plan, setup.topology
    thp = read_text(root, "/sys/kernel/mm/transparent_hugepage/enabled") or ""
    huge_pools = {}
    base = os.path.join(root, "sys/kernel/mm/hugepages")
    for entry in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        rel = f"/sys/kernel/mm/hugepages/{entry}"
        huge_pools[entry] = {
            k: int((read_text(root, f"{rel}/{k}") or "0").strip() or 0)
            for k in ("nr_hugepages", "free_hugepages", "resv_hugepages")
        }
    return {
        "fits": why is None,
        "refusal": why or "",
        "memory_cgroup": _memory_cgroup(root),
        "region": {
            "region_bytes": g.region_bytes,
            "resident_bytes": resident_bytes,
            "headroom_bytes": headroom_bytes,
            "huge_pages": setup.backing.huge_pages,
            "directory": setup.backing.directory,
            "page_bytes": g.page_bytes,
            "thp": setup.backing.how,
            "chunk_bytes": plan.chunk_bytes,
            "chunks": len(plan.chunks),
            "populate_threads": sum(plan.threads),
            "numa": plan.numa,
        },
        "limits": [_limit(lim) for lim in limits],
        "pages": {
            "thp_enabled": _bracketed(thp),
            "thp_shmem_enabled": shmem_enabled(root),
            "huge_page_pools": huge_pools,
        },
        "nodes": [
            {
                "node": n.node,
                "cpus": len(n.cpus),
                "memory_bytes": n.mem_total_bytes,
                "free_bytes": n.mem_free_bytes,
                "gpus": [gpu.bus_id for gpu in topo.gpus_on(n.node)],
                "part_bytes": sum(
                    b for p, b in zip(plan.parts, plan.part_bytes) if p.node == n.node
                ),
                "populate_threads": sum(
                    t for p, t in zip(plan.parts, plan.threads) if p.node == n.node
                ),
            }
            for n in topo.nodes
        ],
        "gpus_without_node": [gpu.bus_id for gpu in topo.gpus if gpu.node < 0],
    }


def _memory_cgroup(root: str) -> dict[str, Any]:
    """This process's memory cgroup, limited or not (the report names it either way)."""
    dirs = cgroup_dirs("memory", root)
    if dirs is None:
        return {"version": 0, "name": "", "limited": False}
    files = ("memory.max",) if dirs.version == 2 else ("memory.limit_in_bytes",)
    text = (read_text("/", os.path.join(dirs.paths[0], files[0])) or "max").strip()
    limited = text != "max" and int(text) < UNLIMITED_BYTES
    return {"version": dirs.version, "name": dirs.names[0], "limited": limited}


def _limit(lim: Limit) -> dict[str, Any]:
    return {
        "what": lim.what,
        "limit_bytes": lim.limit_bytes,
        "available_bytes": lim.available_bytes,
        "needed_bytes": lim.needed_bytes,
        "fits": lim.fits,
        "summary": lim.describe(),
    }


def _bracketed(text: str) -> str:
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else text.strip()


__all__ = ["RegionSetup", "fit_check", "human", "need_of", "node_report", "plan_setup"]
