"""``make gpu-check``: the CUDA path re-verified in one command that fits a short GPU slot.

Parts, in order, each in its own process with its own timeout (a hang costs that part,
never the slot), all within ``--budget-s`` (8 minutes by default):

- ``env``: the machine, PyTorch, the driver, and the shipped kernel loaded on GPU 0;
- ``unit``: the GPU path's unit tests against the fake driver (CPU only);
- ``test-gpu``: ``tests/gpu`` (what ``make test-gpu`` runs);
- ``engines``: two engines and a third on one daemon, per-rank and canonical pages in
  NHD and HND, byte-exact, the daemon SIGKILLed mid-copy and restarted (two_engines);
- ``kernel``: the gather kernel through the driver seam: GB/s, SM time per GiB, the
  calibration's choice, a byte-exact round trip (gpu_kernel_bench);
- ``bench``: the GPU rows of ``make bench`` (2 MiB, 32 x 32 KiB, 16 x 8 KiB, canonical
  NHD fragments; both directions; ratios to one large pinned copy in the same run),
  once with DMA only (``gpu_kernel = "off"``) and once as the daemon runs by default;
- ``startup``: a 64 GiB region's start-up and pinning, and the worst wait of another
  process's CUDA calls meanwhile (gpu_startup).

Without a GPU the parts that need none run (``engines`` with CPU caches, ``startup``
without pinning, ``unit``) and the others are listed as skipped, with why; the exit
status is 0 unless a part failed or timed out. Every figure goes to one JSON file:
``$OUT/gpu-check.json`` when ``OUT`` is set, else ``--json``; a summary table is printed.

    python -m kvoffloadbench.gpu_check [--json FILE] [--parts a,b] [--budget-s 470]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SHM = "/dev/shm"


@dataclass(frozen=True)
class Part:
    name: str
    timeout_s: float
    needs_gpu: bool
    what: str


PARTS = (
    Part("env", 60, False, "machine, PyTorch, driver, kernel load"),
    Part("unit", 120, False, "GPU path unit tests on the fake driver"),
    Part("test-gpu", 200, True, "tests/gpu"),
    Part("engines", 150, False, "two engines, four layouts, daemon killed mid-copy"),
    Part("kernel", 90, True, "gather kernel GB/s and SM time"),
    Part("bench", 200, True, "GPU bench rows, DMA only and default"),
    Part("startup", 200, False, "64 GiB region start-up and pinning"),
)


# ------------------------------------------------------------------ the parts


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


RUNNERS = {
    "env": part_env,
    "unit": part_unit,
    "test-gpu": part_test_gpu,
    "engines": part_engines,
    "kernel": part_kernel,
    "bench": part_bench,
    "startup": part_startup,
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


# ------------------------------------------------------------------ the orchestra


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (a daemon in its own session too)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError, IndexError):
            continue
        if state not in ("Z", "X"):  # a zombie is gone, only not reaped yet
            children.setdefault(int(ppid), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(pid: int) -> None:
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def become_subreaper() -> None:
    """Orphans of our parts (a daemon whose pytest was killed) become our children,
    so that nothing a part started outlives it (PR_SET_CHILD_SUBREAPER)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)


def kill_leftovers(deadline_s: float = 10.0) -> list[int]:
    """Kill every process still below us (parts are over) and reap them; returns those
    that did not die within ``deadline_s`` (stuck in the kernel)."""
    end = time.monotonic() + deadline_s
    while True:
        for p in descendants(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        left = descendants(os.getpid())
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.01)


