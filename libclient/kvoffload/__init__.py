"""kvoffload: client library for the node-local KV-cache offload daemon kvoffloadd.

Scheduler side::

    client = kvoffload.connect()
    ns = client.namespace("llama-3.1-8b", kvoffload.KVLayout(tensor_page_bytes=[...]))
    hits = ns.lookup(keys)

Worker side::

    caches = [kvoffload.shared_kv_cache(num_blocks, page_bytes) for _ in range(n)]
    w = ns.attach_worker(caches, rank=0)
    w.submit_store(job_id, engine_block_ids, plan.slots)
"""

from .cache import shared_kv_cache
from .client import Client, connect
from .namespace import Namespace
from .plans import LoadPlan, OffloadEvent, StorePlan
from .protocol.errors import (
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
from .protocol.messages import KEY_ABSENT, KEY_PROMOTING, KEY_READY, KVLayout
from .worker import TransferResult, Worker

__version__ = "0.1.0"

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
