"""``KVOffloadStorage``: kvoffloadd as SGLang 0.5.23's HiCache L3 storage backend.

Selected by configuration alone::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "kvoffload", "module_path": "kvoffload.sglang",
        "class_name": "KVOffloadStorage", "interface_v1": 1, "allocator": "shm"}'

Rules:
- Zero-copy only (``"interface_v1": 1``, refused at start without it): pages move
  between SGLang's host pool and the daemon's region, never through a bounce buffer.
  With ``"allocator": "shm"`` the host pool is a memfd and the daemon copies
  inside system calls only (kvoffloadd's ``fdcopy``: a shrink fails a job, never the
  daemon); with the default
  allocator the client copies through its own mapping of the region (trusted uids).
- No call raises into SGLang, and none outlives its deadline: ``deadline_s`` plus
  ``deadline_per_ki_token_s`` per 1,024 tokens of the call (well under SGLang's own
  prefetch timeout of 1 s + 0.25 s per 1,024 tokens). A daemon that is away, hung or
  refusing turns into misses and failed (never committed) backups; the client
  reconnects by itself and re-registers.
- A page SGLang was told hit loads the bytes stored under its key, or is reported
  missing (``kvoffload.sglang.link``).
- The namespace carries everything that changes a page's bytes
  (``kvoffload.sglang.identity``); one namespace per shard.
- Hybrid models (pools registered through ``register_mem_host_pool_v2``) and host pools
  other than SGLang's MHA and MLA pools are refused at start with one error naming
  them.
- Three connections, one per SGLang storage thread's role (hit queries, prefetch
  loads, backups), so a long copy never delays a hit query. Hit queries are answered
  from a local mirror of the namespace's keys (``mirror``), no round trip.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvoffload.client import Client, connect
from kvoffload.sglang.identity import SglangIdentity, Shard, mha_shards
from kvoffload.sglang.link import Deadline, PageLink, PoolWorker
from kvoffload.sglang.mirror import KeyMirror
from kvoffload.sglang.pool import (
    PoolError,
    block_ids,
    memfd_descs,
    plain_views,
    pool_shape,
    shm_offset,
)

log = logging.getLogger(__name__)

SUPPORTED_POOLS = ("MHATokenToKVPoolHost", "MLATokenToKVPoolHost")
COPY_MODES = ("auto", "daemon", "client")


_PAGE_KEY = np.dtype((np.void, 32))  # a void dtype keeps trailing NUL bytes


def page_key(key: str) -> bytes:
    """SGLang's 64-hex page hash as its 32 bytes; any other key string hashed so."""
    if len(key) == 64:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    import hashlib

    return hashlib.sha256(key.encode()).digest()


def page_keys(keys: list[str]) -> list[bytes]:
    """``page_key`` of each key. A batch of SGLang's page hashes (the usual call) is
    decoded in one ``fromhex`` and split at C speed: a third of the per-key cost."""
    if len(keys) >= 8:  # fewer: numpy's setup costs more than it saves
        joined = "".join(keys)
        if len(joined) == 64 * len(keys):
            try:
                raw = bytes.fromhex(joined)
            except ValueError:
                raw = b""
            # fromhex skips whitespace: only a batch of 64-hex keys gives 32 bytes each
            if len(raw) == 32 * len(keys):
                out: list[bytes] = np.frombuffer(raw, dtype=_PAGE_KEY).tolist()
                return out
    return [page_key(k) for k in keys]


class _Role:
    """One connection and its shard links, used by one kind of call at a time."""

    REVIVE_S = 0.1  # the longest a call waits for a daemon that just restarted

    def __init__(self, client: Client, links: list[PageLink], mirrors: list[KeyMirror]) -> None:
        self.client = client
        self.links = links
        self.mirrors = mirrors  # the query role's: one per link
        self.lock = threading.Lock()

    def acquire(self, deadline: Deadline) -> bool:
        """Take the role for one call; first notice (without blocking) a daemon that
        went away since the last call, and give one that is already back a moment to
        be reconnected, so a restart costs no call."""
        if not self.lock.acquire(timeout=max(0.0, deadline.left_s())):
            return False
        if self.client.connected:
            self.client.poll()
            if not self.client.connected:
                self.client.wait_connected(min(deadline.left_s() / 2, self.REVIVE_S))
        return True


