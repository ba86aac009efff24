"""GPU data path end to end: real engine processes, real CUDA IPC, a real daemon.

Skipped without CUDA (tests/conftest.py). Every engine runs in its own spawned
process: a process cannot import its own CUDA IPC handles, so this is also the only
way the daemon's import path is exercised.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from typing import Any

import gpu_engines as eng
import pytest

import kvoffload
from kvoffloadbench.launch import DaemonProcess

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

CTX = mp.get_context("spawn")


def run_in_engine(fn: Any, *args: Any) -> Any:
    with CTX.Pool(1) as pool:
        return pool.apply(fn, args)


@pytest.fixture(scope="module")
def gpu_daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess("1GiB", "--log-level", "info") as d:
        client = kvoffload.connect(d.socket_path)
        gpu = client.stats()["gpu"]
        client.close()
        assert gpu["enabled"], gpu
        yield d
        assert d.stop() == 0


def gpu_stats(sock: str) -> dict[str, Any]:
    client = kvoffload.connect(sock)
    try:
        stats: dict[str, Any] = client.stats()["gpu"]
        return stats
    finally:
        client.close()


def wait_handles_closed(sock: str) -> None:
    deadline = time.monotonic() + 30
    while gpu_stats(sock)["open_ipc_handles"]:
        assert time.monotonic() < deadline, "IPC handles of finished engines stay open"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("factor", "skip", "shared"),
    [(1, 0, False), (3, 1, False), (3, 2, True)],
    ids=["f1", "f3-skip1", "f3-skip2-one-allocation"],
)
def test_store_in_one_engine_load_in_another(
    gpu_daemon: DaemonProcess, factor: int, skip: int, shared: bool
) -> None:
    """Engine A stores random GPU KV; engine B loads it back: identical bytes."""
    sock, name = gpu_daemon.socket_path, f"ns-f{factor}-s{skip}-{int(shared)}"
    pages = [16384, 32768, 8192]  # three canonical tensors
    n_blocks = 24
    run_in_engine(eng.store, sock, name, pages, factor, n_blocks, 11, shared)
    bad = run_in_engine(eng.load_and_compare, sock, name, pages, factor, n_blocks, 11, skip, shared)
    assert bad == 0
    wait_handles_closed(sock)


def test_store_waits_for_the_engine_stream(gpu_daemon: DaemonProcess) -> None:
    """KV written on the engine's stream just before submit_store is what gets stored."""
    sock, pages = gpu_daemon.socket_path, [65536]
    run_in_engine(eng.store, sock, "fence", pages, 1, 32, 5, False, True)
    assert run_in_engine(eng.load_and_compare, sock, "fence", pages, 1, 32, 5, 0) == 0


@pytest.mark.parametrize("load", [False, True], ids=["store", "load"])
def test_engine_killed_mid_transfer(gpu_daemon: DaemonProcess, load: bool) -> None:
    sock, pages = gpu_daemon.socket_path, [1 << 20]
    name = f"killed-{int(load)}"
    if load:
        run_in_engine(eng.store, sock, name, pages, 1, eng.NUM_ENGINE_BLOCKS, 3, False)
    ready = CTX.Event()
    p = CTX.Process(target=eng.transfer_then_die, args=(sock, name, pages, load, ready))
    p.start()
    p.join(120)
    assert ready.is_set() and p.exitcode == -9
    assert gpu_daemon.alive()
    wait_handles_closed(sock)
    # The daemon still serves GPU engines, and the killed engine's blocks are intact
    # (load) or were never committed (store).
    if load:
        bad = run_in_engine(eng.load_and_compare, sock, name, pages, 1, eng.NUM_ENGINE_BLOCKS, 3, 0)
        assert bad == 0
    else:
        client = kvoffload.connect(sock)
        ns = client.namespace(name, eng.layout(pages, 1))
        assert ns.lookup(eng.keys(name.encode(), 1)) == 0
        client.close()
    run_in_engine(eng.store, sock, name + "-after", [8192], 1, 8, 9, False)


def test_expandable_segments_are_refused(gpu_daemon: DaemonProcess) -> None:
    import os

    old = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        message = run_in_engine(eng.attach_error, gpu_daemon.socket_path)
    finally:
        if old is None:
            del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
        else:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = old
    assert "expandable_segments:False" in message
    assert gpu_daemon.alive()


def wait_pinned(sock: str) -> None:
    deadline = time.monotonic() + 60
    while (st := gpu_stats(sock))["pinned_bytes"] < st["pin_target_bytes"]:
        assert not st["pin_error"], st
        assert time.monotonic() < deadline, st
        time.sleep(0.1)


def test_region_is_pinned_and_copies_are_batched(gpu_daemon: DaemonProcess) -> None:
    wait_pinned(gpu_daemon.socket_path)
    run_in_engine(eng.store, gpu_daemon.socket_path, "batched", [32768], 1, 16, 1, False)
    st = gpu_stats(gpu_daemon.socket_path)
    if st["batched_copies"]:
        assert st["batched_jobs_total"] >= 1, st


@pytest.mark.parametrize("mode", ["always", "off"])
def test_the_kernel_path_moves_the_same_bytes_as_dma(mode: str) -> None:
    """Stores and loads with every aligned run through the gather kernel ("always"),
    or none ("off"): both byte-exact. Runs of the 1028-byte pages are not 16-byte long, so
    a kernel job copies them with DMA in the same job."""
    pages = [8192, 4096, 1028]
    with DaemonProcess("1GiB", "--log-level", "info", settings={"gpu_kernel": mode}) as d:
        sock = d.socket_path
        wait_pinned(sock)
        run_in_engine(eng.store, sock, "kernel", pages, 2, 40, 21, False, False, True)
        bad = run_in_engine(eng.load_and_compare, sock, "kernel", pages, 2, 40, 21, 1)
        st = gpu_stats(sock)
        assert bad == 0
        assert st["copy_paths"]["0"]["state"] == ("ready" if mode == "always" else "off"), st
        if mode == "always":
            assert st["kernel_jobs_total"] == 2 and st["kernel_bytes_total"] > 0, st
            assert st["batched_jobs_total"] + st["looped_jobs_total"] == 2, st  # 1028 B pages
        else:
            assert st["kernel_jobs_total"] == 0, st
        assert d.stop() == 0
