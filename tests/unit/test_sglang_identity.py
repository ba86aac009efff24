"""Which namespace an SGLang rank's pages go to, and where a host pool's pages lie
(pure: no SGLang needed; a host pool here is a fake that answers SGLang's page-meta
calls the way SGLang's MHA pool does)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvoffload.sglang.identity import SglangIdentity, Shard, mha_shards
from kvoffload.sglang.pool import PoolError, block_ids, memfd_descs, plain_views, pool_shape

BASE = SglangIdentity(
    model="llama",
    kv_dtype="bfloat16",
    page_size=64,
    host_layout="page_first",
    pool_kind="MHATokenToKVPoolHost",
    geometry="layers=32;heads=8;head_dim=128;v_head_dim=128",
    element_bytes=[4 << 20, 4 << 20],
    shard=Shard("0/1"),
)


def test_equal_identities_share_one_namespace() -> None:
    assert BASE.namespace() == dataclasses.replace(BASE).namespace()
    assert BASE.namespace()[0].startswith("sglang/llama/")


@pytest.mark.parametrize(
    "change",
    [
        {"model": "llama-ft"},
        {"kv_dtype": "float16"},
        {"page_size": 32},
        {"host_layout": "page_first_direct"},
        {"pool_kind": "MLATokenToKVPoolHost"},
        {"geometry": "layers=32;heads=4;head_dim=256;v_head_dim=256"},
        {"element_bytes": [2 << 20] * 4},
        {"shard": Shard("1/2")},
        {"shard": Shard("0/1", pp="1/2")},
        {"shard": Shard("0/1", cp="1/2")},
        {"cache_salt": "v2"},
    ],
)
def test_anything_that_changes_a_page_changes_the_namespace(change: dict[str, object]) -> None:
    other = dataclasses.replace(BASE, **change)  # type: ignore[arg-type]
    assert other.namespace()[0] != BASE.namespace()[0]
    assert other.layout().fingerprint() != BASE.layout().fingerprint()


def test_named_namespaces_carry_the_shard() -> None:
    assert BASE.namespace("mine")[0] == "mine/0/1"
    mla = dataclasses.replace(BASE, shard=Shard(""))
    assert mla.namespace("mine")[0] == "mine"


def test_virtual_head_shards() -> None:
    assert mha_shards(0, 2, 2) == ["0/4", "1/4"]
    assert mha_shards(1, 2, 2) == ["2/4", "3/4"]
    assert mha_shards(3, 4, 1) == ["3/4"]


class FakeMHAPool:
    """SGLang's MHA page_first pool as its zero-copy meta describes it."""

    def __init__(self, pages: int = 6, page_size: int = 4, token_bytes: int = 64) -> None:
        self.page_size, self.page_num = page_size, pages
        self.size = pages * page_size
        self.token_bytes = token_bytes
        self.kv_buffer = torch.zeros(2, self.size, token_bytes, dtype=torch.uint8)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        base = self.kv_buffer.data_ptr()
        v = self.size * self.token_bytes
        out = []
        for i in range(0, len(indices), self.page_size):
            k = base + int(indices[i]) * self.token_bytes
            out += [k, k + v]
        return out, [self.page_size * self.token_bytes] * len(out)


def test_pool_pages_become_strided_caches() -> None:
    pool = FakeMHAPool()
    shape = pool_shape(pool)
    (elements,) = shape.shards
    assert [(e.offset_bytes, e.page_bytes, e.stride_bytes) for e in elements] == [
        (0, 256, 256),
        (6 * 4 * 64, 256, 256),
    ]
    k, v = plain_views(pool, elements, shape.page_num)
    assert k.shape == (6, 256) and k.data_ptr() == pool.kv_buffer.data_ptr()
    assert v.data_ptr() == pool.kv_buffer[1].data_ptr()
    descs = memfd_descs(elements, shape.page_num, 4096)
    assert [(d.kind, d.offset_bytes, d.row_stride_bytes) for d in descs] == [
        ("memfd_io", 4096, 256),
        ("memfd_io", 4096 + 6 * 256, 256),
    ]


def test_a_pool_whose_pages_do_not_line_up_is_refused() -> None:
    pool = FakeMHAPool()
    meta = pool.get_page_buffer_meta
    pool.get_page_buffer_meta = lambda indices: (  # type: ignore[method-assign]
        [p + int(indices[0]) % 3 for p in meta(indices)[0]],
        meta(indices)[1],
    )
    with pytest.raises(PoolError, match="evenly"):
        pool_shape(pool)


def test_block_ids_take_whole_aligned_pages_only() -> None:
    ids = np.concatenate([np.arange(8, 12), np.arange(0, 4)])
    whole = block_ids(ids, 2, 4)
    assert whole is not None and whole.tolist() == [2, 0]
    assert block_ids(np.arange(1, 9), 2, 4) is None  # not page-aligned
    assert block_ids(np.array([0, 1, 3, 2]), 1, 4) is None  # not in order
    assert block_ids(np.arange(4), 2, 4) is None  # short
