"""Packed fields: keys and block ids as the wire carries them.

Rules:
- All keys of one field have one length ``key_bytes`` (1..``MAX_KEY_BYTES``) and are
  concatenated into one ``bytes`` object; a field holds at most
  ``MAX_KEYS_PER_MESSAGE`` keys. Block ids and slots are little-endian int64.
- A packed field costs nothing until it is used: the receiver splits it when it needs
  the keys or ids, and every split checks the field's shape first (``ValueError``
  for a malformed one: the daemon answers ``INVALID_ARGUMENT``).
- Whoever sends keys chooses ``key_bytes`` and the count: what is memoised per shape
  (``_splitters``) is bounded.
- What they answer depends on their arguments alone (the splitter memo aside); no I/O.
"""

from __future__ import annotations

import array
import struct
import sys
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.protocol.messages import MAX_KEY_BYTES, MAX_KEYS_PER_MESSAGE


def pack_keys(keys: list[bytes] | tuple[bytes, ...]) -> tuple[bytes, int]:
    """Concatenate equal-length keys; returns ``(packed, key_bytes)``.

    Raises ValueError for keys of different lengths, empty keys or keys longer than
    ``MAX_KEY_BYTES``.
    """
    if not keys:
        return b"", 0
    key_bytes = len(keys[0])
    packed = b"".join(keys)
    if len(packed) != key_bytes * len(keys):
        raise ValueError("all keys of one call must have the same length")
    if not 0 < key_bytes <= MAX_KEY_BYTES:
        raise ValueError(f"keys must be 1..{MAX_KEY_BYTES} bytes long, got {key_bytes}")
    if len(keys) > MAX_KEYS_PER_MESSAGE:
        raise ValueError(f"{len(keys)} keys in one call; split it (at most {MAX_KEYS_PER_MESSAGE})")
    return packed, key_bytes


def packed_count(packed: bytes, key_bytes: int) -> int:
    """How many keys a packed key field holds; raises ValueError when it is malformed."""
    if not packed:
        return 0
    if not 0 < key_bytes <= MAX_KEY_BYTES or len(packed) % key_bytes:
        raise ValueError(
            f"packed keys of {len(packed)} bytes do not split into keys of {key_bytes} bytes"
        )
    n = len(packed) // key_bytes
    if n > MAX_KEYS_PER_MESSAGE:
        raise ValueError(f"{n} keys in one request; split it (at most {MAX_KEYS_PER_MESSAGE})")
    return n


def unpack_keys(packed: bytes, key_bytes: int) -> list[bytes]:
    """Split a packed key field; raises ValueError when it is malformed."""
    n = packed_count(packed, key_bytes)
    if n <= 1:
        return [packed] if packed else []
    if n <= SPLIT_MAX_KEYS:  # a request's or a step's few keys: one C call
        splitter = _splitters.get((key_bytes, n))
        if splitter is None:
            splitter = _splitter(key_bytes, n)
        return list(splitter(packed))
    if len(packed) <= SMALL_UNPACK_BYTES:  # slicing beats numpy's setup
        return [packed[i : i + key_bytes] for i in range(0, len(packed), key_bytes)]
    # A void dtype keeps every byte (an "S" dtype would strip trailing NULs).
    keys: list[bytes] = np.frombuffer(packed, dtype=np.dtype((np.void, key_bytes))).tolist()
    return keys


# Fields of at most SPLIT_MAX_KEYS keys are split by a struct.Struct of n fields of
# key_bytes each (3x faster than slicing for 16 keys). The splitters are kept per
# (key_bytes, n), at most SPLITTERS of them (whoever sends keys chooses both: the memo
# is cleared when full, so it stays under SPLITTERS x SPLIT_MAX_KEYS fields).
SPLIT_MAX_KEYS = 128
SPLITTERS = 64
_splitters: dict[tuple[int, int], Any] = {}


def _splitter(key_bytes: int, n: int) -> Any:
    if len(_splitters) >= SPLITTERS:
        _splitters.clear()
    split = _splitters[(key_bytes, n)] = struct.Struct(f"{key_bytes}s" * n).unpack
    return split


_ID_DTYPE = np.dtype("<i8")
# Fields up to this size are split without numpy: the few keys and slots of one engine
# step's pushes, where numpy's per-call setup costs more than the work.
SMALL_UNPACK_BYTES = 2048
_NATIVE_LE = sys.byteorder == "little"


def id_list(packed: bytes) -> list[int]:
    """``unpack_ids(packed).tolist()``, without numpy for a few ids."""
    if len(packed) % 8:
        raise ValueError(f"packed ids of {len(packed)} bytes are not a multiple of 8")
    if _NATIVE_LE and len(packed) <= SMALL_UNPACK_BYTES:
        ids: list[int] = memoryview(packed).cast("q").tolist()
        return ids
    out: list[int] = np.frombuffer(packed, dtype=_ID_DTYPE).tolist()
    return out


def pack_ids(ids: npt.ArrayLike) -> bytes:
    """Pack block ids or slots as little-endian int64 (a list without numpy: a third
    of the time for a step's or a request's few)."""
    if _NATIVE_LE and isinstance(ids, list):
        try:
            return array.array("q", ids).tobytes()
        except (TypeError, OverflowError):
            pass  # what numpy makes of it (or refuses), as for any other input
    return np.ascontiguousarray(ids, dtype=_ID_DTYPE).tobytes()


def unpack_ids(packed: bytes) -> npt.NDArray[np.int64]:
    """Inverse of ``pack_ids`` (a read-only view); ValueError when malformed."""
    if len(packed) % 8:
        raise ValueError(f"packed ids of {len(packed)} bytes are not a multiple of 8")
    return np.frombuffer(packed, dtype=_ID_DTYPE)
