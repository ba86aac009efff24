"""Tests against SGLang 0.5.23's real HiCache controller; ``make test-sglang`` installs it.

SGLang's modules import torchvision (model configs), which cannot load against the
local CPU torch: ``kvoffloadbench.sglang_cpu`` serves a stand-in before any SGLang
import (see its docstring)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="SGLang 0.5.23 is not installed; run `make test-sglang`",
)

from kvoffloadbench import sglang_cpu
from kvoffloadbench.launch import DaemonProcess

sglang_cpu.install()


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    """A fresh daemon (128 MiB region); must stop cleanly, nothing leaked."""
    with DaemonProcess(
        "128MiB", "--log-level", "warning", settings={"max_writing_fraction": 1.0}
    ) as d:
        yield d
        rc = d.stop() if d.alive() else 0
    assert rc == 0, f"kvoffloadd exited with {rc}"
    assert not os.path.exists(d.socket_path), "socket leaked"
