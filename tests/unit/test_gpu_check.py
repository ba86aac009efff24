"""``make gpu-check`` on this machine: what it can check without a GPU, so that a short
GPU slot is never spent on the check's own bugs (docs/gpu-check.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
from fake_cuda import FakeCuda

from kvoffloadbench import gpu_check, gpu_kernel_bench
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
    report = {
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
