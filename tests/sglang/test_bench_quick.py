"""``make bench-sglang`` in a quick run, so the benchmark docs/performance.md quotes cannot rot:
every backend goes through SGLang's controller and comes back with the bytes it stored
(the benchmark asserts that), and the report renders."""

from __future__ import annotations

import json
import pathlib

import pytest

from kvoffloadbench import bench_sglang


@pytest.mark.timeout(300)
def test_bench_sglang_quick(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench-sglang.json"
    bench_sglang.main(["--quick", "--json", str(out)])
    r = json.loads(out.read_text())
    labels = [row["backend"] for row in r["rows"]]
    assert labels[:3] == [
        "kvoffload, shm pool (daemon copies)",
        "kvoffload, default pool (client copies)",
        "SGLang file backend, tmpfs",
    ]
    assert all(row["prefetch_gbps"] > 0 and row["exists_p50_us"] > 0 for row in r["rows"])
    assert "| kvoffload, shm pool (daemon copies) |" in capsys.readouterr().out
