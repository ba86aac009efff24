"""Engines of one model at several tensor-parallel sizes, as vLLM 0.33 builds them.

Everything that decides the layout is vLLM's own code: ``VllmConfig`` for the TP size
and rank, the KV cache config (``get_kv_cache_configs``), the offloading config
(``build_offloading_config``: is the configuration parallelism-agnostic, is it
replicated), the KV cache views (``create_kv_cache_views``) and the connector's
worker registration (``OffloadingConnector.register_kv_caches``, which derives each
rank's ``CanonicalPageMapping``). Only the model weights and the forward pass are
missing: tests write the KV caches themselves.

Models (tiny local ``config.json`` files, hub offline):
- ``gqa``: Llama, 4 KV heads of 16 (TP 1, 2 and 4 shard the heads);
- ``mla``: DeepSeek-V2, a 48-byte-wide latent (kv_lora_rank 32 + rope 16) that every
  TP rank holds whole.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import warnings

import torch

with warnings.catch_warnings():  # torch's own deprecations, raised by vLLM's imports
    warnings.simplefilter("ignore", DeprecationWarning)
    import vllm.distributed.kv_transfer  # noqa: F401
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from .engine_rig import allocate_kv_caches  # also registers KVOffloadSpec with vLLM

BLOCK_TOKENS = 16
LAYERS = 2
NUM_BLOCKS = 160
MAX_MODEL_LEN = 1024


_COMMON = {"vocab_size": 1000, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
MODELS: dict[str, dict[str, Any]] = {
    "gqa": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "num_hidden_layers": LAYERS,
        "rms_norm_eps": 1e-05,
        **_COMMON,
    },
    "mla": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": LAYERS,
        "kv_lora_rank": 32,
        "q_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": LAYERS,
        "rms_norm_eps": 1e-06,
        **_COMMON,
    },
}
_DIRS: dict[str, str] = {}


def model_dir(name: str) -> str:
    if name not in _DIRS:
        d = tempfile.mkdtemp(prefix=f"kvoffload-{name}-")
        Path(d, "config.json").write_text(json.dumps(MODELS[name]))
        _DIRS[name] = d
    return _DIRS[name]


class Rank:
    """One worker rank of an engine: its vLLM config, KV caches and connector worker."""

    def __init__(
        self,
        model: str,
        tp: int,
        rank: int,
        socket_path: str,
        engine_id: str,
        canonical: bool = True,
        layout: str = "LBHNC",
        pp: int = 1,
        memfd: bool = True,
    ) -> None:
        self.model, self.tp, self.rank = model, tp, rank
        self.cfg = vllm_config(model, tp, rank, socket_path, engine_id, canonical, pp)
        mcfg = self.cfg.model_config
        total = mcfg.get_total_num_kv_heads()
        if mcfg.use_mla:
            heads = 1  # one latent, replicated on every rank
            kind: type[FullAttentionSpec] = MLAAttentionSpec
        else:
            heads, kind = max(1, total // tp), FullAttentionSpec
        kv_spec = kind(
            block_size=BLOCK_TOKENS,
            num_kv_heads=heads,
            head_size=mcfg.get_head_size(),
            dtype=torch.bfloat16,
        )
        specs = {f"model.layers.{i}.self_attn.attn": kv_spec for i in range(LAYERS)}
        resolve_kv_cache_layout(self.cfg, [[layout]], specs.values())
        groups = get_global_kv_cache_groups(self.cfg, [specs])
        memory = NUM_BLOCKS * kv_spec.page_size_bytes * LAYERS
        self.kv_cache_config = get_kv_cache_configs(self.cfg, [specs], [memory], groups)[0]
        self.cfg.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.offloading = build_offloading_config(self.cfg, self.kv_cache_config)
        self.caches = allocate_kv_caches(self.cfg, self.kv_cache_config, memfd)
        self.connector = OffloadingConnector(self.cfg, KVConnectorRole.WORKER, self.kv_cache_config)
        self.connector.register_kv_caches(self.caches)

    @property
    def spec(self) -> Any:
        """The connector's KVOffloadSpec."""
        return self.connector.connector_worker.spec

    @property
    def worker(self) -> Any:
        """The connector's worker: our KVOffloadWorker."""
        return self.connector.connector_worker.worker

    def shutdown(self) -> None:
        self.worker.shutdown()
        if self.spec._manager is not None:  # a scheduler side this test asked for
            self.spec._manager.shutdown()


def vllm_config(
    model: str,
    tp: int,
    rank: int,
    socket_path: str,
    engine_id: str,
    canonical: bool,
    pp: int = 1,
) -> VllmConfig:
    extra: dict[str, Any] = {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        "socket_path": socket_path,
        "offload_prompt_only": False,
    }
    if canonical:
        extra["canonical_layout"] = True
    parallel = ParallelConfig(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp"
    )
    parallel.rank = rank
    return VllmConfig(
        model_config=ModelConfig(
            model=model_dir(model),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=MAX_MODEL_LEN,
        ),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True),
        parallel_config=parallel,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=2048,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id=engine_id,
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
    )
