"""``make bench-submit`` runs end to end (quick mode): every shape, with one cache and
with one cache per layer, plans contiguous runs from the lease pool."""

from __future__ import annotations

from kvoffloadbench.bench_submit import LAYERS, SIZES, run_submit, submit_table


def test_quick_run_covers_every_shape_and_renders() -> None:
    r = run_submit(quick=True)
    assert [(x["caches"], x["blocks"]) for x in r["rows"]] == [
        (c, n) for c in (1, LAYERS) for n in SIZES
    ]
    for row in r["rows"]:
        assert row["store"] > 0 and row["load-keys"] > 0 and row["load-slots"] > 0
        assert row["lease_run_blocks"] == row["blocks"]  # one run: slots were contiguous
    assert submit_table(r).count("\n") == 1 + len(r["rows"])
