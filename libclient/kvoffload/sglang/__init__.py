"""The SGLang plug-in: kvoffloadd as SGLang 0.5.23's HiCache L3 storage backend.

Point SGLang at it with configuration alone::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvoffload",
      "module_path": "kvoffload.sglang", "class_name": "KVOffloadStorage",
      "interface_v1": 1, "allocator": "shm"}'

``KVOffloadStorage`` is imported lazily, so ``kvoffload.sglang.identity`` and
``kvoffload.sglang.pool`` work without SGLang.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVOffloadStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVOffloadStorage":
        from .backend import KVOffloadStorage

        return KVOffloadStorage
    raise AttributeError(name)
