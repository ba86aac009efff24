"""Warm restart: a daemon that dies or stops with keep_region comes back with its blocks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

import kvoffload
from kvoffloadbench.launch import DaemonProcess

LAYOUT = kvoffload.KVLayout(tensor_page_bytes=[8192, 4096], block_size_factor=2)
DEADLINE_S = 20.0


def random_caches(seed: int, blocks: int = 64, shared: bool = True) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    out = []
    for page in LAYOUT.tensor_page_bytes:
        t = (
            kvoffload.shared_kv_cache(blocks, page)
            if shared
            else torch.empty(blocks, page, dtype=torch.int8)
        )
        t.copy_(torch.from_numpy(rng.integers(-128, 128, t.shape, dtype=np.int8)))
        out.append(t)
    return out


def store(
    ns: kvoffload.Namespace, w: kvoffload.Worker, keys: list[bytes], first: int, job: int
) -> None:
    plan = ns.prepare_store(keys)
    assert plan is not None and plan.keys_to_store == keys
    assert w.submit_store(job, np.arange(first, first + 2 * len(keys)), plan.slots), w.last_error
    w.wait([job])
    assert all(r.success for r in w.get_finished())
    ns.complete_store(keys)


def until(predicate: Callable[[], object], what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("how", "copy_mode"),
    [("sigkill", "daemon"), ("keep_region", "daemon"), ("sigkill", "client")],
)
def test_blocks_survive_a_daemon_restart(how: str, copy_mode: str) -> None:
    """In client-copy mode the engine still maps the region when the next daemon
    starts: that mapping must not hold the region's lock (one daemon per region)."""
    args = ["--log-level", "warning"] + (["--keep-region"] if how == "keep_region" else [])
    d1 = DaemonProcess("64MiB", *args).start()
    engine = kvoffload.connect(d1.socket_path, timeout_s=2.0)
    ns = engine.namespace("llama", LAYOUT)
    src = random_caches(11, shared=copy_mode == "daemon")
    w = ns.attach_worker(src, copy_mode=copy_mode)
    assert w.copy_mode == copy_mode
    done = [b"done%04d" % i for i in range(10)]
    store(ns, w, done, 0, 1)
    pending = [b"pend%04d" % i for i in range(4)]
    plan = ns.prepare_store(pending)  # leased, never completed: must not come back
    assert plan is not None
    if how == "sigkill":
        d1.kill()
    else:
        assert d1.stop() == 0
    region = f"/dev/shm{d1.region_name}"
    assert os.path.exists(region)

    # the engine keeps running: misses, failed submits, no exceptions, no hang
    assert ns.lookup(done) == 0
    assert w.submit_store(2, np.arange(8), plan.slots) is False

    d2 = DaemonProcess("64MiB", *args, instance=d1.instance, socket_path=d1.socket_path).start()
    assert d2.region_name == d1.region_name  # found through the daemon's private state
    try:
        until(lambda: ns.lookup(done) == len(done), "recovered blocks to be visible")
        assert ns.lookup(pending) == 0
        dst = [kvoffload.shared_kv_cache(64, p) for p in LAYOUT.tensor_page_bytes]
        w2 = ns.attach_worker(dst)
        lp = ns.prepare_load(done)
        assert w2.submit_load(3, lp.slots, np.arange(30, 30 + 2 * len(done)))
        w2.wait([3])
        assert all(r.success for r in w2.get_finished())
        ns.complete_load(done)
        for s, t in zip(src, dst):
            assert torch.equal(s[: 2 * len(done)], t[30 : 30 + 2 * len(done)])
        # the slots of the recovered blocks are not handed out again
        fresh = [b"next%04d" % i for i in range(4)]
        plan2 = ns.prepare_store(fresh)
        assert plan2 is not None and not set(plan2.slots) & set(lp.slots)
        ns.complete_store(fresh, success=False)
        stats = engine.stats()["namespaces"]["llama"]
        assert stats["stored_blocks"] == len(done) and stats["writing_blocks"] == 0
    finally:
        engine.close()
        d2.stop()
    if how == "keep_region":
        os.unlink(region)
    else:
        assert not os.path.exists(region)


