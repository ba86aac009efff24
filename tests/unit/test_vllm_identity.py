"""The vLLM plug-in's namespace identity (pure): names from what every role of an
engine shares, layouts from what one worker registers."""

from __future__ import annotations

from typing import Any

import pytest

from kvoffload.vllm.identity import MAX_NAME_CHARS, VllmIdentity


def ident(**kw: Any) -> VllmIdentity:
    base: dict[str, Any] = {
        "model": "m/a",
        "kv_dtype": "bfloat16",
        "blocks_per_chunk": 4,
        "tokens_per_block": (16,),
        "tokens_per_hash": 16,
        "parallel": "tp2.pp1.pcp1.dcp1.w2",
    }
    return VllmIdentity(**(base | kw))


def test_equal_engines_share_and_any_other_fact_separates_them() -> None:
    name = ident().namespace(0, 1, 0, 1)
    assert name.startswith("vllm/m/a/") and name == ident().namespace(0, 1, 0, 1)
    for change in (
        {"model": "m/b"},
        {"kv_dtype": "fp8"},
        {"parallel": "tp4.pp1.pcp1.dcp1.w4"},
        {"blocks_per_chunk": 2},
        {"tokens_per_block": (32,)},
        {"tokens_per_hash": 32},
        {"cache_salt": "v2"},
        {"kv_cache_layout": "HND"},
        {"canonical_format": "v1-hnd", "parallel": ""},
    ):
        assert ident(**change).namespace(0, 1, 0, 1) != name, change
    assert ident().namespace(0, 1, 0, 1, name="shared") == "shared"


def test_the_canonical_format_replaces_the_parallel_shape() -> None:
    """Every TP size of a model meets in the canonical namespace."""
    tp2 = ident(canonical_format="v1-hnd", parallel="")
    assert tp2.namespace(0, 1, 0, 1) == ident(canonical_format="v1-hnd", parallel="").namespace(
        0, 1, 0, 1
    )
    assert "parallel" not in tp2.salt() and "canonical=v1-hnd" in tp2.salt()


def test_groups_and_stages_get_a_namespace_each_only_when_there_are_several() -> None:
    i = ident()
    base = i.namespace(0, 1, 0, 1)
    assert i.namespace(7, 2, 0, 1) == f"{base}/g7"
    assert i.namespace(0, 1, 2, 3) == f"{base}/pp2"
    assert i.namespace(5, 4, 1, 2, name="team") == "team/g5/pp1"
    long = ident(model="x" * 400).namespace(1_000_000, 9, 63, 64, name=None)
    assert len(long) <= MAX_NAME_CHARS


def test_a_layout_is_what_one_worker_registers_and_names_its_group() -> None:
    i = ident()
    lay = i.layout([4096, 8192], 2, group_id=3)
    assert lay.tensor_page_bytes == [4096, 8192] and lay.world_size == 2
    assert (lay.block_size_factor, lay.model, lay.kv_dtype) == (4, "m/a", "bfloat16")
    assert (
        lay.salt.endswith(";group=3")
        and lay.fingerprint() != i.layout([4096, 8192], 2, 4).fingerprint()
    )
    with pytest.raises(ValueError, match="no KV bytes"):
        i.layout([], 1, 0)
