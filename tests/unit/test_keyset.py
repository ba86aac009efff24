"""The index's set of ready keys (kvoffloadd.index.keyset): the C set and the Python
path answer alike, against a plain set, under any mix of operations."""

from __future__ import annotations

import os
import random
import shutil
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffloadd.index import keyset
from kvoffloadd.index.keyset import KeySetLike, PyKeySet, key_set

BUILT = keyset._NativeKeySet is not None  # used unless KVOFFLOAD_NO_NATIVE_INDEX is set
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
        keyset._NativeKeySet(b"short")


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
