"""The vLLM plug-in: kvoffloadd as an OffloadingSpec for vLLM 0.33's OffloadingConnector.

Point vLLM at it with configuration alone::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm", "socket_path": "/run/kvoffloadd/kvoffloadd.sock"}}'

Rules:
- ``KVOffloadSpec`` is imported lazily, so ``kvoffload.vllm.identity`` works without vLLM.
- Every configuration is derived from vLLM's own planning; a shape kvoffload cannot
  share falls back with one log line, never a crash at start (invariant 14).
- No daemon fault reaches vLLM: every submit returns True, every result succeeds or
  finishes uncommitted (invariant 8).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVOffloadSpec"]


def __getattr__(name: str) -> Any:
    if name == "KVOffloadSpec":
        from kvoffload.vllm.spec import KVOffloadSpec

        return KVOffloadSpec
    raise AttributeError(name)
