"""The parts of ``gpu_check``: each runs in its own process and returns its figures.

Rules:
- A part returns a JSON-able dict of figures, with ``skips`` listing what it left out
  and why; it raises when a check fails (the orchestrator records the error).
- Parts that need a GPU are run only where PyTorch sees one (``has_gpu``); the others
  run everywhere, on CPU caches or without pinning where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SHM = "/dev/shm"


def has_gpu() -> tuple[bool, str]:
    """Whether PyTorch sees a CUDA device (why not, if not)."""
    try:
        import torch
    except ImportError as exc:
        return False, f"PyTorch is not installed ({exc})"
    if not torch.cuda.is_available():
        return False, f"PyTorch {torch.__version__} sees no CUDA device"
    return True, ""


def part_env(opts: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    with open("/proc/meminfo") as f:
        out["meminfo"] = {
            k: v.strip()
            for k, v in (line.split(":", 1) for line in f)
            if k in ("MemTotal", "MemAvailable")
        }
    st = os.statvfs(SHM)
    out["dev_shm_bytes"] = st.f_blocks * st.f_frsize
    try:
        import numpy
        import torch

        out["numpy"], out["torch"] = numpy.__version__, torch.__version__
        out["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["gpu_name"] = torch.cuda.get_device_name(0)
            out["gpu_capability"] = list(torch.cuda.get_device_capability(0))
    except ImportError as exc:
        out["torch"] = f"missing: {exc}"
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        out["nvidia_smi"] = f"unavailable: {exc}"
    from kvoffload.cuda.driver import driver_error, load_driver

    api = load_driver()
    if api is None:
        out["driver"] = driver_error()
        out["skips"] = ["kernel load: no CUDA driver"]
        return out
    out["driver_version"] = api.driver_version
    out["batched_copies"] = api.has_batch
    if api.device_count():
        from kvoffloadd.copies.gather import load_kernel

        api.set_device(0)
        t0 = time.perf_counter()
        kernel, why = load_kernel(api, 0)
        out["kernel_load_s"] = time.perf_counter() - t0
        out["kernel"] = "loaded" if kernel else why
        if kernel is None:
            raise RuntimeError(f"the shipped kernel does not load: {why}")
    return out


def pytest_part(paths: list[str], xml: str, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    rc = subprocess.run([*cmd, *paths], cwd=ROOT, timeout=timeout_s).returncode
    out: dict[str, Any] = {"pytest_rc": rc}
    try:
        top = ET.parse(xml).getroot()
        suite = top.find("testsuite") if top.tag == "testsuites" else top
        assert suite is not None
        for k in ("tests", "failures", "errors", "skipped"):
            out[k] = int(suite.get(k, 0))
        out["time_s"] = float(suite.get("time", 0))
        out["failed"] = [
            f"{c.get('classname')}::{c.get('name')}"
            for c in suite.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None
        ]
    except (OSError, ET.ParseError, AssertionError) as exc:
        out["junit"] = f"unreadable: {exc}"
    if rc not in (0, 5):
        raise RuntimeError(f"pytest exited {rc}: {out.get('failed')}")
    return out


def part_unit(opts: argparse.Namespace) -> dict[str, Any]:
    tests = ["tests/unit/test_gpu_path.py", "tests/unit/test_gpu_kernel.py"]
    return pytest_part(tests, os.path.join(opts.workdir, "unit.xml"), opts.timeout_s - 10)


def part_test_gpu(opts: argparse.Namespace) -> dict[str, Any]:
    return pytest_part(["tests/gpu"], os.path.join(opts.workdir, "gpu.xml"), opts.timeout_s - 10)


def part_engines(opts: argparse.Namespace) -> dict[str, Any]:
    from .two_engines import run

    out = run("cuda" if opts.gpu else "cpu", "2GiB")
    if not opts.gpu:
        out["skips"] = ["CUDA caches: the engines ran with memfd CPU caches instead"]
    elif not out["kill"]["inflight_jobs_at_kill"]:
        raise RuntimeError(f"the daemon was not killed mid-copy: {out['kill']}")
    return out


def part_kernel(opts: argparse.Namespace) -> dict[str, Any]:
    from .gpu_kernel_bench import run

    out = run()
    if out["bad_bytes"]:
        raise RuntimeError(f"the kernel's round trip changed {out['bad_bytes']} bytes")
    return out


def part_bench(opts: argparse.Namespace) -> dict[str, Any]:
    from .bench_gpu import ratios, report_gpu, run_gpu

    out: dict[str, Any] = {}
    for mode in ("off", "auto"):
        r = run_gpu(True, settings={"gpu_kernel": mode})
        r["rows"] = report_gpu(r)
        r["ratios"] = ratios(r)
        out[mode] = r
    return out


def part_startup(opts: argparse.Namespace) -> dict[str, Any]:
    from .gpu_startup import region_size, run

    want = opts.region_gib << 30 if opts.gpu else min(opts.region_gib << 30, 1 << 30)
    size, note = region_size(want, opts.grow_shm)
    out = run(size, opts.gpu, deadline_s=max(30.0, opts.timeout_s - 100))
    out["region_note"] = note
    if not opts.gpu:
        out["skips"] = [f"pinning and the CUDA probe (no GPU; a {size >> 30} GiB region only)"]
    return out


def part_tiers(opts: argparse.Namespace) -> dict[str, Any]:
    """``make bench``'s secondary-tier rows on as many promotion threads as the machine
    has free cores (1 to 8), with the targets judged (``promotion_targets``): on the
    GPU machine's 16 cores, the 0.5-of-memcpy promotion targets that 2 vCPUs cannot
    check."""
    from .bench import run
    from .bench_tiers import promotion_targets, tier_rows

    free = len(os.sched_getaffinity(0)) - 1  # one for the daemon's loop
    threads = tuple(t for t in (1, 2, 4, 8) if t <= max(2, free))
    out = run(False, only_tiers=True, tier_threads=threads)
    out["free_cores"] = free
    out["rows"] = tier_rows(out)
    out["targets"] = promotion_targets(out, free)
    out["skips"] = [out[f"{k}_skipped"] for k in ("redis", "mooncake") if f"{k}_skipped" in out]
    if free < 4:
        out["skips"].append(f"the 0.5-of-memcpy promotion targets: {free} free cores (needs 4)")
    return out


RUNNERS = {
    "env": part_env,
    "unit": part_unit,
    "test-gpu": part_test_gpu,
    "engines": part_engines,
    "kernel": part_kernel,
    "bench": part_bench,
    "startup": part_startup,
    "tiers": part_tiers,
}


def run_part(opts: argparse.Namespace) -> int:
    """In the part's own process: run it, write {status, figures | error} as JSON."""
    result: dict[str, Any]
    try:
        result = {"status": "ok", "figures": RUNNERS[opts.run_part](opts)}
    except Exception as exc:
        traceback.print_exc()
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    with open(opts.part_json, "w") as f:
        json.dump(result, f, default=str)
    return 0
