"""NUMA placement and readiness on a fake two-socket, 8-GPU node (invariant 16): the
region is split by the GPUs on each node, every prefix of it is split alike, populate
threads are bound to their node's CPUs, a namespace whose GPUs share a node takes its
extents there, others interleave, and ready extents are handed out first."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_node import gpu_uuid, two_socket_node, write

from kvoffloadd.region.allocator import ExtentPool
from kvoffloadd.region.placement import (
    ChunkStates,
    ExtentPlacement,
    Part,
    assign_chunks,
    chunk_size,
    plan_parts,
    plan_region,
    split_threads,
)
from kvoffloadd.region.slots import SlotPool
from kvoffloadd.region.topology import parse_list, read_topology, usable_cpus

GIB = 1 << 30
MIB = 1 << 20
ALL_CPUS = set(range(96))


def test_the_topology_of_a_two_socket_node(tmp_path: Path) -> None:
    two_socket_node(tmp_path, (6, 2))
    topo = read_topology(str(tmp_path))
    assert [n.node for n in topo.nodes] == [0, 1]
    assert len(topo.nodes[0].cpus) == 48 and 24 in topo.nodes[1].cpus
    assert topo.nodes[0].mem_total_bytes == 1024 * GIB
    # the NIC and the NVSwitch are no GPUs
    assert len(topo.gpus) == 8
    assert [len(topo.gpus_on(n)) for n in (0, 1)] == [6, 2]
    assert topo.node_of_gpu(gpu_uuid(0)) == 0 and topo.node_of_gpu(gpu_uuid(7)) == 1
    assert topo.node_of_gpu(b"\x00" * 16) is None
    assert parse_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


def test_a_machine_without_numa_files_is_one_node(tmp_path: Path) -> None:
    topo = read_topology(str(tmp_path))
    assert len(topo.nodes) == 1 and topo.nodes[0].node == 0 and not topo.gpus
    parts, mode = plan_parts(topo, "auto", ALL_CPUS)
    assert mode == "one node" and parts == [Part(0, 0, frozenset())]


def test_parts_are_sized_by_the_gpus_on_each_node(tmp_path: Path) -> None:
    two_socket_node(tmp_path, (6, 2))
    topo = read_topology(str(tmp_path))
    parts, mode = plan_parts(topo, "auto", ALL_CPUS)
    assert mode == "2 nodes"
    assert [(p.node, p.gpus, len(p.cpus)) for p in parts] == [(0, 6, 48), (1, 2, 48)]
    plan = plan_region(256 * GIB, 2 * GIB, parts, 16, mode)
    assert plan.part_bytes == [192 * GIB, 64 * GIB]
    assert plan.threads == [12, 4]  # threads follow the bytes: both parts finish together
    assert plan.mbind
    # every prefix of the region is split close to 6:2, so both nodes' threads start
    # at its beginning and the in-order pinner never waits for one node only
    for n in range(1, len(plan.chunks) + 1):
        on_0 = plan.part_of_chunk[:n].count(0)
        assert abs(on_0 - n * 6 / 8) <= 1
    off, _ = plan_parts(topo, "off", ALL_CPUS)
    assert off == [Part(None, 8, frozenset())]


def test_threads_bind_only_to_cpus_the_daemon_may_use(tmp_path: Path) -> None:
    two_socket_node(tmp_path, (4, 4))
    parts, _ = plan_parts(read_topology(str(tmp_path)), "auto", {0, 1, 2, 3})
    assert parts[0].cpus == {0, 1, 2, 3} and parts[1].cpus == frozenset()


def test_nodes_without_gpus_or_memory_get_no_part(tmp_path: Path) -> None:
    two_socket_node(tmp_path, (8, 0))
    write(tmp_path, "/sys/devices/system/node/online", "0-2\n")  # node 2: memory only
    write(tmp_path, "/sys/devices/system/node/has_memory", "0-2\n")
    parts, mode = plan_parts(read_topology(str(tmp_path)), "auto", ALL_CPUS)
    assert [(p.node, p.gpus) for p in parts] == [(0, 8)] and mode == "1 of 3 nodes"
    plan = plan_region(8 * GIB, 2 * GIB, parts, 4, mode)
    assert plan.mbind and plan.part_bytes == [8 * GIB]  # all of it near the GPUs
    write(tmp_path, "/sys/devices/system/node/has_memory", "0\n")
    parts, mode = plan_parts(read_topology(str(tmp_path)), "auto", ALL_CPUS)
    assert mode == "one node" and parts[0].node == 0


def test_weights_without_gpus_are_equal() -> None:
    assert assign_chunks(4, [0, 0]) == [0, 1, 0, 1]
    assert assign_chunks(8, [6, 2]).count(1) == 2
    assert split_threads(3, [10, 10]) == [2, 1]
    assert split_threads(1, [10, 10]) == [1, 1]  # one each at least
    assert split_threads(8, [0, 10]) == [0, 8]


def test_chunks_are_whole_extents_and_pages() -> None:
    assert chunk_size(2 * GIB, 256 * MIB) == 2 * GIB
    assert chunk_size(100 * MIB, 64 * MIB) == 64 * MIB
    assert chunk_size(2 * GIB, 3 * MIB, 2 * MIB) == 2046 * MIB  # 6 MiB units
    plan = plan_region(5 * GIB, 2 * GIB, [Part(None, 0, frozenset())], 64, "off")
    assert plan.chunks == [(0, 2 * GIB), (2 * GIB, 2 * GIB), (4 * GIB, GIB)]
    assert plan.threads == [5]  # at most one thread per GiB
    assert not plan.mbind


def test_cpu_quota_bounds_the_default_thread_count(tmp_path: Path) -> None:
    write(tmp_path, "/proc/self/cgroup", "0::/kvoffloadd\n")
    write(
        tmp_path,
        "/proc/self/mountinfo",
        "40 22 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
    )
    write(tmp_path, "/sys/fs/cgroup/cgroup.controllers", "cpu memory\n")
    write(tmp_path, "/sys/fs/cgroup/kvoffloadd/cpu.max", "250000 100000\n")
    assert usable_cpus(str(tmp_path), set(range(16))) == 3
    assert usable_cpus(str(tmp_path), {0}) == 1
    write(tmp_path, "/sys/fs/cgroup/kvoffloadd/cpu.max", "max 100000\n")
    assert usable_cpus(str(tmp_path), set(range(16))) == 16


# ------------------------------------------------------------ extents


def pool_on(
    tmp_path: Path, gpus: tuple[int, int], extents: int = 16
) -> tuple[ExtentPool, ExtentPlacement]:
    """A pool of 2 MiB extents, chunks of two extents, on the fake node."""
    two_socket_node(tmp_path, gpus)
    topo = read_topology(str(tmp_path))
    parts, mode = plan_parts(topo, "auto", ALL_CPUS)
    plan = plan_region(extents * 2 * MIB, 4 * MIB, parts, 2, mode)
    states = ChunkStates(len(plan.chunks), 2, extents)
    for c in range(len(plan.chunks)):
        states.mark_populated(c)
    placement = ExtentPlacement(plan, 2 * MIB, extents, states, topo)
    return ExtentPool(extents, 2 * MIB, placement=placement), placement


def test_a_namespace_whose_gpus_share_a_node_gets_extents_there(tmp_path: Path) -> None:
    pool, placement = pool_on(tmp_path, (4, 4))
    node1 = SlotPool(pool, owner=1, slot_bytes=MIB)
    placement.gpu_worker(1, gpu_uuid(4))
    placement.gpu_worker(1, gpu_uuid(7))  # ranks on GPUs 4-7: all on node 1
    node1.allocate(8)  # four extents
    assert {placement.part_of_extent[e] for e in node1.extents if e is not None} == {1}
    assert pool.fallback_extents_total == 0
    # a tensor-parallel engine spread over both sockets interleaves
    both = SlotPool(pool, owner=2, slot_bytes=MIB)
    placement.gpu_worker(2, gpu_uuid(0))
    placement.gpu_worker(2, gpu_uuid(5))
    both.allocate(8)
    parts = [placement.part_of_extent[e] for e in both.extents if e is not None]
    assert parts == [0, 1, 0, 1]


def test_a_full_node_falls_back_to_the_other_and_counts_it(tmp_path: Path) -> None:
    pool, placement = pool_on(tmp_path, (4, 4), extents=8)
    placement.gpu_worker(1, gpu_uuid(0))
    a = SlotPool(pool, owner=1, slot_bytes=2 * MIB)
    a.allocate(6)  # node 0 holds 4 extents
    got = [placement.part_of_extent[e] for e in a.extents if e is not None]
    assert got[:4] == [0, 0, 0, 0] and got[4:] == [1, 1]
    assert pool.fallback_extents_total == 2


def test_a_namespace_id_given_again_forgets_the_old_gpus(tmp_path: Path) -> None:
    _, placement = pool_on(tmp_path, (4, 4))
    placement.gpu_worker(3, gpu_uuid(5))
    assert placement.preferred_part(3) == 1
    placement.forget(3)
    assert placement.preferred_part(3) is None


def test_ready_extents_are_handed_out_first() -> None:
    """Scenario: a 6-chunk region on one node whose chunk 0 is populated last (its
    thread was slow): a new namespace gets chunk 1's extent, not chunk 0's."""
    plan = plan_region(12 * MIB, 2 * MIB, [Part(0, 0, frozenset())], 1, "one node")
    states = ChunkStates(len(plan.chunks))
    placement = ExtentPlacement(plan, 2 * MIB, 6, states)
    pool = ExtentPool(6, 2 * MIB, placement=placement)
    states.mark_populated(1)
    states.mark_populated(2)
    a = SlotPool(pool, owner=0, slot_bytes=2 * MIB)
    assert a.allocate(2) == [0, 1] and a.extents == [1, 2]
    assert pool.unready_extents_total == 0
    assert a.allocate(1) == [2] and a.extents[2] == 0  # nothing ready left: the lowest
    assert pool.unready_extents_total == 1
    # while pinning, populated is not enough: pinned chunks come first
    states.track_pinning()
    for c in range(6):
        states.mark_populated(c)
    states.mark_pinned(4)
    assert [states.is_ready(c) for c in range(6)] == [True] * 4 + [False] * 2
    b = SlotPool(pool, owner=1, slot_bytes=2 * MIB)
    assert b.allocate(1) == [0] and b.extents == [3]
    states.stop_pinning()  # the pinner failed: populated is ready again
    assert states.all_ready


@pytest.mark.parametrize("pinning", [False, True])
def test_all_ready_is_the_fast_path(pinning: bool) -> None:
    states = ChunkStates(3)
    if pinning:
        states.track_pinning()
    for c in range(3):
        assert not states.all_ready
        states.mark_populated(c)
    assert states.all_ready is not pinning
    states.mark_pinned(3)
    assert states.all_ready
    assert states.wait_populated(1, 0) is True


def test_huge_page_geometry_aligns_the_data_and_keeps_the_old_plans() -> None:
    from kvoffloadd.region.segment import Geometry, RegionError

    g = Geometry.plan(2 * GIB, GIB, 16384, GIB)  # the tables take the first 1 GiB page
    assert (g.num_extents, g.data_offset, g.region_bytes, g.page_bytes) == (1, GIB, 2 * GIB, GIB)
    g = Geometry.plan(64 * GIB, GIB, 16384, GIB)
    assert g.data_offset % GIB == 0 and g.region_bytes <= 64 * GIB and g.num_extents == 63
    with pytest.raises(RegionError, match="multiple of the huge page size"):
        Geometry.plan(8 * GIB, 256 * MIB, 16384, GIB)
    # without huge pages (and with 2 MiB ones) the plan is what kept regions were made with
    for page in (4096, 2 * MIB):
        g = Geometry.plan(GIB, 16 * MIB, 16384, page)
        assert (g.num_extents, g.data_offset, g.region_bytes) == (63, 8 * MIB, 1016 * MIB)
