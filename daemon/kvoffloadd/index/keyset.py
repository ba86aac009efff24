"""The set of a namespace's ready keys, that lookups probe.

Rules:
- A lookup answers how many leading keys are ready: ``prefix`` for a list of keys,
  ``prefix_packed`` for a request's packed key field, probed where it lies, with no key
  object made. The rest is a set of equal-length ``bytes``: ``add``, ``update``,
  ``discard``, ``in``, ``len``, iteration (in no particular order).
- Where the C set was built (``_keyset``, optional at install) it holds the keys in
  one table of its own, hashed with SipHash under a secret drawn per set (engines
  choose keys; nobody can choose ones that collide), its memory traced by
  ``tracemalloc`` like the rest of the index's. Elsewhere (or with
  ``KVOFFLOAD_NO_NATIVE_INDEX=1``) a Python ``set`` does the same, slower for long
  lookups: a key object and a set probe per key.
- A namespace's keys all have one length (storeindex.py refuses others before they
  get here); the C set takes the first key's length and refuses keys of another.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from itertools import takewhile
from typing import Protocol

from kvoffload.protocol.packing import unpack_keys

try:
    from kvoffloadd.index._keyset import KeySet as _NativeKeySet
except ImportError as exc:  # built where a compiler was found at install time
    logging.getLogger(__name__).info("no C key set (%s): lookups take the Python path", exc)
    _NativeKeySet = None  # type: ignore[assignment,misc]

BUILT = _NativeKeySet is not None  # whether the C key set was built
NATIVE = BUILT and not os.environ.get("KVOFFLOAD_NO_NATIVE_INDEX")


class KeySetLike(Protocol):
    def add(self, key: bytes, /) -> None: ...
    def update(self, keys: Iterable[bytes], /) -> None: ...
    def discard(self, key: bytes, /) -> None: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[bytes]: ...
    def prefix(self, keys: Sequence[bytes], /) -> int: ...
    def prefix_packed(self, packed: bytes, key_bytes: int, /) -> int: ...


class PyKeySet(set[bytes]):
    """The Python path: a set of the keys themselves."""

    def prefix(self, keys: Sequence[bytes], /) -> int:
        if self.issuperset(keys):  # all of them (the usual hit): one C loop, no call per key
            return len(keys)
        # stops at the first key not ready; hashes are cached
        return len(list(takewhile(self.__contains__, keys)))

    def prefix_packed(self, packed: bytes, key_bytes: int, /) -> int:
        return self.prefix(unpack_keys(packed, key_bytes))


def key_set(native: bool = NATIVE) -> KeySetLike:
    """An empty set of ready keys: the C one where it was built."""
    if native and _NativeKeySet is not None:
        return _NativeKeySet(os.urandom(16))
    return PyKeySet()