def held(path: str) -> bool:
    """Whether a live daemon holds this region (its lock on the segment)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def drop_new_regions(before: set[str]) -> list[str]:
    """Regions a part's daemons left in /dev/shm (killed ones keep theirs): a 64 GiB
    one would hold its memory until the machine goes back."""
    left = []
    for name in set(os.listdir(SHM)) - before:
        path = os.path.join(SHM, name)
        if name.startswith("kvoffload-") and not held(path):
            with contextlib.suppress(OSError):
                os.unlink(path)
                left.append(name)
    return left


def launch(part: Part, opts: argparse.Namespace, timeout_s: float, log: Path) -> dict[str, Any]:
    part_json = os.path.join(opts.workdir, f"{part.name}.json")
    cmd = [
        sys.executable, "-m", "kvoffloadbench.gpu_check", "--run-part", part.name,
        "--part-json", part_json, "--workdir", opts.workdir, "--timeout-s", str(timeout_s),
        "--region-gib", str(opts.region_gib), *(["--gpu"] if opts.gpu else []),
        *(["--grow-shm"] if opts.grow_shm else []),
    ]  # fmt: skip
    before = set(os.listdir(SHM))
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        kill_tree(proc.pid)  # whatever it left running (a daemon, an engine)
        proc.wait()
        stuck = kill_leftovers()  # and what it left that lost its parent
    result: dict[str, Any] = {"seconds": round(time.monotonic() - t0, 2)}
    if stuck:
        result["processes_not_killed"] = stuck
    if timed_out:
        result.update(status="timeout", error=f"no result after {timeout_s:.0f} s")
    else:
        try:
            with open(part_json) as f:
                result.update(json.load(f))
        except (OSError, ValueError) as exc:
            result.update(status="failed", error=f"exited {proc.returncode}: {exc}")
    if left := drop_new_regions(before):
        result["regions_removed"] = left
    if result["status"] != "ok":
        result["log_tail"] = log.read_text(errors="replace")[-3000:]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvoffloadbench.gpu_check")
    p.add_argument("--json", help="the figures' file (default: $OUT/gpu-check.json)")
    p.add_argument("--parts", default=",".join(x.name for x in PARTS))
    p.add_argument("--budget-s", type=float, default=470.0, help="all parts together")
    p.add_argument("--region-gib", type=int, default=64, help="region of the startup part")
    p.add_argument("--grow-shm", action="store_true", help="remount /dev/shm to hold it (root)")
    p.add_argument("--run-part", help=argparse.SUPPRESS)
    p.add_argument("--part-json", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--timeout-s", type=float, default=0, help=argparse.SUPPRESS)
    p.add_argument("--gpu", action="store_true", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.run_part:
        return run_part(opts)
    out_dir = os.environ.get("OUT")
    path = opts.json or (os.path.join(out_dir, "gpu-check.json") if out_dir else "gpu-check.json")
    wanted = [x.strip() for x in opts.parts.split(",") if x.strip()]
    unknown = set(wanted) - set(RUNNERS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; parts are {', '.join(RUNNERS)}")
    opts.gpu, why_not = has_gpu()
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "gpu": opts.gpu,
        "no_gpu_reason": why_not,
        "budget_s": opts.budget_s,
        "parts": {},
        "skipped": [],
    }
    start = time.monotonic()
    become_subreaper()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        opts.workdir = work
        for part in PARTS:
            if part.name not in wanted:
                continue
            left = opts.budget_s - (time.monotonic() - start)
            if part.needs_gpu and not opts.gpu:
                why = f"{part.name} ({part.what}): skipped, needs a GPU: {why_not}"
            elif left < 20:
                why = f"{part.name} ({part.what}): skipped, {left:.0f} s of the budget left"
            else:
                why = ""
            if why:
                report["skipped"].append(why)
                report["parts"][part.name] = {"status": "skipped", "why": why}
                continue
            print(f"gpu-check: {part.name} ({part.what}) ...", flush=True)
            log = Path(work) / f"{part.name}.log"
            res = launch(part, opts, min(part.timeout_s, left), log)
            report["parts"][part.name] = res
            skipped = res.get("figures", {}).get("skips", []) if res["status"] == "ok" else []
            report["skipped"] += [f"{part.name}: {s}" for s in skipped]
            print(f"gpu-check: {part.name}: {res['status']} in {res['seconds']} s", flush=True)
            if out_dir and res["status"] != "ok":  # one file: at most 8 come back
                with open(Path(out_dir) / "gpu-check-failed-parts.log", "a") as f:
                    f.write(f"===== {part.name}: {res['status']}\n")
                    f.write(log.read_text(errors="replace"))
    report["seconds"] = round(time.monotonic() - start, 1)
    report["summary"] = summarize(report)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print("\n".join(table(report)))
    print(f"gpu-check: figures in {path}")
    bad = [n for n, r in report["parts"].items() if r["status"] in ("failed", "timeout")]
    return 1 if bad else 0


# ------------------------------------------------------------------ the summary


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The figures the issue asks for, flat, with targets met or not."""
    parts = report["parts"]
    s: dict[str, Any] = {"parts": {n: r["status"] for n, r in parts.items()}}
    bench = parts.get("bench", {}).get("figures", {})
    for mode, r in bench.items():
        for label, x in r.get("ratios", {}).items():
            s[f"ratio_{mode}_{label}"] = {
                "store": round(x["store"], 3),
                "load": round(x["load"], 3),
                "target": x["target"],
                "met": x["store"] >= x["target"] and x["load"] >= x["target"],
            }
    kern = parts.get("kernel", {}).get("figures", {})
    for row in kern.get("rows", []):
        key = f"kernel_{row['direction']}_{row['run_bytes']}"
        s[key] = {
            "gbps": round(row["kernel_gbps"], 2),
            "sm_ms_per_gib": round(row["kernel_sm_ms_per_gib"], 2),
            "dma_gbps": round(row.get("dma_gbps", 0.0), 2),
        }
    st = parts.get("startup", {}).get("figures", {})
    if st:
        s["startup"] = {
            k: st.get(k)
            for k in (
                "region_bytes",
                "listening_s",
                "prefaulted_s",
                "first_pinned_s",
                "fully_pinned_s",
            )
        }
        if "probe" in st:
            s["startup"]["probe_worst_ms"] = st["probe"].get("pinning_worst_ms")
            s["startup"]["probe_idle_worst_ms"] = st["probe"].get("idle_worst_ms")
    eng = parts.get("engines", {}).get("figures", {})
    if eng:
        s["engines"] = {
            "device": eng.get("device"),
            "cases": list(eng.get("cases", {})),
            "inflight_jobs_at_kill": eng.get("kill", {}).get("inflight_jobs_at_kill"),
            "reconnect_s": eng.get("restart", {}).get("reconnect_s"),
        }
    return s


