"""The slot table as a namespace's journal (kvoffloadd.region.journal): the C writer and
the Python path write the same bytes under any mix of operations, and a batch with one
wrong slot or key writes nothing."""

from __future__ import annotations

import contextlib
import random
import shutil
import uuid
import zlib
from collections.abc import Callable, Iterator

import pytest

from kvoffload.datapath.regionfmt import SLOT_READY, SLOT_RECORD_BYTES, ready_crc
from kvoffloadd.region import journal
from kvoffloadd.region.allocator import ExtentPool
from kvoffloadd.region.region import Geometry, SharedOffloadRegion
from kvoffloadd.region.slots import SlotPool

MIB = 1 << 20
needs_c = pytest.mark.skipif(not journal.BUILT, reason="the C slot record writer is not built")


def test_the_c_writer_is_built_where_a_compiler_is() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the Python path writes the records")
    assert journal.BUILT, "kvoffloadd.region._slotrecords did not build: pip install -e ."


Made = tuple[SharedOffloadRegion, SlotPool, journal.RegionJournal]


@contextlib.contextmanager
def namespace(cls: type[journal.RegionJournal]) -> Iterator[Made]:
    """A 16 MiB region with namespace 3 owning extents 5, (a hole), 2, 9 (records in
    several extents, out of order), journaled by ``cls``."""
    region = SharedOffloadRegion(f"kvoffload-journal-{uuid.uuid4().hex[:8]}",
                                 Geometry.plan(16 * MIB, MIB, 4096))  # fmt: skip
    try:
        pool = ExtentPool(region.geometry.num_extents, MIB)
        slots = SlotPool(pool, owner=3, slot_bytes=4096)
        slots.extents = [5, None, 2, 9]
        yield region, slots, cls(region, 3, slots)
    finally:
        region.close()


def table(region: SharedOffloadRegion) -> bytes:
    return region.slot_table.tobytes()


def live_slots(slots: SlotPool) -> list[int]:
    spe = slots.slots_per_extent
    return [s for s in range(len(slots.extents) * spe) if slots.extents[s // spe] is not None]


@needs_c
@pytest.mark.parametrize("seed", range(6))
def test_the_c_writer_and_the_python_path_write_the_same_bytes(seed: int) -> None:
    rng = random.Random(seed)
    with (
        namespace(journal.NativeJournal) as (ra, sa, ja),
        namespace(journal.RegionJournal) as (rb, _, jb),
    ):
        live = live_slots(sa)
        for _ in range(60):
            op = rng.choice(["writing", "ready", "leased", "freed", "buried", "one"])
            n = rng.choice([1, 2, 16, 33, 200])  # both sides of the Python path's 32
            slots = rng.sample(live, n)
            keys = [rng.randbytes(rng.randint(1, 64)) for _ in slots]
            lease = rng.getrandbits(64)
            for j in (ja, jb):
                if op == "writing":
                    j.writing_many(slots, keys, lease)
                elif op == "ready":
                    j.ready_many(slots, keys)
                elif op == "leased":
                    j.leased_many(slots, lease)
                elif op == "freed":
                    j.freed_many(slots)
                elif op == "buried":
                    j.buried(slots[0])
                else:  # the one-slot calls go through the batches
                    j.writing(slots[0], keys[0], lease)
                    j.ready(slots[0], keys[0])
            assert table(ra) == table(rb), op


@needs_c
def test_a_ready_record_carries_its_sequence_number_and_crc() -> None:
    with namespace(journal.NativeJournal) as (region, slots, j):
        s = live_slots(slots)[:3]
        keys = [b"k" * 12, b"q" * 64, b"z"]
        j.writing_many(s, keys, 9)
        first = region.next_seqs(1) + 1
        j.ready_many(s, keys)
        spe, spe_max = slots.slots_per_extent, region.geometry.slots_per_extent_max
        for i, (slot, key) in enumerate(zip(s, keys)):
            ext = slots.extents[slot // spe]
            assert ext is not None
            r = region.slot_table[ext * spe_max + slot % spe]
            fields = (r["state"], r["ns"], r["seq"], r["lease"], bytes(r["key"]))
            assert fields == (SLOT_READY, 3, first + i, 9, key.ljust(64, b"\0"))
            assert r["crc"] == ready_crc(3, first + i, key)
            del r  # no view of the mapping outlives the region


@needs_c
def test_the_c_crc_is_zlibs() -> None:
    from kvoffloadd.region import _slotrecords

    rng = random.Random(7)
    for n in [0, 1, 13, 77, 4096]:
        data = rng.randbytes(n)
        assert _slotrecords.crc32(data) == zlib.crc32(data)


@pytest.mark.parametrize("cls", [journal.RegionJournal, journal.NativeJournal])
def test_a_slot_in_a_hole_is_a_broken_invariant_and_writes_nothing(
    cls: type[journal.RegionJournal],
) -> None:
    if cls is journal.NativeJournal and not journal.BUILT:
        pytest.skip("the C slot record writer is not built")
    with namespace(cls) as (region, slots, j):
        spe = slots.slots_per_extent
        good, hole = live_slots(slots)[:4], spe + 1  # extent index 1 is a hole
        before = table(region)
        calls: tuple[Callable[[], object], ...] = (
            lambda: j.writing_many([*good, hole], [b"k" * 8] * 5, 1),
            lambda: j.freed_many([*good, hole]),
            lambda: j.leased_many([*good, hole], 1),
            lambda: j.ready_many([*good, hole], [b"k" * 8] * 5),
        )
        for call in calls:
            with pytest.raises(AssertionError, match="hole"):
                call()
            assert table(region) == before


@needs_c
def test_a_bad_slot_or_key_is_refused_before_anything_is_written() -> None:
    from kvoffloadd.region import _slotrecords

    with namespace(journal.NativeJournal) as (region, slots, j):
        good = live_slots(slots)[:4]
        before = table(region)
        past = len(slots.extents) * slots.slots_per_extent
        with pytest.raises(AssertionError, match="not one of"):
            j.freed_many([*good, past])
        with pytest.raises(AssertionError, match="not one of"):
            j.freed_many([*good, -1])
        with pytest.raises(ValueError, match="65 bytes"):
            j.writing_many(good, [b"k"] * 3 + [b"x" * 65], 1)
        with pytest.raises(TypeError, match="bytes"):
            j.writing_many(good, [b"k"] * 3 + ["text"], 1)  # type: ignore[list-item]
        with pytest.raises(ValueError, match="fewer keys"):
            j.ready_many(good, [b"k"] * 3)
        assert table(region) == before
    # a record past the end of the mapping: refused, the buffer untouched
    buf = bytearray(4 * SLOT_RECORD_BYTES)
    with pytest.raises(IndexError, match="outside the mapping"):
        _slotrecords.freed(buf, 0, 4, [0, 1], 4, [0, 5])  # slot 5: record 5 of 4
    buf[:] = b"\xff" * len(buf)
    _slotrecords.freed(buf, 0, 4, [0], 4, [2])
    assert buf == b"\xff" * 192 + bytes(96) + b"\xff" * 96
