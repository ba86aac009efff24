"""``make bench-report``: run every benchmark and write docs/benchmarks.md with plots.

    python -m kvoffloadbench.bench_report [--quick] [--out docs] [--from-json FILE]

The report holds the machine, the commit, the exact commands, one table per benchmark
and PNG plots (matplotlib, the ``bench`` extra). The raw figures go to
``benchmarks.json`` beside it, and ``--from-json`` re-renders a report from them
without measuring again. Every figure is taken in this one run on this one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from .bench import cpu_rows
from .bench import run as run_targets
from .bench_gpu import cuda_available, gpu_sweep
from .bench_sweep import BATCHES, CLIENTS, PAGES, control_path, datapath_sweep, index_scale, startup
from .bench_trace import run_trace
from .machine import machine

GIB, MIB, KIB = 1 << 30, 1 << 20, 1 << 10


def measure(quick: bool) -> dict[str, Any]:
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("targets", lambda: run_targets(quick)),
        ("trace", lambda: run_trace(quick)),
        ("datapath", lambda: datapath_sweep(quick)),
        ("control", lambda: control_path(quick)),
        ("startup", lambda: startup(quick)),
        ("index", lambda: index_scale(quick)),
    ]
    if cuda_available():
        steps.append(("gpu_datapath", lambda: gpu_sweep(quick, PAGES, BATCHES)))
    r: dict[str, Any] = {"machine": machine(), "quick": quick}
    for name, fn in steps:
        t0 = time.perf_counter()
        print(f"bench-report: {name} ...", flush=True)
        r[name] = fn()
        print(f"bench-report: {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
    return r


def size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def plots(r: dict[str, Any], out_dir: str) -> list[str]:
    """PNG plots; none (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    img = os.path.join(out_dir, "img")
    os.makedirs(img, exist_ok=True)
    made = []

    rows = r["trace"]["rows"]
    ns = sorted({x["engines"] for x in rows})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, pool in enumerate(("shared", "private")):
        vals = [
            next(x["hit_rate"] for x in rows if x["engines"] == n and x["pool"] == pool) for n in ns
        ]
        ax.bar([j + i * 0.38 for j in range(len(ns))], vals, 0.38, label=f"{pool} pool")
    ax.set_xticks([j + 0.19 for j in range(len(ns))], [f"{n} engines" for n in ns])
    ax.set_ylabel("prompt tokens served from CPU")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("Same trace, same total CPU memory")
    made.append(_save(fig, img, "trace_hit_rate.png"))

    for key, base_key, title, fname in (
        ("datapath", "memcpy_gbps", "CPU data path (memcpy = 1.0)", "datapath_cpu.png"),
        (
            "gpu_datapath",
            "pinned_h2d_gbps",
            "GPU data path (pinned copy = 1.0)",
            "datapath_gpu.png",
        ),
    ):
        if key not in r:
            continue
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for i, batch in enumerate(BATCHES):
            pts = [x for x in r[key] if x["batch_blocks"] == batch]
            xs = [x["page_bytes"] / KIB for x in pts]
            base = [x[base_key] for x in pts]
            st = [x["store_gbps"] / b for x, b in zip(pts, base)]
            ld = [x["load_gbps"] / b for x, b in zip(pts, base)]
            ax.plot(xs, st, "o-", color=f"C{i}", label=f"store, {batch} blocks/job")
            ax.plot(xs, ld, "s--", color=f"C{i}", label=f"load, {batch} blocks/job")
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks([p / KIB for p in PAGES], [size(p) for p in PAGES])
        ax.set_xlabel("block size")
        ax.set_ylabel("throughput / baseline")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.legend(fontsize=7, ncol=2)
        ax.set_title(title)
        made.append(_save(fig, img, fname))

    fig, ax = plt.subplots(figsize=(6, 3.8))
    ops = sorted({x["op"] for x in r["control"]}, key=[x["op"] for x in r["control"]].index)
    for op in ops:
        pts = [x for x in r["control"] if x["op"] == op]
        ax.plot([x["clients"] for x in pts], [x["p50_us"] for x in pts], "o-", label=op)
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(list(CLIENTS), [str(c) for c in CLIENTS])
    ax.set_yscale("log")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("p50 round trip (µs)")
    ax.legend(fontsize=7)
    ax.set_title("Control path under concurrency")
    made.append(_save(fig, img, "control_p50.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    pts = r["index"]
    ax.plot([x["blocks"] for x in pts], [x["lookup1000_p50_us"] for x in pts], "o-")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("blocks stored in the namespace")
    ax.set_ylabel("lookup of 1,000 keys, p50 (µs)")
    ax.set_title("Lookup cost as the index grows")
    made.append(_save(fig, img, "lookup_scale.png"))
    return made


def _save(fig: Any, img: str, name: str) -> str:
    fig.tight_layout()
    fig.savefig(os.path.join(img, name), dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return f"img/{name}"


def mac_line(tr: dict[str, Any]) -> str:
    """The MAC's share of a promotion's work, in this run's figures."""
    if "copy_mac_gbps" not in tr:
        return "not measured."
    both, base = tr["copy_mac_gbps"], tr["memcpy_gbps"]
    return (
        f"on one thread, copy + MAC ran at {both:.2f} GB/s here, {both / base:.2f} of "
        "memcpy: each CPU the promotion has to itself adds at most that much."
    )


def tier_table(tr: dict[str, Any]) -> list[list[str]]:
    """One row per tier and thread count (older figures: one row per tier)."""
    base = tr["memcpy_gbps"]
    rows = []
    for kind in ("disk", "redis", "mooncake"):
        runs = tr.get(kind)
        if runs is None and f"{kind}_promote_gbps" in tr:  # figures from before tier_threads
            runs = [{k: tr[f"{kind}_{k}"] for k in ("cascade_gbps", "promote_gbps")}]
            runs[0]["one_block_ms"] = tr.get(f"{kind}_one_block_ms", 0.0)
        if runs is None:
            rows.append([kind, "", "not measured", tr.get(f"{kind}_skipped", ""), "", "", ""])
            continue
        for x in runs:
            same = x.get("same_threads_ratio")
            rows.append(
                [
                    kind,
                    str(x.get("threads", "")),
                    f"{x['cascade_gbps']:.2f} GB/s",
                    f"{x['promote_gbps']:.2f} GB/s",
                    "" if same is None else f"{same:.2f} (of {x['copy_mac_gbps']:.2f} GB/s)",
                    f"{x['promote_gbps'] / base:.2f}",
                    f"{x['one_block_ms']:.2f} ms",
                ]
            )
    return rows


def render(r: dict[str, Any], images: list[str]) -> str:
    m = r["machine"]
    out = [
        "# kvoffload benchmarks",
        "",
        "Written by `make bench-report` (`python -m kvoffloadbench.bench_report`); every figure "
        "below comes from that one run. Raw figures: `benchmarks.json`. Regenerate on your "
        "machine with `make bench-report`; `make bench` runs the short DESIGN.md target check.",
        "",
        table(["machine", ""], [[k, str(v)] for k, v in m.items()]),
        "",
    ]
    if r.get("quick"):
        out += ["*Quick run (`--quick`): fewer requests, smaller sizes, fewer repeats.*", ""]

    out += [
        "## DESIGN.md targets (`make bench`)",
        "",
        "The figures `make bench` prints, against the targets of DESIGN.md section 6: "
        "CPU data path against a same-run single-threaded memcpy (jobs submitted one-way, "
        "as an engine's worker submits them; the blocking API's rows for reference), "
        "control path through the daemon's socket, the vLLM key-mirror lookup, index "
        "memory.",
        "",
        table(["figure", "value", "ratio / target"], [list(x) for x in cpu_rows(r["targets"])]),
        "",
    ]
    t = r["trace"]["trace"]
    out += [
        "## Shared pool against private pools",
        "",
        f"A synthetic chat trace (`kvoffloadbench/trace.py`, seed {t['seed']}): "
        f"{t['conversations']} conversations over {t['system_prompts']} system prompts "
        "(Zipf popularity, s = 1.1), Zipf-distributed turns (s = 1.2, up to 12), each turn "
        f"resending its whole history: {t['requests']} requests, {t['unique_blocks']} distinct "
        f"blocks of {t['tokens_per_block']} tokens ({size(t['block_bytes'])} each). Requests "
        "go to a random engine. Each engine process looks its prompt up, loads the hits and "
        "stores the rest, as vLLM's connector does. Both set-ups get "
        f"{t['total_pool_mib']} MiB of CPU memory in total: one kvoffloadd shared by all "
        "engines, or one kvoffloadd per engine with 1/N each. Requests run in trace order, "
        "so the figures are the same on every run with this seed. The shared pool's hit "
        "rate does not depend on N (every engine finds every block); private pools split "
        "both the memory and the traffic, so each holds 1/N of the blocks and a request "
        "finds only what its own engine stored. A mean copy run is the pages the "
        "daemon's copy planner merged into one copy (contiguous engine blocks into "
        "contiguous slots).",
        "",
        table(
            [
                "engines",
                "pool",
                "CPU memory",
                "hit tokens",
                "prompt tokens",
                "hit rate",
                "loaded",
                "stored",
                "mean copy run",
            ],
            [
                [
                    str(x["engines"]),
                    x["pool"],
                    size(x["pool_bytes"]),
                    f"{x['hit_tokens']:,}",
                    f"{x['prompt_tokens']:,}",
                    f"{x['hit_rate']:.1%}",
                    f"{x['bytes_loaded'] / GIB:.2f} GiB",
                    f"{x['bytes_stored'] / GIB:.2f} GiB",
                    f"{x.get('mean_run_pages', 0.0):.1f} pages",
                ]
                for x in r["trace"]["rows"]
            ],
        ),
        "",
    ]
    out += _img(images, "trace_hit_rate.png")

    out += [
        "## Data path against memcpy",
        "",
        "Store (engine cache to region) and load (region to engine cache) of one-page "
        "blocks, memfd caches copied by the daemon (two copier threads), against the best "
        "single-threaded memcpy of this run (of the same total bytes, and of 384 MiB). "
        "Best of several repeats. A job is one `submit_store`/`submit_load` round trip; "
        "its fixed cost (round trip, validation, completion) dominates small jobs, so "
        "engines should batch: vLLM submits one job per scheduler step and direction.",
        "",
        _datapath_table(r["datapath"], "memcpy_gbps", "memcpy_gbps"),
        "",
    ]
    out += _img(images, "datapath_cpu.png")
    if "gpu_datapath" in r:
        out += [
            "GPU: CUDA caches exported by IPC, against one large pinned `cudaMemcpyAsync` "
            "per direction in the same run.",
            "",
            _datapath_table(r["gpu_datapath"], "pinned_d2h_gbps", "pinned_h2d_gbps"),
            "",
        ]
        out += _img(images, "datapath_gpu.png")
    else:
        out += ["No CUDA device on this machine: the GPU sweep did not run.", ""]

    out += [
        "## Control path",
        "",
        "Round trips of each scheduler operation on 16 keys, from 1, 4 and 16 client "
        "processes at once, each in a closed loop. `touch16` does not wait for its reply: "
        "the client reads the replies in batches once 64 are unanswered, so its p50 is the "
        "client's cost and its rate the daemon's.",
        "",
        table(
            ["operation", "clients", "p50", "p99", "ops/s"],
            [
                [
                    x["op"],
                    str(x["clients"]),
                    f"{x['p50_us']:.1f} µs",
                    f"{x['p99_us']:.1f} µs",
                    f"{x['ops_per_s']:,.0f}",
                ]
                for x in r["control"]
            ],
        ),
        "",
    ]
    out += _img(images, "control_p50.png")

    out += [
        "## Scale",
        "",
        "Start-up: until the daemon listens, and until its region is pre-faulted (it "
        "serves meanwhile); the daemon's own memory (RssAnon, the region not counted).",
        "",
        table(
            ["region", "listening after", "pre-faulted after", "daemon memory"],
            [
                [
                    f"{x['region_gib']} GiB",
                    f"{x['listen_s']:.2f} s",
                    f"{x['prefaulted_s']:.2f} s",
                    f"{x['daemon_anon_bytes'] / MIB:.0f} MiB",
                ]
                for x in r["startup"]
            ],
        ),
        "",
        "Index memory per stored block and the cost of one 1,000-key lookup (the index "
        "alone, in process; a round trip adds the control-path figures above):",
        "",
        table(
            ["stored blocks", "index memory per block", "lookup 1,000 keys p50", "p99"],
            [
                [
                    f"{x['blocks']:,}",
                    f"{x['index_bytes_per_block']:.0f} B",
                    f"{x['lookup1000_p50_us']:.1f} µs",
                    f"{x['lookup1000_p99_us']:.1f} µs",
                ]
                for x in r["index"]
            ],
        ),
        "",
    ]
    out += _img(images, "lookup_scale.png")

    tr = r["targets"]  # make bench measures the tiers too
    out += [
        "## Secondary tiers",
        "",
        f"{tr['tier_blocks']} blocks of {size(tr['tier_block_bytes'])} cascade from the "
        "region to the tier, then are evicted from the region and promoted back by one "
        "lookup, on 1 and then 2 promotion threads per tier (`tier_threads`); then single "
        "blocks are evicted and looked up again (one block's promotion: from the lookup "
        "that starts it to the one that hits). Disk files are in the page cache (just "
        "written); Redis and Mooncake Store (TCP) run on loopback. Every block is sealed "
        "on its way down and its keyed MAC (BLAKE3) verified on its way up. Each promotion "
        "is set against the machine's own copy+MAC rate on as many threads, measured "
        "around it in the same run (target >= 0.8 for disk and Mooncake), and against "
        "memcpy (targets: >= 0.5 for disk and Mooncake where >= 4 cores are free, >= 0.1 "
        f"for Redis). A promotion copies and hashes every byte: {mac_line(tr)}",
        "",
        table(
            [
                "tier",
                "tier_threads",
                "cascade",
                "promotion",
                "promotion / copy+MAC, same threads",
                "promotion / memcpy",
                "one block",
            ],
            tier_table(tr),
        ),
        "",
        *engine_section(r.get("engine")),
        *sglang_section(r.get("sglang")),
        "## Commands",
        "",
        "```",
        "make bench-report            # this report (add ARGS=--quick for a short run)",
        "make bench                   # the DESIGN.md section 6 targets",
        "make bench-engine            # vLLM's scheduler step (its own virtualenv)",
        "make bench-sglang            # SGLang HiCache L3 backends (their own virtualenv)",
        "make bench-submit            # the daemon loop's time per submitted block",
        "make bench-canonical         # bytes per block, per-rank and canonical vLLM pages",
        "```",
        "",
    ]
    return "\n".join(out)


def _datapath_table(rows: list[dict[str, Any]], store_base: str, load_base: str) -> str:
    return table(
        ["block", "blocks/job", "store", "store / base", "load", "load / base"],
        [
            [
                size(x["page_bytes"]),
                str(x["batch_blocks"]),
                f"{x['store_gbps']:.2f} GB/s",
                f"{x['store_gbps'] / x[store_base]:.2f}",
                f"{x['load_gbps']:.2f} GB/s",
                f"{x['load_gbps'] / x[load_base]:.2f}",
            ]
            for x in rows
        ],
    )


def engine_section(e: dict[str, Any] | None) -> list[str]:
    """``make bench-engine``'s figures (taken in the vLLM virtualenv), if saved."""
    if not e:
        return []
    from kvoffloadbench.bench_engine import render as render_engine

    return [
        "## Engine step cost (`make bench-engine`)",
        "",
        "vLLM 0.33's real `Scheduler` and `OffloadingConnector`, N decoding requests, "
        "block_size 16; engine-side step time is `schedule()` + `update_from_output()`. "
        "(1) no connector, (2) vLLM's own CPU offloading manager (its worker completes at "
        "once), (3) kvoffload with its worker copying in the engine's process, while a "
        "second engine process stores in the same namespace; in blocks of "
        f"{e.get('block', '?')} timed steps per configuration (each block after untimed "
        f"settling steps), {e.get('passes', '?')} passes, the first of a pass rotating. "
        "Target: (3)/(2) <= 1.10 at p50 and <= 1.3 at p99, and no blocking round trip in "
        "a step. Taken separately from the figures above: "
        f"{e.get('machine', {}).get('date', '?')}, commit "
        f"{e.get('machine', {}).get('commit', '?')}.",
        "",
        render_engine(e),
        "",
    ]


def sglang_section(e: dict[str, Any] | None) -> list[str]:
    """``make bench-sglang``'s figures (taken in the SGLang virtualenv), if saved."""
    if not e:
        return []
    from kvoffloadbench.bench_sglang import render as render_sglang

    return [
        "## SGLang HiCache L3 (`make bench-sglang`)",
        "",
        "SGLang 0.5.23's own `HiCacheController` and host pool drive each L3 backend: "
        "backup (`write_storage` to its ack) and prefetch (hit query, then "
        "`prefetch_buffer` to its ack, bytes checked) of one batch; GB/s over the "
        "backend call's own time, rounds interleaved across backends, each prefetch "
        "against a memcpy of the same bytes taken just before it. kvoffload with the "
        "`shm` host pool (the daemon copies through its own mapping of the pool's memfd, "
        "a guarded copy) and with the default pool (the client copies through its "
        "mapping of the region); SGLang's `file` backend on "
        "tmpfs; its `mooncake` backend with a local `mooncake_master` (TCP). Target: "
        "kvoffload's prefetch >= 0.5 of memcpy and faster than both; `batch_exists` of "
        "128 pages <= 100 us. Taken separately from the figures above: "
        f"{e.get('machine', {}).get('date', '?')}, commit "
        f"{e.get('machine', {}).get('commit', '?')}.",
        "",
        render_sglang(e),
        "",
    ]


def _img(images: list[str], name: str) -> list[str]:
    path = f"img/{name}"
    return [f"![{name}]({path})", ""] if path in images else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvoffloadbench.bench_report")
    p.add_argument("--quick", action="store_true", help="fewer requests and repeats")
    p.add_argument("--out", default="docs", help="directory for benchmarks.md and img/")
    p.add_argument("--from-json", help="render from saved figures instead of measuring")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.from_json:
        with open(args.from_json) as f:
            r = json.load(f)
    else:
        r = measure(args.quick)
        with open(os.path.join(args.out, "benchmarks.json"), "w") as f:
            json.dump(r, f, indent=1)
    engine_json = os.path.join(args.out, "bench-engine.json")  # make bench-engine's
    if os.path.exists(engine_json):
        with open(engine_json) as f:
            r["engine"] = json.load(f)
    sglang_json = os.path.join(args.out, "bench-sglang.json")  # make bench-sglang's
    if os.path.exists(sglang_json):
        with open(sglang_json) as f:
            r["sglang"] = json.load(f)
    images = plots(r, args.out)
    if not images:
        print("matplotlib is not installed: no plots (pip install 'kvoffload[bench]')")
    with open(os.path.join(args.out, "benchmarks.md"), "w") as f:
        f.write(render(r, images))
    print(f"wrote {os.path.join(args.out, 'benchmarks.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
