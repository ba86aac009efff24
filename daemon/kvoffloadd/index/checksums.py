"""Block checksums (``verify_checksums``): a CRC32 per stored block and rank, checked
before every load, and the blocks found corrupt.

Rules:
- A store's copy reports the CRC32 of each slot's rank area once its bytes are in the
  region (``set``); a load's copy compares before copying (``expected``, -1 where no
  checksum is known: blocks recovered by a warm restart, promoted from a tier).
- A block whose bytes no longer match is never served again: it leaves lookups at
  once and is evicted now, or when its last pin goes (``corrupt``).
- Keyed by slot: a freed slot forgets its checksums (``forget``).
- Loop thread only, like the index that owns it.
"""

from __future__ import annotations

from collections.abc import Sequence


class BlockChecksums:
    def __init__(self, world_size: int) -> None:
        self._world_size = world_size
        self._crc: dict[int, int] = {}  # slot * world_size + rank -> CRC32
        self.corrupt: set[bytes] = set()  # keys found corrupt, evicted when unpinned

    def set(self, slots: Sequence[int], rank: int, crcs: Sequence[int]) -> None:
        w = self._world_size
        for slot, crc in zip(slots, crcs):
            self._crc[slot * w + rank] = crc

    def expected(self, slots: Sequence[int], rank: int) -> list[int]:
        """Stored checksums of the slots' rank areas; -1 where none is known."""
        w = self._world_size
        return [self._crc.get(slot * w + rank, -1) for slot in slots]

    def forget(self, slot: int) -> None:
        self.forget_many((slot,))

    def forget_many(self, slots: Sequence[int]) -> None:
        if self._crc:
            w, pop = self._world_size, self._crc.pop
            for slot in slots:
                for rank in range(w):
                    pop(slot * w + rank, None)
