"""Caches the daemon copies by descriptor (``memfd_io``): unsealable memfds, as
SGLang's ``shm`` host pool is, that the daemon copies without trusting their size.

The attack: a client registers its memfd, then shrinks it (``ftruncate``) before or
while the daemon copies. A plain memmove would die of SIGBUS there. Every test runs
against both of the daemon's ways to copy (``copy_path``): the guarded C copy (the
fault jumps back out of the copy) and system calls (where the C loop is not built:
a short count). Either way that job fails and the daemon lives.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from hostile import NOBODY, as_uid, requires_root

import kvoffload
from kvoffload.datapath import memruns
from kvoffload.protocol.messages import CacheDesc
from kvoffload.sglang.link import Deadline, PageLink, PoolWorker
from kvoffloadbench.launch import DaemonProcess


@pytest.fixture(params=["guarded", "syscalls"])
def daemon(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    """A fresh daemon copying descriptor caches by the guarded C loop or by syscalls."""
    if request.param == "guarded" and not memruns.NATIVE:
        pytest.skip("the C copy loop is not built here")
    env = dict(os.environ)
    if request.param == "syscalls":
        env["KVOFFLOAD_NO_NATIVE_COPY"] = "1"
    with DaemonProcess("64MiB", "--log-level", "warning", env=env) as d:
        yield d
        assert d.stop() == 0


PAGE = 64 * 1024
PAGES = 32
LAYOUT = kvoffload.KVLayout(tensor_page_bytes=[PAGE], model="m", kv_dtype="bf16")


def pool(pages: int = PAGES, seed: int = 0) -> tuple[int, mmap.mmap]:
    """An unsealable memfd (no MFD_ALLOW_SEALING, as SGLang makes it), filled."""
    fd = os.memfd_create("pool", os.MFD_CLOEXEC)
    os.ftruncate(fd, pages * PAGE)
    mm = mmap.mmap(fd, pages * PAGE)
    mm[:] = np.random.default_rng(seed).integers(0, 256, pages * PAGE, dtype=np.uint8).tobytes()
    return fd, mm


def link(client: kvoffload.Client, fd: int, pages: int = PAGES) -> PageLink:
    ns = client.namespace("pool", LAYOUT)
    desc = CacheDesc("memfd_io", pages, PAGE, 0, 0, PAGE)
    return PageLink(ns, PoolWorker(ns, [desc], os.dup(fd)))


def keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(8, "big") for i in range(n)]


def deadline() -> Deadline:
    return Deadline.after(10.0)


def test_store_and_load_by_descriptor(daemon: DaemonProcess) -> None:
    src_fd, src = pool(seed=1)
    dst_fd, dst = pool(seed=2)
    with kvoffload.connect(daemon.socket_path) as c:
        a, b = link(c, src_fd), link(c, dst_fd)
        ids = np.arange(PAGES, dtype=np.int64)
        assert all(a.store(keys(PAGES), ids, deadline()))
        assert b.load(keys(PAGES), ids[::-1].copy(), deadline()) == PAGES
        for i in range(PAGES):
            j = PAGES - 1 - i
            assert dst[j * PAGE : (j + 1) * PAGE] == src[i * PAGE : (i + 1) * PAGE]
        assert c.stats()["copies"]["stored_bytes_total"] >= PAGES * PAGE


def test_a_pool_shrunk_before_the_copy_fails_its_jobs_only(daemon: DaemonProcess) -> None:
    fd, _ = pool()
    with kvoffload.connect(daemon.socket_path) as c:
        victim = link(c, fd)
        ids = np.arange(PAGES, dtype=np.int64)
        assert all(victim.store(keys(4, b"a"), ids[:4], deadline()))
        os.ftruncate(fd, PAGE)  # the attack: shrink under the daemon
        assert not any(victim.store(keys(PAGES, b"b"), ids, deadline()))
        assert victim.load(keys(4, b"a"), ids[4:8].copy(), deadline()) == 0
        assert os.fstat(fd).st_size == PAGE  # the daemon never grows it back
        assert c.ping() < 5
        other_fd, _ = pool(seed=3)
        with kvoffload.connect(daemon.socket_path) as c2:  # the stored blocks are fine
            assert link(c2, other_fd).load(keys(4, b"a"), ids[:4], deadline()) == 4
        assert c.stats()["copies"]["failed_jobs_total"] >= 2
    assert daemon.alive()


def test_a_pool_shrunk_during_copies_never_kills_the_daemon(daemon: DaemonProcess) -> None:
    """Scenario: one thread stores and loads 2 MiB jobs back to back while another
    shrinks and regrows the pool as fast as it can: jobs fail, the daemon lives."""
    fd, _ = pool()
    stop = threading.Event()

    def shrink() -> None:
        while not stop.is_set():
            os.ftruncate(fd, 0)
            os.ftruncate(fd, PAGES * PAGE)

    with kvoffload.connect(daemon.socket_path) as c:
        victim = link(c, fd)
        ids = np.arange(PAGES, dtype=np.int64)
        attacker = threading.Thread(target=shrink)
        attacker.start()
        try:
            for i in range(40):
                ks = keys(PAGES, b"%03d" % i)
                victim.store(ks, ids, deadline())
                victim.load(ks, ids, deadline())
        finally:
            stop.set()
            attacker.join()
        assert c.ping() < 5
        assert c.stats()["copies"]["failed_jobs_total"] > 0  # the attack did land
    assert daemon.alive()


def test_descriptors_that_are_not_shared_memory_are_refused(daemon: DaemonProcess) -> None:
    r, w = os.pipe()
    s1, s2 = socket.socketpair()
    fd, _ = pool()
    read_only = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    with kvoffload.connect(daemon.socket_path) as c:
        for bad in (r, s1.fileno(), read_only):
            with pytest.raises(kvoffload.InvalidArgumentError, match="memfd_io"):
                link(c, bad)
        with pytest.raises(kvoffload.InvalidArgumentError, match="holds"):
            link(c, fd, pages=PAGES + 1)  # rows past the end of the memfd
        # an unsealed memfd is still never mapped as a plain "memfd" cache
        ns = c.namespace("pool", LAYOUT)
        with pytest.raises(kvoffload.InvalidArgumentError, match="sealed"):
            PoolWorker(ns, [CacheDesc("memfd", PAGES, PAGE, 0, 0, PAGE)], os.dup(fd))
        assert c.ping() < 5
    for x in (r, w, read_only, fd):
        os.close(x)
    s1.close()
    s2.close()


def test_another_uid_gets_daemon_copies_and_its_shrink_hurts_nobody(
    daemon: DaemonProcess,
) -> None:
    """Scenario: an engine of another uid (not trusted to map the region) registers
    its unsealable pool: the daemon copies for it; then it shrinks the pool under the
    daemon: its own jobs fail, and a root engine's blocks and the daemon are fine."""
    requires_root()
    sock = daemon.socket_path
    os.chmod(os.path.dirname(sock), 0o750)  # the engine's group (0) reaches the socket
    with kvoffload.connect(sock) as c:
        fd, _ = pool(seed=4)
        assert all(link(c, fd).store(keys(4, b"r"), np.arange(4, dtype=np.int64), deadline()))

    def engine() -> tuple[bool, int, bool]:
        efd, emm = pool(seed=5)
        with kvoffload.connect(sock) as ec:
            mine = link(ec, efd)
            ids = np.arange(PAGES, dtype=np.int64)
            stored = all(mine.store(keys(PAGES, b"n"), ids, deadline()))
            before = emm[:PAGE]
            emm[:PAGE] = b"\0" * PAGE
            loaded = mine.load(keys(1, b"n"), ids[:1].copy(), deadline())
            same = emm[:PAGE] == before
            os.ftruncate(efd, 0)
            refused = not any(mine.store(keys(PAGES, b"x"), ids, deadline()))
            return stored and same and refused, loaded, ec.ping() < 5

    ok, loaded, alive = as_uid(engine, NOBODY, gid=0)  # gid 0 reaches the 0660 socket
    assert ok and loaded == 1 and alive
    with kvoffload.connect(sock) as c:
        fd2, _ = pool(seed=6)
        assert link(c, fd2).load(keys(4, b"r"), np.arange(4, dtype=np.int64), deadline()) == 4
    assert daemon.alive()
