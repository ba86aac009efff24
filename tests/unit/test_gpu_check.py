"""``make gpu-check`` on this machine: what it can check without a GPU, so that a short
GPU slot is never spent on the check's own bugs (docs/gpu-check.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from fake_cuda import FakeCuda

from kvoffloadbench import bench_tiers, gpu_check, gpu_kernel_bench
from kvoffloadd.copies import calibrate


def test_the_kernel_bench_runs_its_rows_and_round_trip_on_the_fake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCuda(multiprocessors=8)
    monkeypatch.setattr(gpu_kernel_bench, "load_driver", lambda: fake)
    monkeypatch.setattr(gpu_kernel_bench, "SPAN_BYTES", 1 << 20)
    monkeypatch.setattr(gpu_kernel_bench, "RUN_SIZES", (512, 32768))
    monkeypatch.setattr(gpu_kernel_bench, "REPEATS", 1)
    small = partial(calibrate.calibrate, scratch_bytes=1 << 20, sizes=(512, 8192), counts=(1, 16))
    monkeypatch.setattr(gpu_kernel_bench, "calibrate", small)
    r = gpu_kernel_bench.run()
    assert r["bad_bytes"] == 0 and r["sms"] == 8
    assert [(x["direction"], x["run_bytes"]) for x in r["rows"]] == [
        ("store", 512),
        ("store", 32768),
        ("load", 512),
        ("load", 32768),
    ]
    assert all(x["kernel_sm_fraction"] <= 1 and x["dma_gbps"] > 0 for x in r["rows"])
    assert len(gpu_kernel_bench.rows_table(r)) == 6
    assert fake.calls["mem_alloc"] == fake.calls["mem_free"]


def test_the_summary_says_which_targets_were_met() -> None:
    ratios = {"32k": {"store": 0.9, "load": 0.8, "target": 0.85}}
    report: dict[str, Any] = {
        "gpu": True,
        "seconds": 1.0,
        "skipped": ["bench: none"],
        "parts": {
            "bench": {"status": "ok", "seconds": 1, "figures": {"auto": {"ratios": ratios}}},
            "kernel": {"status": "timeout", "seconds": 90, "error": "no result after 90 s"},
        },
    }
    report["summary"] = gpu_check.summarize(report)
    assert report["summary"]["ratio_auto_32k"]["met"] is False
    text = "\n".join(gpu_check.table(report))
    assert "MISSED" in text and "no result after 90 s" in text and "bench: none" in text


def _tier_run(threads: int, promote_gbps: float, same: float) -> dict[str, float]:
    return {"threads": threads, "promote_gbps": promote_gbps, "same_threads_ratio": same}


def test_the_tier_promotion_targets_are_judged_on_free_cores_only() -> None:
    r: dict[str, Any] = {
        "memcpy_gbps": 10.0,
        "disk": [_tier_run(1, 2.0, 0.9), _tier_run(4, 5.5, 0.85), _tier_run(8, 6.0, 0.82)],
        "mooncake": [_tier_run(1, 2.5, 0.9), _tier_run(4, 4.0, 0.7)],
        "redis": [_tier_run(1, 1.2, 0.4)],
    }
    on16 = bench_tiers.promotion_targets(r, free_cores=15)
    assert on16["disk"]["memcpy_checked"] and on16["disk"]["memcpy_met"]
    assert on16["disk"]["same_threads_met"]
    assert [x["of_memcpy"] for x in on16["disk"]["runs"]] == [0.2, 0.55, 0.6]
    # 0.4 of memcpy on 4 threads misses; and 0.7 of copy+MAC misses the same-thread target
    assert on16["mooncake"]["memcpy_checked"] and not on16["mooncake"]["memcpy_met"]
    assert not on16["mooncake"]["same_threads_met"]
    # Redis: its 0.1 target holds on any machine, and no same-thread target (its server
    # copies on the same cores)
    assert on16["redis"]["memcpy_met"] and on16["redis"]["same_threads_met"]
    # fewer free cores than a run's threads: that run is not judged
    on5 = bench_tiers.promotion_targets(r, free_cores=5)
    assert on5["disk"]["memcpy_met"]  # 4 threads: 0.55
    r["disk"][1] = _tier_run(4, 4.0, 0.85)
    assert not bench_tiers.promotion_targets(r, free_cores=5)["disk"]["memcpy_met"]
    assert bench_tiers.promotion_targets(r, free_cores=15)["disk"]["memcpy_met"]  # 8: 0.6
    on1 = bench_tiers.promotion_targets(r, free_cores=1)
    assert not on1["disk"]["memcpy_checked"] and not on1["disk"]["memcpy_met"]
    report = {
        "gpu": False,
        "seconds": 1.0,
        "skipped": [],
        "parts": {
            "tiers": {"status": "ok", "seconds": 1, "figures": {"free_cores": 1, "targets": on1}}
        },
    }
    report["summary"] = gpu_check.summarize(report)
    text = "\n".join(gpu_check.table(report))
    assert "disk promotion, of memcpy/of copy+MAC: 1T 0.20/0.90, 4T 0.40/0.85" in text
    assert "memcpy >= 0.5 not checked" in text and "same threads MISSED" in text


def test_a_part_is_killed_with_everything_it_started() -> None:
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(gpu_check.descendants(proc.pid)) < 2:
            assert time.monotonic() < deadline, "children never appeared"
        kids = gpu_check.descendants(proc.pid)
        gpu_check.kill_tree(proc.pid)
        assert proc.wait(10) == -9
        while any(map(running, kids)):
            assert time.monotonic() < deadline + 10, "a child of the part survived"
    finally:
        gpu_check.kill_tree(proc.pid)


def running(pid: int) -> bool:
    """Alive and not a zombie (whoever adopted it may never reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_without_a_gpu_it_lists_what_it_skipped_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "out" / "gpu-check.json"
    parts = "env,test-gpu,bench"
    rc = subprocess.run(
        [sys.executable, "-m", "kvoffloadbench.gpu_check", "--parts", parts, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rc.returncode == 0, rc.stdout + rc.stderr
    report = json.loads(out.read_text())
    assert report["gpu"] is False and report["parts"]["env"]["status"] == "ok"
    for name in ("test-gpu", "bench"):
        assert report["parts"][name]["status"] == "skipped"
        assert any(s.startswith(f"{name} (") and "needs a GPU" in s for s in report["skipped"])
    assert "skipped:" in rc.stdout


ORPHAN = """
import subprocess, sys, time
from kvoffloadbench import gpu_check
gpu_check.become_subreaper()
subprocess.run(["sh", "-c", "sleep 60 & echo $!"], stdout=open(sys.argv[1], "w"), check=True)
pid = int(open(sys.argv[1]).read())
assert pid in gpu_check.descendants(gpu_check.os.getpid()), "the orphan is not ours"
gpu_check.kill_leftovers()
assert pid not in gpu_check.descendants(gpu_check.os.getpid())
"""


def test_what_a_part_leaves_without_a_parent_is_killed_too(tmp_path: Path) -> None:
    """A daemon whose pytest was killed outlives it; the check adopts and kills it."""
    rc = subprocess.run(
        [sys.executable, "-c", ORPHAN, str(tmp_path / "pid")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rc.returncode == 0, rc.stderr
    pid = int((tmp_path / "pid").read_text())
    assert not running(pid)


def test_every_bench_case_stores_and_loads_its_rounds_on_cpu_caches() -> None:
    """The GPU bench's cases with memfd caches on a real daemon: each round's fresh keys
    and the stored ones fit one namespace (same length), and store, load and both at
    once succeed round after round, as the GPU part runs them."""
    import kvoffload
    from kvoffloadbench.bench_gpu import CASES, GpuCase
    from kvoffloadbench.launch import BULK_STORES, DaemonProcess

    with DaemonProcess("96MiB", settings=BULK_STORES) as d:
        client = kvoffload.connect(d.socket_path)
        try:
            for label, _, pages, tp in CASES:
                case = GpuCase(
                    client, f"gpu-{label}", pages, blocks=4, job_blocks=2, tp=tp, device="cpu"
                )
                for store, load in ((True, False), (False, True), (True, True), (True, True)):
                    assert case.run(store, load) > 0
                case.close()
                client.evict(f"gpu-{label}")
        finally:
            client.close()
