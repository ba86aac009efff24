"""Copies a worker runs itself through its mapping of the region: planned from the
region's own tables, and checked against the slot records, so a worker never writes a
slot that is not its engine's lease and never uses bytes that changed under its read.

A real region and a real index (the daemon's loop thread is this test), a real
mapping of the region by descriptor; no daemon process.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvoffload.datapath.client_copy import LocalCopies, RegionMapping, SlotChanged
from kvoffload.datapath.runs import CacheGeometry
from kvoffload.protocol.messages import KVLayout
from kvoffloadd.index.index import NamespaceIndex
from kvoffloadd.index.leases import new_token
from kvoffloadd.region.region import Geometry, SharedOffloadRegion
from kvoffloadd.region.slots import SlotPool

PAGE = 4096
BLOCKS = 16


@pytest.fixture
def region() -> Iterator[SharedOffloadRegion]:
    r = SharedOffloadRegion(
        f"/kvoffload-u{uuid.uuid4().hex[:8]}", Geometry.plan(8 << 20, 2 << 20, 16384)
    )
    yield r
    r.close()


def make(region: SharedOffloadRegion) -> tuple[NamespaceIndex, LocalCopies, torch.Tensor]:
    layout = KVLayout([PAGE])
    slots = SlotPool(region.pool, 0, 16384)
    region.register_namespace(0, "n", "fp", b"")
    index = NamespaceIndex(0, "n", layout, "fp", slots, journal=region.journal_for(0, slots))
    cache = torch.zeros(BLOCKS, PAGE, dtype=torch.int8)
    mapping = RegionMapping(region.open_fd(), region.geometry.region_bytes)
    local = LocalCopies(
        layout, 0, [CacheGeometry(BLOCKS, PAGE, 0, PAGE)], [cache.data_ptr()], 0, 16384, mapping
    )
    return index, local, cache


def store_k(index: NamespaceIndex, token: int) -> list[int]:
    """The key ``k`` stored by an engine into a slot leased to ``token``; its slot."""
    slots = index.lease(token, 1)
    index.claim(token, 1, [b"k"], slots)
    index.mark_written(slots, 0)
    index.commit(token, 1, [b"k"], True)
    return slots


def ids(*xs: int) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


def test_a_store_writes_its_leased_slots_and_nothing_else(region: SharedOffloadRegion) -> None:
    index, local, cache = make(region)
    token = new_token()
    slots = index.lease(token, 2)
    cache[3] = 7
    cache[4] = -3
    assert local.store(ids(*slots), ids(3, 4), [], token) == 2 * PAGE
    index.claim(token, 1, [b"a", b"b"], slots)
    index.mark_written(slots, 0)
    index.commit(token, 1, [b"a", b"b"], True)
    out = torch.zeros(BLOCKS, PAGE, dtype=torch.int8)
    reader = LocalCopies(
        index.layout, 0, [CacheGeometry(BLOCKS, PAGE, 0, PAGE)], [out.data_ptr()], 0, 16384,
        local.region,
    )  # fmt: skip
    reader.load(ids(*slots), ids(9, 10), 0, [], [b"a", b"b"])
    assert torch.equal(out[9], cache[3]) and torch.equal(out[10], cache[4])
    with pytest.raises(SlotChanged, match="no longer leased"):
        local.store(ids(*slots), ids(3, 4), [], token)  # READY now: not a lease any more
    other = index.lease(new_token(), 1)
    with pytest.raises(SlotChanged, match="no longer leased"):
        local.store(ids(*other), ids(3), [], token)  # another engine's lease
    assert not cache[5:].any()


def test_a_load_checks_its_keys_before_and_the_slot_after(region: SharedOffloadRegion) -> None:
    index, local, _cache = make(region)
    token = new_token()
    slots = store_k(index, token)
    with pytest.raises(SlotChanged, match="no longer holds the key"):
        local.load(ids(*slots), ids(0), 0, [], [b"other"])
    assert local.load(ids(*slots), ids(0), 0, [], [b"k"]) == PAGE
    index.evict([b"k"])  # freed (no mirror): the slot may be reused at once
    with pytest.raises(SlotChanged):
        local.load(ids(*slots), ids(0), 0, [], [b"k"])


def test_a_slot_rewritten_during_a_read_is_detected(region: SharedOffloadRegion) -> None:
    index, local, _cache = make(region)
    token = new_token()
    slots = store_k(index, token)

    def copy_while_the_daemon_restores(dst: np.ndarray, src: np.ndarray, n: np.ndarray) -> None:
        # mid-copy: evicted, leased again, stored again under the same key
        index.evict([b"k"])
        store_k(index, token)

    local._copy = copy_while_the_daemon_restores
    with pytest.raises(SlotChanged, match="rewritten"):
        local.load(ids(*slots), ids(0), 0, [], [b"k"])


def test_engine_block_ids_are_checked_before_any_copy(region: SharedOffloadRegion) -> None:
    index, local, _cache = make(region)
    token = new_token()
    slots = index.lease(token, 1)
    from kvoffload.protocol.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="outside the registered caches"):
        local.store(ids(*slots), ids(BLOCKS), [], token)
