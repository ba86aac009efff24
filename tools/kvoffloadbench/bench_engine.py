"""``make bench-engine``: what the shared pool costs an engine per scheduler step.

vLLM 0.33's real ``Scheduler`` and ``OffloadingConnector`` (``engine_rig``) run N
decoding requests with block_size 16. Engine-side step time is ``schedule()`` +
``update_from_output()``, the forward pass excluded, in the same run for:

1. no connector;
2. vLLM's own ``CPUOffloadingManager`` (its worker needs CUDA, so its jobs complete at
   once: the lower bound of what offloading can cost the scheduler);
3. ``KVOffloadSpec`` against a kvoffloadd with a real worker (client copies), while a
   second engine process runs the same workload in the same namespace.

The three are interleaved step by step (one step of each, the first rotating), so
machine noise and drift hit all alike, and the second engine runs during all three.
Stores happen every step with ``offload_prompt_only=False`` (a block fills every 16
steps per request) and only for prompts with vLLM's default ``True``. Per step it
counts the blocking round trips of the scheduler and of the worker (the target is
zero) and the one-way frames sent; the daemon's CPU per engine step and its loop turns
come from the daemon itself.

``--scale K`` (8 by default) then runs K engine processes of N=256 at full step rate on
a daemon of their own and reports each engine's step rate and the daemon's CPU and
loop turns. ``make bench-engine`` saves the figures in docs/bench-engine.json, which
``make bench-report`` puts in docs/benchmarks.md.
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

from kvoffloadbench.launch import DaemonProcess

PROMPT_TOKENS = 40
WARMUP_STEPS = 30


def _prompt(i: int, salt: int = 0) -> list[int]:
    return [(i * 131 + j * 7 + salt * 17) % 997 + 1 for j in range(PROMPT_TOKENS)]


def _engine(spec: str, n: int, prompt_only: bool, sock: str, eid: str, salt: int = 0) -> Any:
    from .engine_rig import Engine

    e = Engine(
        spec,
        socket_path=sock,
        engine_id=eid,
        num_blocks=max(512, n * 48),
        max_num_seqs=n,
        offload_prompt_only=prompt_only,
        verify=False,
    )
    for i in range(n):
        e.add(f"{eid}-{i}", _prompt(i, salt), 100_000)
    for _ in range(WARMUP_STEPS):
        e.step()
    return e


def _counters(e: Any) -> tuple[int, int, int]:
    """(scheduler round trips, worker round trips, one-way frames) so far."""
    if e.spec != "kvoffload":
        return 0, 0, 0
    sched = e.manager.ns.client
    worker = e.offload_worker.worker.ns.client
    return sched.round_trips_total, worker.round_trips_total, sched.posts_total + worker.posts_total


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _background(sock: str, n: int, prompt_only: bool, stop: Any, steps: Any) -> None:
    """The second engine sharing the namespace, stepping until told to stop. Its own
    prompts: both engines store (and both views follow both engines' stores)."""
    e = _engine("kvoffload", n, prompt_only, sock, f"bg{n}{int(prompt_only)}", salt=1)
    while not stop.is_set():
        e.step()
        with steps.get_lock():
            steps.value += 1
    e.shutdown()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def measure_point(
    d: DaemonProcess, n: int, prompt_only: bool, steps: int, rounds: int
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    stop, bg_steps = ctx.Event(), ctx.Value("q", 0)
    bg = ctx.Process(target=_background, args=(d.socket_path, n, prompt_only, stop, bg_steps))
    bg.start()
    engines = {s: _engine(s, n, prompt_only, d.socket_path, f"{s}{n}") for s in SPECS}
    times: dict[str, list[float]] = {s: [] for s in SPECS}
    before = _counters(engines["kvoffload"])
    cpu0, bg0 = _cpu_s(d.pid), bg_steps.value
    order = list(engines.items())
    for i in range(rounds * steps):  # step by step, first engine rotating: same noise
        k = i % len(order)
        for spec, e in order[k:] + order[:k]:
            a, b = e.step()
            times[spec].append((a + b) * 1e3)
    cpu1, bg1 = _cpu_s(d.pid), bg_steps.value
    after = _counters(engines["kvoffload"])
    view = engines["kvoffload"].manager.view
    point: dict[str, Any] = {"n": n, "offload_prompt_only": prompt_only}
    for spec, xs in times.items():
        point[spec] = {"p50_ms": statistics.median(xs), "p99_ms": _pct(xs, 0.99)}
    measured = steps * rounds
    point["ratio_p50"] = point["kvoffload"]["p50_ms"] / point["vllm"]["p50_ms"]
    point["ratio_p99"] = point["kvoffload"]["p99_ms"] / point["vllm"]["p99_ms"]
    point["scheduler_round_trips_per_step"] = (after[0] - before[0]) / measured
    point["worker_round_trips_per_step"] = (after[1] - before[1]) / measured
    point["one_way_frames_per_step"] = (after[2] - before[2]) / measured
    point["lease_fallbacks_total"] = view.lease_fallbacks_total
    point["feed_resyncs_total"] = view.resyncs_total
    engine_steps = measured + (bg1 - bg0)
    point["daemon_cpu_us_per_engine_step"] = (cpu1 - cpu0) / max(1, engine_steps) * 1e6
    stop.set()
    bg.join(60)
    for e in engines.values():
        e.shutdown()
    return point


SPECS = ("none", "vllm", "kvoffload")


def _scale_engine(sock: str, n: int, seconds: float, out: Any) -> None:
    e = _engine("kvoffload", n, False, sock, f"s{os.getpid()}", salt=os.getpid())
    view = e.manager.view
    trips0, fallbacks0 = sum(_counters(e)[:2]), view.lease_fallbacks_total  # after warm-up
    times, t_end = [], time.monotonic() + seconds
    while time.monotonic() < t_end:
        a, b = e.step()
        times.append((a + b) * 1e3)
    out.put(
        {
            "steps_per_s": len(times) / seconds,
            "p50_ms": statistics.median(times),
            "p99_ms": _pct(times, 0.99),
            "lease_fallbacks_total": view.lease_fallbacks_total - fallbacks0,
            "round_trips": sum(_counters(e)[:2]) - trips0,
        }
    )
    e.shutdown()


def measure_scale(d: DaemonProcess, engines: int, n: int, seconds: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_scale_engine, args=(d.socket_path, n, seconds, out))
        for _ in range(engines)
    ]
    for p in procs:
        p.start()
    time.sleep(min(10.0, seconds / 2))  # the engines are importing vLLM meanwhile
    cpu0, t0 = _cpu_s(d.pid), time.monotonic()
    results = [out.get(timeout=seconds + 600) for _ in procs]
    cpu1, t1 = _cpu_s(d.pid), time.monotonic()
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench-engine", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="16,64,256", help="running requests per point ('': none)")
    p.add_argument("--steps", type=int, default=200, help="measured steps per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--scale", type=int, default=8, help="engines for the scale run (0: off)")
    p.add_argument("--seconds", type=float, default=20.0, help="scale run length")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    from .machine import machine

    report: dict[str, Any] = {
        "machine": machine(),
        "steps": args.steps,
        "rounds": args.rounds,
        "points": [],
    }
    sizes = [int(x) for x in args.sizes.split(",") if x]
    if sizes:
        with DaemonProcess("1GiB", "--log-level", "warning") as d:
            for prompt_only in (False, True):
                for n in sizes:
                    report["points"].append(
                        measure_point(d, n, prompt_only, args.steps, args.rounds)
                    )
            report["daemon_loop"] = _loop(d)
            d.stop()
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


def render(report: dict[str, Any]) -> str:
    lines = []
    if report.get("points"):
        lines += [
            "| stores | N | (1) none p50 / p99 ms | (2) vLLM CPU p50 / p99 ms | (3) kvoffload "
            "p50 / p99 ms | (3)/(2) p50 / p99 | round trips per step (scheduler + worker) "
            "| one-way frames per step | daemon CPU per engine step |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for pt in report["points"]:
            mode = "prompt only" if pt["offload_prompt_only"] else "every step"
            cells = [
                f"{pt[s]['p50_ms']:.3f} / {pt[s]['p99_ms']:.3f}"
                for s in ("none", "vllm", "kvoffload")
            ]
            lines.append(
                f"| {mode} | {pt['n']} | {' | '.join(cells)} | "
                f"{pt['ratio_p50']:.2f} / {pt['ratio_p99']:.2f} | "
                f"{pt['scheduler_round_trips_per_step']:.3f} + "
                f"{pt['worker_round_trips_per_step']:.3f} | "
                f"{pt['one_way_frames_per_step']:.2f} | "
                f"{pt['daemon_cpu_us_per_engine_step']:.0f} us |"
            )
        loop = report.get("daemon_loop", {})
        lines.append(
            f"\ndaemon loop turns: p50 {loop.get('turn_p50_us')} us, p99 "
            f"{loop.get('turn_p99_us')} us, max {loop.get('turn_max_us')} us"
        )
    if "scale" in report:
        sc = report["scale"]
        rates = [r["steps_per_s"] for r in sc["per_engine"]]
        lines.append(
            f"{sc['engines']} engines x N={sc['n']}: {min(rates):.0f}-{max(rates):.0f} steps/s "
            f"each; step p99 {max(r['p99_ms'] for r in sc['per_engine']):.2f} ms; lease "
            f"fallbacks {sum(r['lease_fallbacks_total'] for r in sc['per_engine'])}; round "
            f"trips {sum(r['round_trips'] for r in sc['per_engine'])}; daemon CPU "
            f"{sc['daemon_cpu_share'] * 100:.0f}% of a core, "
            f"{sc['daemon_cpu_us_per_engine_step']:.0f} us per engine step; loop p99 "
            f"{sc['daemon_loop']['turn_p99_us']} us"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
