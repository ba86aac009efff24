"""The benchmark report renders every section from saved figures (--from-json)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from kvoffloadbench import bench, bench_report


def figures() -> dict[str, Any]:
    row = {"hit_tokens": 10, "prompt_tokens": 40, "bytes_loaded": 1 << 30, "bytes_stored": 0}
    return {
        "machine": {"cpu": "test cpu", "commit": "abc1234"},
        "quick": False,
        "trace": {
            "trace": {
                "seed": 7,
                "requests": 100,
                "conversations": 20,
                "system_prompts": 4,
                "unique_blocks": 300,
                "block_bytes": 16384,
                "tokens_per_block": 16,
                "total_pool_mib": 48,
            },
            "rows": [
                {**row, "engines": 2, "pool": "shared", "pool_bytes": 48 << 20, "hit_rate": 0.75},
                {**row, "engines": 2, "pool": "private", "pool_bytes": 48 << 20, "hit_rate": 0.5},
            ],
        },
        "datapath": [
            {
                "page_bytes": 4 << 20,
                "batch_blocks": 16,
                "blocks": 16,
                "store_gbps": 15.0,
                "load_gbps": 10.0,
                "memcpy_gbps": 10.0,
            }
        ],
        "control": [
            {"op": "ping", "clients": 4, "p50_us": 50.0, "p99_us": 90.0, "ops_per_s": 30000.0}
        ],
        "startup": [
            {"region_gib": 4, "listen_s": 0.5, "prefaulted_s": 6.0, "daemon_anon_bytes": 24 << 20}
        ],
        "index": [
            {
                "blocks": 1_000_000,
                "index_bytes_per_block": 239.0,
                "lookup1000_p50_us": 27.0,
                "lookup1000_p99_us": 60.0,
            }
        ],
        "targets": {
            "machine": "x86_64 2 cpus",
            "memcpy_gbps": 12.0,
            "store_2mib_gbps": 12.0,
            "load_2mib_gbps": 6.0,
            "store_32x32k_gbps": 3.0,
            "load_32x32k_gbps": 3.0,
            "echo_p50_us": 20.0,
            "echo_p99_us": 40.0,
            "ping_p50_us": 30.0,
            "ping_p99_us": 60.0,
            "lookup1000_p50_us": 100.0,
            "lookup1000_p99_us": 200.0,
            "store_round16_p50_us": 150.0,
            "store_round16_p99_us": 300.0,
            "lookup_calls_per_s_8_clients": 20000.0,
            "mirror_lookup_us": 0.3,
            "set_lookup_us": 0.03,
            "index_bytes_per_block": 239.0,
            "tier_blocks": 32,
            "tier_block_bytes": 2 << 20,
            "disk": [
                {
                    "threads": t,
                    "cascade_gbps": 1.0,
                    "promote_gbps": 1.5 * t,
                    "copy_mac_gbps": 2.0 * t,
                    "same_threads_ratio": 0.75,
                    "one_block_ms": 2.0,
                }
                for t in (1, 2)
            ],
            "redis_skipped": "redis-server is not installed",
            "mooncake_cascade_gbps": 2.0,  # saved before tier_threads: one row
            "mooncake_promote_gbps": 6.0,
            "mooncake_one_block_ms": 1.5,
        },
    }


def test_report_renders_every_section_from_saved_figures(tmp_path: pathlib.Path) -> None:
    saved = tmp_path / "figures.json"
    saved.write_text(json.dumps(figures()))
    assert bench_report.main(["--from-json", str(saved), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "benchmarks.md").read_text()
    for heading in (
        "## DESIGN.md targets",
        "## Shared pool against private pools",
        "## Data path against memcpy",
        "## Control path",
        "## Scale",
        "## Secondary tiers",
        "## Commands",
    ):
        assert heading in md
    assert "| 2 | shared | 48 MiB | 10 | 40 | 75.0% | 1.00 GiB | 0.00 GiB |" in md
    assert "| 4 MiB | 16 | 15.00 GB/s | 1.50 | 10.00 GB/s | 1.00 |" in md
    assert "| ping | 4 | 50.0 µs | 90.0 µs | 30,000 |" in md
    assert "| 4 GiB | 0.50 s | 6.00 s | 24 MiB |" in md
    assert "| 1,000,000 | 239 B | 27.0 µs | 60.0 µs |" in md
    assert "| disk | 1 | 1.00 GB/s | 1.50 GB/s | 0.75 (of 2.00 GB/s) | 0.12 | 2.00 ms |" in md
    assert "| disk | 2 | 1.00 GB/s | 3.00 GB/s | 0.75 (of 4.00 GB/s) | 0.25 | 2.00 ms |" in md
    assert "| mooncake |  | 2.00 GB/s | 6.00 GB/s |  | 0.50 | 1.50 ms |" in md
    assert "| load, 2 MiB blocks | 6.00 GB/s | 0.50 (target >= 0.8) |" in md
    assert (
        "| ping p50 / p99, one CPU | 30.0 / 60.0 us | 1.50 x the floor; target p50 <= 1.3 x |" in md
    )
    assert "client and server apart" not in md  # figures saved before the placements
    assert "| redis |  | not measured | redis-server is not installed |" in md
    assert "the GPU sweep did not run" in md and "seed 7" in md and "abc1234" in md


def test_the_blocking_rows_show_beside_the_targets_rows_without_a_target() -> None:
    """The data-path targets are measured as engines submit (one-way); the blocking
    API's 32 KiB figures print too, as a reference, with no target of their own."""
    r = dict(figures()["targets"], store_32x32k_blocking_gbps=2.4, load_32x32k_blocking_gbps=1.2)
    rows = {label: (value, ratio) for label, value, ratio in bench.cpu_rows(r)}
    assert rows["store, 32 x 32 KiB pages/block"] == ("3.00 GB/s", "0.25 (target >= 0.8)")
    assert rows["store, 32 x 32 KiB, blocking submits"] == ("2.40 GB/s", "0.20")
    assert rows["load, 32 x 32 KiB, blocking submits"] == ("1.20 GB/s", "0.10")
    # each against the best memcpy taken between its own repeats
    r["memcpy_window_gbps"] = {"32x32k": [10.0, 15.0], "32x32k_blocking": [10.0, 8.0]}
    rows = {label: (value, ratio) for label, value, ratio in bench.cpu_rows(r)}
    assert rows["store, 32 x 32 KiB, blocking submits"] == (
        "2.40 GB/s",
        "0.24 (memcpy then 10.00 GB/s)",
    )
    assert rows["load, 32 x 32 KiB pages/block"] == (
        "3.00 GB/s",
        "0.20 (target >= 0.8, memcpy then 15.00 GB/s)",
    )


class _KeysOf:
    """A namespace that keeps the keys each call names (for the sweep's operations)."""

    def __init__(self) -> None:
        self.client = self
        self.named: list[bytes] = []

    def ping(self) -> float:
        return 0.0

    def take_events(self) -> None:
        pass

    def prepare_store(self, keys: list[bytes]) -> None:
        self.named.extend(keys)

    def complete_store(self, keys: list[bytes], success: bool = True) -> None:
        self.named.extend(keys)


def test_the_control_sweeps_store_rounds_use_keys_of_the_stored_keys_length() -> None:
    """A namespace holds keys of one length (the first store fixes it): the sweep's
    store rounds name fresh keys as long as the keys its clients stored, all distinct."""
    from kvoffloadbench.bench_sweep import _ops

    ns = _KeysOf()
    keys = [b"c%03d-%08d" % (7, i) for i in range(16)]
    store_round = _ops(ns, 7, keys)["store_round16"]  # type: ignore[arg-type]
    for _ in range(3):
        store_round()
    assert {len(k) for k in ns.named} == {len(keys[0])}
    assert len(set(ns.named)) == 3 * 16
