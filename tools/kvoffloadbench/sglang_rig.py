"""SGLang 0.5.23's real HiCache controller and host pools on CPU (tests and benchmarks).

``Instance`` is one SGLang rank as far as L3 storage goes: a real
``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost`` (any host layout, the default or
the ``shm`` allocator) and a real ``HiCacheController`` with a storage backend picked
by SGLang's own factory from ``--hicache-storage-backend`` and its extra-config, so
kvoffload is loaded exactly as a user's flags load it. What it drives is SGLang's own
path: ``write_storage`` -> backup thread -> ``ack_backup_queue``, and ``prefetch`` ->
hit query -> ``prefetch_hit_queue`` -> ``prefetch_buffer`` -> ``ack_prefetch_queue``.

What needs a GPU is left out: the device KV pool is a stand-in exposing the three
things the controller reads of it (device, layer count, the layer-transfer counter
hook), and pages reach the host pool by writing its tensor (``fill``) rather than by
a device-to-host kernel. Everything from the host pool down is SGLang's.

Import ``sglang_cpu`` first (done here): it serves the CPU stand-ins SGLang needs.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import sglang_cpu

sglang_cpu.install()

import warnings  # noqa: E402

import torch  # noqa: E402

with warnings.catch_warnings():  # SGLang's imports warn about CUDA-only kernels and torch.jit
    warnings.simplefilter("ignore")
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        HybridCacheController,
    )
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.runtime_context import get_context, get_parallel

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
KVOFFLOAD_BACKEND = {
    "backend_name": "kvoffload",
    "module_path": "kvoffload.sglang",
    "class_name": "KVOffloadStorage",
    "interface_v1": 1,
}


@dataclass(frozen=True)
class Model:
    """The KV geometry of one rank: MHA (``heads`` K/V heads of ``head_dim``) or MLA
    (one latent row of ``kv_dim``)."""

    name: str = "tiny-llama"
    mla: bool = False
    layers: int = 4
    heads: int = 4
    head_dim: int = 32
    kv_dim: int = 96
    dtype: torch.dtype = torch.bfloat16


class _DevicePool:
    """What HiCacheController reads of the device KV pool, without a device."""

    device = torch.device("cpu")

    def __init__(self, layer_num: int) -> None:
        self.layer_num = layer_num

    def register_layer_transfer_counter(self, counter: Any) -> None:
        return


class _MLADevicePool(MLATokenToKVPool):
    """An MLA device pool as far as the controller's isinstance test goes."""

    device = torch.device("cpu")

    def __init__(self, layer_num: int) -> None:  # no device memory
        self.layer_num = layer_num

    def register_layer_transfer_counter(self, counter: Any) -> None:
        return


