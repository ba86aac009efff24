"""``KVOffloadSpec``: vLLM 0.33's OffloadingSpec for kvoffloadd.

``kv_connector_extra_config`` keys (all optional):

- ``socket_path``: the daemon's socket (default: ``$KVOFFLOAD_SOCKET``, then the
  default path of the "default" instance).
- ``namespace``: share blocks under this name; default: derived from the model and
  the KV layout (``identity``), so equal instances share and different ones never do.
- ``cache_salt``: part of the namespace identity; change it when the KV bytes of the
  same model change (new weights).
- ``copy_mode``: "auto" (default), "daemon" or "client" (see ``kvoffload.worker``).
- ``timeout_s`` (5): per blocking daemon call (start-up and fallbacks only).
- ``lease_blocks`` (64): the fewest empty slots the scheduler keeps leased, so a
  store never waits for the daemon; the pool grows with the engine's store rate.
- ``store_timeout_s`` (10): a store the daemon has not copied by then is dropped
  (never committed), so the engine may reuse its blocks.
- ``load_wait_s`` (10): how long a planned load may wait for a daemon that went away
  before the engine stops with ``LoadLostError`` (only workers the daemon does not
  trust with the region ever wait: trusted ones copy from the region themselves).

With ``canonical_layout: true`` and a configuration vLLM certifies as
parallelism-agnostic, blocks are stored as vLLM's canonical pages: one copy per block
(MLA's replicated latent included), shared by every TP size of the model; each rank
writes its byte ranges (``kvoffload.canonical``). Otherwise each rank's pages are
stored as they are, and the log says which layout is used and why.

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
        extra: dict[str, Any] = dict(self.extra_config)
        world = config.parallel.world_size
        certified = config.canonical_layout and config.parallel.is_parallelism_agnostic
        fmt = format_id(config) if certified else ""
        self.canonical = bool(fmt)
        self.replicated_layout = self.canonical and config.replicated_layout
        # A canonical page holds every head: one rank's bytes times the ranks that
        # shard them (1 for a replicated MLA latent).
        copies = 1 if self.replicated_layout else world
        identity = VllmIdentity(
            model=config.model.name,
            kv_dtype=config.model.dtype,
            worker_kv_bytes_per_block=config.worker_kv_bytes_per_block
            * (copies if self.canonical else 1),
            world_size=1 if self.canonical else world,
            blocks_per_chunk=config.cache.blocks_per_chunk,
            tokens_per_block=self.tokens_per_block,
            tokens_per_hash=config.cache.tokens_per_hash,
            kv_cache_layout=config.kv_cache_layout,
            cache_salt=str(extra.get("cache_salt", "")),
            canonical_format=fmt,
        )
        self.namespace_name, self.layout = identity.namespace(extra.get("namespace"))
        log.info("kvoffload: %s", layout_choice(config, self.canonical))
        self.socket_path: str | None = extra.get("socket_path") or None
        self.timeout_s = float(extra.get("timeout_s", 5.0))
        self.copy_mode = str(extra.get("copy_mode", "auto"))
        self.lease_blocks = int(extra.get("lease_blocks", 64))
        self.store_timeout_s = float(extra.get("store_timeout_s", 10.0))
        self.load_wait_s = float(extra.get("load_wait_s", 10.0))
        self._manager: KVOffloadManager | None = None
        self._worker: KVOffloadWorker | None = None

    def _connect(self, role: str) -> Client:
        """One connection per role (scheduler, each rank); its owner closes it."""
        client = connect(
            self.socket_path,
            timeout_s=self.timeout_s,
            name=f"vllm-{self.config.engine_id}-{role}",
            lazy=True,
        )
        # An engine starts (with misses) even when the daemon is not up yet; when it
        # is, the first steps already find the pool.
        client.wait_connected(self.timeout_s)
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
                lease_blocks=self.lease_blocks,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KVOffloadWorker:
        if self._worker is None:
            rank = self.config.parallel.rank
            client = self._connect(f"rank{rank}")
            ns = client.namespace(self.namespace_name, self.layout, subscribe=False)
            self._worker = KVOffloadWorker(
                ns,
                kv_caches,
                rank,
                self.blocks_per_chunk,
                self.copy_mode,
                self.store_timeout_s,
                self.load_wait_s,
                parts=self.config.parallel.world_size if self.canonical else 0,
            )
        return self._worker


def layout_choice(config: OffloadingConfig, canonical: bool) -> str:
    """Which host layout an instance uses, and why (for its log)."""
    p = config.parallel
    if canonical:
        what = (
            "one copy for all ranks (replicated MLA latent)"
            if config.replicated_layout
            else (f"each of {p.world_size} ranks writes its heads")
        )
        return f"canonical layout, shared by every TP size of the model: {what}"
    if config.canonical_layout:
        return (
            f"per-rank layout (world size {p.world_size}): canonical_layout was requested, "
            "but vLLM does not certify this configuration as parallelism-agnostic "
            f"(tp={p.tp_size}, pp={p.pp_size}, dcp={p.dcp_size}, pcp={p.pcp_size}, or its "
            "attention layout), so blocks are shared only with the same world size"
        )
    return (
        f"per-rank layout (world size {p.world_size}); "
        "set canonical_layout to share blocks across TP sizes"
    )


def format_id(config: OffloadingConfig) -> str:
    """vLLM's canonical format id for the worker's KV layout ("" if it has none)."""
    # Imported here: the module pulls in vLLM's whole connector package, which an
    # engine has loaded anyway but the scheduler-only path need not.
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
        canonical_format_id,
    )

    try:
        return str(canonical_format_id(config.kv_cache_layout or ""))
    except KeyError:
        return ""
