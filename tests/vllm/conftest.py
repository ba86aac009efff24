"""Tests against the real vLLM 0.33 classes; ``make test-vllm`` installs them."""

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.base", reason="vLLM 0.33 is not installed; run `make test-vllm`"
)
# vLLM's connector package, imported once with torch's own deprecation warnings off
# (pytest turns them into errors at collection otherwise).
import kvoffloadbench.vllm_plan  # noqa: F401
