"""The daemon's one block checksum: CRC-32 with zlib's polynomial.

Rules:
- ``crc32`` is ISA-L's folding implementation (the ``isal`` package, a dependency) where
  it loads, zlib's otherwise. Both give the same value for the same bytes, so a block
  written by a daemon with one is checked by a daemon with the other, and the disk
  tier's files and the region's checksums keep their meaning.
- Both release the GIL while they run, so the tiers' threads check blocks in parallel
  with the loop thread.
- Why this one: a promotion copies each block once and checks it once, both at memory
  speed. zlib's CRC-32 runs at a third of memcpy, CRC32C in hardware at four fifths,
  ISA-L's CRC-32 at about 1.7x memcpy (`make bench`'s machine), so checking no longer
  doubles the cost of a promotion.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

_impl: Callable[[Any, int], int]
try:
    from isal.isal_zlib import crc32 as _isal_crc32

    _impl = _isal_crc32
    IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the fallback
    _impl = zlib.crc32
    IMPLEMENTATION = "zlib"


def crc32(data: Any, value: int = 0) -> int:
    """CRC-32 of a bytes-like object (zlib's ``crc32``, faster), continuing ``value``."""
    return int(_impl(data, value))
