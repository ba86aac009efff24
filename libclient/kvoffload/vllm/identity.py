"""Which kvoffload namespace a vLLM instance uses, from its configuration alone.

Rules:
- Two instances share blocks exactly when the bytes of a block mean the same to both:
  same model, KV dtype, bytes per worker block, world size, blocks per chunk (vLLM's
  block size factor), tokens per block and per hash, KV cache layout, and cache salt.
  All of these go into the namespace's layout, so its fingerprint differs whenever
  any differs; a named namespace opened with another layout is refused
  (LAYOUT_MISMATCH), never shared silently.
- Without an explicit ``namespace`` the name is derived from the model and the
  fingerprint, so different models (or layouts) never meet and equal ones always do.
- The scheduler does not know the worker's canonical tensors, only the bytes one
  worker block takes, so the layout has one page per rank; workers register their
  tensors as parts of it (``copyplan.place_caches``).
- Canonical layout (``canonical_format`` set, vLLM certified the configuration as
  parallelism-agnostic): the page is the whole block without parallelism and the
  world size is 1, so engines of one model and KV format share blocks whatever their
  TP size; vLLM's canonical format id replaces the world size in the identity. A
  canonical namespace never meets a per-rank one (their layouts differ).
- Pure: no vLLM import, unit-tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..protocol.messages import KVLayout

MAX_NAME_CHARS = 200


@dataclass(frozen=True)
class VllmIdentity:
    model: str
    kv_dtype: str
    worker_kv_bytes_per_block: int
    world_size: int
    blocks_per_chunk: int
    tokens_per_block: Sequence[int]
    tokens_per_hash: int
    kv_cache_layout: str | None = None
    cache_salt: str = ""
    canonical_format: str = ""  # vLLM's canonical_format_id; "": per-rank pages

    def layout(self) -> KVLayout:
        if self.worker_kv_bytes_per_block <= 0:
            raise ValueError("vLLM reported no KV bytes per block; nothing to offload")
        salt = (
            f"vllm;tokens_per_block={','.join(map(str, self.tokens_per_block))};"
            f"tokens_per_hash={self.tokens_per_hash};kv_layout={self.kv_cache_layout};"
            f"salt={self.cache_salt}"
        )
        if self.canonical_format:
            salt += f";canonical={self.canonical_format}"
        return KVLayout(
            tensor_page_bytes=[self.worker_kv_bytes_per_block],
            world_size=self.world_size,
            block_size_factor=self.blocks_per_chunk,
            model=self.model,
            kv_dtype=self.kv_dtype,
            salt=salt,
        )

    def namespace(self, name: str | None = None) -> tuple[str, KVLayout]:
        """(namespace name, layout): ``name`` if given, else one derived from both."""
        layout = self.layout()
        if name:
            return name, layout
        model = self.model[: MAX_NAME_CHARS - 32]
        return f"vllm/{model}/{layout.fingerprint()[:12]}", layout
