"""vLLM 0.33's own planning of an engine's KV caches, for tiny local models at any
parallel shape: what an engine's scheduler and each of its worker ranks are handed.

What decides the layout is vLLM's code: ``VllmConfig`` (its validation of TP, PP,
DCP and DP), ``get_global_kv_cache_groups`` and ``get_kv_cache_configs`` (the KV cache
groups of hybrid models, each rank's tensors, the PP projection),
``generate_scheduler_kv_cache_config`` (the scheduler's view: rank 0's) and the
connector's own ``build_offloading_config``. What vLLM would read from the model's
attention modules, each layer's ``KVCacheSpec``, is derived here from the model's
``config.json`` the way those modules do (KV heads sharded over TP, sliding window
layers from ``layer_types``, MLA's latent), since no model is loaded. The KV caches are
allocated like vLLM's ``allocate_kv_cache`` (one backing buffer, one view per layer),
over plain memory or a memfd.

Models (``models/<name>/config.json``, read with the hub offline):
- ``tiny``: the Llama of ``tiny-llama/`` (2 layers, 2 KV heads): the benchmark's;
- ``llama``: 4 layers, 4 KV heads (TP 1, 2 and 4 shard them; PP=3 splits 1/2/1);
- ``mqa``: one KV head (decode context parallelism needs TP above the KV heads);
- ``mla``: DeepSeek-V2, a latent every TP rank holds whole;
- ``gptoss``: sliding window (24 tokens) and full attention layers alternating: two
  KV cache groups that each use every tensor;
- ``gemma3``: five sliding window layers to two full ones: three sliding window
  groups, the last of them with one layer only (a subset of the tensors).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# vLLM's CPU backend runs the V1 model runner; it is also the runner that certifies the
# most configurations as parallelism-agnostic (set before vLLM reads its environment).
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

import warnings

import torch

with warnings.catch_warnings():  # torch's own deprecations, raised by vLLM's imports
    warnings.simplefilter("ignore", DeprecationWarning)
    import vllm.distributed.kv_transfer  # noqa: F401
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.utils import get_pp_indices
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    create_kv_cache_views,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

BLOCK_TOKENS = 16
TINY_DIR = Path(__file__).with_name("tiny-llama")

if "KVOffloadSpec" not in OffloadingSpecFactory._registry:
    # vLLM resolves spec_name + spec_module_path with this same loader, after a
    # warning whose import chain needs all of vLLM's optional dependencies.
    OffloadingSpecFactory.register_spec("KVOffloadSpec", "kvoffload.vllm", "KVOffloadSpec")

MODELS_DIR = Path(__file__).with_name("models")
MODELS = ("tiny", *sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file()))


def model_dir(name: str) -> str:
    """The directory of a model's ``config.json`` (vLLM's ``--model``)."""
    if name == "tiny":
        return str(TINY_DIR)
    if name not in MODELS:
        raise ValueError(f"no model {name!r}; the models are {MODELS}")
    return str(MODELS_DIR / name)


def vllm_config(
    model: str = "tiny",
    *,
    tp: int = 1,
    pp: int = 1,
    dcp: int = 1,
    dp: int = 1,
    dp_index: int = 0,
    rank: int = 0,
    transfer: dict[str, Any] | None = None,
    engine_id: str = "e0",
    max_num_seqs: int = 16,
    max_batched_tokens: int = 2048,
    max_model_len: int = 2048,
    kv_events: bool = False,
) -> VllmConfig:
    """vLLM's configuration of one rank of an engine (``transfer``: the connector's
    ``kv_connector_extra_config``, None for no connector; ``kv_events``: vLLM's KV
    cache events on)."""
    parallel = ParallelConfig(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        decode_context_parallel_size=dcp,
        data_parallel_size=dp,
        distributed_executor_backend="mp",
    )
    parallel.rank = rank
    parallel.data_parallel_index = parallel.data_parallel_rank = dp_index
    kv_transfer = None
    if transfer is not None:
        kv_transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id=engine_id,
            kv_connector_extra_config=transfer,
        )
    cfg = VllmConfig(
        model_config=ModelConfig(
            model=model_dir(model),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=max_model_len,
        ),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True),
        parallel_config=parallel,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=kv_transfer,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True) if kv_events else None,
        device_config=DeviceConfig("cpu"),
    )
    # A GPU platform keeps vLLM's hybrid KV cache manager (one block table per KV cache
    # group) with the OffloadingConnector; this platform-less process would turn it off.
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    return cfg


def stage_of(cfg: VllmConfig, rank: int) -> int:
    p = cfg.parallel_config
    return int(rank // (p.world_size // p.pipeline_parallel_size))


def layer_specs(cfg: VllmConfig, rank: int) -> dict[str, KVCacheSpec]:
    """The KV cache spec of every layer of ``rank``, as its attention modules give it."""
    mc, p = cfg.model_config, cfg.parallel_config
    hf = mc.hf_text_config
    layers = int(hf.num_hidden_layers)
    start, end = get_pp_indices(layers, stage_of(cfg, rank), p.pipeline_parallel_size)
    kinds = getattr(hf, "layer_types", None) or ["full_attention"] * layers
    heads = max(1, mc.get_total_num_kv_heads() // p.tensor_parallel_size)
    common = {"block_size": BLOCK_TOKENS, "head_size": mc.get_head_size(), "dtype": torch.bfloat16}
    out: dict[str, KVCacheSpec] = {}
    for i in range(start, end):
        name = f"model.layers.{i}.self_attn.attn"
        if mc.use_mla:
            out[name] = MLAAttentionSpec(num_kv_heads=1, **common)
        elif kinds[i] == "sliding_attention":
            out[name] = SlidingWindowSpec(
                num_kv_heads=heads, sliding_window=int(hf.sliding_window), **common
            )
        else:
            out[name] = FullAttentionSpec(num_kv_heads=heads, **common)
    return out


def plan(
    cfg: VllmConfig, num_blocks: int, layout: str = "LBHNC"
) -> tuple[list[KVCacheConfig], KVCacheConfig]:
    """(each rank's KV cache config, the scheduler's), from every rank's layer specs."""
    world = cfg.parallel_config.world_size
    specs = [layer_specs(cfg, r) for r in range(world)]
    resolve_kv_cache_layout(cfg, [[layout]], [s for per in specs for s in per.values()])
    groups = get_global_kv_cache_groups(cfg, specs)
    # one block more: the null block vLLM holds back
    memory = [(num_blocks + 1) * sum(s.page_size_bytes for s in per.values()) for per in specs]
    configs = get_kv_cache_configs(cfg, specs, memory, groups)
    for c in configs:
        c.kv_cache_layout = cfg.cache_config.kv_cache_layout
    cfg.cache_config.num_gpu_blocks = configs[0].num_blocks
    return configs, generate_scheduler_kv_cache_config(configs)


def allocate_kv_caches(cfg: VllmConfig, kvc: KVCacheConfig, memfd: bool) -> dict[str, torch.Tensor]:
    """vLLM's ``allocate_kv_cache``: one backing buffer, one view per layer; over a memfd
    (the daemon copies) or plain memory (the worker copies itself: client-copy mode)."""
    if not kvc.kv_cache_tensors:
        return {}
    size = kvc.kv_cache_tensors[0].size
    if memfd:
        import kvoffload

        buf = kvoffload.shared_kv_cache(1, size).view(-1)
    else:
        buf = torch.zeros(size, dtype=torch.int8)
    layout = cfg.cache_config.get_resolved_kv_cache_layout()
    caches: dict[str, torch.Tensor] = {}
    for t in kvc.kv_cache_tensors:
        spec = spec_of(kvc, t.layers[0])
        views = create_kv_cache_views(buf, spec, kvc.num_blocks_of(t), layout, t)
        caches.update(zip(t.layers, views))
    return caches


def spec_of(kvc: KVCacheConfig, layer: str) -> KVCacheSpec:
    group = next(g for g in kvc.kv_cache_groups if layer in g.layer_names)
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer]
    return spec
