"""One worker rank of an engine at any parallel shape, as vLLM 0.33 builds it, with no
scheduler: tests store and load through its connector worker directly.

Everything that decides the layout is vLLM's own code (``vllm_plan``: the rank's
``VllmConfig``, its KV cache config planned with every rank of the engine, the
offloading config, the KV cache views) and the connector's worker registration
(``OffloadingConnector.register_kv_caches``, which derives the rank's
``CanonicalPageMapping``). Only the model weights and the forward pass are missing:
tests write the KV caches themselves.
"""

from __future__ import annotations

import warnings
from typing import Any

with warnings.catch_warnings():  # torch's own deprecations, raised by vLLM's imports
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

from .vllm_plan import allocate_kv_caches, plan, vllm_config

NUM_BLOCKS = 160


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
        extra: dict[str, Any] | None = None,
        kv_events: bool = False,
        num_blocks: int = NUM_BLOCKS,
    ) -> None:
        self.model, self.tp, self.rank = model, tp, rank
        options: dict[str, Any] = {
            "spec_name": "KVOffloadSpec",
            "spec_module_path": "kvoffload.vllm",
            "socket_path": socket_path,
            "offload_prompt_only": False,
            "canonical_layout": canonical,
            **(extra or {}),
        }
        self.cfg = vllm_config(
            model,
            tp=tp,
            pp=pp,
            rank=rank,
            transfer=options,
            engine_id=engine_id,
            max_model_len=1024,
            kv_events=kv_events,
        )
        configs, _ = plan(self.cfg, num_blocks, layout)
        self.kv_cache_config = configs[rank]
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
