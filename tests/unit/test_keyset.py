"""The index's set of ready keys (kvoffloadd.index.keyset): the C set and the Python
path answer alike, against a plain set, under any mix of operations."""

from __future__ import annotations

import os
import random
import shutil
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffloadd.index import keyset
from kvoffloadd.index.keyset import KeySetLike, PyKeySet, key_set

# keyset._NativeKeySet: the C set, private to keyset (None where not built); the index
# uses it unless KVOFFLOAD_NO_NATIVE_INDEX is set
BUILT = keyset._NativeKeySet is not None  # type: ignore[attr-defined]
KEY_BYTES = 12
POOL = [os.urandom(KEY_BYTES) for _ in range(64)]  # few keys: adds and removals collide


def both() -> list[KeySetLike]:
    return [key_set(native=True), PyKeySet()] if BUILT else [PyKeySet()]


def test_the_c_key_set_is_built_where_a_compiler_is() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: lookups take the Python path")
    assert BUILT, "kvoffloadd.index._keyset did not build: pip install -e ."


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "discard", "update", "prefix"]),
        st.lists(st.integers(0, len(POOL) - 1), max_size=12),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_any_operations_answer_as_a_set_does(steps: list[tuple[str, list[int]]]) -> None:
    sets, model = both(), set[bytes]()
    for op, picks in steps:
        keys = [POOL[i] for i in picks]
        if op == "add":
            for k in keys:
                model.add(k)
                for s in sets:
                    s.add(k)
        elif op == "discard":
            for k in keys:
                model.discard(k)
                for s in sets:
                    s.discard(k)
        elif op == "update":
            model.update(keys)
            for s in sets:
                s.update(keys)
        want = next((i for i, k in enumerate(keys) if k not in model), len(keys))
        for s in sets:
            assert s.prefix(keys) == want
            assert s.prefix_packed(b"".join(keys), KEY_BYTES) == want
            assert len(s) == len(model)
            assert sorted(s) == sorted(model)
            assert all((k in s) == (k in model) for k in POOL)


def test_many_keys_in_and_out_in_any_order() -> None:
    """Tables that grow and shrink many times, removals in random order (each one
    shifts back the entries after it)."""
    rng = random.Random(7)
    keys = [rng.randbytes(KEY_BYTES) for _ in range(30_000)]
    for s in both():
        s.update(keys)
        assert len(s) == len(keys) and s.prefix(keys) == len(keys)
        gone = rng.sample(keys, 25_000)
        for i, k in enumerate(gone):
            s.discard(k)
            if i % 5000 == 0:  # every key still in is still found
                left = set(keys) - set(gone[: i + 1])
                assert len(s) == len(left) and all(k in s for k in left)
        left = set(keys) - set(gone)
        assert set(s) == left and not any(k in s for k in gone)
        packed = b"".join(sorted(left))
        assert s.prefix_packed(packed, KEY_BYTES) == len(left)


