"""Small helpers shared by the integration tests."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

import kvoffload


def ctl(sock: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run kvoffloadctl against a daemon socket."""
    return subprocess.run(
        [sys.executable, "-m", "kvoffloadctl", "--socket", sock, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def store_blocks(
    client: kvoffload.Client, ns_name: str, keys: list[bytes], page_bytes: int = 4096
) -> tuple[kvoffload.Namespace, kvoffload.Worker]:
    """Open a one-tensor namespace and store ``keys`` from engine blocks 0.. (job 1)."""
    ns = client.namespace(ns_name, kvoffload.KVLayout(tensor_page_bytes=[page_bytes]))
    w = ns.attach_worker([kvoffload.shared_kv_cache(max(8, len(keys)), page_bytes)])
    plan = ns.prepare_store(keys)
    assert plan is not None
    assert w.submit_store(1, np.arange(len(keys)), plan.slots), w.last_error
    w.wait([1])
    assert [r.success for r in w.get_finished()] == [True]
    ns.complete_store(keys)
    return ns, w


def poll(predicate: Callable[[], object], what: str, deadline_s: float = 30.0) -> None:
    """Wait for ``predicate`` to hold, failing after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
