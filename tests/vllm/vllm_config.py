"""vLLM's OffloadingConfig of every role of an engine, the way vLLM builds them: the
engine's ``VllmConfig``, its KV cache planning over every rank (``vllm_plan``), and the
connector's ``build_offloading_config`` for the scheduler (handed rank 0's KV cache
config, as vLLM's engine core does) and for each rank."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvoffloadbench.vllm_plan import plan, vllm_config


def offloading_configs(
    socket_path: str,
    model: str = "tiny",
    *,
    tp: int = 1,
    pp: int = 1,
    engine_id: str = "e0",
    num_blocks: int = 160,
    **extra: Any,
) -> tuple[OffloadingConfig, list[OffloadingConfig]]:
    """(the scheduler's config, each rank's)."""
    options = {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        "socket_path": socket_path,
        **extra,
    }
    shape: dict[str, Any] = {"tp": tp, "pp": pp, "transfer": options, "engine_id": engine_id}
    cfg = vllm_config(model, max_model_len=1024, **shape)
    configs, scheduler = plan(cfg, num_blocks)
    ranks = []
    for r, kvc in enumerate(configs):
        rank_cfg = vllm_config(model, rank=r, max_model_len=1024, **shape)
        rank_cfg.cache_config = cfg.cache_config
        ranks.append(build_offloading_config(rank_cfg, kvc))
    return build_offloading_config(cfg, scheduler), ranks