def test_other_lengths_are_never_in_and_never_added() -> None:
    for s in both():
        s.add(POOL[0])
        assert POOL[0][:-1] not in s and POOL[0] + b"x" not in s and "text" not in s
        assert s.prefix([POOL[0], POOL[0][:-1], POOL[0]]) == 1
        assert s.prefix_packed(POOL[0] + POOL[0], KEY_BYTES * 2) == 0
        s.discard(POOL[0][:-1])
        assert len(s) == 1
    if not BUILT:
        pytest.skip("the C set was not built")
    native = key_set(native=True)
    native.add(POOL[0])
    with pytest.raises(ValueError, match="keys of 12 bytes, not 11"):
        native.add(POOL[1][:-1])
    with pytest.raises(TypeError, match="keys are bytes"):
        native.add("text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="do not split"):
        native.prefix_packed(b"x" * 13, KEY_BYTES)
    with pytest.raises(ValueError, match=r"1\.\.64 bytes"):
        key_set(native=True).add(b"x" * 65)
    with pytest.raises(ValueError, match="16 bytes"):
        keyset._NativeKeySet(b"short")  # type: ignore[attr-defined]


def test_adding_a_key_already_in_never_grows_the_table() -> None:
    if not BUILT:
        pytest.skip("the C set was not built")
    s = key_set(native=True)
    for k in POOL:
        s.add(k)
        size = s.table_bytes()  # type: ignore[attr-defined]
        s.add(k)
        s.update([k, k])
        assert s.table_bytes() == size and len(s) == POOL.index(k) + 1  # type: ignore[attr-defined]
    assert s.prefix_packed(b"", 0) == 0 and PyKeySet().prefix_packed(b"", 0) == 0


def test_each_set_hashes_under_its_own_secret() -> None:
    """Engines choose keys: where a key goes in the table depends on a secret nobody
    sees, so the same keys lie in another order in every set."""
    if not BUILT:
        pytest.skip("the C set was not built")
    keys = [os.urandom(KEY_BYTES) for _ in range(1000)]
    a, b = key_set(native=True), key_set(native=True)
    a.update(keys)
    b.update(keys)
    assert set(a) == set(b) and list(a) != list(b)


SECRET = bytes(range(16))


def _rotl(x: np.ndarray, b: int) -> np.ndarray:
    out: np.ndarray = (x << np.uint64(b)) | (x >> np.uint64(64 - b))
    return out


def siphash13(secret: bytes, keys: list[bytes]) -> np.ndarray:
    """SipHash-1-3 (the reference algorithm) of equal-length keys, all at once."""
    k0, k1 = (np.uint64(int.from_bytes(secret[i : i + 8], "little")) for i in (0, 8))
    n, length = len(keys), len(keys[0])
    v = [
        np.full(n, k0 ^ np.uint64(0x736F6D6570736575)),
        np.full(n, k1 ^ np.uint64(0x646F72616E646F6D)),
        np.full(n, k0 ^ np.uint64(0x6C7967656E657261)),
        np.full(n, k1 ^ np.uint64(0x7465646279746573)),
    ]

    def sipround() -> None:
        for a, b, r1, r2 in ((0, 1, 13, 32), (2, 3, 16, 0), (0, 3, 21, 0), (2, 1, 17, 32)):
            v[a] += v[b]
            v[b] = _rotl(v[b], r1) ^ v[a]
            if r2:
                v[a] = _rotl(v[a], r2)

    padded = np.frombuffer(b"".join(k + bytes(-length % 8) for k in keys), dtype="<u8")
    words = padded.reshape(n, -1)
    for i in range(length // 8):
        v[3] ^= words[:, i]
        sipround()
        v[0] ^= words[:, i]
    last = np.uint64(length << 56) | (words[:, -1] if length % 8 else np.uint64(0))
    v[3] ^= last
    sipround()
    v[0] ^= last
    v[2] ^= np.uint64(0xFF)
    for _ in range(3):
        sipround()
    out: np.ndarray = v[0] ^ v[1] ^ v[2] ^ v[3]
    return out


def test_tags_are_siphash_1_3_under_the_secret() -> None:
    """Every length's keys, whole words and tails of any size, hash as the reference."""
    if not BUILT:
        pytest.skip("the C set was not built")
    s = keyset._NativeKeySet(SECRET)  # type: ignore[attr-defined]
    rng = random.Random(7)
    for length in range(1, 65):
        keys = [rng.randbytes(length) for _ in range(20)]
        want = [int(h) & 0xFFFFFFFF or 1 for h in siphash13(SECRET, keys)]
        assert [s._tag(k) for k in keys] == want, length


def _colliding(keys: list[bytes]) -> list[tuple[bytes, bytes]]:
    """Pairs of ``keys`` whose tags (under ``SECRET``) are equal."""
    tags = siphash13(SECRET, keys) & np.uint64(0xFFFFFFFF)
    order = np.argsort(tags, kind="stable")
    same = np.flatnonzero(tags[order][1:] == tags[order][:-1])
    return [(keys[order[i]], keys[order[i + 1]]) for i in same]


@pytest.mark.parametrize("differ", ["in the last bytes", "in the first word"])
def test_keys_of_one_tag_are_told_apart(differ: str) -> None:
    """Keys whose tags are equal are compared byte for byte: those that differ only
    past the whole words, or only in the first word, are different keys."""
    if not BUILT:
        pytest.skip("the C set was not built")
    n = 1 << 18  # about 8 pairs of equal 32-bit tags among them
    if differ == "in the last bytes":
        keys = [b"samehead" + i.to_bytes(4, "little") for i in range(n)]
    else:
        keys = [i.to_bytes(8, "little") + b"tail" for i in range(n)]
    pairs = _colliding(keys)
    assert pairs, "no two keys share a tag: make more"
    for a, b in pairs:
        s = keyset._NativeKeySet(SECRET)  # type: ignore[attr-defined]
        assert s._tag(a) == s._tag(b)
        s.add(a)
        assert b not in s and s.prefix([b]) == 0 and s.prefix_packed(b, 12) == 0
        s.add(b)
        assert len(s) == 2 and a in s and b in s and s.prefix_packed(a + b, 12) == 2
        s.discard(a)
        assert a not in s and b in s and len(s) == 1


def test_its_memory_is_traced_as_the_index_is_measured() -> None:
    if not BUILT:
        pytest.skip("the C set was not built")
    keys = [os.urandom(32) for _ in range(10_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        s = key_set(native=True)
        s.update(keys)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert used >= len(keys) * 32  # the keys' bytes at least, in the table
    for k in keys:
        s.discard(k)
    assert len(s) == 0 and list(s) == []
