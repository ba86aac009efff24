"""The daemon's block checksum: zlib's CRC-32 values, from ISA-L's faster code."""

from __future__ import annotations

import zlib

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvoffloadd.copies import crc


def test_the_fast_implementation_is_the_one_loaded() -> None:
    # isal is a dependency: falling back to zlib quietly would cost promotions 2x
    assert crc.IMPLEMENTATION == "isal"


@given(st.binary(max_size=70_000), st.integers(0, 2**32 - 1))
def test_values_are_zlibs(data: bytes, start: int) -> None:
    assert crc.crc32(data) == zlib.crc32(data)
    assert crc.crc32(data, start) == zlib.crc32(data, start)


def test_a_region_slot_view_and_a_large_block_match_zlib() -> None:
    block = np.random.default_rng(7).integers(0, 256, 4 << 20, dtype=np.uint8)
    view = memoryview(block.data)[12345:]  # unaligned, as a slot inside a page need not be
    assert crc.crc32(view) == zlib.crc32(view)
    whole = crc.crc32(view[:1000])
    assert crc.crc32(view[1000:], whole) == zlib.crc32(view)
