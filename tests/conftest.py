"""Shared fixtures: a real kvoffloadd subprocess per test module or per test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvoffloadbench.launch import DaemonProcess
from kvoffloadbench.redis_server import RedisServer


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(params=("redis-server", "valkey-server"), ids=("redis", "valkey"))
def redis_server_name(request: pytest.FixtureRequest) -> str:
    """Each Redis tier test runs against Redis and against Valkey (make test installs
    both from Debian); one that is not installed skips, naming it."""
    name: str = request.param
    if why := RedisServer.available(name):
        pytest.skip(why)
    return name


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    """A fresh daemon with a 64 MiB region; must stop cleanly (exit 0, nothing leaked)."""
    with DaemonProcess("64MiB", "--log-level", "warning") as d:
        yield d
        rc = d.stop()
    assert rc == 0, f"kvoffloadd exited with {rc}"
    assert not os.path.exists(f"/dev/shm{d.region_name}"), "region leaked"
    assert not os.path.exists(d.socket_path), "socket leaked"
