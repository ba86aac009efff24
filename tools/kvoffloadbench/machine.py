"""The machine a benchmark ran on, for the reports: cpu, memory, kernel, python, date,
commit, and the GPU when there is one."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess

from .bench_gpu import cuda_available

GIB = 1 << 30


def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    out = {
        "cpu": f"{cpu}, {os.cpu_count()} logical CPUs",
        "memory": f"{mem / GIB:.1f} GiB",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    try:
        out["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out["commit"] = "unknown"
    if cuda_available():
        import torch

        out["gpu"] = torch.cuda.get_device_name(0)
    return out