class KVOffloadStorage(HiCacheStorage):
    ACK_INTERVAL_S = 0.1

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.config = storage_config
        extra = dict(storage_config.extra_config or {})
        if not extra.get("interface_v1"):
            raise ValueError(
                'kvoffload: add "interface_v1": 1 to --hicache-storage-backend-extra-config '
                "(kvoffload moves pages zero-copy only)"
            )
        self.copy_mode = str(extra.get("copy_mode", "auto"))
        if self.copy_mode not in COPY_MODES:
            raise ValueError(f"kvoffload: copy_mode must be one of {COPY_MODES}")
        self.socket_path: str | None = extra.get("socket_path") or None
        self.namespace_name: str | None = extra.get("namespace") or None
        self.cache_salt = str(extra.get("cache_salt", ""))
        self.deadline_s = float(extra.get("deadline_s", 0.4))
        self.deadline_per_ki_token_s = float(extra.get("deadline_per_ki_token_s", 0.1))
        self.connect_timeout_s = float(extra.get("connect_timeout_s", 1.0))
        self.page_size = 0
        self.namespaces: list[str] = []
        self._clients: list[Client] = []
        self._workers: list[PoolWorker] = []
        self._query: _Role | None = None
        self._loads: _Role | None = None
        self._stores: _Role | None = None
        self._warned: set[str] = set()
        self._stop = threading.Event()

    # ------------------------------------------------------------ start

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        try:
            self._attach(mem_pool_host)
        except PoolError as exc:
            raise ValueError(f"kvoffload cannot store this host pool: {exc}") from None

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang 0.5.23 registers every entry of the host pool group here, the KV anchor
        (already registered by ``register_mem_pool_host``) included: that one is
        stored; any other pool (a hybrid model's) is refused, at start."""
        if host_pool is getattr(self, "mem_pool_host", None):
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        raise NotImplementedError(
            f"kvoffload does not store hybrid models yet: model {self.config.model_name!r} "
            f"has a {host_pool_name} pool ({type(host_pool).__name__}) that needs HiCache's "
            "*_v2 storage calls; run it without --hicache-storage-backend dynamic kvoffload"
        )

    def _attach(self, pool: Any) -> None:
        kind = type(pool).__name__
        if kind not in SUPPORTED_POOLS:
            raise PoolError(
                f"model {self.config.model_name!r} uses a {kind} host pool; kvoffload stores "
                f"{' and '.join(SUPPORTED_POOLS)} pages"
            )
        c = self.config
        split = 1
        if not c.is_mla_model and c.should_split_heads and c.tp_lcm_size:
            split = c.tp_lcm_size // c.tp_size
        shape = pool_shape(pool, split)
        self.page_size = shape.page_size
        mode = self.copy_mode
        if mode == "auto":
            mode = "daemon" if getattr(pool, "fd", None) is not None else "client"
        offset = shm_offset(pool) if mode == "daemon" else 0
        if c.is_mla_model:
            geometry = f"layers={pool.layer_num};kv_dim={pool.kv_cache_dim}"
            tps = [""]
        else:
            geometry = (
                f"layers={pool.layer_num};heads={pool.head_num // split};"
                f"head_dim={pool.head_dim};v_head_dim={pool.v_head_dim}"
            )
            tps = mha_shards(c.tp_rank, c.tp_size, split)
        dcp = f"{c.dcp_rank}/{c.dcp_size}"
        pp, cp = f"{c.pp_rank}/{c.pp_size}", f"{c.attn_cp_rank}/{c.attn_cp_size}"
        layouts = []
        for tp, elements in zip(tps, shape.shards):
            ident = SglangIdentity(
                model=c.model_name or "",
                kv_dtype=str(pool.dtype).removeprefix("torch."),
                page_size=shape.page_size,
                host_layout=pool.layout,
                pool_kind=kind,
                geometry=geometry,
                element_bytes=[e.page_bytes for e in elements],
                shard=Shard(tp, pp, cp, dcp),
                cache_salt=self.cache_salt,
            )
            name, layout = ident.namespace(self.namespace_name)
            self.namespaces.append(name)
            layouts.append((name, layout, elements))
        roles = []
        for role in ("query", "loads", "stores"):
            client = connect(
                self.socket_path,
                timeout_s=self.connect_timeout_s,
                name=f"sglang-tp{c.tp_rank}-{role}",
                lazy=True,
            )
            self._clients.append(client)
            links, mirrors = [], []
            for name, layout, elements in layouts:
                ns = client.namespace(name, layout, subscribe=role == "query")
                if role == "query":
                    mirrors.append(KeyMirror(ns))
                worker = None
                if role != "query":
                    if mode == "daemon":
                        caches: list[Any] = memfd_descs(elements, shape.page_num, offset)
                        fd: int | None = os.dup(pool.fd)
                    else:
                        caches, fd = plain_views(pool, elements, shape.page_num), None
                    worker = PoolWorker(ns, caches, fd)
                    self._workers.append(worker)
                links.append(PageLink(ns, worker))
            roles.append(_Role(client, links, mirrors))
        self._query, self._loads, self._stores = roles
        for client in self._clients:
            client.wait_connected(self.connect_timeout_s)
        self._acker = threading.Thread(target=self._ack_feed, name="kvoffload-feed", daemon=True)
        self._acker.start()
        log.info(
            "kvoffload: rank tp=%d pp=%d stores %s pages in %s (%s copies) at %s",
            c.tp_rank,
            c.pp_rank,
            kind,
            ", ".join(self.namespaces),
            mode,
            self._clients[0].socket_path,
        )

    # ------------------------------------------------------------ helpers

    def _ack_now(self) -> None:
        """Acknowledge this instance's mirrors now (when no hit query holds them)."""
        role = self._query
        if role is not None and role.lock.acquire(blocking=False):
            try:
                for mirror in role.mirrors:
                    mirror.refresh()
            finally:
                role.lock.release()

    def _ack_feed(self) -> None:
        """Between hit queries, keep the mirrors current and their feed acknowledged,
        so evicted blocks' slots are reused without waiting (never blocks a query)."""
        while not self._stop.wait(self.ACK_INTERVAL_S):
            try:
                self._ack_now()
            except Exception as exc:  # pragma: no cover - the client never raises here
                log.debug("feed refresh: %s", exc)

    def _deadline(self, pages: int) -> Deadline:
        tokens = pages * max(self.page_size, 1)
        return Deadline.after(self.deadline_s + self.deadline_per_ki_token_s * tokens / 1024)

    def _warn_once(self, what: str, exc: BaseException) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("kvoffload: %s failed (%s); treated as a miss", what, exc)

    # ------------------------------------------------------------ zero-copy calls

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        role = self._query
        if role is None or not keys:
            return 0
        try:
            deadline = self._deadline(0)
            if not role.acquire(deadline):
                return 0
            try:
                packed = page_keys(keys)
                hits = len(packed)
                for link, mirror in zip(role.links, role.mirrors):
                    found = mirror.leading(packed[:hits])
                    if found < hits and link.ns.tiers:  # a tier may hold the rest
                        found = link.ready(packed[:hits], deadline)
                    hits = found
                    if hits == 0:
                        break
                return hits
            finally:
                role.lock.release()
        except Exception as exc:  # never into SGLang
            self._warn_once("a hit query", exc)
            return 0

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._transfer(self._loads, keys, host_indices, is_store=False)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._transfer(self._stores, keys, host_indices, is_store=True)

    def _transfer(
        self, role: _Role | None, keys: list[str], host_indices: Any, is_store: bool
    ) -> list[bool]:
        n = len(keys)
        if role is None or n == 0:
            return [False] * n
        try:
            deadline = self._deadline(n)
            ids = block_ids(host_indices, n, self.page_size)
            if ids is None:
                self._warn_once("a page of unaligned host slots", ValueError("not page-aligned"))
                return [False] * n
            if not role.acquire(deadline):
                return [False] * n
            try:
                packed = page_keys(keys)
                if is_store:
                    ok = [True] * n
                    for link in role.links:
                        done = link.store(packed, ids, deadline, self._ack_now)
                        ok = [a and b for a, b in zip(ok, done)]
                    query = self._query
                    if query is not None:
                        for mirror in query.mirrors:
                            mirror.note_stored(k for k, good in zip(packed, ok) if good)
                    return ok
                loaded = n
                for link in role.links:
                    loaded = min(loaded, link.load(packed[:loaded], ids, deadline))
                    if loaded == 0:
                        break
                return [i < loaded for i in range(n)]
            finally:
                role.lock.release()
        except Exception as exc:  # never into SGLang
            self._warn_once("a backup" if is_store else "a prefetch", exc)
            return [False] * n

    # ------------------------------------------------------------ the generic calls

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return None  # zero-copy only: SGLang calls batch_get_v1 with interface_v1

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        return [None] * len(keys)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return False

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return False

    def get_stats(self) -> Any:
        return None

    def clear(self) -> None:
        return  # the pool is shared: clearing it is the admin's (kvoffloadctl evict)

    def close(self) -> None:
        self._stop.set()
        for w in self._workers:
            w.close()
        for client in self._clients:
            client.close()
        self._workers, self._clients = [], []
        self._query = self._loads = self._stores = None


__all__ = ["KVOffloadStorage"]
