"""GPU part of ``make bench``: GPU<->region GB/s against one large pinned copy.

Runs only where PyTorch sees a CUDA device. The baseline is one large
``cudaMemcpyAsync`` between a pinned host buffer and GPU memory in this same process,
per direction; the daemon's transfers move engine blocks between this process's GPU
caches (exported by CUDA IPC) and its pinned region. Targets (DESIGN.md section 6), as
ratios to the baseline per direction: 2 MiB blocks >= 0.90 (and >= 45 GB/s on an
H100), 32 x 32 KiB pages per block >= 0.85, 16 x 8 KiB pages and canonical NHD
fragments (a TP 2 engine's 512-byte pieces of 32 x 32 KiB canonical pages) >= 0.7.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import kvoffload
from kvoffload.cuda.driver import load_driver
from kvoffload.datapath.canonical import CanonicalPart

from .launch import BULK_STORES, DaemonProcess
from .two_engines import head_fragments

MIB = 1 << 20
JOB_BLOCKS = 64
# (label, description, canonical pages per block, TP of a canonical NHD engine or 0)
CASES = (
    ("2mib", "2 MiB blocks", [2 * MIB], 0),
    ("32k", "32 x 32 KiB pages/block", [32 * 1024] * 32, 0),
    ("8k", "16 x 8 KiB pages/block", [8 * 1024] * 16, 0),
    ("nhd", "canonical NHD, 512 B fragments of 32 x 32 KiB (TP 2)", [32 * 1024] * 32, 2),
)
LABELS = tuple(label for label, _, _, _ in CASES)
TARGETS = {"2mib": 0.90, "32k": 0.85, "8k": 0.7, "nhd": 0.7}
# A 32 KiB canonical page: K and V of 16 tokens x 4 KV heads x 128 dims x 2 bytes.
NHD_SHAPE = (16, 4, 128, 2)


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
    """Caches on the GPU for one layout, a stored set of blocks and a fresh set. With
    ``tp`` > 0 the pages are canonical NHD pages written by ``tp`` workers (one per
    rank, each with its heads' fragments), as a TP engine's ranks store them."""

    def __init__(
        self,
        client: kvoffload.Client,
        name: str,
        pages: list[int],
        blocks: int,
        job_blocks: int = JOB_BLOCKS,
        tp: int = 0,
        device: str = "cuda",
    ):
        import torch

        self.job_blocks = job_blocks
        self.ns = client.namespace(name, kvoffload.KVLayout(tensor_page_bytes=pages))
        self.name, self.blocks = name, blocks
        self.block_bytes = sum(pages)
        self.workers: list[kvoffload.Worker] = []
        for rank in range(max(tp, 1)):
            local = [p // max(tp, 1) for p in pages]
            # 2x the blocks: the load half and the store half of a bidirectional run.
            if device == "cuda":
                caches = [torch.ones(2 * blocks, p, dtype=torch.int8, device="cuda") for p in local]
                torch.cuda.synchronize()
            else:  # the CPU side (tests): memfd caches the daemon maps
                caches = [kvoffload.shared_kv_cache(2 * blocks, p) for p in local]
            if tp:
                frags = head_fragments("NHD", *NHD_SHAPE, tp, rank)
                parts = [CanonicalPart(pages[0], frags)] * len(pages)
                self.workers.append(self.ns.attach_worker(caches, rank, canonical=parts, parts=tp))
            else:
                self.workers.append(self.ns.attach_worker(caches))
            self.caches = caches
        self.stored = self.keys("stored")
        plan = self.ns.prepare_store(self.stored)
        assert plan is not None and len(plan.slots) == blocks, "region too small for bench"
        self._job = 0
        self._finish(self._submit(True, plan.slots, self.ids(0), plan.lease))
        self.ns.complete_store(self.stored)
        self._round = 0

    def keys(self, tag: str) -> list[bytes]:
        """The keys of one set of blocks: a namespace's keys all have one length, so
        every ``tag`` has six characters."""
        assert len(tag) == 6, tag
        return [b"%s-%s-%08d" % (self.name.encode(), tag.encode(), i) for i in range(self.blocks)]

    def ids(self, half: int) -> np.ndarray:
        """Engine block ids in a shuffled order, so no two pages merge into one run."""
        rng = np.random.default_rng(half)
        return rng.permutation(self.blocks) + half * self.blocks

    def _submit(self, store: bool, slots: list[int], ids: np.ndarray, lease: int = 0) -> int:
        """One job of every worker (the same job id on each); a store names its plan's
        lease, as engines do."""
        self._job += 1
        for w in self.workers:
            if store:
                ok = w.submit_store(self._job, ids, slots, lease=lease)
            else:
                ok = w.submit_load(self._job, slots, ids)
            assert ok, w.last_error
        return self._job

    def _finish(self, *jobs: int) -> None:
        for w in self.workers:
            w.wait(jobs)
            results = w.get_finished()
            assert all(r.success for r in results), results

    def run(self, store: bool, load: bool) -> float:
        """Wall seconds for a store and/or a load of
        ``blocks`` blocks, submitted together as jobs of ``job_blocks`` blocks (an engine
        submits one job per request, so jobs queue behind each other)."""
        self._round += 1
        fresh = self.keys(f"r{self._round:05d}")
        splan = self.ns.prepare_store(fresh) if store else None
        lplan = self.ns.prepare_load(self.stored) if load else None
        load_ids, store_ids = self.ids(0), self.ids(1)
        t0 = time.perf_counter()
        jobs = []
        for a in range(0, self.blocks, self.job_blocks):
            part = slice(a, a + self.job_blocks)
            if lplan is not None:
                jobs.append(self._submit(False, lplan.slots[part], load_ids[part]))
            if splan is not None:
                jobs.append(self._submit(True, splan.slots[part], store_ids[part], splan.lease))
        self._finish(*jobs)
        dt = time.perf_counter() - t0
        if lplan is not None:
            self.ns.complete_load(self.stored)
        if splan is not None:
            self.ns.complete_store(fresh, success=False)
        return dt

    def close(self) -> None:
        for w in self.workers:
            w.close()


def run_gpu(
    quick: bool,
    daemon_args: list[str] | None = None,
    settings: dict[str, Any] | None = None,
    labels: tuple[str, ...] = LABELS,
) -> dict[str, Any]:
    """The GPU rows for the ``labels`` of CASES; ``settings``: daemon config keys."""
    import torch

    repeats = 3 if quick else 6
    job_bytes = 512 * MIB if quick else 1024 * MIB
    r: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "labels": list(labels)}
    r["pinned_h2d_gbps"], r["pinned_d2h_gbps"] = pinned_baseline_gbps(job_bytes, repeats)
    r["registered_h2d_gbps"], r["registered_d2h_gbps"] = registered_baseline_gbps(
        job_bytes, repeats
    )
    region = f"{(4 * job_bytes + 256 * MIB) >> 20}MiB"
    args = ["--log-level", "warning", *(daemon_args or [])]
    r["daemon_args"] = " ".join(daemon_args or []) + "".join(
        f" {k}={v}" for k, v in (settings or {}).items() if k in ("gpu_kernel",)
    )
    with DaemonProcess(
        region, *args, start_timeout_s=120, settings={**BULK_STORES, **(settings or {})}
    ) as d:
        client = kvoffload.connect(d.socket_path)
        gpu = wait_pinned(client)
        r["pin_seconds"], r["pin_error"] = gpu["pin_seconds"], gpu["pin_error"]
        r["batched_copies"] = gpu["batched_copies"]
        for label, _, pages, tp in CASES:
            if label not in labels:
                continue
            case = GpuCase(client, f"gpu-{label}", pages, job_bytes // sum(pages), tp=tp)
            wait_copy_paths(client)
            before = client.stats()["gpu"]
            nbytes = case.blocks * case.block_bytes
            for kind, store, load in (("d2h", True, False), ("h2d", False, True)):
                best = min(case.run(store, load) for _ in range(repeats))
                r[f"{kind}_{label}_gbps"] = nbytes / best / 1e9
            best = min(case.run(True, True) for _ in range(repeats))
            r[f"both_{label}_gbps"] = 2 * nbytes / best / 1e9
            after = client.stats()["gpu"]
            r[f"paths_{label}"] = {
                k: after.get(k, 0) - before.get(k, 0)
                for k in ("kernel_jobs_total", "batched_jobs_total", "looped_jobs_total")
            }
            case.close()
            client.evict(f"gpu-{label}")
        r["gpu_stats"] = client.stats()["gpu"]
        client.close()
    return r


def wait_copy_paths(client: kvoffload.Client, deadline_s: float = 60.0) -> None:
    """Until the daemon's copy paths on GPU 0 are settled (calibrated or DMA only)."""
    end = time.monotonic() + deadline_s
    while client.stats()["gpu"].get("copy_paths", {}).get("0", {}).get("state") in (
        None,
        "calibrating",
    ):
        if time.monotonic() > end:
            raise TimeoutError(f"the copy paths are not calibrated after {deadline_s} s")
        time.sleep(0.05)


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
    for label, desc, _, _ in CASES:
        if f"d2h_{label}_gbps" not in r:
            continue
        target = f" (target >= {TARGETS[label]:.2f})"
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


def ratios(r: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per case label: store and load GB/s as ratios to the same-run pinned copy."""
    out = {}
    for label, _, _, _ in CASES:
        if f"d2h_{label}_gbps" in r:
            out[label] = {
                "store": r[f"d2h_{label}_gbps"] / r["pinned_d2h_gbps"],
                "load": r[f"h2d_{label}_gbps"] / r["pinned_h2d_gbps"],
                "target": TARGETS[label],
            }
    return out


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
