"""GPU part of ``make bench``: GPU<->region GB/s against one large pinned copy.

Runs only where PyTorch sees a CUDA device. The baseline is one large
``cudaMemcpyAsync`` between a pinned host buffer and GPU memory in this same process,
per direction; the daemon's transfers move engine blocks between this process's GPU
caches (exported by CUDA IPC) and its pinned region. Target (DESIGN.md section 6):
>= 90% of the baseline and >= 45 GB/s per direction on an H100 for 2 MiB blocks.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import kvoffload
from kvoffload.cuda.driver import load_driver

from .launch import BULK_STORES, DaemonProcess

MIB = 1 << 20
JOB_BLOCKS = 64


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pinned_baseline_gbps(nbytes: int, repeats: int) -> tuple[float, float]:
    """Best (host->GPU, GPU->host) GB/s of one large pinned cudaMemcpyAsync."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best_h2d = best_d2h = float("inf")
    for _ in range(repeats):
        for to_dev in (True, False):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if to_dev:
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if to_dev:
                best_h2d = min(best_h2d, dt)
            else:
                best_d2h = min(best_d2h, dt)
    return nbytes / best_h2d / 1e9, nbytes / best_d2h / 1e9


def registered_baseline_gbps(nbytes: int, repeats: int) -> tuple[float, float]:
    """As ``pinned_baseline_gbps`` but over shared memory page-locked with
    cudaHostRegister, as the region is: separates memory-type costs from ours."""
    import mmap

    import torch

    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)
    host = torch.frombuffer(mm, dtype=torch.uint8)
    host.fill_(1)
    api = load_driver()
    if api is None:
        return 0.0, 0.0
    api.set_device(0)
    api.host_register(host.data_ptr(), nbytes)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, (dst, src) in enumerate(((dev, host), (host, dev))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best[i] = min(best[i], time.perf_counter() - t0)
    api.host_unregister(host.data_ptr())
    del host
    mm.close()
    return nbytes / best[0] / 1e9, nbytes / best[1] / 1e9


def wait_pinned(client: kvoffload.Client, deadline_s: float = 300.0) -> dict[str, Any]:
    end = time.monotonic() + deadline_s
    while True:
        gpu: dict[str, Any] = client.stats()["gpu"]
        if not gpu.get("enabled"):
            raise RuntimeError(f"the daemon has no GPU support: {gpu.get('reason')}")
        if gpu["pin_error"] or gpu["pinned_bytes"] >= gpu["pin_target_bytes"]:
            return gpu
        if time.monotonic() > end:
            raise TimeoutError(f"region not pinned after {deadline_s} s: {gpu}")
        time.sleep(0.1)


class GpuCase:
    """Caches on the GPU for one layout, a stored set of blocks and a fresh set."""

    def __init__(
        self,
        client: kvoffload.Client,
        name: str,
        pages: list[int],
        blocks: int,
        job_blocks: int = JOB_BLOCKS,
    ):
        import torch

        self.job_blocks = job_blocks
        self.ns = client.namespace(name, kvoffload.KVLayout(tensor_page_bytes=pages))
        self.name, self.blocks = name, blocks
        self.block_bytes = sum(pages)
        # 2x the blocks: the load half and the store half of a bidirectional run.
        self.caches = [torch.ones(2 * blocks, p, dtype=torch.int8, device="cuda") for p in pages]
        torch.cuda.synchronize()
        self.worker = self.ns.attach_worker(self.caches)
        self.stored = [b"%s-stored-%08d" % (name.encode(), i) for i in range(blocks)]
        plan = self.ns.prepare_store(self.stored)
        assert plan is not None and len(plan.slots) == blocks, "region too small for bench"
        self._job = 0
        self._finish(self._submit_store(plan.slots, self.ids(0)))
        self.ns.complete_store(self.stored)
        self._round = 0

    def ids(self, half: int) -> np.ndarray:
        """Engine block ids in a shuffled order, so no two pages merge into one run."""
        rng = np.random.default_rng(half)
        return rng.permutation(self.blocks) + half * self.blocks

    def _submit_store(self, slots: list[int], ids: np.ndarray) -> int:
        self._job += 1
        assert self.worker.submit_store(self._job, ids, slots), self.worker.last_error
        return self._job

    def _submit_load(self, slots: list[int], ids: np.ndarray) -> int:
        self._job += 1
        assert self.worker.submit_load(self._job, slots, ids), self.worker.last_error
        return self._job

    def _finish(self, *jobs: int) -> None:
        self.worker.wait(jobs)
        results = self.worker.get_finished()
        assert all(r.success for r in results), results

    def run(self, store: bool, load: bool) -> float:
        """Wall seconds for a store and/or a load of
        ``blocks`` blocks, submitted together as jobs of ``job_blocks`` blocks (an engine
        submits one job per request, so jobs queue behind each other)."""
        self._round += 1
        fresh = [b"%s-r%d-%08d" % (self.name.encode(), self._round, i) for i in range(self.blocks)]
        splan = self.ns.prepare_store(fresh) if store else None
        lplan = self.ns.prepare_load(self.stored) if load else None
        load_ids, store_ids = self.ids(0), self.ids(1)
        t0 = time.perf_counter()
        jobs = []
        for a in range(0, self.blocks, self.job_blocks):
            part = slice(a, a + self.job_blocks)
            if lplan is not None:
                jobs.append(self._submit_load(lplan.slots[part], load_ids[part]))
            if splan is not None:
                jobs.append(self._submit_store(splan.slots[part], store_ids[part]))
        self._finish(*jobs)
        dt = time.perf_counter() - t0
        if lplan is not None:
            self.ns.complete_load(self.stored)
        if splan is not None:
            self.ns.complete_store(fresh, success=False)
        return dt

    def close(self) -> None:
        self.worker.close()


def run_gpu(quick: bool, daemon_args: list[str] | None = None) -> dict[str, Any]:
    import torch

    repeats = 3 if quick else 6
    job_bytes = 512 * MIB if quick else 1024 * MIB
    r: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0)}
    r["pinned_h2d_gbps"], r["pinned_d2h_gbps"] = pinned_baseline_gbps(job_bytes, repeats)
    r["registered_h2d_gbps"], r["registered_d2h_gbps"] = registered_baseline_gbps(
        job_bytes, repeats
    )
    region = f"{(4 * job_bytes + 256 * MIB) >> 20}MiB"
    args = ["--log-level", "warning", *(daemon_args or [])]
    r["daemon_args"] = " ".join(daemon_args or [])
    with DaemonProcess(region, *args, start_timeout_s=120, settings=BULK_STORES) as d:
        client = kvoffload.connect(d.socket_path)
        gpu = wait_pinned(client)
        r["pin_seconds"], r["pin_error"] = gpu["pin_seconds"], gpu["pin_error"]
        r["batched_copies"] = gpu["batched_copies"]
        for label, pages in (("2mib", [2 * MIB]), ("32k", [32 * 1024] * 32)):
            case = GpuCase(client, f"gpu-{label}", pages, job_bytes // sum(pages))
            nbytes = case.blocks * case.block_bytes
            for kind, store, load in (("d2h", True, False), ("h2d", False, True)):
                best = min(case.run(store, load) for _ in range(repeats))
                r[f"{kind}_{label}_gbps"] = nbytes / best / 1e9
            best = min(case.run(True, True) for _ in range(repeats))
            r[f"both_{label}_gbps"] = 2 * nbytes / best / 1e9
            case.close()
        r["gpu_stats"] = client.stats()["gpu"]
        client.close()
    return r


def report_gpu(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    h2d, d2h = r["pinned_h2d_gbps"], r["pinned_d2h_gbps"]
    rows = [
        ("gpu", r["gpu"], f"batched copies: {r['batched_copies']}; {r['daemon_args']}"),
        ("pinned cudaMemcpyAsync GPU->host", f"{d2h:.2f} GB/s", "1.00"),
        ("pinned cudaMemcpyAsync host->GPU", f"{h2d:.2f} GB/s", "1.00"),
        (
            "same, cudaHostRegister'ed shared memory",
            f"{r['registered_d2h_gbps']:.2f} / {r['registered_h2d_gbps']:.2f} GB/s",
            f"{r['registered_d2h_gbps'] / d2h:.2f} / {r['registered_h2d_gbps'] / h2d:.2f}",
        ),
    ]
    for label, desc in (("2mib", "2 MiB blocks"), ("32k", "32 x 32 KiB pages/block")):
        target = " (target >= 0.90, >= 45 GB/s)" if label == "2mib" else ""
        for kind, base, name in (
            ("d2h", d2h, "store GPU->region"),
            ("h2d", h2d, "load region->GPU"),
        ):
            v = r[f"{kind}_{label}_gbps"]
            rows.append((f"{name}, {desc}", f"{v:.2f} GB/s", f"{v / base:.2f}{target}"))
        v = r[f"both_{label}_gbps"]
        rows.append((f"both directions at once, {desc}", f"{v:.2f} GB/s", f"{v / (h2d + d2h):.2f}"))
    rows.append(("region pinning", f"{r['pin_seconds']:.2f} s", r["pin_error"] or "ok"))
    return rows


def gpu_sweep(
    quick: bool, pages: tuple[int, ...], batches: tuple[int, ...]
) -> list[dict[str, Any]]:
    """GPU<->region GB/s for one-page blocks of each size, in jobs of each batch size,
    against the same-run pinned baseline (``make bench-report``)."""
    total = (64 if quick else 256) * MIB
    repeats = 2 if quick else 4
    h2d, d2h = pinned_baseline_gbps(total, repeats)
    rows = []
    region = f"{(2 * total + 256 * MIB) >> 20}MiB"
    with DaemonProcess(region, "--log-level", "warning", settings=BULK_STORES) as d:
        client = kvoffload.connect(d.socket_path)
        wait_pinned(client)
        for page in pages:
            for batch in batches:
                blocks = max(batch, min(total // page, 4096 if batch == 1 else 16384))
                name = f"gs{page}-{batch}"
                case = GpuCase(client, name, [page], blocks, job_blocks=batch)
                nbytes = blocks * page
                store = nbytes / min(case.run(True, False) for _ in range(repeats)) / 1e9
                load = nbytes / min(case.run(False, True) for _ in range(repeats)) / 1e9
                case.close()
                client.evict(name)
                rows.append(
                    {
                        "page_bytes": page,
                        "batch_blocks": batch,
                        "blocks": blocks,
                        "store_gbps": store,
                        "load_gbps": load,
                        "pinned_d2h_gbps": d2h,
                        "pinned_h2d_gbps": h2d,
                    }
                )
        client.close()
    return rows
