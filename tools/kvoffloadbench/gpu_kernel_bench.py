"""The gather kernel on its own, through the driver seam: GB/s, SM time per GiB, bytes.

Part of ``gpu_check``. In this process, on GPU 0: the daemon's start-up calibration
(what it chose, how long it took), then for run sizes of 512 B, 8 KiB and 32 KiB
scattered over 128 MiB, per direction, the kernel (with the calibrated CTAs and with
two per SM) against DMA (one ``cuMemcpyBatchAsync`` descriptor per run, or a
``cuMemcpyAsync`` loop) and one large copy. SM time is the kernel's wall time times
the SMs its CTAs occupy (at most one SM per CTA): the compute an engine loses to a
GiB of copies. Finally the kernel's bytes are checked: host -> device -> host through
two scattered gathers must give back the same bytes.
"""

from __future__ import annotations

import ctypes
import time
from functools import partial
from typing import Any

import numpy as np

from kvoffload.cuda.driver import load_driver
from kvoffloadd.copies.calibrate import calibrate
from kvoffloadd.copies.choice import TILE_BYTES
from kvoffloadd.copies.gather import TileRing, load_kernel

MIB = 1 << 20
GIB = 1 << 30
SPAN_BYTES = 128 * MIB
RUN_SIZES = (512, 8192, 32768)
REPEATS = 3


def run() -> dict[str, Any]:
    api = load_driver()
    if api is None:
        raise RuntimeError("no CUDA driver")
    api.set_device(0)
    t0 = time.perf_counter()
    kernel, why = load_kernel(api, 0)
    if kernel is None:
        raise RuntimeError(why)
    out: dict[str, Any] = {"ptx_load_s": time.perf_counter() - t0, "sms": kernel.multiprocessors}
    t0 = time.perf_counter()
    choice = calibrate(api, 0, kernel)
    out["calibration_s"] = time.perf_counter() - t0
    out["max_ctas"] = {"store": choice.max_ctas[True], "load": choice.max_ctas[False]}
    out["kernel_below_bytes"] = {
        "store": choice.crossover_bytes[True],
        "load": choice.crossover_bytes[False],
    }
    stream, event = api.stream_create(), api.event_create()
    dev = api.mem_alloc(2 * SPAN_BYTES)
    host = api.host_alloc(2 * SPAN_BYTES)
    ring = TileRing(api)
    sms = kernel.multiprocessors

    def timed(issue: Any) -> float:
        best = float("inf")
        for _ in range(REPEATS):
            t = time.perf_counter()
            issue()
            api.event_record(event, stream)
            api.event_synchronize(event)
            best = min(best, time.perf_counter() - t)
        return best

    try:
        rows = []
        for to_host in (True, False):
            direction = "store" if to_host else "load"
            whole = (host, dev) if to_host else (dev, host)
            big = timed(partial(api.memcpy_async, whole[0], whole[1], SPAN_BYTES, stream))
            for size in RUN_SIZES:
                count = SPAN_BYTES // size
                rng = np.random.default_rng(size)
                h = rng.permutation(2 * count)[:count].astype(np.int64) * size + host
                d = rng.permutation(2 * count)[:count].astype(np.int64) * size + dev
                dst, src = (h, d) if to_host else (d, h)
                n = np.full(count, size, dtype=np.int64)
                row: dict[str, Any] = {"direction": direction, "run_bytes": size}
                row["one_copy_gbps"] = SPAN_BYTES / big / 1e9
                for name, ctas in (("kernel", choice.max_ctas[to_host]), ("kernel_2x", 2 * sms)):
                    s = timed(partial(ring.launch, kernel, dst, src, n, stream, ctas, TILE_BYTES))
                    used = min(ctas, sms)
                    row[f"{name}_ctas"] = ctas
                    row[f"{name}_gbps"] = SPAN_BYTES / s / 1e9
                    row[f"{name}_sm_ms_per_gib"] = s * 1e3 * used * GIB / SPAN_BYTES
                    row[f"{name}_sm_fraction"] = used / sms
                if api.has_batch:
                    s = timed(partial(api.memcpy_batch_async, dst, src, n, stream, 0, to_host))
                    row["dma_gbps"] = SPAN_BYTES / s / 1e9
                rows.append(row)
        out["rows"] = rows
        out["bad_bytes"] = round_trip(api, kernel, ring, host, dev, stream, event)
    finally:
        ring.close()
        api.mem_free(dev)
        api.host_free(host)
        api.event_destroy(event)
        api.stream_destroy(stream)
    return out


def round_trip(
    api: Any, kernel: Any, ring: TileRing, host: int, dev: int, stream: int, event: int
) -> int:
    """Random bytes host -> device (scattered 8 KiB pages) -> host elsewhere: mismatches."""
    size = 8192
    count = min(4096, SPAN_BYTES // size)
    nbytes = size * count
    buf = (ctypes.c_uint8 * (2 * SPAN_BYTES)).from_address(host)
    data = np.ctypeslib.as_array(buf)
    data[:nbytes] = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    data[SPAN_BYTES : SPAN_BYTES + nbytes] = 0
    perm = np.random.default_rng(8).permutation(count).astype(np.int64)
    n = np.full(count, size, dtype=np.int64)
    src = np.arange(count, dtype=np.int64) * size + host
    mid = perm * size + dev
    back = np.arange(count, dtype=np.int64) * size + host + SPAN_BYTES
    ring.launch(kernel, mid, src, n, stream, 64, TILE_BYTES)
    ring.launch(kernel, back, mid, n, stream, 64, TILE_BYTES)
    api.event_record(event, stream)
    api.event_synchronize(event)
    return int((data[:nbytes] != data[SPAN_BYTES : SPAN_BYTES + nbytes]).sum())


def rows_table(r: dict[str, Any]) -> list[str]:
    lines = [
        f"kernel: PTX loaded in {r['ptx_load_s'] * 1e3:.0f} ms, calibrated in "
        f"{r['calibration_s']:.2f} s; CTAs {r['max_ctas']}, kernel below {r['kernel_below_bytes']}"
    ]
    lines += [
        f"  {x['direction']:5} {x['run_bytes']:6d} B runs: kernel {x['kernel_gbps']:6.1f} GB/s "
        f"({x['kernel_ctas']} CTAs, {x['kernel_sm_ms_per_gib']:.1f} SM-ms/GiB), "
        f"2/SM {x['kernel_2x_gbps']:6.1f}, DMA {x.get('dma_gbps', 0):6.1f}, "
        f"one copy {x['one_copy_gbps']:6.1f}"
        for x in r["rows"]
    ]
    lines.append(f"  round trip through the kernel: {r['bad_bytes']} bad bytes")
    return lines
