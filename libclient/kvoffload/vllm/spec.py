"""``KVOffloadSpec``: vLLM 0.33's OffloadingSpec for kvoffloadd.

``kv_connector_extra_config`` keys (all optional):

- ``socket_path``: the daemon's socket (default: ``$KVOFFLOAD_SOCKET``, then the
  default path of the "default" instance).
- ``namespace``: share blocks under this name; default: derived from the model and
  the engine's identity (``identity``), so equal engines share and different ones
  never do. Models with several KV cache groups, and pipeline stages, add
  ``/g<group>`` and ``/pp<stage>`` to it.
- ``cache_salt``: part of the namespace identity; change it when the KV bytes of the
  same model change (new weights).
- ``copy_mode``: "auto" (default), "daemon" or "client" (see ``kvoffload.worker``).
- ``timeout_s`` (5): per blocking daemon call (start-up and fallbacks only).
- ``lease_blocks`` (64): the fewest empty slots the scheduler keeps leased, so a
  store never waits for the daemon; the pool grows with the engine's store rate.
- ``batch_interval_s`` (0.02): the scheduler and each worker write to the daemon and
  read what it pushed at most this often (loads, and a lease pool running low, at
  once): what an engine's steps change goes out in one frame per namespace.
- ``store_timeout_s`` (10): a store the daemon has not copied by then is dropped
  (never committed), so the engine may reuse its blocks.
- ``load_wait_s`` (10): how long a planned load may wait for a daemon that went away
  before the engine stops with ``LoadLostError`` (only workers the daemon does not
  trust with the region ever wait: trusted ones copy from the region themselves).

Layouts. With ``canonical_layout: true`` and a configuration vLLM certifies as
parallelism-agnostic whose ranks each hold every layer (no pipeline parallelism),
blocks are stored as vLLM's canonical pages: one copy per block (MLA's replicated
latent included), shared by every TP size of the model; each rank writes its byte
ranges (``kvoffload.datapath.canonical``). Otherwise each rank's pages are stored as they are,
one namespace per pipeline stage. The scheduler logs which layout is used and why.

Who creates what. Each worker rank opens the namespaces of its stage, one per KV
cache group, with the pages it registers (a group with no layer on the rank's stage
registers a one-byte placeholder, so the group's blocks are whole on every stage);
the scheduler joins them by name (``identity``). Ranks that disagree about a
namespace's layout are refused at start with both layouts named.

The pool's size is the daemon's business (its ``region_size``), so
``cpu_bytes_to_use`` is not needed here.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig

from kvoffload.client import Client, connect
from kvoffload.protocol.messages import KVLayout
from kvoffload.vllm.identity import VllmIdentity
from kvoffload.vllm.manager import BATCH_INTERVAL_S, KVOffloadManager
from kvoffload.vllm.transfer import KVOffloadWorker, group_caches

log = logging.getLogger(__name__)


class KVOffloadSpec(OffloadingSpec):
    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        extra: dict[str, Any] = dict(self.extra_config)
        p = config.parallel
        self.canonical, self.layout_note = layout_choice(config)
        self.replicated_layout = self.canonical and config.replicated_layout
        self.stages = 1 if self.canonical else p.pp_size
        self.stage_ranks = p.world_size // self.stages  # ranks that split one stage
        self.identity = VllmIdentity(
            model=config.model.name,
            kv_dtype=config.model.dtype,
            blocks_per_chunk=config.cache.blocks_per_chunk,
            tokens_per_block=self.tokens_per_block,
            tokens_per_hash=config.cache.tokens_per_hash,
            kv_cache_layout=config.kv_cache_layout,
            cache_salt=str(extra.get("cache_salt", "")),
            canonical_format=format_id(config) if self.canonical else "",
            parallel=(
                ""
                if self.canonical
                else f"tp{p.tp_size}.pp{p.pp_size}.pcp{p.pcp_size}.dcp{p.dcp_size}.w{p.world_size}"
            ),
        )
        self.group_ids = [g.group_id for g in config.groups]
        self.name_option: str | None = extra.get("namespace") or None
        self.namespace_name = self.namespace(0, 0)  # the first group's, stage 0's
        self.socket_path: str | None = extra.get("socket_path") or None
        self.timeout_s = float(extra.get("timeout_s", 5.0))
        self.copy_mode = str(extra.get("copy_mode", "auto"))
        self.lease_blocks = int(extra.get("lease_blocks", 64))
        self.batch_interval_s = float(extra.get("batch_interval_s", BATCH_INTERVAL_S))
        self.store_timeout_s = float(extra.get("store_timeout_s", 10.0))
        self.load_wait_s = float(extra.get("load_wait_s", 10.0))
        self._manager: KVOffloadManager | None = None
        self._worker: KVOffloadWorker | None = None

    def namespace(self, group: int, stage: int) -> str:
        """The namespace of the ``group``-th offloaded KV cache group at ``stage``."""
        return self.identity.namespace(
            self.group_ids[group], len(self.group_ids), stage, self.stages, self.name_option
        )

    def _client(self, role: str) -> Client:
        """One connection per role (scheduler, each rank); its owner closes it. An
        engine starts (with misses) even when the daemon is not up yet; when it is,
        the role's namespaces are opened on the caller's thread, so a refusal (a
        layout that does not match) stops the engine at start."""
        client = connect(
            self.socket_path,
            timeout_s=self.timeout_s,
            name=f"vllm-{self.config.engine_id}-{role}",
            lazy=True,
        )
        client.wait_connected(self.timeout_s)
        return client

    def _connected(self, client: Client, role: str, names: list[str]) -> None:
        shown = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"
        log.info(
            "kvoffload: %s of engine %s uses namespace %s at %s",
            role,
            self.config.engine_id,
            shown,
            client.socket_path,
        )

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            log.info("kvoffload: %s", self.layout_note)
            client = self._client("scheduler")
            joined = KVLayout([])  # the workers' pages: unknown here, never compared
            namespaces = [
                [
                    client.namespace(self.namespace(g, s), joined, join=True)
                    for s in range(self.stages)
                ]
                for g in range(len(self.group_ids))
            ]
            self._manager = KVOffloadManager(
                namespaces,
                self.group_ids,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                lease_blocks=self.lease_blocks,
                batch_interval_s=self.batch_interval_s,
            )
            self._connected(client, "scheduler", [ns.name for per in namespaces for ns in per])
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KVOffloadWorker:
        if self._worker is None:
            rank = self.config.parallel.rank
            stage = rank // self.stage_ranks
            client = self._client(f"rank{rank}")
            groups = group_caches(
                kv_caches,
                self.identity,
                [self.namespace(g, stage) for g in range(len(self.group_ids))],
                self.group_ids,
                world_size=1 if self.canonical else self.stage_ranks,
                canonical=self.canonical,
                rank=rank,
            )
            self._worker = KVOffloadWorker(
                client,
                groups,
                rank % self.stage_ranks,
                stage,
                self.blocks_per_chunk,
                self.copy_mode,
                self.store_timeout_s,
                self.load_wait_s,
                parts=self.config.parallel.world_size if self.canonical else 0,
                batch_interval_s=self.batch_interval_s,
            )
            self._connected(client, f"rank {rank}", [g.namespace for g in groups])
        return self._worker


def layout_choice(config: OffloadingConfig) -> tuple[bool, str]:
    """(canonical?, the log line saying which host layout an engine uses and why)."""
    p = config.parallel
    shape = f"tp={p.tp_size}, pp={p.pp_size}, pcp={p.pcp_size}, dcp={p.dcp_size}"
    per_rank = f"per-rank layout ({shape}; world size {p.world_size})"
    groups = f"{len(config.groups)} KV cache group{'s' * (len(config.groups) > 1)}"
    if not config.canonical_layout:
        return False, (
            f"{per_rank}, {groups}: blocks are shared with engines of the same parallel "
            "shape; set canonical_layout to share them across TP sizes"
        )
    if not p.is_parallelism_agnostic:
        return False, (
            f"{per_rank}, {groups}: canonical_layout was requested, but vLLM does not "
            "certify this configuration as parallelism-agnostic (context parallelism, "
            "or its attention layout), so blocks are shared only with the same shape"
        )
    if p.pp_size > 1 or p.world_size != p.tp_size * p.pcp_size:
        return False, (
            f"{per_rank}, {groups}: canonical_layout was requested and vLLM certified "
            "the configuration, but vLLM derives canonical pages only when every rank "
            "holds every layer (no pipeline parallelism), so each pipeline stage "
            "keeps its own blocks, shared with engines of the same shape"
        )
    fmt = format_id(config)
    if not fmt:
        return False, (
            f"{per_rank}, {groups}: canonical_layout was requested, but the KV cache "
            f"layout {config.kv_cache_layout} has no canonical format"
        )
    what = (
        "one copy for all ranks (replicated MLA latent)"
        if config.replicated_layout
        else f"each of {p.world_size} ranks writes its heads"
    )
    return True, (f"canonical layout {fmt}, {groups}, shared by every TP size of the model: {what}")


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
