"""The SGLang plug-in: kvoffloadd as SGLang 0.5.23's HiCache L3 storage backend.

Point SGLang at it with configuration alone::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvoffload",
      "module_path": "kvoffload.sglang", "class_name": "KVOffloadStorage",
      "interface_v1": 1, "allocator": "shm"}'

Rules:
- ``KVOffloadStorage`` is imported lazily, so ``kvoffload.sglang.identity`` and
  ``kvoffload.sglang.pool`` work without SGLang.
- Every call SGLang's controller makes is bounded in time: it catches exceptions but
  not hangs, and all-reduces hit counts across ranks.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVOffloadStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVOffloadStorage":
        from kvoffload.sglang.backend import KVOffloadStorage

        return KVOffloadStorage
    raise AttributeError(name)
