"""The daemon's region on a fake two-socket node, through the service and the fake
driver: a GPU worker's node decides where its namespace's extents come from, and the
stats, metrics and pinning timings report population, readiness and pinning per node
(what the GPU check reads on a real node: ``gpu.pinned_bytes`` and the per-chunk
``pin_*`` fields)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fake_cuda import FakeCuda, FakeCudaTensor
from fake_node import gpu_uuid, two_socket_node

from kvoffload.cuda.export import StoreFence, export_cuda_caches
from kvoffload.protocol import messages as m
from kvoffload.protocol.packing import pack_keys
from kvoffloadbench.inproc import handle_now
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import CpuCopier
from kvoffloadd.copies.gpu import GpuRuntime
from kvoffloadd.region.placement import plan_parts, plan_region
from kvoffloadd.region.region import Geometry, SharedOffloadRegion
from kvoffloadd.region.topology import read_topology
from kvoffloadd.server.metrics import StatsCollector
from kvoffloadd.service.service import Service
from kvoffloadd.service.stats import render_stats

MIB = 1 << 20
PAGE = 64 * 1024
GPU_ON_NODE_1 = gpu_uuid(5)  # GPUs 4-7 sit on socket 1


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    two_socket_node(tmp_path, (4, 4))
    topo = read_topology(str(tmp_path))
    parts, mode = plan_parts(topo, "auto", os.sched_getaffinity(0))
    cfg = DaemonConfig(instance=f"s{uuid.uuid4().hex[:8]}", region_size="64MiB")
    g = Geometry.plan(cfg.region_bytes, 2 * MIB, 16384)
    # chunks of 4 MiB (two extents), no mbind: this machine may have one node only
    plan = plan_region(g.data_bytes, 4 * MIB, parts, 2, mode, mbind=False)
    region = SharedOffloadRegion(cfg.region_name, g, plan=plan, topology=topo)
    region.start_populate()
    region.wait_prefault()
    fake = FakeCuda((GPU_ON_NODE_1,))
    copier = CpuCopier(1)
    pinner = region.make_pinner(fake)
    gpu = GpuRuntime(fake, copier.sink, region.data_address, pinner)
    region.start_pinning()
    assert pinner.done.wait(10)
    service = Service(cfg, region, copier, gpu)
    yield service
    gpu.close()
    copier.close()
    service.namespaces.clear()
    region.close()


def test_a_gpu_worker_on_node_1_gets_its_namespace_extents_there(svc: Service) -> None:
    s = svc.open_session(1, 1, 0, 0)
    r = svc.handle(s, m.OpenNamespace(1, "llama", m.KVLayout([PAGE], 1, 1)))
    assert isinstance(r, m.NamespaceOpened)
    fake = svc.gpu.api  # type: ignore[union-attr]
    assert isinstance(fake, FakeCuda)
    rows = fake.alloc(32 * PAGE).reshape(32, PAGE)
    export = export_cuda_caches([FakeCudaTensor(rows)], fake)
    fence = StoreFence(fake, 0)
    a = handle_now(
        svc, s, m.AttachWorker(2, r.ns, 0, export.descs, export.device_uuid, fence.handle)
    )
    assert isinstance(a, m.WorkerAttached)
    keys = [b"k%04d" % i for i in range(3 * 2 * MIB // PAGE)]  # three extents' worth
    kp, kb = pack_keys(keys)
    plan = svc.handle(s, m.PrepareStore(3, r.ns, kp, kb))
    assert isinstance(plan, m.StorePlanReply)
    index = svc.namespaces[r.ns]
    owned = [e for e in index.slots.extents if e is not None]
    assert len(owned) == 3
    part_of = svc.region.placement.part_of_extent
    node_of_part = [p.node for p in svc.region.plan.parts]
    assert {node_of_part[part_of[e]] for e in owned} == {1}
    assert svc.region.pool.fallback_extents_total == 0


def test_stats_and_metrics_report_each_node(svc: Service) -> None:
    st = render_stats(svc)
    region, nodes, gpu = st["region"], st["numa_nodes"], st["gpu"]
    data = region["data_bytes"]
    assert region["populated_bytes"] == region["ready_bytes"] == data
    assert region["populate_done"] and region["numa"] == "2 nodes"
    assert region["populate_chunk_bytes"] == 4 * MIB and region["populate_threads"] == 2
    assert set(nodes) == {"0", "1"}
    assert sum(n["bytes"] for n in nodes.values()) == data
    assert all(n["bytes"] == n["populated_bytes"] == n["pinned_bytes"] for n in nodes.values())
    assert [n["gpus"] for n in nodes.values()] == [4, 4]
    # pinning: the prefix the GPU lanes batch below, and every chunk's timings
    assert gpu["pinned_bytes"] == gpu["pin_target_bytes"] == data
    assert gpu["pin_chunk_bytes"] == 4 * MIB and gpu["pinned_chunks"] == -(-data // (4 * MIB))
    for field in ("pin_first_chunk_s", "pin_chunk_seconds_max", "pin_register_seconds_total"):
        assert gpu[field] >= 0
    assert gpu["pin_error"] == ""
    collector = StatsCollector()
    collector.publish(st, {})
    families = {f.name: f for f in collector.collect()}
    node_bytes = families["kvoffload_region_node_bytes"]
    assert {s.labels["node"]: s.value for s in node_bytes.samples} == {
        k: float(v["bytes"]) for k, v in nodes.items()
    }
    pinned = families["kvoffload_region_node_pinned_bytes"]
    assert sum(s.value for s in pinned.samples) == data
    for name in (
        "kvoffload_region_populated_bytes",
        "kvoffload_region_ready_bytes",
        "kvoffload_region_pinned_bytes",
        "kvoffload_region_pin_chunk_max_seconds",
        "kvoffload_region_pin_first_chunk_seconds",
        "kvoffload_region_pin_wait_seconds",
    ):
        assert name in families, name
    assert np.isclose(families["kvoffload_region_populated_bytes"].samples[0].value, data)


def test_without_population_every_extent_counts_as_ready() -> None:
    """prefault = false: nothing populates, so nothing is waited for; a planned
    population (a kept region's, started once its blocks are recovered) holds the
    pinner back from the start, so it never faults the region in on its own."""
    g = Geometry.plan(16 * MIB, 2 * MIB, 16384)
    region = SharedOffloadRegion(f"/kvoffload-s{uuid.uuid4().hex[:8]}", g)
    try:
        st = region.statistics()
        assert st["ready_bytes"] == g.data_bytes and st["populated_bytes"] == 0
        assert region.wait_chunk(0, 0) is True
        region.prepare_populate()
        assert region.statistics()["ready_bytes"] == 0
        assert region.wait_chunk(0, 0) is None  # a pinner keeps waiting
        region.start_populate()
        assert region.wait_chunk(0, 10) is True
        region.wait_prefault()
        assert region.statistics()["ready_bytes"] == g.data_bytes
    finally:
        region.close()
