"""Keys of two lengths in one namespace: found while writing issue 35's tests, not one
of its findings.

A namespace's keys need not all have one length (a vLLM and an SGLang engine, or a
client that lies, may share one), but every packed key field of the protocol has one
``key_bytes``. One eviction that takes keys of both lengths makes the daemon pack
them together: for a connection mirroring the namespace by push (``SyncKeys(push=
True)``) the loop's feed pushes raise ``ValueError`` outside any request's handler,
and the daemon exits (status 1). One uid does it alone, in its own namespace.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hostile import requires_root
from liar import Liar
from procfigs import Hold, Measure
from test_isolation import start

import kvoffload
from kvoffload.protocol import messages as m

PAGE = 64 * 1024


@pytest.fixture
def run() -> Iterator[Path]:
    """A directory other uids can reach (0755): the daemon's socket goes there."""
    requires_root()
    path = Path(tempfile.mkdtemp(prefix="kvoffload-mixed-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def evict_two_lengths(sock: str, hold: Hold) -> str:
    """Mirror a namespace by push, fill it with keys of 8 and 16 bytes, then store
    as many new keys: the eviction takes keys of both lengths at once."""
    mirror = Liar(sock)
    ns_id = mirror.open("mixed", m.KVLayout([PAGE])).ns
    mirror.call(m.SyncKeys(0, ns_id, push=True))
    with kvoffload.connect(sock) as c:
        ns = c.namespace("mixed", kvoffload.KVLayout(tensor_page_bytes=[PAGE]))
        region = c.stats()["region"]
        capacity = region["extents_total"] * (region["extent_bytes"] // PAGE)
        w = ns.attach_worker([kvoffload.shared_kv_cache(capacity, PAGE)])
        half = capacity // 2
        short = [b"s%07d" % i for i in range(half)]
        long = [b"long%012d" % i for i in range(capacity - half)]
        for job, keys in enumerate((short, long)):
            plan = ns.prepare_store(keys)
            assert plan is not None and w.submit_store(job, np.arange(len(keys)), plan.slots)
            w.wait([job])
            w.get_finished()
            ns.complete_store(keys)
        try:
            ns.prepare_store([b"n%07d" % i for i in range(capacity)])
            got = "planned"
        except Exception as exc:
            got = type(exc).__name__
        hold()
    mirror.close()
    return got


def test_an_eviction_of_keys_of_two_lengths_never_stops_the_daemon(run: Path) -> None:
    sock = str(run / "k.sock")
    with start(run, "32MiB", "max_writing_fraction = 1.0\n") as d:
        with Measure("an eviction of keys of two lengths", d) as f:
            got = f.attack(lambda hold: evict_two_lengths(sock, hold))
            f.note(f"the evicting store: {got}; the daemon alive: {d.alive()}")
        assert d.alive(), "the daemon exited"
        with kvoffload.connect(sock) as c:
            assert c.ping() > 0
