"""The vLLM plug-in: kvoffloadd as an OffloadingSpec for vLLM 0.33's OffloadingConnector.

Point vLLM at it with configuration alone::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm", "socket_path": "/run/kvoffload/kvoffloadd.sock"}}'

``KVOffloadSpec`` is imported lazily, so ``kvoffload.vllm.identity`` works without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVOffloadSpec"]


def __getattr__(name: str) -> Any:
    if name == "KVOffloadSpec":
        from .spec import KVOffloadSpec

        return KVOffloadSpec
    raise AttributeError(name)
