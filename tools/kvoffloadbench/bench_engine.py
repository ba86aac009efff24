"""``make bench-engine``: what the shared pool costs an engine per scheduler step.

Each point (``engine_step``) times vLLM 0.33's real ``schedule()`` +
``update_from_output()`` with N decoding requests, in blocks of ``--block`` steps per
configuration, ``--passes`` passes: no connector, vLLM's own CPU offloading manager
(a stand-in completes its jobs at once), and kvoffload with its worker copying in the
engine's process while a second engine shares the namespace. The ratios kvoffload /
vLLM's manager at p50 and p99 are printed beside their targets (DESIGN.md section 6:
<= 1.10 and <= 1.3 at N = 16, 64 and 256), and so are the blocking round trips per step
of the scheduler and the worker (target 0).

``--runs K`` repeats the every-step points K times, each on a daemon of its own, and
sums up the spread of the ratios and how many runs met each target, with the load
average around each run (other work on the machine moves every figure; ``--max-load``
waits for it to fall first). Stores only of prompts (vLLM's default) are measured in
the first run. ``--scale K`` (8 by default) then runs K engine processes of N=256 at
full step rate on a daemon of their own and reports each engine's step rate and the
daemon's CPU and loop turns. ``make bench-engine`` saves the figures in
docs/bench-engine.json, which ``make bench-report`` puts in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

from kvoffloadbench.engine_step import measure_point, pct
from kvoffloadbench.launch import DaemonProcess

TARGET_P50 = 1.10
TARGET_P99 = 1.3


def _scale_engine(sock: str, n: int, seconds: float, out: Any) -> None:
    from kvoffloadbench.engine_step import Churn, counters

    churn = Churn(n, False, sock, f"s{os.getpid()}", salt=os.getpid())
    e = churn.engine
    views = e.manager.views
    trips0 = sum(counters(e)[:2])  # after warm-up
    fallbacks0 = sum(v.lease_fallbacks_total for v in views)
    times, t_end = [], time.monotonic() + seconds
    while time.monotonic() < t_end:
        a, b = churn.step()
        times.append((a + b) * 1e3)
    out.put(
        {
            "steps_per_s": len(times) / seconds,
            "p50_ms": statistics.median(times),
            "p99_ms": pct(times, 0.99),
            "lease_fallbacks_total": sum(v.lease_fallbacks_total for v in views) - fallbacks0,
            "round_trips": sum(counters(e)[:2]) - trips0,
        }
    )
    e.shutdown()


def measure_scale(d: DaemonProcess, engines: int, n: int, seconds: float) -> dict[str, Any]:
    from kvoffloadbench.engine_step import cpu_s

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_scale_engine, args=(d.socket_path, n, seconds, out))
        for _ in range(engines)
    ]
    for p in procs:
        p.start()
    time.sleep(min(10.0, seconds / 2))  # the engines are importing vLLM meanwhile
    cpu0, t0 = cpu_s(d.pid), time.monotonic()
    results = [out.get(timeout=seconds + 600) for _ in procs]
    cpu1, t1 = cpu_s(d.pid), time.monotonic()
    for p in procs:
        p.join(60)
    total_steps = sum(r["steps_per_s"] for r in results) * seconds
    return {
        "engines": engines,
        "n": n,
        "per_engine": results,
        "daemon_cpu_share": (cpu1 - cpu0) / max(1e-9, t1 - t0),
        "daemon_cpu_us_per_engine_step": (cpu1 - cpu0) / max(1.0, total_steps) * 1e6,
    }


def _loop(d: DaemonProcess) -> dict[str, Any]:
    import kvoffload

    with kvoffload.connect(d.socket_path) as c:
        loop: dict[str, Any] = c.stats()["loop"]
        return loop


def _wait_for_load(max_load: float, wait_s: float) -> float:
    """The 1-minute load average once it is below ``max_load`` (or ``wait_s`` passed)."""
    deadline = time.monotonic() + wait_s
    while (load := os.getloadavg()[0]) > max_load and time.monotonic() < deadline:
        time.sleep(5.0)
    return load


def run_once(sizes: list[int], prompt_only: bool, passes: int, block: int) -> dict[str, Any]:
    """Every point of one run, on a daemon of its own."""
    run: dict[str, Any] = {"points": []}
    with DaemonProcess("1GiB", "--log-level", "warning") as d:
        for mode in (False, True) if prompt_only else (False,):
            for n in sizes:
                run["points"].append(measure_point(d, n, mode, passes, block))
        run["daemon_loop"] = _loop(d)
        d.stop()
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench-engine", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="16,64,256", help="running requests per point ('': none)")
    p.add_argument("--block", type=int, default=20, help="timed steps of one engine in a row")
    p.add_argument("--passes", type=int, default=60, help="blocks of each configuration")
    p.add_argument("--runs", type=int, default=1, help="runs of the every-step points")
    p.add_argument(
        "--no-prompt-only", action="store_true", help="skip the points storing prompts only"
    )
    p.add_argument(
        "--max-load", type=float, default=0.0, help="wait for a lower load average first"
    )
    p.add_argument("--scale", type=int, default=8, help="engines for the scale run (0: off)")
    p.add_argument("--seconds", type=float, default=20.0, help="scale run length")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    from .machine import machine

    report: dict[str, Any] = {
        "machine": machine(),
        "block": args.block,
        "passes": args.passes,
        "runs": [],
    }
    sizes = [int(x) for x in args.sizes.split(",") if x]
    for i in range(args.runs if sizes else 0):
        load = _wait_for_load(args.max_load, 600.0) if args.max_load else os.getloadavg()[0]
        run = run_once(sizes, i == 0 and not args.no_prompt_only, args.passes, args.block)
        run["load_average"] = [load, os.getloadavg()[0]]
        report["runs"].append(run)
        print(render_run(run, i, args.runs), flush=True)
    if args.scale:  # on a daemon of its own
        with DaemonProcess("1GiB", "--log-level", "warning") as d:
            report["scale"] = measure_scale(d, args.scale, 256, args.seconds)
            report["scale"]["daemon_loop"] = _loop(d)
            d.stop()
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _verdict(ratio: float, target: float) -> str:
    return f"{ratio:.2f} {'ok' if ratio <= target else 'OVER'}"


def _cpu_ratio(pt: dict[str, Any], key: str) -> str:
    """kvoffload's engine CPU per step over vLLM's own offloader's (``-`` when older
    figures lack it)."""
    a, b = pt["kvoffload"].get(key), pt["vllm"].get(key)
    return f"{a / b:.2f}" if a and b else "-"


def render_points(points: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| stores | N | (1) none p50 / p99 ms | (2) vLLM CPU p50 / p99 ms | (3) kvoffload "
        f"p50 / p99 ms | (3)/(2) p50, target <= {TARGET_P50:.2f} | (3)/(2) p99, target <= "
        f"{TARGET_P99:.1f} | blocking round trips per step, scheduler + worker (target 0) "
        "| one-way frames per step | daemon CPU per engine step | engine CPU p50 / p99, (3)/(2) "
        "| steps preempted, (2) / (3) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for pt in points:
        mode = "prompt only" if pt["offload_prompt_only"] else "every step"
        mode += f" ({pt['steps_with_stores']:.0%} of steps)"
        cells = [
            f"{pt[s]['p50_ms']:.3f} / {pt[s]['p99_ms']:.3f}" for s in ("none", "vllm", "kvoffload")
        ]
        lines.append(
            f"| {mode} | {pt['n']} | {' | '.join(cells)} | "
            f"{_verdict(pt['ratio_p50'], TARGET_P50)} | {_verdict(pt['ratio_p99'], TARGET_P99)} | "
            f"{pt['scheduler_round_trips_per_step']:.3f} + "
            f"{pt['worker_round_trips_per_step']:.3f} | "
            f"{pt['one_way_frames_per_step']:.2f} | "
            f"{pt['daemon_cpu_us_per_engine_step']:.0f} us | "
            f"{_cpu_ratio(pt, 'cpu_p50_ms')} / {_cpu_ratio(pt, 'cpu_p99_ms')} | "
            f"{_preempted([pt], 'vllm'):.1%} / {_preempted([pt], 'kvoffload'):.1%} |"
        )
    for pt in points:
        prof = pt.get("profile") or {}
        if not prof:
            continue
        mode = "prompt only" if pt["offload_prompt_only"] else "every step"
        split = "; ".join(
            f"{part} {what} {prof.get(f'{part}_{what}_us_per_step', 0.0):.1f} us "
            f"(CPU {prof.get(f'{part}_{what}_cpu_us_per_step', 0.0):.1f}, "
            f"{prof.get(f'{part}_{what}_calls_per_step', 0.0):.2f}/step"
            + (
                f", {msgs:.1f} messages each"
                if (msgs := prof.get(f"{part}_{what}_msgs_per_call"))
                else ""
            )
            + ")"
            for part in ("scheduler", "worker")
            for what in ("send", "recv", "apply")
        )
        io = ", ".join(
            f"{parts} {x['share']:.0%} (p50 {x['p50_ms']:.3f} ms)"
            for parts, x in pt.get("io_steps", {}).items()
        )
        lines.append(
            f"\nN={pt['n']}, stores {mode}, client time per step: {split}. Steps by the "
            f"parts that wrote or read: {io}"
        )
    return lines


def render_run(run: dict[str, Any], i: int, runs: int) -> str:
    load = run.get("load_average", [0.0, 0.0])
    lines = [f"\nrun {i + 1} of {runs}, load average {load[0]:.2f} -> {load[1]:.2f}"]
    lines += render_points(run["points"])
    loop = run.get("daemon_loop", {})
    lines.append(
        f"\ndaemon loop turns: p50 {loop.get('turn_p50_us')} us, p99 "
        f"{loop.get('turn_p99_us')} us, max {loop.get('turn_max_us')} us"
    )
    return "\n".join(lines)


def summary(runs: list[dict[str, Any]]) -> list[str]:
    """Per N, the every-step ratios over the runs and how many met their targets."""
    by_n: dict[int, list[dict[str, Any]]] = {}
    for run in runs:
        for pt in run["points"]:
            if not pt["offload_prompt_only"]:
                by_n.setdefault(pt["n"], []).append(pt)
    lines = [
        f"| N | p50 ratio per run | met <= {TARGET_P50:.2f} | p99 ratio per run "
        f"| met <= {TARGET_P99:.1f} | engine CPU p99 ratio per run | steps preempted, (2) / (3) "
        "| blocking round trips in all runs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, pts in sorted(by_n.items()):
        p50 = [pt["ratio_p50"] for pt in pts]
        p99 = [pt["ratio_p99"] for pt in pts]
        trips = sum(
            (pt["scheduler_round_trips_per_step"] + pt["worker_round_trips_per_step"]) for pt in pts
        )
        lines.append(
            f"| {n} | {' '.join(f'{x:.2f}' for x in p50)} ({min(p50):.2f}-{max(p50):.2f}) | "
            f"{sum(x <= TARGET_P50 for x in p50)} of {len(p50)} | "
            f"{' '.join(f'{x:.2f}' for x in p99)} ({min(p99):.2f}-{max(p99):.2f}) | "
            f"{sum(x <= TARGET_P99 for x in p99)} of {len(p99)} | "
            f"{' '.join(_cpu_ratio(pt, 'cpu_p99_ms') for pt in pts)} | "
            f"{_preempted(pts, 'vllm'):.1%} / {_preempted(pts, 'kvoffload'):.1%} | "
            f"{trips:.3f} per step |"
        )
    loads = ", ".join(f"{r['load_average'][0]:.1f}->{r['load_average'][1]:.1f}" for r in runs)
    lines.append(f"\nload average around each run: {loads}")
    return lines


def _preempted(pts: list[dict[str, Any]], spec: str) -> float:
    """The share of ``spec``'s steps preempted, averaged over ``pts`` (one point's own,
    or a summary's over its runs)."""
    return sum(float(pt[spec].get("preempted", 0.0)) for pt in pts) / len(pts)


def render(report: dict[str, Any]) -> str:
    lines: list[str] = []
    runs = report.get("runs") or []
    if runs:
        lines += render_points(runs[0]["points"])
        if len(runs) > 1:
            lines += ["", f"Over {len(runs)} runs, stores in every step:", ""]
            lines += summary(runs)
    if "scale" in report:
        sc = report["scale"]
        rates = [r["steps_per_s"] for r in sc["per_engine"]]
        lines.append(
            f"\n{sc['engines']} engines x N={sc['n']}: {min(rates):.0f}-{max(rates):.0f} "
            f"steps/s each; step p99 {max(r['p99_ms'] for r in sc['per_engine']):.2f} ms; "
            f"lease fallbacks {sum(r['lease_fallbacks_total'] for r in sc['per_engine'])}; "
            f"round trips {sum(r['round_trips'] for r in sc['per_engine'])}; daemon CPU "
            f"{sc['daemon_cpu_share'] * 100:.0f}% of a core, "
            f"{sc['daemon_cpu_us_per_engine_step']:.0f} us per engine step; loop p99 "
            f"{sc['daemon_loop']['turn_p99_us']} us"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
