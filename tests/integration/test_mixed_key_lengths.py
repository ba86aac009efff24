"""Keys of two lengths in one namespace: found while writing issue 35's tests, not one
of its findings.

Every packed key field of the protocol has one ``key_bytes``. When a namespace could
hold keys of two lengths, one eviction that took keys of both made the daemon pack
them together: for a connection mirroring the namespace by push (``SyncKeys(push=
True)``) the loop's feed pushes raised ``ValueError`` outside any request's handler,
and the daemon exited (status 1). One uid did it alone, in its own namespace. A
namespace's keys now all have the first stored key's length; a store of another
length is refused.
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
from kvoffload.protocol.errors import KVOffloadError

PAGE = 64 * 1024


@pytest.fixture
def run() -> Iterator[Path]:
    """A directory other uids can reach (0755): the daemon's socket goes there."""
    requires_root()
    path = Path(tempfile.mkdtemp(prefix="kvoffload-mixed-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def evict_two_lengths(sock: str, hold: Hold) -> tuple[str, str]:
    """Mirror a namespace by push, fill half of it with keys of 8 bytes, try to fill
    the rest with keys of 16, then store a region's worth of new keys: the eviction
    would take keys of both lengths at once. What the 16-byte store and the last store
    got."""
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
        plan = ns.prepare_store(short)
        assert plan is not None and w.submit_store(0, np.arange(half), plan.slots)
        w.wait([0])
        w.get_finished()
        ns.complete_store(short)
        try:
            ns.prepare_store([b"long%012d" % i for i in range(capacity - half)])
            other = "planned"
        except KVOffloadError as exc:
            other = exc.code.name
        try:  # evicts the 8-byte keys (held for the mirror: the plan may come later)
            plan = ns.prepare_store([b"n%07d" % i for i in range(half)])
            got = "planned" if plan else "evicted, space held for the mirror"
        except Exception as exc:
            got = type(exc).__name__
        hold()
    mirror.close()
    return other, got


def test_an_eviction_of_keys_of_two_lengths_never_stops_the_daemon(run: Path) -> None:
    sock = str(run / "k.sock")
    with start(run, "32MiB", "max_writing_fraction = 1.0\n") as d:
        with Measure("an eviction of keys of two lengths", d) as f:
            other, got = f.attack(lambda hold: evict_two_lengths(sock, hold))
            f.note(f"the store of another length: {other}; the daemon alive: {d.alive()}")
        assert d.alive(), "the daemon exited"
        assert other == "INVALID_ARGUMENT"
        assert got in ("planned", "evicted, space held for the mirror"), got
        with kvoffload.connect(sock) as c:
            assert c.ping() > 0