def table(report: dict[str, Any]) -> list[str]:
    lines = ["", f"gpu-check on {'a GPU' if report['gpu'] else 'no GPU'} in {report['seconds']} s"]
    lines += [f"  {n:9} {r['status']:8} {r.get('seconds', '')}" for n, r in report["parts"].items()]
    for n, r in report["parts"].items():
        if r["status"] in ("failed", "timeout"):
            lines.append(f"  {n}: {r.get('error', '')}")
    s = report["summary"]
    ratio_rows = [(k, v) for k, v in s.items() if k.startswith("ratio_")]
    if ratio_rows:
        lines.append("  ratio to one large pinned copy   store  load  target")
        lines += [
            f"  {k[6:]:31} {v['store']:5.2f} {v['load']:5.2f}  {v['target']:.2f} "
            + ("ok" if v["met"] else "MISSED")
            for k, v in ratio_rows
        ]
    lines += [
        f"  {k}: {v['gbps']} GB/s, {v['sm_ms_per_gib']} SM-ms/GiB (DMA {v['dma_gbps']} GB/s)"
        for k, v in s.items()
        if k.startswith("kernel_")
    ]
    if "startup" in s:
        lines.append(f"  startup: {json.dumps(s['startup'])}")
    if "engines" in s:
        lines.append(f"  engines: {json.dumps(s['engines'])}")
    if report["skipped"]:
        lines.append("  skipped:")
        lines += [f"    - {x}" for x in report["skipped"]]
    return lines


if __name__ == "__main__":
    sys.exit(main())
