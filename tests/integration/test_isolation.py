"""What one tenant makes kvoffloadd hold or do is charged to it and bounded (issue 35).

Each test is one finding of the issue: a local attacker (another uid on the socket,
or an allowed engine lying in every field) hurting other tenants. Every attack runs
as a second uid (a forked child that drops to ``nobody``, group 0 only to reach the
0660 socket; none needs root) against a real daemon, measured the same way
(``procfigs.Measure``: the daemon's /proc figures before, at their peak during and
after, a canary pinging without pause, ``/healthz`` probed where the daemon serves
metrics), and asserts what must be true: on the daemon's /proc, the canary's round
trip and the protocol's answers, never on timings of the attacker itself. Each
prints one line (``pytest -s``; finding 11 one per daemon it compares).

The attacks are the issue's, at its scale unless a docstring says otherwise (where
this 2-core machine needed less, and the finding still shows).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import shutil
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hostile import as_uid, fd_count, requires_root
from liar import Liar
from procfigs import MIB, Hold, Measure

import kvoffload
from kvoffload.protocol import messages as m
from kvoffload.protocol.connection import encode_frame
from kvoffload.protocol.errors import ErrorCode
from kvoffload.sglang.identity import SglangIdentity, Shard
from kvoffloadbench.launch import DaemonProcess
from kvoffloadbench.server_process import free_port

TENANT = 4243  # a uid that stores, and loses if the attacker wins
NEWCOMER = 4300  # a uid holding nothing yet
KIB = 1 << 10


# ------------------------------------------------------------------ the stage


@pytest.fixture
def run() -> Iterator[Path]:
    """A directory other uids can reach (0755): the daemon's socket goes there."""
    requires_root()
    path = Path(tempfile.mkdtemp(prefix="kvoffload-isolation-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start(run: Path, size: str, config: str = "", metrics_port: int = 0) -> DaemonProcess:
    """A daemon on ``run``'s socket, with ``config`` (TOML) as its config file."""
    args = ["--log-level", "warning"]
    if config:
        (run / "kvoffloadd.toml").write_text(config)
        args += ["--config", str(run / "kvoffloadd.toml")]
    if metrics_port:
        args += ["--metrics-port", str(metrics_port)]
    return DaemonProcess(size, *args, socket_path=str(run / "k.sock"))


class FdLiar(Liar):
    """A ``Liar`` that sends descriptors along (SCM_RIGHTS), as an engine's worker does."""

    def call_with(self, msg: m.Request, fds: list[int]) -> m.Reply:
        rid = self.rid()
        frame = encode_frame(msgspec.structs.replace(msg, rid=rid))
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        sent = self.sock.sendmsg([frame], anc)
        self.sock.sendall(memoryview(frame)[sent:])
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self.next(deadline)
            if getattr(reply, "rid", 0) == rid:
                return reply
            self._keep(reply)


def memfd(nbytes: int, sealed: bool, populated: int = -1) -> int:
    """A memfd sealed against shrinking (a ``memfd`` cache), or unsealable as SGLang's
    ``shm`` pool is (a ``memfd_io`` cache), its first ``populated`` bytes written (-1:
    all of it), the rest sparse: an engine populates the memory it registers (the
    daemon refuses holes), and a sparse rest is what the daemon must never fault."""
    if not sealed:
        fd = os.memfd_create("pool", os.MFD_CLOEXEC)
    else:
        fd = os.memfd_create("kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    chunk = b"\0" * (1 << 20)
    end = nbytes if populated < 0 else populated
    for off in range(0, end, len(chunk)):
        os.pwrite(fd, chunk[: end - off], off)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def answer(reply: m.Reply) -> str:
    """A reply's kind, or its error code's name."""
    if isinstance(reply, (m.ErrorReply, m.Notice)):
        return ErrorCode(reply.code).name
    return type(reply).__name__


def keys_of(tag: bytes, n: int, start: int = 0) -> list[bytes]:
    return [tag + i.to_bytes(8, "big") for i in range(start, start + n)]


def store_and_load(sock: str, name: str, page: int = 4096, blocks: int = 4) -> str:
    """An engine's first steps: connect, open, attach a cache, store and load back.
    "ok", or what went wrong."""
    try:
        with kvoffload.connect(sock) as c:
            ns = c.namespace(name, kvoffload.KVLayout(tensor_page_bytes=[page]))
            src, dst = (kvoffload.shared_kv_cache(blocks, page) for _ in range(2))
            data = np.arange(blocks * page, dtype=np.int64) % 251 - 125
            src.numpy().ravel()[:] = data  # numpy: torch's threads hang after fork
            w = ns.attach_worker([src])
            keys = keys_of(b"new", blocks)
            plan = ns.prepare_store(keys)
            if plan is None or not w.submit_store(1, np.arange(blocks), plan.slots):
                return f"store refused: {ns.last_error or w.last_error}"
            w.wait([1])
            if not all(r.success for r in w.get_finished()):
                return "store failed"
            ns.complete_store(keys)
            r = ns.attach_worker([dst])
            lp = ns.prepare_load(keys)
            if not r.submit_load(2, lp.slots, np.arange(blocks)):
                return f"load refused: {r.last_error}"
            r.wait([2])
            ns.complete_load(keys)
            same = np.array_equal(dst.numpy().ravel(), data)
            return "ok" if same else "loaded other bytes"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def store_rounds(sock: str, name: str, page: int, tag: bytes, rounds: int) -> int:
    """A tenant storing ``rounds`` times the region's size in ``name``, 32 blocks a
    step (what it cannot place it skips); how many of its blocks the region holds
    at the end."""
    with kvoffload.connect(sock) as c:
        ns = c.namespace(name, kvoffload.KVLayout(tensor_page_bytes=[page]))
        region = c.stats()["region"]
        capacity = region["extents_total"] * (region["extent_bytes"] // page)
        w = ns.attach_worker([kvoffload.shared_kv_cache(32, page)])
        for job, start in enumerate(range(0, rounds * capacity, 32)):
            keys = keys_of(tag, 32, start)
            plan = ns.prepare_store(keys)
            if plan is None or not plan.slots:
                continue
            assert w.submit_store(job, np.arange(len(plan.slots)), plan.slots), w.last_error
            w.wait([job])
            w.get_finished()
            ns.complete_store(plan.keys_to_store)
        w.close()
        held: int = c.stats()["namespaces"][name]["stored_blocks"]
        return held


# ----------------------------------------------------- 1, 2: imported memory

ROW_BYTES = 16 * KIB
SPARSE_BYTES = 768 * MIB
FEW_PAGES_BYTES = 256 * KIB  # 64 pages: a claimed row and the tables it touches


def claim_one_row_twice(sock: str, hold: Hold) -> list[str]:
    fd = memfd(SPARSE_BYTES, sealed=False, populated=ROW_BYTES)  # the row it claims
    liar = FdLiar(sock, timeout_s=60)
    ns = liar.open("one-row", m.KVLayout([ROW_BYTES])).ns
    one_row = [m.CacheDesc("memfd_io", 1, ROW_BYTES, 0)]
    answers = [
        answer(liar.call_with(m.AttachWorker(0, ns, 0, one_row, push=True), [fd])) for _ in range(2)
    ]
    hold()
    liar.close()
    os.close(fd)
    return answers


def test_a_memfd_io_cache_costs_the_rows_it_claims_not_its_file(run: Path) -> None:
    """Finding 1: two ``memfd_io`` workers, each claiming one 16 KiB row of a 768 MiB
    sparse memfd. The daemon maps and faults what a copy touches, never the file:
    at most a few pages of RssShmem (today: the whole file, twice, +1,536 MiB)."""
    with start(run, "32MiB") as d, Measure("1 one 16 KiB row of a 768 MiB memfd, twice", d) as f:
        answers = f.attack(lambda hold: claim_one_row_twice(d.socket_path, hold))
    assert answers == ["WorkerAttached"] * 2  # an honest claim is taken
    assert f.growth.rss_shmem_bytes <= FEW_PAGES_BYTES, (
        f"the daemon faulted in {f.growth.rss_shmem_bytes / MIB:.0f} MiB for two 16 KiB rows"
    )
    f.assert_round_trips()


CACHES_OVER_ONE_FD = 512
POOL_BYTES = 64 * MIB
# What 512 caches over one descriptor may add to the daemon: caches over one
# descriptor share one mapping, no thread per cache, no descriptor per cache.
MAPS_SLACK = 32
PTE_SLACK_BYTES = 2 * MIB
THREADS_SLACK = 8
FDS_SLACK = 16


def many_caches_over_one_memfd(sock: str, hold: Hold) -> str:
    fd = memfd(POOL_BYTES, sealed=False)
    liar = FdLiar(sock, timeout_s=60)
    ns = liar.open("many", m.KVLayout([CACHES_OVER_ONE_FD * 64])).ns
    descs = [m.CacheDesc("memfd_io", 1, 64, 0, i * 64) for i in range(CACHES_OVER_ONE_FD)]
    got = answer(liar.call_with(m.AttachWorker(0, ns, 0, descs, push=True), [fd]))
    hold()
    liar.close()
    os.close(fd)
    return got


def test_one_attach_of_512_caches_over_one_memfd_holds_nobody_up(run: Path) -> None:
    """Finding 2: one AttachWorker of 512 ``memfd_io`` caches over one 64 MiB memfd.
    Another client never waits 100 ms, and the daemon's mappings, page tables,
    threads and descriptors stay within small bounds (today: the loop stalled
    4.4-5.3 s, page tables +64 MiB, 1,025 descriptors: a mapping of the whole file,
    two descriptors and a pre-fault thread per cache, on the loop thread)."""
    with start(run, "32MiB") as d, Measure("2 one attach, 512 memfd_io caches", d) as f:
        got = f.attack(lambda hold: many_caches_over_one_memfd(d.socket_path, hold))
        f.note(f"attach: {got}")
    f.assert_round_trips()
    g = f.growth
    assert g.maps <= MAPS_SLACK, f"{g.maps} more mappings"
    assert g.pte_bytes <= PTE_SLACK_BYTES, f"page tables +{g.pte_bytes / MIB:.0f} MiB"
    assert g.threads <= THREADS_SLACK, f"{g.threads} more threads"
    assert g.fds <= FDS_SLACK, f"{g.fds} more descriptors"


# ------------------------------------------------------ 3, 4: registrations

ONE_BYTE_CACHES = 3400  # per AttachWorker: six of them pass the 20,000-descriptor limit
MAX_ATTACHES = 64


def one_byte_caches(sock: str, hold: Hold) -> list[str]:
    """Attach workers of 3,400 one-byte caches over one sealed memfd until one is
    refused, then of half as many, and so on (64 attaches at most): every descriptor
    the daemon would give."""
    fd = memfd(4096, sealed=True)
    liar = FdLiar(sock, timeout_s=60)
    answers: list[str] = []
    n = ONE_BYTE_CACHES
    while n and len(answers) < MAX_ATTACHES and "cut off" not in answers:
        ns = liar.open(f"fds-{n}", m.KVLayout([n])).ns  # n one-byte caches tile it
        descs = [m.CacheDesc("memfd", 1, 1, 0, i % 4096) for i in range(n)]
        while len(answers) < MAX_ATTACHES:
            try:
                got = answer(liar.call_with(m.AttachWorker(0, ns, 0, descs), [fd]))
            except OSError:
                answers.append("cut off")
                break
            answers.append(f"{n}: {got}")
            if got != "WorkerAttached":
                break
        n //= 2
    hold()
    liar.close()
    os.close(fd)
    return answers


def test_attach_floods_cannot_take_the_daemons_descriptors(run: Path) -> None:
    """Finding 3: AttachWorker after AttachWorker of 3,400 one-byte caches on one
    sealed memfd. While the attacker holds what it got, a new engine of another uid
    connects, stores and loads; every refusal says what was refused (today: 19,985
    of 20,000 descriptors after 6 requests, a mapping's duplicate per cache, and the
    new engine's connection reset until the attacker left)."""
    sock = str(run / "k.sock")
    with start(run, "32MiB") as d, Measure("3 attach flood of one-byte caches", d) as f:
        answers = f.attack(
            lambda hold: one_byte_caches(sock, hold),
            during=lambda: as_uid(lambda: store_and_load(sock, "newcomer"), NEWCOMER, gid=0),
        )
        f.note(f"attacker's answers {answers}; new engine: {f.during_result}")
    assert f.during_result == "ok", f"a new engine could not work: {f.during_result}"
    assert not [a for a in answers if "INTERNAL" in a], f"a refusal said nothing: {answers}"
    f.assert_round_trips()


FRAGMENT_PAGE = 65536  # bytes of one canonical page: one fragment per byte
FRAGMENT_CACHES = 10
# Peak heap growth allowed for 40 maximal canonical registrations. One of them (10 x
# 1.5 MiB of fragments, in one 15 MiB frame) keeps 15 MiB and peaks at +29 MiB while
# its frame is decoded (measured). Two are accepted: 30 MiB kept, and one frame read
# and decoded at a time, 60 MiB live at most; the peak measured +60-62 MiB alone and
# +75 MiB beside the other suites (what the allocator keeps of the frames gone is
# RssAnon too). The 40, unbounded, kept 616 MiB.
FRAGMENT_HEAP_BYTES = 96 * MIB


def canonical_registrations(sock: str, hold: Hold, connections: int, each: int) -> dict[str, int]:
    fd = memfd(FRAGMENT_CACHES * FRAGMENT_PAGE, sealed=True)
    at = np.arange(FRAGMENT_PAGE, dtype=np.int64)
    frags = np.stack([at, at, np.ones_like(at)], axis=1).astype("<i8").tobytes()
    canonical = [m.CanonicalDesc(FRAGMENT_PAGE, frags)] * FRAGMENT_CACHES
    caches = [
        m.CacheDesc("memfd", 1, FRAGMENT_PAGE, 0, c * FRAGMENT_PAGE) for c in range(FRAGMENT_CACHES)
    ]
    layout = m.KVLayout([FRAGMENT_PAGE] * FRAGMENT_CACHES)
    answers: Counter[str] = Counter()
    liars = []
    for _ in range(connections):
        liar = FdLiar(sock, timeout_s=60)
        liars.append(liar)
        ns = liar.open("fragments", layout).ns
        for _ in range(each):
            attach = m.AttachWorker(0, ns, 0, caches, parts=2, canonical=canonical)
            try:
                answers[answer(liar.call_with(attach, [fd]))] += 1
            except OSError as exc:  # cut off: the next connection
                answers[type(exc).__name__] += 1
                break
    hold()
    for liar in liars:
        liar.close()
    os.close(fd)
    return dict(answers)


def test_worker_registrations_are_charged_before_the_heap_grows(run: Path) -> None:
    """Finding 4: 40 canonical-rank AttachWorkers (4 connections of one uid, 10 each)
    of 10 caches x 65,536 one-byte fragments, no store. They are refused before the
    daemon's heap grows by more than FRAGMENT_HEAP_BYTES (today: +616 MiB, the
    placements keep every fragment array for the worker's life)."""
    sock = str(run / "k.sock")
    with start(run, "32MiB") as d, Measure("4 40 maximal canonical registrations", d) as f:
        answers = f.attack(lambda hold: canonical_registrations(sock, hold, 4, 10))
        f.note(f"answers {answers}")
    assert f.growth.rss_anon_bytes <= FRAGMENT_HEAP_BYTES, (
        f"the heap grew {f.growth.rss_anon_bytes / MIB:.0f} MiB for registrations: {answers}"
    )
    assert "INTERNAL" not in answers
    f.assert_round_trips()


# --------------------------------------------------------------- 5: leases

LEASE_PAGE = 64 * KIB
LEASE_NAMESPACES = 8


def lease_everywhere(sock: str, hold: Hold) -> int:
    """Open 8 namespaces, store nothing, wish 2^40 leases in each; the slots held."""
    liar = Liar(sock)
    nss = [liar.open(f"lease-{i}", m.KVLayout([LEASE_PAGE])).ns for i in range(LEASE_NAMESPACES)]
    for _ in range(4):  # refills as the region moves to the new namespaces
        for ns in nss:
            liar.send(m.StepBatch(0, ns, 8, want_leases=1 << 40))
        liar.drain(0.1)
    held = sum(len(set(liar.granted.get(ns, []))) for ns in nss)
    hold()
    liar.close()
    return held


def test_leases_across_namespaces_do_not_starve_another_uid(run: Path) -> None:
    """Finding 5: a uid that stores nothing opens 8 namespaces and wishes 2^40 leases
    in each, and holds them while another uid stores twice the region's size. The
    measure: the blocks the storing uid holds at the end of that, against the same
    storing done alone in the same daemon just before; it keeps at least 3/4 (today:
    about a tenth, the lease budget and the fair share being per namespace)."""
    sock = str(run / "k.sock")

    def tenant(tag: bytes) -> int:
        return int(as_uid(lambda: store_rounds(sock, "tenant", LEASE_PAGE, tag, 2), TENANT, 0))

    with start(run, "128MiB") as d:
        alone = tenant(b"a")
        with Measure("5 leases wished in 8 namespaces", d) as f:
            leased = f.attack(
                lambda hold: lease_everywhere(sock, hold), during=lambda: tenant(b"b")
            )
            f.note(f"attacker leased {leased} slots; tenant holds {f.during_result} of {alone}")
    assert f.during_result >= 0.75 * alone, (
        f"the storing uid holds {f.during_result} blocks, {alone} alone"
    )
    f.assert_round_trips()


# --------------------------------------------------------------- 6: graves

GRAVE_PAGE = 16 * KIB
GRAVE_BLOCKS = 4096
ACKING_MIRRORS = 200
ACK_BURSTS = 2


def graves_and_mirrors(sock: str, hold: Hold) -> int:
    """Store 4,096 blocks, attach a silent mirror and 200 acking ones, evict the 4,096
    (a store of as many new keys, the namespace's quota being 4,096 blocks), then ack
    in bursts: every acking mirror at once. Returns the acks sent."""
    with kvoffload.connect(sock) as c:
        ns = c.namespace("graves", kvoffload.KVLayout(tensor_page_bytes=[GRAVE_PAGE]))
        w = ns.attach_worker([kvoffload.shared_kv_cache(GRAVE_BLOCKS, GRAVE_PAGE)])
        first = keys_of(b"g", GRAVE_BLOCKS)
        plan = ns.prepare_store(first)
        assert plan is not None and w.submit_store(1, np.arange(GRAVE_BLOCKS), plan.slots)
        w.wait([1])
        w.get_finished()
        ns.complete_store(first)
        mirrors = [Liar(sock, timeout_s=60) for _ in range(ACKING_MIRRORS + 1)]
        ids = []
        for liar in mirrors:  # the silent one first, then the acking ones
            ns_id = liar.open("graves", m.KVLayout([GRAVE_PAGE])).ns
            page = liar.call(m.SyncKeys(0, ns_id))
            assert isinstance(page, m.KeysPage) and page.next_offset == -1, answer(page)
            ids.append(ns_id)
        evicting = ns.prepare_store(keys_of(b"h", GRAVE_BLOCKS))  # buried: mirrors may hit
        assert evicting is None or len(evicting.evicted_keys) == GRAVE_BLOCKS
        acks = 0
        for _ in range(ACK_BURSTS):
            for liar, ns_id in zip(mirrors[1:], ids[1:]):
                liar.step(ns_id, 8, ack_seq=1 << 62)
                acks += 1
            for liar in mirrors[1:]:
                liar.call(m.Ping(0))
        hold()
        for liar in mirrors:
            liar.close()
        w.close()
    return acks


def test_acks_cost_the_same_with_graves_and_mirrors(run: Path) -> None:
    """Finding 6: 200 acking mirrors and a silent one, a 4,096-block eviction, then
    bursts of acks (every mirror at once, twice). Another client's round trip stays
    under 100 ms (today: a ping behind the acks waited ~1.0 s per burst,
    ``Graveyard.free_now`` checking every grave against every mirror on each ack).
    The silent mirror is the first one, as the issue's figure implies; as the last,
    each grave is checked against all 201 on every ack: 6-36 s per burst here."""
    config = (
        "max_writing_fraction = 1.0\nmirror_grace_s = 60.0\n"
        '[[namespace_quotas]]\npattern = "graves"\nmax_region_size = "64MiB"\n'
    )
    with start(run, "96MiB", config) as d, Measure("6 ack bursts, 4,096 graves", d) as f:
        acks = f.attack(lambda hold: graves_and_mirrors(d.socket_path, hold))
        f.note(f"{acks} acks")
    f.assert_round_trips()


# ----------------------------------------------------------- 7, 8: loop turns

BUSY_CONNECTIONS = 96  # the 128 took 23 s here (a 14.6 s stall, 93 of 137 probes 503)
MAX_KEYS = m.MAX_KEYS_PER_MESSAGE


def maximal_steps(sock: str, hold: Hold, connections: int) -> int:
    """Store one key, then ``connections`` connections each send one StepBatch that
    pins, unpins and touches it 65,536 times; returns the batches answered."""
    key = b"k" * 8
    with kvoffload.connect(sock) as c:
        ns = c.namespace("busy", kvoffload.KVLayout(tensor_page_bytes=[4096]))
        w = ns.attach_worker([kvoffload.shared_kv_cache(1, 4096)])
        plan = ns.prepare_store([key])
        assert plan is not None and w.submit_store(1, [0], plan.slots)
        w.wait([1])
        w.get_finished()
        ns.complete_store([key])
        liars = [Liar(sock, timeout_s=120) for _ in range(connections)]
        ids = [liar.open("busy", m.KVLayout([4096])).ns for liar in liars]
        assert len(set(ids)) == 1  # one namespace, one id on every connection
        many = key * MAX_KEYS
        batch = encode_frame(
            m.StepBatch(0, ids[0], 8, pin_keys=many, unpin_keys=many, touch_keys=many)
        )
        alive = []
        for liar in liars:  # all but the last byte: the daemon buffers what it has
            with contextlib.suppress(OSError):  # past the uid's buffer share: cut off
                liar.sock.sendall(batch[:-1])
                alive.append(liar)
        for liar in list(alive):  # then every frame completes in the same loop turn
            try:
                liar.sock.sendall(batch[-1:])
            except OSError:
                alive.remove(liar)
        answered = 0
        for liar in alive:
            with contextlib.suppress(OSError, TimeoutError):
                answered += isinstance(liar.call(m.Ping(0)), m.Pong)
        hold()
        for liar in liars:
            liar.close()
        w.close()
    return answered


def test_a_loop_turn_is_bounded_for_all_connections_together(run: Path) -> None:
    """Finding 7: connections of one uid each send one StepBatch pinning, unpinning and
    touching 65,536 keys, their frames completing in the same loop turn. The canary
    stays under 100 ms and /healthz answers 200 to every probe (today: 12.8-14.6 s
    round trips and 503 on 37-41 of 64-69 probes: each busy connection's first frame
    always runs). 96 connections, not the issue's 128 (23 s here): the same batches
    stall the loop 3/4 as long, well past the 5 s after which /healthz says 503."""
    port = free_port()
    sock = str(run / "k.sock")
    with (
        start(run, "32MiB", metrics_port=port) as d,
        Measure("7 96 maximal steps at once", d, port) as f,
    ):
        answered = f.attack(lambda hold: maximal_steps(sock, hold, BUSY_CONNECTIONS))
        f.note(f"{answered} connections answered, the others cut off past their buffers")
    f.assert_round_trips()
    f.assert_healthy()


INFLIGHT_BLOCKS = 46_848
LEAVING_CONNECTIONS = 1000


def open_and_leave(sock: str, hold: Hold, connections: int) -> int:
    """``connections`` connections open the namespace, then all close at once."""
    liars = [Liar(sock, timeout_s=60) for _ in range(connections)]
    for liar in liars:
        liar.open("inflight", m.KVLayout([4096]))
    hold()
    for liar in liars:
        liar.close()
    return len(liars)


def test_disconnects_cost_the_same_with_writes_in_flight(run: Path) -> None:
    """Finding 8: 1,000 connections of one uid that opened a namespace close at once
    while another tenant has 46,848 blocks in flight there. The canary stays under
    100 ms (today: ~1 s; 0.03 s with nothing in flight: ``release_client`` walks
    every in-flight block of the namespace for each leaving connection)."""
    sock = str(run / "k.sock")
    config = 'min_slot_size = "4KiB"\nmax_writing_fraction = 1.0\n'
    config += "[limits.connections]\nper_uid = 1024\n"  # 1,000 of one uid, on purpose
    with start(run, "256MiB", config) as d, kvoffload.connect(sock) as tenant:
        ns = tenant.namespace("inflight", kvoffload.KVLayout(tensor_page_bytes=[4096]))
        writing = keys_of(b"w", INFLIGHT_BLOCKS)
        assert ns.prepare_store(writing) is not None  # in flight until the end
        with Measure("8 1,000 disconnects, 46,848 blocks in flight", d) as f:
            f.attack(lambda hold: open_and_leave(sock, hold, LEAVING_CONNECTIONS))
        ns.complete_store(writing, success=False)
    f.assert_round_trips()


# ------------------------------------------------------ 9, 10: the namespace table

TABLE = 256
CREATORS = list(range(5001, 5009))  # 8 uids, 32 entries each: the table is full


def create_and_leave(sock: str, uid: int, n: int) -> int:
    liar = Liar(sock)
    for i in range(n):
        liar.open(f"u{uid}-{i:02d}", m.KVLayout([4096]))
    liar.close()
    return n


def join_everything(sock: str, hold: Hold) -> dict[str, int]:
    liar = Liar(sock, timeout_s=60)
    answers: Counter[str] = Counter()
    for uid in CREATORS:
        for i in range(TABLE // len(CREATORS)):
            r = liar.call(m.OpenNamespace(0, f"u{uid}-{i:02d}", m.KVLayout([]), False, True))
            answers[answer(r)] += 1
    hold()
    liar.close()
    return dict(answers)


def newcomer_opens(sock: str) -> tuple[str, str]:
    liar = Liar(sock)
    r = liar.call(m.OpenNamespace(0, "newcomer", m.KVLayout([4096])))
    liar.close()
    return answer(r), getattr(r, "message", "")


def test_joins_do_not_freeze_the_namespace_table(run: Path) -> None:
    """Finding 9: 8 uids created 32 namespaces each (the table is full) and left; one
    uid joins all 256. A newcomer uid holding nothing still gets an entry (today:
    NO_SPACE, "no uid holds more than its share", while 8 uids hold 32 entries
    against a share of 28: a join holds an entry but is not counted as holding it)."""
    sock = str(run / "k.sock")
    with start(run, "32MiB") as d:
        for uid in CREATORS:
            as_uid(partial(create_and_leave, sock, uid, TABLE // len(CREATORS)), uid, 0)
        with Measure("9 joins of all 256 namespaces", d) as f:
            joins = f.attack(
                lambda hold: join_everything(sock, hold),
                during=lambda: as_uid(lambda: newcomer_opens(sock), NEWCOMER, 0),
            )
            f.note(f"joins {joins}; the newcomer: {f.during_result}")
    code, message = f.during_result
    assert code == "NamespaceOpened", (
        f"a newcomer holding nothing was refused ({message!r}) while {len(CREATORS)} uids "
        f"hold {TABLE // len(CREATORS)} entries each"
    )
    f.assert_round_trips()


VICTIM_BLOCKS = 16
LONG_MODEL = "m" * 2000
LONG_SALT = "s" * 1700


def victim_blocks(sock: str, store: bool) -> int:
    """The tenant's namespace: store 16 blocks (``store``), or count what is left."""
    with kvoffload.connect(sock) as c:
        ns = c.namespace("victim", kvoffload.KVLayout(tensor_page_bytes=[4096]))
        keys = keys_of(b"v", VICTIM_BLOCKS)
        if store:
            w = ns.attach_worker([kvoffload.shared_kv_cache(VICTIM_BLOCKS, 4096)])
            plan = ns.prepare_store(keys)
            assert plan is not None and w.submit_store(1, np.arange(VICTIM_BLOCKS), plan.slots)
            w.wait([1])
            w.get_finished()
            ns.complete_store(keys)
            w.close()
        return ns.lookup(keys) or 0


def open_too_large(sock: str, hold: Hold) -> list[tuple[str, str]]:
    """Two opens whose layouts do not fit a namespace record: a 2,000-character model,
    and an SGLang identity with a 1,700-character cache_salt."""
    liar = Liar(sock)
    sglang = SglangIdentity(
        model="Qwen/Qwen3-8B",
        kv_dtype="bfloat16",
        page_size=64,
        host_layout="layer_first",
        pool_kind="MHATokenToKVPoolHost",
        geometry="layers=36;heads=8;head_dim=128;v_head_dim=128",
        element_bytes=[64 * 8 * 128 * 2] * 2,
        shard=Shard(tp="0/1"),
        cache_salt=LONG_SALT,
    )
    opens = [("long-model", m.KVLayout([4096], model=LONG_MODEL)), sglang.namespace()]
    got = []
    for name, layout in opens:
        r = liar.call(m.OpenNamespace(0, name, layout))
        got.append((answer(r), getattr(r, "message", "")))
    hold()
    liar.close()
    return got


def test_a_refused_open_never_drops_another_tenants_namespace(run: Path) -> None:
    """Finding 10: the table is full (255 namespaces held open, one idle namespace of
    another uid with 16 blocks); an open whose layout is too large for a record is
    refused with INVALID_ARGUMENT, and the idle namespace keeps its blocks (today:
    INTERNAL, after ``NamespaceTable.open`` dropped the idle namespace)."""
    sock = str(run / "k.sock")
    config = "[limits.namespaces]\nper_connection = 256\n"  # one holder holds the table
    with start(run, "32MiB", config) as d, kvoffload.connect(sock) as holder:
        for i in range(TABLE - 1):
            holder.namespace(f"held-{i:03d}", kvoffload.KVLayout(tensor_page_bytes=[4096]))
        stored = as_uid(lambda: victim_blocks(sock, store=True), TENANT, 0)
        with Measure("10 opens too large for a record, the table full", d) as f:
            got = f.attack(lambda hold: open_too_large(sock, hold))
            left = as_uid(lambda: victim_blocks(sock, store=False), TENANT, 0)
            f.note(f"answers {got}; the tenant's blocks {stored} -> {left}")
    assert left == stored == VICTIM_BLOCKS, f"the tenant's namespace kept {left} of {stored}"
    assert [code for code, _ in got] == ["INVALID_ARGUMENT"] * 2, got
    f.assert_round_trips()


# -------------------------------------------------------------- 11: event feeds

FEED_KEYS = 8192
FEED_CYCLES = 64  # the 100 take 25 s here; 64 show the same
FEED_TAG_BYTES = 28  # and an 8-byte counter: vLLM's keys (a 32-byte hash, a 4-byte group)
# What a subscriber that never reads may cost beyond a neighbour subscribed to nothing:
# its share of the event log, whose bytes the daemon bounds (4 MiB a namespace, as
# counted), with room for what Python objects cost over that count.
FEED_SLACK_BYTES = 32 * MIB


def neighbour(sock: str, hold: Hold, subscribed: bool) -> int:
    """Open the namespace, subscribed to its events or not, never take any, and hold
    while the churn runs."""
    liar = Liar(sock, timeout_s=60)
    liar.call(m.OpenNamespace(0, "feed", m.KVLayout([4096]), subscribed))
    hold()
    liar.close()
    return 0


def churn(sock: str) -> None:
    """Another tenant: stores 8,192 keys and evicts them, 64 times."""
    with kvoffload.connect(sock) as c:
        ns = c.namespace("feed", kvoffload.KVLayout(tensor_page_bytes=[4096]), subscribe=False)
        w = ns.attach_worker([kvoffload.shared_kv_cache(FEED_KEYS, 4096)])
        for cycle in range(FEED_CYCLES):
            keys = keys_of((b"%03d" % cycle).ljust(FEED_TAG_BYTES, b"-"), FEED_KEYS)
            plan = ns.prepare_store(keys)
            assert plan is not None and w.submit_store(cycle, np.arange(FEED_KEYS), plan.slots)
            w.wait([cycle])
            w.get_finished()
            ns.complete_store(keys)
            assert c.evict("feed", keys) == FEED_KEYS
        w.close()


def test_a_subscriber_that_never_reads_costs_a_bounded_amount(run: Path) -> None:
    """Finding 11: a connection holds a namespace open while another tenant stores and
    evicts 8,192 keys 64 times; once (a daemon) subscribed to nothing, once (another
    daemon, the same way) subscribed and never taking its events. The one that never
    reads costs the daemon's heap at most FEED_SLACK_BYTES more (today: +113 MiB
    against +8; the issue's 100 cycles: +228 against +49 for one that reads).

    The reference is a neighbour subscribed to nothing rather than one that reads:
    today a subscriber taking its events every 10 ms kept +26 to +114 MiB over five
    runs, so against it this test would pass by chance."""
    sock = str(run / "k.sock")
    config = 'min_slot_size = "4KiB"\nmax_writing_fraction = 1.0\n'
    growth = {}
    for subscribed in (False, True):
        name = (
            "11 a subscriber that never reads" if subscribed else "11 a neighbour, not subscribed"
        )
        with start(run, "64MiB", config) as d, Measure(name, d) as f:
            f.attack(partial(neighbour, sock, subscribed=subscribed), during=lambda: churn(sock))
        growth[subscribed] = f.growth.rss_anon_bytes
    assert growth[True] <= growth[False] + FEED_SLACK_BYTES, (
        f"a subscriber that never reads cost {growth[True] / MIB:.0f} MiB of heap, "
        f"a neighbour subscribed to nothing {growth[False] / MIB:.0f} MiB"
    )


# ----------------------------------------------------- region descriptors, pipelined


def attaches_in_flight(sock: str, rids: list[int]) -> tuple[int, int]:
    """AttachWorker requests asking for the region's descriptor, sent back to back
    before any reply is read: (replies, descriptors received). The descriptors are
    closed."""
    fd = memfd(4 * 4096, sealed=True)
    liar = FdLiar(sock, timeout_s=30)
    ns = liar.open("pipelined", m.KVLayout([4096])).ns
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
    for rid in rids:
        cache = [m.CacheDesc("memfd", 4, 4096, 0)]
        frame = encode_frame(m.AttachWorker(rid, ns, 0, cache, want_region=True))
        assert liar.sock.sendmsg([frame], anc) == len(frame)
    os.close(fd)
    replies, got, buf = 0, [], b""
    deadline = time.monotonic() + 30
    liar.sock.settimeout(1.0)
    while replies < len(rids) and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            data, ancdata, _, _ = liar.sock.recvmsg(1 << 16, socket.CMSG_SPACE(64 * 4))
            for _, _, payload in ancdata:
                got += array.array("i", payload[: len(payload) - len(payload) % 4]).tolist()
            buf += data
        while len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[:4], "little"):
            n = int.from_bytes(buf[:4], "little")
            reply = msgspec.msgpack.decode(buf[4 : 4 + n], type=m.Reply)
            buf = buf[4 + n :]
            assert isinstance(reply, m.WorkerAttached), reply
            replies += 1
    for f in got:
        os.close(f)
    liar.close()
    return replies, len(got)


def test_each_attach_in_flight_gets_its_own_region_descriptor(run: Path) -> None:
    """Attaches whose imports finish in the same loop turn each take the region's
    descriptor with their own reply: none is overwritten (leaked in the daemon) and
    the daemon holds none after they left."""
    sock = str(run / "k.sock")
    with start(run, "32MiB") as d:
        with kvoffload.connect(sock) as c:
            c.ping()
        before = fd_count(d.pid)
        for _ in range(3):
            replies, fds = attaches_in_flight(sock, list(range(100, 116)))
            assert (replies, fds) == (16, 16)
        deadline = time.monotonic() + 10
        while fd_count(d.pid) > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fd_count(d.pid) <= before, "descriptors the daemon kept after its clients left"
