"""Region start-up at node scale: how soon a large region serves and is pinned, and
what its pinning does to another process's CUDA calls.

Part of ``gpu_check``. A probe process (CUDA through the driver seam, no torch) loops
``cuMemAlloc`` of 2 MiB, a 4 KiB copy from pageable memory, a wait for it and
``cuMemFree`` (what an engine's caching allocator and small copies do), timing each
round. It runs a second alone, then while a daemon starts on a large region (64 GiB
by default: pre-faulting, then ``cuMemHostRegister`` in chunks, in the background).
Everything about the daemon is read from its stats, polled every 50 ms, so the
figures hold however pinning is done: listening, pre-faulted, first chunk pinned,
fully pinned, pinned bytes over time; and the probe's worst round, idle and while
the daemon pinned (DESIGN.md section 6: never more than 1 s).

Without a GPU only the daemon's start and pre-faulting are measured.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import subprocess
import time
from multiprocessing.connection import Connection
from typing import Any

import kvoffload

from .launch import DaemonProcess

GIB = 1 << 30
POLL_S = 0.05
HEADROOM_BYTES = 24 * GIB  # engines, the probe and the page cache beside the region


def _meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def shm_free_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def region_size(want_bytes: int, grow_shm: bool) -> tuple[int, str]:
    """The region to start: ``want_bytes`` if /dev/shm and memory hold it (growing
    /dev/shm with ``grow_shm``, as root), else the largest whole GiB that fits."""
    note = ""
    fits = _meminfo_bytes("MemAvailable") - HEADROOM_BYTES
    if grow_shm and shm_free_bytes() < want_bytes + GIB and os.geteuid() == 0:
        size = f"{(want_bytes + 2 * GIB) >> 30}G"
        rc = subprocess.run(
            ["mount", "-o", f"remount,size={size}", "/dev/shm"], capture_output=True, text=True
        )
        note = f"/dev/shm remounted with size={size}" if rc.returncode == 0 else rc.stderr.strip()
    fits = min(fits, shm_free_bytes() - GIB)
    if want_bytes <= fits:
        return want_bytes, note
    got = max(GIB, fits // GIB * GIB)
    why = f"{want_bytes >> 30} GiB does not fit (/dev/shm and MemAvailable less headroom)"
    return got, "; ".join(x for x in (note, why) if x)


def _probe(conn: Connection, stop: Any) -> None:
    """The second process: timed CUDA allocation + small copy rounds until ``stop``."""
    from kvoffload.cuda.driver import load_driver

    api = load_driver()
    assert api is not None
    api.set_device(0)
    event = api.event_create()
    src = ctypes.create_string_buffer(4096)
    samples: list[tuple[float, float]] = []
    conn.send("ready")
    while not stop.is_set():
        t0 = time.monotonic()
        ptr = api.mem_alloc(2 << 20)
        api.memcpy_async(ptr, ctypes.addressof(src), 4096, 0)
        api.event_record(event, 0)
        api.event_synchronize(event)
        api.mem_free(ptr)
        samples.append((t0, time.monotonic() - t0))
        time.sleep(0.005)
    conn.send(samples)


def run(region_bytes: int, gpu: bool, deadline_s: float = 240.0) -> dict[str, Any]:
    out: dict[str, Any] = {"region_bytes": region_bytes, "gpu": gpu}
    probe = stop = conn = None
    if gpu:
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        stop = ctx.Event()
        probe = ctx.Process(target=_probe, args=(child, stop), daemon=True)
        probe.start()
        if not conn.poll(60) or conn.recv() != "ready":
            raise RuntimeError("the CUDA probe process did not start")
        time.sleep(1.0)  # its idle rounds: the baseline
    t0 = time.monotonic()
    d = DaemonProcess(f"{region_bytes >> 20}MiB", "--log-level", "info", start_timeout_s=120)
    try:
        d.start()
        out["listening_s"] = time.monotonic() - t0
        timeline = watch(d.socket_path, t0, gpu, deadline_s)
        out.update(timeline)
    finally:
        if probe is not None and stop is not None and conn is not None:
            stop.set()
            if conn.poll(30):
                out["probe"] = probe_figures(conn.recv(), t0, out.get("fully_pinned_s"))
            else:  # a round has not come back in 30 s
                out["probe"] = {"stuck": True, "pinning_worst_ms": 30e3}
            probe.join(10)
            if probe.is_alive():
                probe.kill()
        if d.alive():
            try:  # unpinning 64 GiB takes a while; a part's figures must come back
                out["stop_rc"] = d.stop(timeout_s=60)
            except subprocess.TimeoutExpired:
                out["stop_rc"] = "did not stop within 60 s: killed"
    return out


def watch(sock: str, t0: float, gpu: bool, deadline_s: float) -> dict[str, Any]:
    """Poll the daemon's stats until pinned (or, without a GPU, pre-faulted)."""
    out: dict[str, Any] = {}
    points: list[tuple[float, int, int]] = []
    with kvoffload.connect(sock) as c:
        while True:
            st = c.stats()
            t = time.monotonic() - t0
            region, g = st["region"], st["gpu"]
            pinned = int(g.get("pinned_bytes", 0)) if g.get("enabled") else 0
            points.append((t, int(region["prefaulted_bytes"]), pinned))
            if region["prefaulted_bytes"] >= region["data_bytes"]:
                out.setdefault("prefaulted_s", t)
            if pinned and "first_pinned_s" not in out:
                out["first_pinned_s"], out["first_pinned_bytes"] = t, pinned
            if not gpu and "prefaulted_s" in out:
                break
            if gpu and not g.get("enabled"):
                out["gpu_reason"] = g.get("reason", "")
                break
            if gpu and (g["pin_error"] or pinned >= g["pin_target_bytes"]):
                out["fully_pinned_s"] = t if not g["pin_error"] else None
                out["pin_error"], out["pin_chunks"] = g["pin_error"], g["pin_chunks"]
                out["pin_seconds_daemon"] = g["pin_seconds"]
                break
            if t > deadline_s:
                out["timed_out_at"] = {"prefaulted_bytes": points[-1][1], "pinned_bytes": pinned}
                break
            time.sleep(POLL_S)
    step = max(1, len(points) // 60)  # about 60 points of the timeline
    out["timeline"] = {
        "columns": ["t_s", "prefaulted_gib", "pinned_gib"],
        "rows": [
            [round(t, 3), round(f / GIB, 2), round(p / GIB, 2)]
            for t, f, p in points[::step] + points[-1:]
        ],
    }
    return out


def probe_figures(
    samples: list[tuple[float, float]], t0: float, pinned_s: float | None
) -> dict[str, Any]:
    """The probe's rounds: idle (before the daemon started), during start-up and
    pinning (until fully pinned, or the end), in ms."""
    idle = [dt for t, dt in samples if t < t0]
    end = t0 + pinned_s if pinned_s is not None else float("inf")
    busy = [dt for t, dt in samples if t0 <= t <= end]
    worst = max(((dt, t - t0) for t, dt in samples if t0 <= t <= end), default=(0.0, 0.0))

    def p(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else 0.0

    return {
        "rounds_idle": len(idle),
        "rounds_while_pinning": len(busy),
        "idle_p50_ms": p(idle, 0.5),
        "idle_worst_ms": p(idle, 1.0),
        "pinning_p50_ms": p(busy, 0.5),
        "pinning_p99_ms": p(busy, 0.99),
        "pinning_worst_ms": worst[0] * 1e3,
        "pinning_worst_at_s": worst[1],
    }
