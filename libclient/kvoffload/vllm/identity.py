"""Which kvoffload namespaces a vLLM engine uses, from facts every role of it shares.

Rules:
- An engine's scheduler is handed rank 0's KV cache config; each worker rank its own.
  Under pipeline parallelism the stages hold different layers (61 layers at PP=2 split
  31/30), and the KV cache groups of a hybrid model may each use a different subset
  of the tensors, so no role knows every rank's pages. The namespace *names* therefore
  come only from what every role of an engine, and every engine of the same model and
  parallel shape, agrees on: model, KV dtype, blocks per chunk, tokens per block (each
  KV cache group) and per hash, KV cache layout, cache salt, and either vLLM's
  canonical format (canonical layout: no parallel shape, so every TP size meets) or the
  parallel shape (TP, PP, PCP, DCP, world size).
- One namespace per KV cache group and pipeline stage: ``<base>/g<group id>`` when the
  model has several groups, ``/pp<stage>`` when it has several stages. Keys carry
  their group (vLLM's OffloadKey ends in it), so a key lives in its group's namespace
  of every stage; a block is loadable when every stage holds it.
- The *layout* of a namespace (its slot size and fingerprint) is what the workers of
  that group and stage register: their tensors' pages (canonical pages in the
  canonical layout) times the stage's ranks. Workers create the namespaces; the
  scheduler joins them by name (``join``), so it never needs pages it cannot know, and
  two workers that disagree about a namespace's layout are refused at start
  (LAYOUT_MISMATCH names both layouts), never shared silently.
- Without an explicit ``namespace`` the base name is derived from the model and a hash
  of the identity, so different models never meet and equal ones always do.
- Pure: no vLLM import, unit-tested without vLLM.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.protocol.messages import KVLayout

MAX_NAME_CHARS = 200
SUFFIX_CHARS = 24  # room for "/g<id>/pp<stage>"


@dataclass(frozen=True)
class VllmIdentity:
    model: str
    kv_dtype: str
    blocks_per_chunk: int
    tokens_per_block: Sequence[int]  # each offloaded KV cache group's
    tokens_per_hash: int
    kv_cache_layout: str | None = None
    cache_salt: str = ""
    canonical_format: str = ""  # vLLM's canonical_format_id; "": per-rank pages
    parallel: str = ""  # the parallel shape, per-rank pages only ("tp2.pp1.pcp1.dcp1")

    def salt(self) -> str:
        """Every fact of the identity, as the layout's salt (so, in its fingerprint)."""
        s = (
            f"vllm;tokens_per_block={','.join(map(str, self.tokens_per_block))};"
            f"tokens_per_hash={self.tokens_per_hash};kv_layout={self.kv_cache_layout};"
            f"salt={self.cache_salt}"
        )
        if self.canonical_format:
            return s + f";canonical={self.canonical_format}"
        return s + f";parallel={self.parallel}"

    def base_name(self, name: str | None = None) -> str:
        """``name`` if given, else one derived from the model and the identity."""
        if name:
            return name[: MAX_NAME_CHARS - SUFFIX_CHARS]
        digest = hashlib.sha256(
            f"{self.model};{self.kv_dtype};f={self.blocks_per_chunk};{self.salt()}".encode()
        ).hexdigest()[:12]
        model = self.model[: MAX_NAME_CHARS - SUFFIX_CHARS - 18]
        return f"vllm/{model}/{digest}"

    def namespace(
        self, group_id: int, groups: int, stage: int, stages: int, name: str | None = None
    ) -> str:
        """The namespace of one KV cache group at one pipeline stage."""
        out = self.base_name(name)
        if groups > 1:
            out += f"/g{group_id}"
        if stages > 1:
            out += f"/pp{stage}"
        return out

    def layout(self, tensor_page_bytes: Sequence[int], world_size: int, group_id: int) -> KVLayout:
        """A group's namespace layout, from the pages one worker registers in it."""
        if not tensor_page_bytes or min(tensor_page_bytes) <= 0:
            raise ValueError("vLLM reported no KV bytes per block; nothing to offload")
        return KVLayout(
            tensor_page_bytes=list(tensor_page_bytes),
            world_size=world_size,
            block_size_factor=self.blocks_per_chunk,
            model=self.model,
            kv_dtype=self.kv_dtype,
            salt=f"{self.salt()};group={group_id}",
        )