class _Timed:
    """The controller's storage backend, with the time of every L3 call recorded."""

    def __init__(self, backend: Any, calls: list[tuple[str, float, int]]) -> None:
        self._inner = backend
        self._calls = calls

    def _timed(self, name: str, *args: Any) -> Any:
        t0 = time.monotonic()
        try:
            return getattr(self._inner, name)(*args)
        finally:
            self._calls.append((name, time.monotonic() - t0, len(args[0])))

    def batch_exists(self, *args: Any) -> Any:
        return self._timed("batch_exists", *args)

    def batch_get_v1(self, *args: Any) -> Any:
        return self._timed("batch_get_v1", *args)

    def batch_set_v1(self, *args: Any) -> Any:
        return self._timed("batch_set_v1", *args)

    def batch_get(self, *args: Any) -> Any:  # SGLang's generic (copying) path
        return self._timed("batch_get", *args)

    def batch_set(self, *args: Any) -> Any:
        return self._timed("batch_set", *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Allocator:
    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def get_kvcache(self) -> Any:
        return self._pool


def _device_rows(model: Model, page_size: int) -> tuple[list[torch.Tensor], ...]:
    """Per-layer device-shaped CPU tensors (one page): the host pool reads their shape
    and pointers at construction only."""
    if model.mla:
        rows = [torch.zeros(page_size, 1, model.kv_dim, dtype=model.dtype)] * model.layers
        return (rows,)
    shape = (page_size, model.heads, model.head_dim)
    k = [torch.zeros(shape, dtype=model.dtype) for _ in range(model.layers)]
    v = [torch.zeros(shape, dtype=model.dtype) for _ in range(model.layers)]
    return k, v


def _ptrs(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def host_pool(
    model: Model, layout: str, page_size: int, pages: int, allocator: str = "default"
) -> Any:
    """A real SGLang host pool of ``pages`` pages (the shm allocator needs the
    published server args that ``Instance`` installs)."""
    common: dict[str, Any] = {
        "host_to_device_ratio": 2.0,
        "host_size": 0,
        "page_size": page_size,
        "layout": layout,
        "pin_memory": False,
        "device": "cpu",
        "allocator_type": allocator,
        "device_capacity_tokens": page_size,
        "start_layer": 0,
        "end_layer": model.layers,
        "host_token_capacity": pages * page_size,
    }
    if model.mla:
        (rows,) = _device_rows(model, page_size)
        info = MLABufferInfo(
            buffers=tuple(rows),
            data_ptrs=_ptrs(rows),
            layer_indices=tuple(range(model.layers)),
            device_layer_num=model.layers,
            page_size=page_size,
            kv_lora_rank=model.kv_dim - 32,
            qk_rope_head_dim=32,
            kv_cache_dim=model.kv_dim,
            dtype=model.dtype,
            device=torch.device("cpu"),
        )
        return MLATokenToKVPoolHost(info, target_layer_num=model.layers, **common)
    k, v = _device_rows(model, page_size)
    buffers = KVBuffers(
        k=tuple(k), v=tuple(v), k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
        layout=KVBufferLayout.NHD,
    )  # fmt: skip
    mha = MHABufferInfo(
        buffers=buffers,
        page_size=page_size,
        head_num=model.heads,
        head_dim=model.head_dim,
        v_head_dim=model.head_dim,
        dtype=model.dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(mha, **common)


def storage_keys(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's L3 page keys of a prompt (its hash chain, as the controller makes it)."""
    keys: list[str] = get_storage_hash_str(tokens, None, page_size=page_size)
    return keys


def page_tokens(seed: int, pages: int, page_size: int) -> list[int]:
    """Token ids of a prompt of ``pages`` full pages (deterministic per seed)."""
    out = []
    for i in range(pages * page_size):
        h = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=4).digest()
        out.append(int.from_bytes(h, "little") % 50_000)
    return out


@dataclass
class Prefetched:
    hit_tokens: int  # what the hit query (all-reduced) said
    loaded_tokens: int  # what the acks said was loaded
    host_indices: torch.Tensor | None
    seconds: float
    acks: list[Any] = field(default_factory=list)


class Instance:
    """One SGLang rank's L2 host pool and cache controller with an L3 backend."""

    def __init__(
        self,
        model: Model,
        layout: str,
        page_size: int,
        pages: int,
        extra_config: dict[str, Any] | None = None,
        backend: str = "dynamic",
        tp_rank: int = 0,
        tp_size: int = 1,
        model_name: str | None = None,
        controller: str = "hybrid",
        swa_pool: bool = False,
    ) -> None:
        """``controller``: "hybrid" is what SGLang 0.5.23's server runs for every model
        (``HybridCacheController`` over a ``HostPoolGroup`` whose anchor is the KV pool,
        registered again through ``register_mem_host_pool_v2``); "base" is the plain
        ``HiCacheController``. ``swa_pool`` adds a sliding-window side pool, as a hybrid
        model's host pool group has."""
        self.model = model
        self.hybrid = controller == "hybrid"
        self.page_size = page_size
        config = dict(KVOFFLOAD_BACKEND if backend == "dynamic" else {})
        config.update(extra_config or {})
        allocator = "shm" if config.get("allocator") == "shm" else "default"
        import json

        self._args = get_context().override_server_args(
            hicache_storage_backend=backend,
            hicache_storage_backend_extra_config=json.dumps(config),
        )
        self._args.install()
        get_parallel().override_permanently(
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
            attn_tp_rank=tp_rank, attn_tp_size=tp_size, moe_tp_size=tp_size,
            attn_dcp_size=1, attn_dcp_rank=0,
        )  # fmt: skip
        try:
            self.pool = host_pool(model, layout, page_size, pages, allocator)
            device = _MLADevicePool(model.layers) if model.mla else _DevicePool(model.layers)
            host: Any = self.pool
            cls: Any = HiCacheController
            if self.hybrid:
                entries = [PoolEntry(PoolName.KV, self.pool, device, lambda i: i, True)]
                if swa_pool:
                    side = host_pool(model, layout, page_size, pages, allocator)
                    entries.append(PoolEntry(PoolName.SWA, side, device, lambda i: i))
                host, cls = HostPoolGroup(entries), HybridCacheController
            self.controller = cls(
                _Allocator(device),
                host,
                page_size,
                tp_group=None,  # type: ignore[arg-type]
                load_cache_event=threading.Event(),
                io_backend="direct",
                storage_backend=backend,
                model_name=model_name or model.name,
                storage_backend_extra_config=dict(config),
            )
        except BaseException:
            self._args.restore()
            raise
        # SGLang's fault injector (SGLANG_TEST_HICACHE_BACKEND_*) wraps the backend
        self.backend = getattr(self.controller.storage_backend, "_backend", None) or (
            self.controller.storage_backend
        )
        self.calls: list[tuple[str, float, int]] = []  # (call, seconds, pages)
        self.controller.storage_backend = _Timed(self.controller.storage_backend, self.calls)

    # ------------------------------------------------------------ L2 pages

    def alloc(self, pages: int) -> torch.Tensor:
        got: torch.Tensor | None = self.pool.alloc(pages * self.page_size)
        assert got is not None, "host pool full"
        return got

    def free(self, host_indices: torch.Tensor) -> None:
        self.pool.free(host_indices)

    def page_bytes(self, host_indices: torch.Tensor, split: int = 1) -> list[bytes]:
        """Every page's bytes, element by element, as SGLang's zero-copy meta says;
        with ``split`` > 1 (``page_head``), each page's virtual head shards in turn:
        ``split`` entries per page."""
        import ctypes

        if split > 1:
            ptrs, sizes = self.pool.get_split_heads_page_buffer_meta(host_indices, split)
        else:
            ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        per = len(ptrs) // (len(host_indices) // self.page_size) // split
        return [
            b"".join(ctypes.string_at(ptrs[i], sizes[i]) for i in range(p, p + per))
            for p in range(0, len(ptrs), per)
        ]

    def fill(self, host_indices: torch.Tensor, seed: int) -> list[bytes]:
        """Write recognisable bytes into the pages (as a device backup would)."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        import ctypes

        for i, (p, n) in enumerate(zip(ptrs, sizes)):
            pattern = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=64).digest()
            data = (pattern * (n // 64 + 1))[:n]
            ctypes.memmove(p, data, n)
        return self.page_bytes(host_indices)

    def clear(self, host_indices: torch.Tensor) -> None:
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        import ctypes

        for p, n in zip(ptrs, sizes):
            ctypes.memset(p, 0, n)

    # ------------------------------------------------------------ SGLang's path

    def backup(self, host_indices: torch.Tensor, tokens: list[int], timeout_s: float = 30.0) -> int:
        """write_storage -> backup thread -> ack_backup_queue; tokens SGLang reports
        backed up."""
        hashes = storage_keys(tokens, self.page_size)
        op_id = self.controller.write_storage(host_indices, tokens, hash_value=hashes)
        assert self.controller.ack_backup_queue is not None
        deadline = time.monotonic() + timeout_s
        while True:
            op = self.controller.ack_backup_queue.get(timeout=max(0.0, deadline - time.monotonic()))
            if op.id == op_id:
                return int(op.completed_tokens)

    def prefetch(
        self,
        tokens: list[int],
        rid: str = "r",
        timeout_s: float = 30.0,
        keep: bool = True,
        between: Callable[[], object] | None = None,
    ) -> Prefetched:
        """prefetch -> hit query -> prefetch_hit_queue -> prefetch_buffer ->
        ack_prefetch_queue, as the scheduler drives it (``between`` runs after the hit
        query, before the pages are fetched)."""
        c = self.controller
        t0 = time.perf_counter()
        op = c.prefetch(CacheRequestHandle(rid, 0) if self.hybrid else rid, tokens)
        assert c.prefetch_hit_queue is not None and c.prefetch_buffer is not None
        deadline = time.monotonic() + timeout_s
        got = c.prefetch_hit_queue.get(timeout=timeout_s)
        assert got is op
        hit = int(op.storage_hit_count)
        if hit == 0:
            return Prefetched(0, 0, None, time.perf_counter() - t0)
        op.host_indices = self.alloc(hit // self.page_size)
        if between is not None:
            between()
        c.prefetch_buffer.put(op)
        acks = []
        loaded = 0
        while True:
            ack = c.ack_prefetch_queue.get(timeout=max(0.0, deadline - time.monotonic()))
            if ack.rid != rid:
                continue
            acks.append(ack)
            if ack.completed_tokens is not None:
                loaded = int(ack.completed_tokens)
            if ack.completed_req:
                break
        seconds = time.perf_counter() - t0
        indices = op.host_indices
        if not keep:
            self.free(indices)
            indices = None
        return Prefetched(hit, loaded, indices, seconds, acks)

    def close(self) -> None:
        try:
            self.controller.detach_storage_backend()
        finally:
            self._args.restore()
