"""``make bench-engine``: what the shared pool costs an engine per scheduler step.

vLLM 0.33's real ``Scheduler`` and ``OffloadingConnector`` (``engine_rig``) run N
decoding requests with block_size 16. Engine-side step time is ``schedule()`` +
``update_from_output()``, the forward pass excluded, in the same run for:

1. no connector;
2. vLLM's own ``CPUOffloadingManager`` (its worker needs CUDA, so its jobs complete at
   once: the lower bound of what offloading can cost the scheduler);
3. ``KVOffloadSpec`` against a kvoffloadd with a real worker (client copies), while a
   second engine process runs the same workload in the same namespace.

The three run in blocks of ``--block`` steps, in turn (the first rotating every
round), so machine noise and drift hit all alike while what one engine's step causes
(the daemon waking on its writes, a copy) lands in its own block, not in the next
configuration's timed step; the second engine runs during all three. Prompt lengths
are spread over a block's 16 tokens, so with ``offload_prompt_only=False`` some
request fills a block, a store, in every step (N/16 of them), and only prompts store
with vLLM's default ``True``. Per step it counts the blocking round trips of the
scheduler and of the worker (the target is zero) and the one-way frames sent; at
N=16 it splits the engine process's time in the client into writes to the daemon
(``send``), reads (``recv``) and delivering what was read to the views and workers
(``apply``), for the scheduler's step and for the worker's part of the step. The
daemon's CPU per engine step and its loop turns come from the daemon itself.

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
BLOCK_TOKENS = 16


def _prompt(i: int, n: int, salt: int = 0) -> list[int]:
    """Lengths spread over a block: the N requests fill their blocks in turn."""
    length = PROMPT_TOKENS + (i * BLOCK_TOKENS // max(1, n)) % BLOCK_TOKENS
    return [(i * 131 + j * 7 + salt * 17) % 997 + 1 for j in range(length)]


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
        e.add(f"{eid}-{i}", _prompt(i, n, salt), 100_000)
    for _ in range(WARMUP_STEPS):
        e.step()
    return e


def _clients(e: Any) -> list[Any]:
    return [e.manager.client, *(w.client for w in e.offload_workers)]


def _counters(e: Any) -> tuple[int, int, int]:
    """(scheduler round trips, worker round trips, one-way frames) so far."""
    if e.spec != "kvoffload":
        return 0, 0, 0
    sched, *workers = _clients(e)
    return (
        sched.round_trips_total,
        sum(w.round_trips_total for w in workers),
        sum(c.posts_total for c in (sched, *workers)),
    )


class Profile:
    """Time the engine process spends in the client, split into writes (``send``),
    reads (``recv``) and delivering what was read (``apply``), for the scheduler's
    step and for the worker's part, while ``on``."""

    def __init__(self) -> None:
        self.part = ""  # "scheduler", "worker", or "" (not measured)
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[tuple[type, str, Any]] = []

    def __enter__(self) -> Profile:
        from kvoffload.client import Client
        from kvoffload.link.transport import Transport

        for cls, name, what in (
            (Transport, "flush", "send"),
            (Transport, "poll", "recv"),
            (Client, "_route", "apply"),
        ):
            orig = getattr(cls, name)
            self._undo.append((cls, name, orig))
            setattr(cls, name, self._timed(orig, what))
        return self

    def _timed(self, fn: Any, what: str) -> Any:
        def timed(*args: Any, **kw: Any) -> Any:
            if not self.part:
                return fn(*args, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                key = f"{self.part}_{what}"
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0
                self.calls[key] = self.calls.get(key, 0) + 1

        return timed

    def __exit__(self, *exc: object) -> None:
        for cls, name, orig in self._undo:
            setattr(cls, name, orig)

    def report(self, steps: int) -> dict[str, float]:
        out = {f"{k}_us_per_step": v / steps * 1e6 for k, v in sorted(self.seconds.items())}
        out |= {f"{k}_calls_per_step": v / steps for k, v in sorted(self.calls.items())}
        return out


def _step(e: Any, profile: Profile | None) -> float:
    """One step; its engine-side milliseconds (``schedule()`` + ``update_from_output()``)."""
    if profile is None:
        a, b = e.step()
        return float(a + b) * 1e3
    profile.part = "scheduler"
    t0 = time.perf_counter()
    out = e.scheduler.schedule()
    t1 = time.perf_counter()
    profile.part = "worker"
    result = e.execute(out)
    profile.part = "scheduler"
    t2 = time.perf_counter()
    e.scheduler.update_from_output(out, result)
    t3 = time.perf_counter()
    profile.part = ""
    return (t1 - t0 + t3 - t2) * 1e3


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
    d: DaemonProcess, n: int, prompt_only: bool, steps: int, rounds: int, block: int
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    stop, bg_steps = ctx.Event(), ctx.Value("q", 0)
    bg = ctx.Process(target=_background, args=(d.socket_path, n, prompt_only, stop, bg_steps))
    bg.start()
    engines = {s: _engine(s, n, prompt_only, d.socket_path, f"{s}{n}") for s in SPECS}
    times: dict[str, list[float]] = {s: [] for s in SPECS}
    stores = dict.fromkeys(SPECS, 0)
    kvo = engines["kvoffload"]
    before = _counters(kvo)
    cpu0, bg0 = _cpu_s(d.pid), bg_steps.value
    order = list(engines.items())
    blocks = max(1, steps // block)
    with Profile() as profile:
        for r in range(rounds * blocks):  # blocks in turn, first one rotating: same noise
            k = r % len(order)
            for spec, e in order[k:] + order[:k]:
                for _ in range(block):
                    times[spec].append(_step(e, profile if e is kvo else None))
                    stores[spec] += bool(e.last_stores)
    measured = blocks * block * rounds
    cpu1, bg1 = _cpu_s(d.pid), bg_steps.value
    after = _counters(kvo)
    views = kvo.manager.views
    point: dict[str, Any] = {"n": n, "offload_prompt_only": prompt_only}
    for spec, xs in times.items():
        point[spec] = {"p50_ms": statistics.median(xs), "p99_ms": _pct(xs, 0.99)}
    point["ratio_p50"] = point["kvoffload"]["p50_ms"] / point["vllm"]["p50_ms"]
    point["ratio_p99"] = point["kvoffload"]["p99_ms"] / point["vllm"]["p99_ms"]
    point["steps_with_stores"] = stores["kvoffload"] / measured
    point["scheduler_round_trips_per_step"] = (after[0] - before[0]) / measured
    point["worker_round_trips_per_step"] = (after[1] - before[1]) / measured
    point["one_way_frames_per_step"] = (after[2] - before[2]) / measured
    point["lease_fallbacks_total"] = sum(v.lease_fallbacks_total for v in views)
    point["feed_resyncs_total"] = sum(v.resyncs_total for v in views)
    point["profile"] = profile.report(measured)
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
    views = e.manager.views
    trips0 = sum(_counters(e)[:2])  # after warm-up
    fallbacks0 = sum(v.lease_fallbacks_total for v in views)
    times, t_end = [], time.monotonic() + seconds
    while time.monotonic() < t_end:
        a, b = e.step()
        times.append((a + b) * 1e3)
    out.put(
        {
            "steps_per_s": len(times) / seconds,
            "p50_ms": statistics.median(times),
            "p99_ms": _pct(times, 0.99),
            "lease_fallbacks_total": sum(v.lease_fallbacks_total for v in views) - fallbacks0,
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
    p.add_argument("--steps", type=int, default=400, help="measured steps per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--block", type=int, default=50, help="steps of one engine in a row")
    p.add_argument("--scale", type=int, default=8, help="engines for the scale run (0: off)")
    p.add_argument("--seconds", type=float, default=20.0, help="scale run length")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    from .machine import machine

    report: dict[str, Any] = {
        "machine": machine(),
        "steps": args.steps,
        "rounds": args.rounds,
        "block": args.block,
        "points": [],
    }
    sizes = [int(x) for x in args.sizes.split(",") if x]
    if sizes:
        with DaemonProcess("1GiB", "--log-level", "warning") as d:
            for prompt_only in (False, True):
                for n in sizes:
                    report["points"].append(
                        measure_point(d, n, prompt_only, args.steps, args.rounds, args.block)
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
            if "steps_with_stores" in pt:
                mode += f" ({pt['steps_with_stores']:.0%} of steps)"
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
        for pt in report["points"]:
            prof = pt.get("profile") or {}
            if pt["n"] != 16 or not prof:
                continue
            mode = "prompt only" if pt["offload_prompt_only"] else "every step"
            split = ", ".join(
                f"{part} {what} {prof.get(f'{part}_{what}_us_per_step', 0.0):.1f} us "
                f"({prof.get(f'{part}_{what}_calls_per_step', 0.0):.2f}/step)"
                for part in ("scheduler", "worker")
                for what in ("send", "recv", "apply")
            )
            lines.append(f"\nN=16, stores {mode}, time in the client per step: {split}")
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
