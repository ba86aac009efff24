"""The index's Block (kvoffloadd.index.policies): the C type and the Python class have
the same attributes and behave alike, and the policies hold either."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

import numpy as np
import pytest

from kvoffloadd.index import policies
from kvoffloadd.index.policies import POLICIES, PyBlock

if TYPE_CHECKING:
    from kvoffloadd.index._block import Block as NativeBlock

# policies._NativeBlock: the C type, private to policies (None where not built)
KINDS: list[type[PyBlock] | type[NativeBlock]] = [PyBlock]
if policies.BUILT:
    KINDS.append(policies._NativeBlock)  # type: ignore[attr-defined]


def test_the_c_block_is_built_where_a_compiler_is() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: blocks are Python objects")
    assert policies.BUILT, "kvoffloadd.index._block did not build: pip install -e ."
    # unless KVOFFLOAD_NO_NATIVE_INDEX (mypy reads Block as PyBlock: the same attributes)
    assert policies.Block is policies._NativeBlock  # type: ignore[attr-defined,comparison-overlap]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__module__)
def test_a_block_starts_written_and_counts_its_pins(
    kind: type[PyBlock] | type[NativeBlock],
) -> None:
    b = kind(7)
    assert (b.slot, b.ref, b.is_ready) == (7, -1, False)
    assert repr(b) == "Block(slot=7, ref=-1)"
    b.ref = 0
    assert b.is_ready
    b.ref += 2
    b.ref -= 1
    assert (b.ref, b.is_ready, repr(b)) == (1, True, "Block(slot=7, ref=1)")
    b.slot = 2**40  # slots come from the allocator as ints or numpy ints
    assert kind(np.int64(2**40)).slot == b.slot == 2**40
    assert kind(True).slot == 1  # what __index__ gives


@pytest.mark.skipif(not policies.BUILT, reason="no C Block built")
def test_the_c_block_refuses_what_is_no_slot() -> None:
    """(The Python class stores what it is given: mypy types its callers.)"""
    kind = policies._NativeBlock  # type: ignore[attr-defined]
    for bad in ((), (1, 2)):
        with pytest.raises(TypeError, match="one positional argument"):
            kind(*bad)
    with pytest.raises(TypeError, match="one positional argument"):
        kind(slot=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        kind(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        kind(b"1")  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        kind(2**80)
    b = kind(3)
    with pytest.raises(TypeError):
        b.ref = None  # type: ignore[assignment]
    with pytest.raises(AttributeError):
        b.other = 1  # type: ignore[attr-defined]
    assert (b.slot, b.ref) == (3, -1)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__module__)
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policies_evict_only_ready_unpinned_blocks_of_either_kind(
    kind: type[PyBlock], name: str
) -> None:
    policy = POLICIES[name](16)
    blocks = {b"k%d" % i: kind(i) for i in range(6)}
    for key, block in blocks.items():
        policy.insert(key, block)
    blocks[b"k0"].ref = 0
    blocks[b"k1"].ref = 2  # pinned
    blocks[b"k2"].ref = 0
    assert policy.evict(3, set()) is None  # only two qualify: nothing is taken
    assert len(policy) == 6
    victims = policy.evict(2, set())
    assert victims is not None and sorted(k for k, _ in victims) == [b"k0", b"k2"]
    assert all(b is blocks[k] for k, b in victims)
    assert policy.get(b"k1") is blocks[b"k1"] and policy.get(b"k0") is None
