"""``make bench-engine``'s report: each run's verdicts, and beside the wall-time p99 the
engine's own CPU p99 and how many steps waited for a CPU, so a p99 decided by the
kernel's preemptions reads as such."""

from __future__ import annotations

from typing import Any

from kvoffloadbench.bench_engine import render_points, summary


def _point(wall_p99_ms: float, cpu_p99_ms: float, preempted: float) -> dict[str, Any]:
    spec = {"p50_ms": 0.4, "p99_ms": 0.8, "cpu_p50_ms": 0.4, "cpu_p99_ms": 0.5, "preempted": 0.01}
    kvo = dict(spec, p99_ms=wall_p99_ms, cpu_p99_ms=cpu_p99_ms, preempted=preempted)
    return {
        "n": 16,
        "offload_prompt_only": False,
        "steps_with_stores": 1.0,
        "none": spec,
        "vllm": spec,
        "kvoffload": kvo,
        "ratio_p50": 1.0,
        "ratio_p99": wall_p99_ms / spec["p99_ms"],
        "scheduler_round_trips_per_step": 0.0,
        "worker_round_trips_per_step": 0.0,
        "one_way_frames_per_step": 0.06,
        "daemon_cpu_us_per_engine_step": 20.0,
    }


def test_the_report_puts_the_engines_cpu_tail_and_preemptions_beside_the_wall_p99() -> None:
    runs: list[dict[str, Any]] = [
        {"points": [_point(1.2, 0.55, 0.02)], "load_average": [1.0, 1.0]},
        {"points": [_point(0.96, 0.6, 0.03)], "load_average": [1.0, 1.0]},
    ]
    row = render_points(runs[0]["points"])[2]
    assert "1.50 OVER" in row  # wall p99: 1.2 / 0.8
    assert "| 1.00 / 1.10 |" in row  # engine CPU p50 / p99 ratios
    assert "| 1.0% / 2.0% |" in row  # steps preempted, vLLM's / kvoffload's
    table = summary(runs)
    n16 = next(line for line in table if line.startswith("| 16 "))
    assert "1.50 1.20 (1.20-1.50) | 1 of 2" in n16
    assert "| 1.10 1.20 | 1.0% / 2.5% |" in n16


def test_figures_without_the_cpu_tail_still_render() -> None:
    old = _point(1.0, 0.5, 0.0)
    for spec in ("vllm", "kvoffload"):
        del old[spec]["cpu_p99_ms"], old[spec]["preempted"]
    assert "| 1.00 / - | 0.0% / 0.0% |" in render_points([old])[2]