def test_incompatible_region_is_refused_with_a_way_out() -> None:
    d1 = DaemonProcess("64MiB", "--log-level", "warning", "--keep-region").start()
    assert d1.stop() == 0
    d2 = DaemonProcess(
        "32MiB",
        "--log-level",
        "warning",
        instance=d1.instance,
        socket_path=d1.socket_path,
        start_timeout_s=10,
    )
    with pytest.raises(RuntimeError, match="did not start"):
        d2.start()
    d3 = DaemonProcess(
        "32MiB",
        "--log-level",
        "warning",
        "--discard-region",
        instance=d1.instance,
        socket_path=d1.socket_path,
    ).start()
    assert d3.region_name != d1.region_name
    assert not os.path.exists(f"/dev/shm{d1.region_name}")
    assert d3.stop() == 0
    assert not os.path.exists(f"/dev/shm{d3.region_name}")


@pytest.mark.parametrize("damage", ["magic", "cut short"])
def test_a_damaged_region_is_dropped_and_the_daemon_starts(damage: str) -> None:
    """A header that is not a region's any more, or a segment cut short (pages past
    its end fault, SIGBUS, at the first touch): refused at every start before (the
    second by an uncaught ValueError from mmap); now dropped with one error line."""
    args = ("--log-level", "warning", "--keep-region")
    d1 = DaemonProcess("64MiB", *args).start()
    with kvoffload.connect(d1.socket_path) as c:
        c.namespace("n", LAYOUT)
    assert d1.stop() == 0
    path = f"/dev/shm{d1.region_name}"
    if damage == "magic":
        with open(path, "r+b") as f:
            f.write(b"garbage!")
    else:
        os.truncate(path, 1 << 20)
    d2 = DaemonProcess("64MiB", *args, instance=d1.instance, socket_path=d1.socket_path).start()
    try:
        assert d2.region_name != d1.region_name and not os.path.exists(path)
        with kvoffload.connect(d2.socket_path) as c:
            assert c.stats()["namespaces"] == {}
    finally:
        assert d2.stop() == 0
        os.unlink(f"/dev/shm{d2.region_name}")


def test_daemon_killed_under_load_engines_carry_on_without_wrong_bytes() -> None:
    """Four engines run random traffic (every loaded byte checked) while the daemon is
    killed with SIGKILL and restarted: no engine crashes or hangs, none loads a wrong
    byte, and all of them work against the new daemon."""
    import multiprocessing
    import threading

    from kvoffloadbench.soak import soak

    d1 = DaemonProcess("64MiB", "--log-level", "error").start()
    result: dict[str, int] = {}  # soak's counts
    stop = multiprocessing.get_context("spawn").Event()
    runner = threading.Thread(
        target=lambda: result.update(soak(d1.socket_path, 4, 300.0, stop)), daemon=True
    )
    runner.start()
    try:
        until(lambda: moved(d1.socket_path, 4 << 20), "engines to store blocks")
        d1.kill()
        time.sleep(0.5)  # engines meet a dead daemon
        d2 = DaemonProcess(
            "64MiB", "--log-level", "error", instance=d1.instance, socket_path=d1.socket_path
        ).start()
        try:  # the engines work against the new daemon, however slow the machine
            until(lambda: moved(d2.socket_path, 1 << 20, loaded=True), "traffic on d2")
        finally:
            stop.set()
            runner.join(120)
            assert d2.stop() == 0
    finally:
        stop.set()
        d1.kill()
    assert not runner.is_alive(), "engines hung"
    assert result["engines_failed"] == 0 and result.get("wrong_bytes", 0) == 0, result
    assert int(result.get("blocks_verified", 0)) > 0


def moved(sock: str, at_least_bytes: int, loaded: bool = False) -> bool:
    """Whether the daemon at ``sock`` stored (and, with ``loaded``, loaded) that much."""
    try:
        c = kvoffload.connect(sock)
    except kvoffload.DaemonUnavailableError:  # its backlog is full of reconnecting engines
        return False
    try:
        copies = c.stats()["copies"]
        stored = int(copies["stored_bytes_total"]) >= at_least_bytes
        return stored and (not loaded or int(copies["loaded_bytes_total"]) > 0)
    finally:
        c.close()
