"""kvoffload: client library for the node-local KV-cache offload daemon kvoffloadd.

Scheduler side::

    client = kvoffload.connect()
    ns = client.namespace("llama-3.1-8b", kvoffload.KVLayout(tensor_page_bytes=[...]))
    hits = ns.lookup(keys)

Worker side::

    caches = [kvoffload.shared_kv_cache(num_blocks, page_bytes) for _ in range(n)]
    w = ns.attach_worker(caches, rank=0)
    w.submit_store(job_id, engine_block_ids, plan.slots)

Layers, lowest first; a module imports only from its own layer or below (checked by
``tests/unit/test_layout.py``):

1. ``protocol``: the sans-IO wire protocol (no sockets, no torch); the daemon and the
   CLI import it too. ``version``: the distribution's version, its one place.
2. ``datapath``, ``cuda``: how blocks lie in slots and the region and the copies that
   move them (shared with the daemon); the CUDA driver seam.
3. ``link``: the unix-socket connection under the API, who the daemon is, and the
   keeper thread that replaces a lost connection.
4. The API: ``client``, ``namespace``, ``worker``, ``cache``, ``plans``, ``paths``.
5. ``engine``: engines' never-waiting machinery (key mirror view, streaming worker,
   tier probes).
6. ``vllm``, ``sglang``: the engine plug-ins.
"""

from kvoffload.cache import shared_kv_cache
from kvoffload.client import Client, connect
from kvoffload.namespace import Namespace
from kvoffload.plans import LoadPlan, OffloadEvent, StorePlan
from kvoffload.protocol.errors import (
    DaemonUnavailableError,
    ErrorCode,
    InvalidArgumentError,
    KVOffloadError,
    LayoutMismatchError,
    LoadLostError,
    NoSpaceError,
    NotFoundError,
    NotLeasedError,
    PermissionDeniedError,
    ProtocolError,
    QuotaExceededError,
    ShuttingDownError,
    VersionMismatchError,
)
from kvoffload.protocol.messages import KEY_ABSENT, KEY_PROMOTING, KEY_READY, KVLayout
from kvoffload.version import __version__
from kvoffload.worker import TransferResult, Worker

__all__ = [
    "KEY_ABSENT",
    "KEY_PROMOTING",
    "KEY_READY",
    "Client",
    "DaemonUnavailableError",
    "ErrorCode",
    "InvalidArgumentError",
    "KVLayout",
    "KVOffloadError",
    "LayoutMismatchError",
    "LoadLostError",
    "LoadPlan",
    "Namespace",
    "NoSpaceError",
    "NotFoundError",
    "NotLeasedError",
    "OffloadEvent",
    "PermissionDeniedError",
    "ProtocolError",
    "QuotaExceededError",
    "ShuttingDownError",
    "StorePlan",
    "TransferResult",
    "VersionMismatchError",
    "Worker",
    "__version__",
    "connect",
    "shared_kv_cache",
]
