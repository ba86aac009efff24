"""``KVOffloadSpec``: vLLM 0.33's OffloadingSpec for kvoffloadd.

``kv_connector_extra_config`` keys (all optional):

- ``socket_path``: the daemon's socket (default: ``$KVOFFLOAD_SOCKET``, then the
  default path of the "default" instance).
- ``namespace``: share blocks under this name; default: derived from the model and
  the KV layout (``identity``), so equal instances share and different ones never do.
- ``cache_salt``: part of the namespace identity; change it when the KV bytes of the
  same model change (new weights).
- ``copy_mode``: "auto" (default), "daemon" or "client" (see ``kvoffload.worker``).
- ``timeout_s`` (5): per daemon call; ``mirror_max_age_s`` (0.05): how stale a
  lookup may be; ``retry_s`` (5): how long lookups answer RETRY while the daemon is
  away before they answer MISS.

The pool's size is the daemon's business (its ``region_size``), so
``cpu_bytes_to_use`` is not needed here.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig

from ..client import Client, connect
from .identity import VllmIdentity
from .manager import KVOffloadManager
from .transfer import KVOffloadWorker

log = logging.getLogger(__name__)


class KVOffloadSpec(OffloadingSpec):
    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if config.canonical_layout:
            raise ValueError(
                "kvoffload stores each rank's KV pages as they are; turn off the canonical "
                "host layout in kv_connector_extra_config to use KVOffloadSpec"
            )
        extra: dict[str, Any] = dict(self.extra_config)
        identity = VllmIdentity(
            model=config.model.name,
            kv_dtype=config.model.dtype,
            worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
            world_size=config.parallel.world_size,
            blocks_per_chunk=config.cache.blocks_per_chunk,
            tokens_per_block=self.tokens_per_block,
            tokens_per_hash=config.cache.tokens_per_hash,
            kv_cache_layout=config.kv_cache_layout,
            cache_salt=str(extra.get("cache_salt", "")),
        )
        self.namespace_name, self.layout = identity.namespace(extra.get("namespace"))
        self.socket_path: str | None = extra.get("socket_path") or None
        self.timeout_s = float(extra.get("timeout_s", 5.0))
        self.copy_mode = str(extra.get("copy_mode", "auto"))
        self.mirror_max_age_s = float(extra.get("mirror_max_age_s", 0.05))
        self.retry_s = float(extra.get("retry_s", 5.0))
        self._manager: KVOffloadManager | None = None
        self._worker: KVOffloadWorker | None = None

    def _connect(self, role: str) -> Client:
        """One connection per role (scheduler, each rank); its owner closes it."""
        # lazy: an engine starts (with misses) even when the daemon is not up yet
        client = connect(
            self.socket_path,
            timeout_s=self.timeout_s,
            name=f"vllm-{self.config.engine_id}-{role}",
            lazy=True,
        )
        log.info(
            "kvoffload: %s of engine %s uses namespace %s at %s",
            role,
            self.config.engine_id,
            self.namespace_name,
            client.socket_path,
        )
        return client

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            ns = self._connect("scheduler").namespace(self.namespace_name, self.layout)
            self._manager = KVOffloadManager(
                ns,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                max_age_s=self.mirror_max_age_s,
                retry_s=self.retry_s,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KVOffloadWorker:
        if self._worker is None:
            rank = self.config.parallel.rank
            ns = self._connect(f"rank{rank}").namespace(self.namespace_name, self.layout)
            self._worker = KVOffloadWorker(
                ns, kv_caches, rank, self.blocks_per_chunk, self.copy_mode
            )
        return self._worker
