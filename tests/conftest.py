"""Shared fixtures: a real kvoffloadd subprocess per test module or per test.

A test session leaves nothing behind: every temporary file and directory (the tests',
the daemons' sockets, pytest's own) goes under one session directory, removed at the
end; so do the regions this session's daemons left in /dev/shm (one killed with
SIGKILL, or one that kept its region for a warm restart), except those a live daemon
still holds. With suites side by side (tools/test-suites), the runner removes those
regions once every suite has ended, as a region new to one suite may be another's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from kvoffload.client import Client
from kvoffloadbench.launch import SHM, SUITES_SIDE_BY_SIDE, DaemonProcess, remove_regions_left
from kvoffloadbench.redis_server import RedisServer

_session: dict[str, object] = {}


def pytest_configure(config: pytest.Config) -> None:
    base = tempfile.mkdtemp(prefix="kvoffload-tests-")
    os.chmod(base, 0o1777)  # as /tmp is: tests acting as another uid work below it too
    _session.update(base=base, tmpdir=os.environ.get("TMPDIR"), shm=set(os.listdir(SHM)))
    os.environ["TMPDIR"] = tempfile.tempdir = base
    if config.option.basetemp is None:
        config.option.basetemp = os.path.join(base, "pytest")


def pytest_unconfigure(config: pytest.Config) -> None:
    if "base" not in _session:
        return
    tempfile.tempdir = None
    if (old := _session["tmpdir"]) is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = str(old)
    shutil.rmtree(str(_session["base"]), ignore_errors=True)
    before = _session["shm"]
    assert isinstance(before, set)
    if not os.environ.get(SUITES_SIDE_BY_SIDE):  # else tools/test-suites, once all end
        remove_regions_left(before)


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


@pytest.fixture(autouse=True)
def _clients_closed_after_each_test() -> Iterator[None]:
    """Every kvoffload client a test made (not its module's or session's fixtures) is
    closed when the test ends: a client left open keeps a keeper thread that retries
    its handshake every few seconds once its daemon is gone, allocating as it does,
    and would run on under the tests that come after it."""
    made: weakref.WeakSet[Client] = weakref.WeakSet()
    init = Client.__init__

    def tracked(self: Client, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.add(self)

    Client.__init__ = tracked  # type: ignore[method-assign]
    try:
        yield
    finally:
        Client.__init__ = init  # type: ignore[method-assign]
        for client in list(made):
            client.close()


@pytest.fixture(params=("redis-server", "valkey-server"), ids=("redis", "valkey"))
def redis_server_name(request: pytest.FixtureRequest) -> str:
    """Each Redis tier test runs against Redis and against Valkey (make test installs
    both from Debian); one that is not installed skips, naming it."""
    name: str = request.param
    if why := RedisServer.available(name):
        pytest.skip(why)
    return name


@pytest.fixture
def redis_server(redis_server_name: str) -> Iterator[RedisServer]:
    """A fresh Redis (or Valkey) server on loopback for one test."""
    server = RedisServer(name=redis_server_name).start()
    yield server
    server.stop()


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    """A fresh daemon with a 64 MiB region; must stop cleanly (exit 0, nothing leaked)."""
    with DaemonProcess("64MiB", "--log-level", "warning") as d:
        yield d
        rc = d.stop()
    assert rc == 0, f"kvoffloadd exited with {rc}"
    assert not os.path.exists(f"/dev/shm{d.region_name}"), "region leaked"
    assert not os.path.exists(d.socket_path), "socket leaked"
