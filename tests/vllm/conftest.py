"""Tests against the real vLLM 0.33 classes; ``make test-vllm`` installs them."""

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.base", reason="vLLM 0.33 is not installed; run `make test-vllm`"
)
