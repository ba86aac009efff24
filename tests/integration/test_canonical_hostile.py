"""Canonical mappings from another local user: a uid that may open a namespace
registers fragments that reach outside its pages. It is refused, the daemon keeps
serving, and nobody else's blocks change."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from hostile import NOBODY, as_uid, requires_root

import kvoffload
from kvoffload.datapath.canonical import CanonicalPart
from kvoffload.protocol.errors import InvalidArgumentError
from kvoffloadbench.launch import DaemonProcess

PAGE = 4096


def frags(*rows: tuple[int, int, int]) -> np.ndarray:
    return np.asarray(rows, dtype=np.int64)


def test_another_uids_bad_canonical_mappings_are_refused_and_harm_nobody() -> None:
    requires_root()
    run = Path(tempfile.mkdtemp(prefix="kvoffload-canon-"))  # reachable by other uids
    run.chmod(0o755)
    sock = str(run / "k.sock")
    with DaemonProcess("32MiB", "--log-level", "warning", socket_path=sock) as d:
        owner = kvoffload.connect(sock)
        ns = owner.namespace("mine", kvoffload.KVLayout(tensor_page_bytes=[PAGE]))
        src = kvoffload.shared_kv_cache(8, PAGE)
        src.copy_(torch.randint(-128, 128, (8, PAGE), dtype=torch.int8))
        w = ns.attach_worker([src])
        keys = [b"mine-%04d" % i for i in range(4)]
        plan = ns.prepare_store(keys)
        assert plan is not None and w.submit_store(1, np.arange(4), plan.slots)
        w.wait([1])
        assert all(r.success for r in w.get_finished())
        ns.complete_store(keys)
        before = src[:4].clone()

        def evil() -> list[str]:
            c = kvoffload.connect(sock)
            theirs = c.namespace("theirs", kvoffload.KVLayout(tensor_page_bytes=[2 * PAGE]))
            cache = kvoffload.shared_kv_cache(8, PAGE)
            refused = []
            for bad in (
                CanonicalPart(2 * PAGE, frags((0, 2 * PAGE - 8, 64))),  # past its page
                CanonicalPart(2 * PAGE, frags((0, 0, 64 * PAGE))),  # past its cache row
                CanonicalPart(2 * PAGE, frags((0, 0, PAGE)), 3, 0),  # more writers than parts
            ):
                try:
                    theirs.attach_worker([cache], rank=0, canonical=[bad], parts=2)
                except InvalidArgumentError as exc:
                    refused.append(str(exc))
            ok = theirs.attach_worker(
                [cache],
                rank=1,
                canonical=[CanonicalPart(2 * PAGE, frags((0, PAGE, PAGE)))],
                parts=2,
            )
            ok.close()
            c.close()
            return refused

        refused = as_uid(evil, NOBODY, gid=0)  # gid 0 reaches the 0660 socket
        assert len(refused) == 3 and "outside" in refused[0] and "writer" in refused[2]
        assert d.alive() and ns.lookup(keys) == 4
        out = kvoffload.shared_kv_cache(8, PAGE)
        reader = ns.attach_worker([out])
        load = ns.prepare_load(keys)
        assert reader.submit_load(2, load.slots, np.arange(4))
        reader.wait([2])
        assert all(r.success for r in reader.get_finished())
        ns.complete_load(keys)
        assert torch.equal(out[:4], before)  # nobody's bytes moved
        reader.close()
        w.close()
        owner.close()
        assert d.stop() == 0
    shutil.rmtree(run, ignore_errors=True)
