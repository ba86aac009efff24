"""The one case that stops an engine, and the restart that avoids it.

A worker the daemon does not trust with the region (its uid is not in
``client_copy_uids``) cannot copy a planned load itself. If the daemon dies after
vLLM planned the load, the worker waits for a daemon to come back, at most
``load_wait_s``: a warm restart keeps the blocks, and the load is resubmitted by key
and completes byte-exact. A daemon that stays away, or comes back without the blocks,
stops the engine with ``LoadLostError`` — vLLM cannot continue a request whose KV
was not loaded, and must never compute with it.
"""

from __future__ import annotations

import os
import random
import tempfile
import uuid
from pathlib import Path

import pytest
from engine_proc import EngineError, EngineProc

import kvoffload
from kvoffloadbench.launch import DaemonProcess, drop_kept_region

pytestmark = pytest.mark.integration

UNTRUSTING = "client_copy_uids = [65534]\n"  # root may not map the region


def test_an_untrusted_worker_resubmits_after_a_warm_restart_or_stops_with_one_error(
    tmp_path: Path,
) -> None:
    instance = f"ll{uuid.uuid4().hex[:8]}"
    sock = os.path.join(tempfile.mkdtemp(prefix="kvoffload-"), "kvoffloadd.sock")
    config = tmp_path / "untrusting.toml"
    config.write_text(UNTRUSTING)

    def daemon() -> DaemonProcess:
        args = ("--config", str(config), "--keep-region", "--log-level", "warning")
        return DaemonProcess("64MiB", *args, socket_path=sock, instance=instance).start()

    rng = random.Random(7)
    p = [rng.randrange(1, 999) for _ in range(6 * 16 + 5)]
    d = daemon()
    e = EngineProc(
        spec="kvoffload",
        socket_path=sock,
        engine_id="c",
        memfd=True,  # daemon copies: the only mode an untrusted uid has
        num_blocks=512,
        extra={"load_wait_s": 3.0},
    )
    try:
        e.ready()
        e.connected()
        e.add(("c1", p, 4))
        e.run()
        with kvoffload.connect(sock) as admin:
            e.sees(int(admin.stats()["blocks"]["used_blocks"]))
        assert e.call("reset_prefix_cache")  # forget the GPU copy: the next one loads

        e.add(("c2", p, 4))
        while not e.schedule()["loads"]:
            e.execute()
        d.kill()
        d = daemon()  # warm: the region and its blocks are kept
        e.execute()  # the load waits for the daemon, then goes to it by key
        e.run()
        st = e.stats()
        assert st["bad_blocks"] == 0 and st["loads"] >= 1 and st["unfinished"] == 0

        assert e.call("reset_prefix_cache")
        e.add(("c3", p, 4))
        while not e.schedule()["loads"]:
            e.execute()
        d.kill()  # and it never comes back
        e.execute()  # vLLM's submit succeeds; the result call stops the engine
        with pytest.raises(EngineError) as lost:
            e.run()
        assert lost.value.kind == "LoadLostError"
        assert "kvoffloadd stayed away for 3.0 s" in str(lost.value)
        assert "cannot complete" in str(lost.value)
    finally:
        e.close()
        if d.alive():
            d.kill()
        drop_kept_region(sock, instance)
