"""``make bench-region``: the region coming up at node scale, per region size.

For each size (1, 4 and 16 GiB by default), in one run, one after the other (never
two regions at once: a 16 GiB region and its raw baseline would not both fit here):

- **raw**: the machine's own first touch of shared memory: a /dev/shm file of the same
  size populated by the same number of threads as the daemon uses (one
  ``MADV_POPULATE_WRITE`` per thread over its slice), just before and just after the
  measured daemon start; their mean is the rate the daemon's population is held to
  (DESIGN.md section 6: >= 0.8 of it);
- **timeline**: seconds from the daemon's start until it listens, until the first GiB
  is ready (populated, and pinned where it pins), until all of it is populated and,
  on a GPU machine, pinned; its populate rate, as it reports it;
- **stores**: store throughput (2 MiB blocks from a memfd cache) while the region is
  being populated and after;
- **warm restart**: a region 90% full of blocks, kept; seconds from the next daemon's
  start until it listens, until every block is found again, and until every block
  has been loaded once (its bytes checked on a sample).

``--daemon-path`` runs another checkout's daemon (its ``daemon`` and ``libclient`` on
the daemon's PYTHONPATH), so one bench measures before and after a change on the
same machine; ``--label`` names the run in the JSON (``docs/bench-region.json``),
which keeps the runs of other labels.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import threading
import time
import uuid
from typing import Any

import numpy as np

import kvoffload
from kvoffloadd.region import kernel

from .launch import BULK_STORES, DaemonProcess, drop_kept_region
from .machine import machine

GIB = 1 << 30
MIB = 1 << 20
BLOCK_BYTES = 2 * MIB
CACHE_BLOCKS = 64
BATCH_BLOCKS = 16
POLL_S = 0.02
DEADLINE_S = 600.0


def raw_first_touch_bps(nbytes: int, threads: int) -> float:
    """Bytes/s of ``threads`` threads populating a fresh /dev/shm file of ``nbytes``."""
    path = f"/dev/shm/kvo-bench-raw-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        base = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        per = -(-nbytes // threads // mmap.PAGESIZE) * mmap.PAGESIZE
        slices = [(base + off, min(per, nbytes - off)) for off in range(0, nbytes, per)]
        workers = [
            threading.Thread(target=kernel.madvise, args=(a, n, kernel.MADV_POPULATE_WRITE))
            for a, n in slices
        ]
        t0 = time.perf_counter()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        seconds = time.perf_counter() - t0
        del base
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return nbytes / seconds


def _ready(region: dict[str, Any]) -> int:
    return int(region.get("ready_bytes", region["prefaulted_bytes"]))


def _populated(region: dict[str, Any]) -> bool:
    if "populate_done" in region:
        return bool(region["populate_done"])
    return bool(region["prefaulted_bytes"] >= region["data_bytes"])


def _start(
    size: str, env: dict[str, str] | None, *args: str, **kw: Any
) -> tuple[DaemonProcess, float]:
    t0 = time.perf_counter()
    d = DaemonProcess(
        size,
        "--log-level",
        "warning",
        *args,
        start_timeout_s=120,
        env=env,
        settings=BULK_STORES,
        **kw,
    ).start()
    return d, time.perf_counter() - t0


def timeline(size: str, env: dict[str, str] | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    d, listen_s = _start(size, env)
    out: dict[str, Any] = {"listen_s": listen_s}
    try:
        client = kvoffload.connect(d.socket_path)
        end = t0 + DEADLINE_S
        while time.perf_counter() < end:
            st = client.stats()
            now = time.perf_counter() - t0
            region, gpu = st["region"], st["gpu"]
            if "first_gib_ready_s" not in out and _ready(region) >= min(GIB, region["data_bytes"]):
                out["first_gib_ready_s"] = now
            if "populated_s" not in out and _populated(region):
                out["populated_s"] = now
            pinning = gpu.get("enabled") and gpu.get("pin_target_bytes")
            if pinning and "pinned_s" not in out and gpu["pinned_bytes"] >= gpu["pin_target_bytes"]:
                out["pinned_s"] = now
            if "populated_s" in out and (not pinning or "pinned_s" in out or gpu["pin_error"]):
                break
            time.sleep(POLL_S)
        st = client.stats()
        region = st["region"]
        out["data_bytes"] = region["data_bytes"]
        out["threads"] = region.get("populate_threads", 1)
        own = region.get("populate_rate_bytes_per_s")
        external = region["data_bytes"] / max(1e-9, out["populated_s"] - listen_s)
        out["populate_rate_bps"] = own or external
        out["populate_rate_source"] = "daemon" if own else "external (listen to populated)"
        out["first_chunk_s"] = region.get("populate_first_chunk_s")
        out["numa"] = region.get("numa", "")
        if st["gpu"].get("enabled"):
            out["gpu"] = {k: v for k, v in st["gpu"].items() if k.startswith("pin")}
        client.close()
    finally:
        d.stop()
    return out


def _store_batch(ns: kvoffload.Namespace, w: kvoffload.Worker, keys: list[bytes], job: int) -> int:
    plan = ns.prepare_store(keys)
    assert plan is not None, ns.last_error
    ids = np.arange(len(keys)) % CACHE_BLOCKS
    assert w.submit_store(job, ids[: len(plan.slots)], plan.slots), w.last_error
    w.wait([job])
    assert all(r.success for r in w.get_finished())
    ns.complete_store(keys)
    return len(plan.slots) * BLOCK_BYTES


def stores_and_warm_restart(size: str, env: dict[str, str] | None) -> dict[str, Any]:
    layout = kvoffload.KVLayout(tensor_page_bytes=[BLOCK_BYTES])
    src = kvoffload.shared_kv_cache(CACHE_BLOCKS, BLOCK_BYTES)
    src.numpy()[:] = np.random.default_rng(7).integers(
        -128, 128, (CACHE_BLOCKS, BLOCK_BYTES), dtype=np.int8
    )
    d, _ = _start(size, env, "--keep-region")
    out: dict[str, Any] = {}
    job = 0
    try:
        client = kvoffload.connect(d.socket_path)
        ns = client.namespace("bench", layout)
        w = ns.attach_worker([src])
        n = 0

        def phase(stop: Any, seconds_cap: float) -> float | None:
            nonlocal job, n
            moved, t0 = 0, time.perf_counter()
            while not stop() and time.perf_counter() - t0 < seconds_cap:
                job += 1
                keys = [b"s%09d" % (n + i) for i in range(BATCH_BLOCKS)]
                n += BATCH_BLOCKS
                moved += _store_batch(ns, w, keys, job)
            seconds = time.perf_counter() - t0
            return moved / seconds if moved else None

        out["store_during_bps"] = phase(lambda: _populated(client.stats()["region"]), 300)
        while not _populated(client.stats()["region"]):
            time.sleep(POLL_S)
        out["store_after_bps"] = phase(lambda: False, 2.0)
        client.evict("bench")
        data_bytes = client.stats()["region"]["data_bytes"]
        fill = int(0.9 * data_bytes) // BLOCK_BYTES
        keys = [b"k%09d" % i for i in range(fill)]
        for a in range(0, fill, BATCH_BLOCKS):
            job += 1
            _store_batch(ns, w, keys[a : a + BATCH_BLOCKS], job)
        out["kept_blocks"] = fill
        w.close()
        client.close()
        out.update(_warm_restart(d, size, env, keys, src.numpy()))
    finally:
        if d.alive():
            d.stop()
        drop_kept_region(d.socket_path, d.instance)
    return out


def _warm_restart(
    d: DaemonProcess, size: str, env: dict[str, str] | None, keys: list[bytes], src: Any
) -> dict[str, Any]:
    """Stop ``d`` keeping its region; the next daemon's listen, every key found, every
    block loaded (sampled blocks byte-checked)."""
    assert d.stop() == 0
    t0 = time.perf_counter()
    d2, listen_s = _start(size, env, instance=d.instance, socket_path=d.socket_path)
    out: dict[str, Any] = {"warm_listen_s": listen_s}
    try:
        client = kvoffload.connect(d2.socket_path)
        ns = client.namespace("bench", kvoffload.KVLayout(tensor_page_bytes=[BLOCK_BYTES]))
        found = 0
        for a in range(0, len(keys), 1024):
            part = keys[a : a + 1024]
            while (hit := ns.lookup(part)) is None:
                time.sleep(POLL_S)
            found += hit
        out["warm_all_found_s"] = time.perf_counter() - t0
        out["warm_found_blocks"] = found
        dst = kvoffload.shared_kv_cache(BATCH_BLOCKS, BLOCK_BYTES)
        w = ns.attach_worker([dst])
        for job, a in enumerate(range(0, found, BATCH_BLOCKS), start=1):
            part = keys[a : a + BATCH_BLOCKS]
            plan = ns.prepare_load(part)
            assert w.submit_load(job, plan.slots, np.arange(len(part))), w.last_error
            w.wait([job])
            assert all(r.success for r in w.get_finished())
            ns.complete_load(part)
            if a % (64 * BATCH_BLOCKS) == 0:
                assert np.array_equal(dst.numpy()[0], src[a % CACHE_BLOCKS]), part[0]
        out["warm_all_loaded_s"] = time.perf_counter() - t0
        region = client.stats()["region"]
        out["warm_resident_at_start_bytes"] = region.get("resident_at_start_bytes")
        w.close()
        client.close()
    finally:
        d2.stop()
    return out


def run(sizes: list[str], daemon_path: str | None) -> dict[str, Any]:
    env = None
    if daemon_path:
        parts = [os.path.join(daemon_path, p) for p in ("daemon", "libclient")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(parts))
    rows = []
    for size in sizes:
        row: dict[str, Any] = {"size": size}
        # the raw rate just before and just after the daemon's, with its threads: other
        # work on the machine moves both, and their mean is the baseline
        first = timeline(size, env)
        raw = [raw_first_touch_bps(first["data_bytes"], first["threads"])]
        row.update(timeline(size, env))
        raw.append(raw_first_touch_bps(row["data_bytes"], row["threads"]))
        row["raw_first_touch_samples_bps"] = raw
        row["raw_first_touch_bps"] = sum(raw) / len(raw)
        row["populate_vs_raw"] = row["populate_rate_bps"] / row["raw_first_touch_bps"]
        row.update(stores_and_warm_restart(size, env))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"machine": machine(), "daemon_commit": _commit(daemon_path), "sizes": rows}


def _commit(path: str | None) -> str:
    """The commit of the daemon that ran (this checkout's without --daemon-path)."""
    try:
        return subprocess.run(
            ["git", "-C", path or ".", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def table(r: dict[str, Any]) -> str:
    lines = [
        "| region | threads | listen | first GiB ready | populated | pinned | populate GiB/s "
        "| raw GiB/s | ratio | stores during / after GiB/s | warm: listen, all found, "
        "all loaded |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines.extend(
        f"| {x['size']} | {x['threads']} | {_s(x['listen_s'])} | "
        f"{_s(x.get('first_gib_ready_s'))} | {_s(x.get('populated_s'))} | "
        f"{_s(x.get('pinned_s'))} | {_g(x['populate_rate_bps'])} | "
        f"{_g(x['raw_first_touch_bps'])} | {x['populate_vs_raw']:.2f} | "
        f"{_g(x.get('store_during_bps'))} / {_g(x.get('store_after_bps'))} | "
        f"{_s(x['warm_listen_s'])}, {_s(x['warm_all_found_s'])}, "
        f"{_s(x['warm_all_loaded_s'])} |"
        for x in r["sizes"]
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1GiB,4GiB,16GiB", help="region sizes, comma-separated")
    p.add_argument("--json", default="docs/bench-region.json", help="results file")
    p.add_argument("--label", default="after", help="this run's name in the results file")
    p.add_argument("--daemon-path", help="a checkout whose daemon to run (before a change)")
    args = p.parse_args(argv)
    result = run(args.sizes.split(","), args.daemon_path)
    print(table(result))
    runs: dict[str, Any] = {}
    if os.path.exists(args.json):
        with open(args.json) as f:
            runs = json.load(f).get("runs", {})
    runs[args.label] = result
    with open(args.json, "w") as f:
        json.dump({"runs": runs}, f, indent=1, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
