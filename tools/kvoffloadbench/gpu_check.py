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
  process's CUDA calls meanwhile (gpu_startup);
- ``tiers``: secondary-tier promotion with MACs verified on 1 to 8 threads, against
  memcpy and the machine's copy+MAC on as many threads (bench_tiers; CPU only, last: the
  16 cores check the 0.5-of-memcpy targets that a 2-vCPU machine cannot).

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
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .gpu_parts import ROOT, RUNNERS, SHM, has_gpu, run_part


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
    Part("tiers", 150, False, "tier promotion on 1-8 threads against memcpy"),
)


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


def use_carried_libs() -> list[str]:
    """The libraries that ``tools/gpu-venv`` unpacked beside the virtualenv (Mooncake's
    client needs them and the image lacks them) go on every part's library path."""
    root = Path(sys.prefix) / "sysroot"
    dirs = [str(d) for d in (root / "usr/lib/x86_64-linux-gnu", root / "lib/x86_64-linux-gnu")]
    dirs = [d for d in dirs if os.path.isdir(d)]
    if dirs:
        old = os.environ.get("LD_LIBRARY_PATH")
        os.environ["LD_LIBRARY_PATH"] = ":".join(dirs + ([old] if old else []))
    return dirs


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
        "carried_libs": use_carried_libs(),
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
    tiers = parts.get("tiers", {}).get("figures", {})
    if tiers:
        s["tiers"] = {"free_cores": tiers.get("free_cores"), **tiers.get("targets", {})}
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
    lines += tier_lines(s.get("tiers", {}))
    if report["skipped"]:
        lines.append("  skipped:")
        lines += [f"    - {x}" for x in report["skipped"]]
    return lines


def tier_lines(t: dict[str, Any]) -> list[str]:
    """Tier promotion per thread count: of memcpy and of copy+MAC, targets judged."""
    lines = []
    for kind, x in t.items():
        if not isinstance(x, dict):
            continue
        runs = ", ".join(
            f"{r['threads']}T {r['of_memcpy']:.2f}/{r['of_copy_mac']:.2f}" for r in x["runs"]
        )
        memcpy = ("ok" if x["memcpy_met"] else "MISSED") if x["memcpy_checked"] else "not checked"
        same = "ok" if x["same_threads_met"] else "MISSED"
        lines.append(
            f"  {kind} promotion, of memcpy/of copy+MAC: {runs}; memcpy >= "
            f"{x['memcpy_target']} {memcpy}, same threads {same}"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
