"""Eviction policies: which ready, unpinned block goes first.

A policy *stores* the blocks of one namespace (key -> Block) and orders them; the index
owns reference counts and slots. Semantics follow vLLM's CPU offloading policies
(research/vllm_kv_offload.md section 3):

- ``touch(keys)`` walks ``reversed(keys)`` so that ``keys[0]`` ends most recently used:
  the head of a prefix is kept longest.
- ``evict(n, protected)`` is atomic: it removes exactly ``n`` blocks whose ``ref == 0``
  and whose key is not in ``protected``, or removes nothing and returns ``None``.
  Blocks being written (``ref == -1``) and pinned blocks (``ref > 0``) never qualify.
- ``lru``: one ordered map, evicted from the least recently used end.
- ``arc``: adaptive replacement (Megiddo & Modha) with recency list t1, frequency list
  t2, ghost lists b1/b2 and an adaptive target size for t1, as vLLM implements it.
- ``Block`` is the C type of ``_block`` where it was built (optional at install, like
  the C key set, and off with ``KVOFFLOAD_NO_NATIVE_INDEX=1``), else ``PyBlock``: the
  same attributes either way; a store makes one per new key.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol


class PyBlock:
    """One stored block: its slot and reference count (-1 writing, 0 ready, N pinned).
    The Python path of ``Block``: ``_block.Block`` has the same attributes."""

    __slots__ = ("ref", "slot")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.ref = -1

    @property
    def is_ready(self) -> bool:
        return self.ref >= 0

    def __repr__(self) -> str:
        return f"Block(slot={self.slot}, ref={self.ref})"


try:
    from kvoffloadd.index._block import Block as _NativeBlock
except ImportError as exc:  # built where a compiler was found at install time
    logging.getLogger(__name__).info("no C Block (%s): blocks are Python objects", exc)
    _NativeBlock = None  # type: ignore[assignment,misc]

BUILT = _NativeBlock is not None  # whether the C Block was built
NATIVE = BUILT and not os.environ.get("KVOFFLOAD_NO_NATIVE_INDEX")
if TYPE_CHECKING:
    Block = PyBlock
else:
    Block = _NativeBlock if NATIVE else PyBlock


class CachePolicy(Protocol):
    def get(self, key: bytes) -> Block | None: ...
    def insert(self, key: bytes, block: Block) -> None: ...
    def remove(self, key: bytes) -> None: ...
    def remove_many(self, keys: Iterable[bytes]) -> None: ...
    def touch(self, keys: Sequence[bytes]) -> None: ...
    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Block]] | None: ...
    def items(self) -> Iterator[tuple[bytes, Block]]: ...
    def clear(self) -> None: ...
    def __len__(self) -> int: ...


def _take_evictable(
    blocks: Iterable[tuple[bytes, Block]], n: int, protected: set[bytes], taken: set[bytes]
) -> list[tuple[bytes, Block]]:
    out: list[tuple[bytes, Block]] = []
    if n <= 0:
        return out
    for key, block in blocks:
        if block.ref == 0 and key not in protected and key not in taken:
            out.append((key, block))
            if len(out) == n:
                break
    return out


class LRUPolicy:
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()
        # The map's own C method: no Python frame per lookup on the hot path.
        self.get: Callable[[bytes], Block | None] = self._blocks.get

    def insert(self, key: bytes, block: Block) -> None:
        self._blocks[key] = block

    def remove(self, key: bytes) -> None:
        del self._blocks[key]

    def remove_many(self, keys: Iterable[bytes]) -> None:
        blocks = self._blocks
        for key in keys:
            del blocks[key]

    def touch(self, keys: Sequence[bytes]) -> None:
        blocks = self._blocks
        for key in reversed(keys):
            if key in blocks:
                blocks.move_to_end(key)

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Block]] | None:
        victims = _take_evictable(self._blocks.items(), n, protected, set())
        if len(victims) < n:
            return None
        for key, _ in victims:
            del self._blocks[key]
        return victims

    def items(self) -> Iterator[tuple[bytes, Block]]:
        return iter(list(self._blocks.items()))

    def clear(self) -> None:
        self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)


class ARCPolicy:
    """Adaptive replacement cache; ``capacity`` bounds the ghost lists."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.target_t1_size = 0.0
        self.t1: OrderedDict[bytes, Block] = OrderedDict()
        self.t2: OrderedDict[bytes, Block] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def get(self, key: bytes) -> Block | None:
        block = self.t1.get(key)
        return block if block is not None else self.t2.get(key)

    def insert(self, key: bytes, block: Block) -> None:
        self.t1[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: bytes) -> None:
        if self.t1.pop(key, None) is None:
            del self.t2[key]

    def remove_many(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.remove(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            block = self.t1.get(key)
            if block is not None:
                if block.is_ready:
                    del self.t1[key]
                    self.t2[key] = block
                else:
                    self.t1.move_to_end(key)
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                delta = max(1.0, len(self.b2) / len(self.b1))
                self.target_t1_size = min(self.target_t1_size + delta, float(self.capacity))
            elif key in self.b2:
                delta = max(1.0, len(self.b1) / len(self.b2))
                self.target_t1_size = max(self.target_t1_size - delta, 0.0)

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Block]] | None:
        if n <= 0:
            return []
        # Plan first (atomicity), then apply.
        t1_victims = _take_evictable(self.t1.items(), n, protected, set())
        t2_victims = _take_evictable(self.t2.items(), n, protected, set())
        plan: list[tuple[bytes, Block, bool]] = []
        i1 = i2 = 0
        virtual_t1 = len(self.t1)
        for _ in range(n):
            from_t1 = virtual_t1 >= int(self.target_t1_size) and i1 < len(t1_victims)
            if not from_t1 and i2 >= len(t2_victims):
                from_t1 = i1 < len(t1_victims)
            if from_t1:
                key, block = t1_victims[i1]
                i1 += 1
                virtual_t1 -= 1
                plan.append((key, block, True))
            elif i2 < len(t2_victims):
                key, block = t2_victims[i2]
                i2 += 1
                plan.append((key, block, False))
            else:
                return None
        for key, _, in_t1 in plan:
            if in_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)
        return [(key, block) for key, block, _ in plan]

    def items(self) -> Iterator[tuple[bytes, Block]]:
        return iter(list(self.t1.items()) + list(self.t2.items()))

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


POLICIES: dict[str, type[LRUPolicy] | type[ARCPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> CachePolicy:
    """Build a registered policy; ValueError names the allowed ones."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"Unknown cache policy: {name!r} (allowed: {', '.join(sorted(POLICIES))})"
        ) from None
    return cls(capacity)
