"""Build vLLM's OffloadingConfig the way the connector does, for a small fake model."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)


def offloading_config(
    socket_path: str,
    *,
    model: str = "test/tiny",
    worker_kv_bytes_per_block: int = 4096,
    blocks_per_chunk: int = 1,
    groups: int = 1,
    rank: int = 0,
    world_size: int = 1,
    events: bool = True,
    engine_id: str = "e0",
    **extra: Any,
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=(f"l{g}",), group_id=g)
            for g in range(groups)
        ),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=events,
        extra_config={
            "spec_name": "KVOffloadSpec",
            "spec_module_path": "kvoffload.vllm",
            "socket_path": socket_path,
            **extra,
        },
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
