"""``kvoffloadctl check``: is this node ready for the configured region?

Reads the daemon's configuration (the same file and defaults kvoffloadd reads), plans
the region exactly as the daemon would (backing, NUMA parts, threads, chunks) and
checks it against every limit the daemon checks at start, without a daemon running:
memory cgroups (v1 and v2), the host's memory, the region's filesystem, the huge page
pools per size and per node, hugetlb cgroups. It prints those limits, the transparent
and reserved huge page settings, the NUMA nodes with their CPUs, memory and GPUs, and
whether the region fits; the exit status says so (0: fits, 4: does not).

A region a daemon of the instance keeps (its record in the state directory, its file
still there) counts as resident: restarting that daemon takes no more of it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kvoffloadd.config import DaemonConfig
from kvoffloadd.region.bringup import human, node_report, plan_setup
from kvoffloadd.region.segment import RegionError

EXIT_UNFIT = 4


def kept_region_bytes(cfg: DaemonConfig) -> int:
    """Bytes already held by the region this instance's record names, if any."""
    record = os.path.join(cfg.state_path, f"kvoffload-{cfg.instance}.region")
    try:
        with open(record, "rb") as f:
            rec = json.loads(f.read(4096))
        path = os.path.join(rec.get("directory", "/dev/shm"), rec["region"].lstrip("/"))
        st = os.stat(path, follow_symlinks=False)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0
    return int(min(st.st_size, st.st_blocks * 512))


def check(cfg: DaemonConfig, as_json: bool, root: str = "/") -> int:
    try:
        setup = plan_setup(
            cfg.region_bytes,
            cfg.extent_bytes,
            cfg.min_slot_bytes,
            huge_pages=cfg.huge_pages,
            region_dir=cfg.region_dir,
            numa=cfg.numa,
            populate_threads=cfg.populate_threads,
            chunk_bytes=cfg.populate_chunk_bytes,
            root=root,
        )
    except RegionError as exc:
        report: dict[str, Any] = {"fits": False, "refusal": str(exc)}
    else:
        report = node_report(setup, cfg.memory_headroom_bytes, kept_region_bytes(cfg), root)
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print_report(report)
    return 0 if report["fits"] else EXIT_UNFIT


def print_report(r: dict[str, Any]) -> None:
    if "region" in r:
        g = r["region"]
        page = "4 KiB" if g["page_bytes"] == 4096 else human(g["page_bytes"])
        thp = f", {g['thp']}" if g["thp"] else ""
        print(
            f"region: {human(g['region_bytes'])} in {g['directory']} (huge_pages "
            f"{g['huge_pages']}, {page} pages{thp}); {g['chunks']} chunk(s) of at most "
            f"{human(g['chunk_bytes'])}, {g['populate_threads']} populate threads, "
            f"numa {g['numa']}"
        )
        print(
            f"  already resident (a kept region): {human(g['resident_bytes'])}; "
            f"daemon headroom: {human(g['headroom_bytes'])}"
        )
        cg = r["memory_cgroup"]
        if cg["version"]:
            limited = "limited" if cg["limited"] else "no memory limit"
            print(f"  memory cgroup (v{cg['version']}): {cg['name']} ({limited})")
        print("\nlimits:")
        for lim in r["limits"]:
            print(f"  {'ok  ' if lim['fits'] else 'SHORT'} {lim['summary']}")
        if not r["limits"]:
            print("  none found")
        p = r["pages"]
        print("\npages:")
        print(f"  transparent huge pages: {p['thp_enabled']}; shmem: {p['thp_shmem_enabled']}")
        for name, pool in p["huge_page_pools"].items():
            print(
                f"  {name}: {pool['nr_hugepages']} reserved, {pool['free_hugepages']} free, "
                f"{pool['resv_hugepages']} promised"
            )
        print("\nNUMA nodes:")
        for n in r["nodes"]:
            gpus = ", ".join(n["gpus"]) or "none"
            print(
                f"  node {n['node']}: {n['cpus']} CPUs, {human(n['memory_bytes'])} "
                f"({human(n['free_bytes'])} free); GPUs: {gpus}; region part "
                f"{human(n['part_bytes'])}, {n['populate_threads']} threads"
            )
        if r["gpus_without_node"]:
            print(f"  GPUs whose node the firmware does not say: {r['gpus_without_node']}")
        print()
    if r["fits"]:
        print("the configured region fits this node")
    else:
        print(f"the configured region does not fit: {r['refusal']}")
