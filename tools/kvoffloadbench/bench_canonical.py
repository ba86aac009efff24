"""``make bench-canonical``: what one offloaded block costs in the region and in copies,
per-rank pages against vLLM's canonical pages, for each TP size.

Engines come from vLLM 0.33's own config derivation (canonical_rig.py): a GQA model
(4 KV heads) at TP 1, 2 and 4 and an MLA model at TP 2 and 4. Each engine stores 16
blocks through a real daemon; the figures are the daemon's own: region bytes per
stored block (its slot: the block rounded up to 4 KiB pages) and bytes copied per
stored block (all ranks together).

    python -m kvoffloadbench.bench_canonical [--json FILE]   (in the vLLM virtualenv)
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext, make_offload_key

import kvoffload

from .canonical_rig import Rank
from .launch import DaemonProcess

BLOCKS = 16
CTX = ReqContext(req_id="bench")


def measure(model: str, tp: int, canonical: bool) -> dict[str, Any]:
    # Page-sized slots: the tiny models' blocks are a few KiB (16 KiB would round them up).
    with DaemonProcess("64MiB", "--log-level", "warning", settings={"min_slot_size": 4096}) as d:
        ranks = [Rank(model, tp, r, d.socket_path, "bench", canonical=canonical) for r in range(tp)]
        mgr = ranks[0].spec.get_manager()
        keys = [make_offload_key(b"b%d" % i, 0) for i in range(BLOCKS)]
        out = mgr.prepare_store(keys, CTX)
        assert out is not None
        gpu = GPULoadStoreSpec(list(range(BLOCKS)), [BLOCKS], [0])
        for r in ranks:
            assert r.worker.submit_store(1, gpu, out.store_spec)
        for r in ranks:
            r.worker.wait({1})
            r.worker.get_finished()
        with kvoffload.connect(d.socket_path) as c:
            stats = c.stats()
        (ns,) = stats["namespaces"].values()
        page = ranks[0].offloading.worker_kv_bytes_per_block
        block = ranks[0].spec.layout.block_bytes
        for r in ranks:
            r.shutdown()
    return {
        "model": model,
        "tp": tp,
        "layout": "canonical" if canonical else "per-rank",
        "rank_page_bytes": page,
        "block_bytes": block,
        "region_bytes_per_block": ns["slot_bytes"],
        "copied_bytes_per_block": stats["copies"]["stored_bytes_total"] // BLOCKS,
    }


def run() -> list[dict[str, Any]]:
    return [
        measure(model, tp, canonical)
        for model, tps in (("gqa", (1, 2, 4)), ("mla", (2, 4)))
        for tp in tps
        for canonical in (False, True)
    ]


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| model | TP | layout | one rank's page | block | region bytes / block (slot) "
        "| copied bytes / block |",
        "|---|---|---|---|---|---|---|",
    ]
    out.extend(
        f"| {x['model']} | {x['tp']} | {x['layout']} | {x['rank_page_bytes']} | "
        f"{x['block_bytes']} | {x['region_bytes_per_block']} | {x['copied_bytes_per_block']} |"
        for x in rows
    )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    rows = run()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
