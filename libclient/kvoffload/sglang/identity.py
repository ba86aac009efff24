"""Which kvoffload namespace an SGLang rank's pages go to, from its configuration alone.

SGLang's page keys are SHA-256 chains over token ids: they say nothing of the model,
the rank, the dtype or the host pool's layout. So the namespace carries everything
that changes a page's bytes, and two ranks share pages exactly when all of it is equal:

- the model (SGLang's storage model name: the served name plus the host pool's
  storage format tag), the KV dtype, tokens per page, the host layout (it orders the
  page's bytes), the pool kind and head geometry (layers; K/V heads and head sizes
  for MHA, the latent row for MLA), and the bytes of each element of a page;
- the shard: for MHA every rank stores its own heads, so the shard is part of the
  identity. With ``page_head`` and ``tp_lcm_size`` SGLang cuts each rank's heads
  into ``tp_lcm_size / tp_size`` virtual shards, each one kvoffload namespace, so a
  TP=2 rank's second shard is a TP=4 rank 1's page. Pipeline and context parallel
  ranks hold different layers or token slices: always part of it;
- no shard for MLA: the latent is replicated, exactly one rank writes (SGLang's
  ``is_storage_writer``) and every rank of every TP size reads the one copy;
- ``cache_salt`` from the extra-config, to keep apart equal geometries with other
  weights.

Each namespace's layout lists the page's elements (``tensor_page_bytes``), one slot
per page; its fingerprint covers all of the above, and the name is derived from the
model and the fingerprint (or given: a named namespace opened with another layout is
refused, LAYOUT_MISMATCH, never shared). Pure: no SGLang import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.protocol.messages import KVLayout

MAX_NAME_CHARS = 200


@dataclass(frozen=True)
class Shard:
    """Which part of a page one namespace holds (empty ``tp`` for MLA)."""

    tp: str = ""  # "v/n": virtual shard v of n (MHA), "" (MLA: replicated)
    pp: str = "0/1"
    cp: str = "0/1"
    dcp: str = "0/1"

    def text(self) -> str:
        return f"tp={self.tp or 'replicated'};pp={self.pp};cp={self.cp};dcp={self.dcp}"


def mha_shards(tp_rank: int, tp_size: int, split: int) -> list[str]:
    """The virtual shards one MHA rank holds: ``split`` of ``tp_size * split``."""
    n = tp_size * split
    return [f"{tp_rank * split + j}/{n}" for j in range(split)]


@dataclass(frozen=True)
class SglangIdentity:
    model: str
    kv_dtype: str
    page_size: int  # tokens per page
    host_layout: str
    pool_kind: str  # the host pool's class: MHATokenToKVPoolHost, MLATokenToKVPoolHost
    geometry: str  # "layers=..;heads=..;head_dim=..;v_head_dim=.." or "layers=..;kv_dim=.."
    element_bytes: Sequence[int]  # bytes of each element of one page, in SGLang's order
    shard: Shard
    cache_salt: str = ""

    def layout(self) -> KVLayout:
        if not self.element_bytes or min(self.element_bytes) <= 0:
            raise ValueError("SGLang's host pool reported no page bytes; nothing to store")
        salt = (
            f"sglang;page_size={self.page_size};host_layout={self.host_layout};"
            f"pool={self.pool_kind};{self.geometry};{self.shard.text()};salt={self.cache_salt}"
        )
        return KVLayout(
            tensor_page_bytes=list(self.element_bytes),
            world_size=1,
            block_size_factor=1,
            model=self.model,
            kv_dtype=self.kv_dtype,
            salt=salt,
        )

    def namespace(self, name: str | None = None) -> tuple[str, KVLayout]:
        """(namespace name, layout): ``name`` (one per shard: the shard is appended
        when given) or one derived from the model and the fingerprint."""
        layout = self.layout()
        if name:
            return (f"{name}/{self.shard.tp}" if self.shard.tp else name), layout
        model = self.model[: MAX_NAME_CHARS - 40]
        return f"sglang/{model}/{layout.fingerprint()[:12]}", layout
