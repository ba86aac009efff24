"""The daemon on the Python stand-ins of its C paths (the copy loop, the key set, the
Block, the slot record writer), as where no C compiler was at install: it says so at start and
serves stores, lookups and probes as it does with them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

import kvoffload
from kvoffload.protocol.messages import KEY_ABSENT, KEY_READY
from kvoffloadbench.launch import DaemonProcess

PAGE = 16 * 1024
LAYOUT = kvoffload.KVLayout(tensor_page_bytes=[PAGE], model="m", kv_dtype="bf16")


def test_without_the_c_paths_it_says_so_and_serves_the_same(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        KVOFFLOAD_NO_NATIVE_INDEX="1",
        KVOFFLOAD_NO_NATIVE_COPY="1",
        KVOFFLOAD_NO_NATIVE_JOURNAL="1",
    )
    log = tmp_path / "kvoffloadd.log"
    with DaemonProcess("64MiB", "--log-level", "info", env=env, log_path=str(log)) as d:
        client = kvoffload.connect(d.socket_path)
        try:
            ns = client.namespace("py", LAYOUT)
            cache = kvoffload.shared_kv_cache(64, PAGE)
            data = cache.numpy().view(np.uint8).reshape(64, PAGE)
            data[:32] = np.random.default_rng(1).integers(0, 256, (32, PAGE), dtype=np.uint8)
            w = ns.attach_worker([cache])
            keys = [b"py-%08d" % i for i in range(32)]
            stored = keys[:10] + keys[11:]  # key 10 is never stored
            plan = ns.prepare_store(stored)
            assert plan is not None
            w.submit_store(1, np.array([keys.index(k) for k in stored]), plan.slots)
            w.wait([1])
            assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
            ns.complete_store(stored)
            assert ns.lookup(keys) == 10
            assert ns.lookup(stored) == len(stored)
            assert ns.lookup([keys[10], keys[0]]) == 0
            assert ns.probe(keys[8:13]) == [KEY_READY, KEY_READY, KEY_ABSENT]
            load = ns.prepare_load(keys[:10])  # back into blocks 32..41, byte for byte
            w.submit_load(2, load.slots, np.arange(32, 42))
            w.wait([2])
            assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, True)]
            ns.complete_load(keys[:10])
            assert np.array_equal(data[32:42], data[:10])
            assert client.evict("py", keys[:2]) == 2  # the keys leave the set
            assert ns.lookup(keys) == 0 and ns.lookup(keys[2:10]) == 8
        finally:
            client.close()
        assert d.stop() == 0
    text = log.read_text()
    assert "the C key set is turned off (KVOFFLOAD_NO_NATIVE_INDEX)" in text, text
    assert "the C Block is turned off (KVOFFLOAD_NO_NATIVE_INDEX)" in text, text
    assert "the C copy loop is turned off (KVOFFLOAD_NO_NATIVE_COPY)" in text, text
    assert "the C slot record writer is turned off (KVOFFLOAD_NO_NATIVE_JOURNAL)" in text, text
