"""The resource census: whatever a peer makes the daemon hold is in its ledger.

Clients of two uids (neither root nor the daemon's; the second may copy for itself,
as an engine's uid may) drive every request type of the protocol against a real
daemon, each in its valid, invalid and maximal forms, some on connections that never
read their replies. After each request type's burst, while the clients hold what they
took, the daemon's own figures from /proc are held to what its ledger accounts for
(``kvoffloadd.ledger``, in its stats) plus a fixed slack:

- descriptors <= before + connections + held descriptors;
- mappings <= before + imported mappings;
- threads <= before (peers start none);
- RssAnon <= before + the heap the ledger says peers hold;
- RssShmem <= the region + the engine memory the daemon maps;
- VmPTE <= before + page tables of the engine memory it maps;

and each uid holds no more of any line than its limit. A resource the ledger does not
account for shows up here, whoever adds it. A request type without a generator below
is a failure (``test_every_request_type_has_a_census_generator``): a new message cannot
skip the census.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import get_args

from liar import Liar
from procfigs import Figures, Hold, Measure, figures
from test_isolation import FdLiar, memfd, run, start

import kvoffload
from kvoffload.protocol import messages as m
from kvoffload.protocol.connection import encode_frame
from kvoffload.protocol.messages import MAX_KEYS_PER_MESSAGE, MAX_STATE_KEYS
from kvoffload.protocol.packing import pack_ids, unpack_ids
from kvoffloadd.server.clients import CHARGE_STEP_BYTES

__all__ = ["run"]  # the fixture

MIB = 1 << 20
PAGE = 64 * 1024
UIDS = (65534, 4242)  # nobody, and another tenant that may copy for itself
WAITS_PER_CONNECTION = 65536  # the ``waits`` line: job ids one connection's waits name
# What the daemon may hold beyond what its ledger accounts for, whatever peers do:
SLACK_FDS = 24  # the region's descriptors for copiers, the descriptor copier's
SLACK_MAPS = 32
SLACK_THREADS = 4  # the descriptor copier starts its threads with its first job
SLACK_ANON_BYTES = 48 * MIB  # the interpreter's arenas, a decoded frame in flight
SLACK_SHMEM_BYTES = 8 * MIB
SLACK_PTE_BYTES = 2 * MIB


class Peer:
    """One uid's connections for the census, and what they made the daemon hold."""

    def __init__(self, sock: str) -> None:
        self.sock = sock
        self.liars: list[Liar] = []
        self.fds: list[int] = []
        self.ns = -1
        self.worker = -1

    def liar(self, cls: type[Liar] = Liar) -> Liar:
        liar = cls(self.sock, timeout_s=60)
        self.liars.append(liar)
        return liar

    def raw(self) -> socket.socket:
        """A connection that sends frames and never reads a reply."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(self.sock)
        s.sendall(encode_frame(m.Hello(1, m.PROTOCOL_VERSION, "census", 0)))
        self.fds.append(s.detach())
        return socket.socket(fileno=os.dup(self.fds[-1]))

    def flood(self, frames: bytes, connections: int = 1) -> None:
        for _ in range(connections):
            s = self.raw()
            with contextlib.suppress(OSError):
                s.setblocking(False)
                s.send(frames)
            s.close()

    def close(self) -> None:
        for liar in self.liars:
            with contextlib.suppress(OSError):
                liar.close()
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def keys(tag: bytes, n: int) -> bytes:
    return b"".join(tag + b"%07d" % i for i in range(n))


KB = 8  # every key of the census is 8 bytes
MAX_KEYS = keys(b"m", MAX_KEYS_PER_MESSAGE)
STATE_KEYS = keys(b"s", MAX_STATE_KEYS)


def opened(p: Peer, liar: Liar, name: str = "census") -> int:
    r = liar.call(m.OpenNamespace(0, name, m.KVLayout([PAGE])))
    return r.ns if isinstance(r, m.NamespaceOpened) else -1


# ------------------------------------------------------------------ the generators
# Each drives one request type: valid, invalid and maximal, and leaves what it took
# held (its connections open) for the check.


def gen_hello(p: Peer) -> None:
    for version in (m.PROTOCOL_VERSION, m.PROTOCOL_VERSION + 1, -1):
        for name in ("x" * m.MAX_CLIENT_NAME_CHARS, "x" * (m.MAX_CLIENT_NAME_CHARS + 1)):
            with contextlib.suppress(Exception):
                p.liar().call(m.Hello(0, version, name, 0))
    for _ in range(64):  # connections, up to what the uid may hold
        with contextlib.suppress(OSError):
            p.raw()


def gen_ping(p: Peer) -> None:
    p.flood(encode_frame(m.Ping(1)) * 20000, connections=4)  # replies never read


def gen_open_namespace(p: Peer) -> None:
    liar = p.liar()
    p.ns = opened(p, liar)
    for i in range(80):  # past one connection's namespaces
        opened(p, liar, f"census-{os.getuid()}-{i}")
    liar.call(m.OpenNamespace(0, "census", m.KVLayout([1]), join=True))
    liar.call(m.OpenNamespace(0, "\0bad", m.KVLayout([PAGE])))
    liar.call(m.OpenNamespace(0, "huge", m.KVLayout([PAGE], model="m" * m.MAX_TEXT_CHARS)))
    liar.call(m.OpenNamespace(0, "n" * m.MAX_TEXT_CHARS, m.KVLayout([1] * m.MAX_TENSORS)))


def gen_lookup(p: Peer) -> None:
    liar = p.liar()
    ns = opened(p, liar)
    liar.call(m.Lookup(0, ns, MAX_KEYS, KB))
    liar.call(m.Lookup(0, ns, b"odd", KB))
    p.flood(encode_frame(m.Lookup(1, ns, MAX_KEYS, KB)) * 4)  # not even opened there


def gen_probe(p: Peer) -> None:
    liar = p.liar()
    ns = opened(p, liar)
    liar.call(m.Probe(0, ns, MAX_KEYS, KB))
    liar.call(m.Probe(0, 999, MAX_KEYS, KB))


def gen_prepare_store(p: Peer) -> None:
    liar = p.liar()
    ns = opened(p, liar)
    for i in range(4):  # blocks being written, never completed
        liar.call(m.PrepareStore(0, ns, keys(b"w%d" % i, MAX_STATE_KEYS), KB))
    liar.call(m.PrepareStore(0, ns, MAX_KEYS, KB))  # past MAX_STATE_KEYS


def gen_complete_store(p: Peer) -> None:
    liar = p.liar()
    ns = opened(p, liar)
    liar.call(m.CompleteStore(0, ns, STATE_KEYS, KB, True))
    liar.call(m.CompleteStore(0, ns, STATE_KEYS, KB, False))


def gen_prepare_load(p: Peer) -> None:
    liar = p.liar()
    ns = opened(p, liar)
    liar.call(m.PrepareLoad(0, ns, STATE_KEYS, KB))  # nothing stored: NOT_FOUND


def gen_complete_load(p: Peer) -> None:
    liar = p.liar()
    liar.call(m.CompleteLoad(0, opened(p, liar), STATE_KEYS, KB))


def gen_touch(p: Peer) -> None:
    liar = p.liar()
    liar.call(m.Touch(0, opened(p, liar), MAX_KEYS, KB))


def gen_take_events(p: Peer) -> None:
    liar = p.liar()
    ns = opened(p, liar)
    liar.call(m.TakeEvents(0, ns))
    p.flood(encode_frame(m.TakeEvents(1, ns)) * 1000)


def gen_sync_keys(p: Peer) -> None:
    for _ in range(8):  # snapshots held, never paged through
        liar = p.liar()
        ns = opened(p, liar)
        liar.call(m.SyncKeys(0, ns, 0, push=True))
    liar.call(m.SyncKeys(0, ns, 12345))


def gen_step_batch(p: Peer) -> None:
    liar = p.liar()
    ns = opened(p, liar)
    step = m.StepBatch(0, ns, KB, pin_keys=MAX_KEYS, unpin_keys=MAX_KEYS, touch_keys=MAX_KEYS,
                       want_leases=1 << 40)  # fmt: skip
    liar.send(step)
    liar.send(m.StepBatch(0, ns, KB, claim_keys=STATE_KEYS, claim_slots=pack_ids(range(7))))
    liar.drain(0.3)


def gen_wrote(p: Peer) -> None:
    liar = p.liar()
    liar.send(m.Wrote(0, 12345, 1, pack_ids(range(4096))))
    liar.send(m.Wrote(0, -1, 0, b"bad"))
    liar.drain(0.1)


def gen_client_copy_done(p: Peer) -> None:
    liar = p.liar()
    liar.call(m.ClientCopyDone(0, 1, 2, True))


def gen_attach_worker(p: Peer) -> None:
    """Caches over memfds as many as a connection may attach, canonical fragment tables
    as large as a frame holds, and lies."""
    liar = p.liar(FdLiar)
    assert isinstance(liar, FdLiar)
    ns = opened(p, liar)
    fd = memfd(16 * MIB, sealed=True)
    caches = [m.CacheDesc("memfd", 16, PAGE, 0, i * PAGE, 16 * PAGE) for i in range(16)]
    layout_caches = [m.CacheDesc("memfd", 256, PAGE, 0)]
    for _ in range(70):  # past the workers of one connection
        r = liar.call_with(m.AttachWorker(0, ns, 0, layout_caches, push=True), [fd])
        if isinstance(r, m.WorkerAttached):
            p.worker = r.worker
    liar.call_with(m.AttachWorker(0, ns, 0, caches), [fd])  # pages that do not tile
    frags = pack_ids([[i, i, 1] for i in range(65536)])
    canon = [m.CanonicalDesc(PAGE, frags)]
    liar.call_with(m.AttachWorker(0, ns, 0, layout_caches, parts=2, canonical=canon), [fd])
    liar.call(m.AttachWorker(0, ns, 0, [m.CacheDesc("memfd", 1, PAGE, 5)]))  # no descriptor
    os.close(fd)


def gen_detach_worker(p: Peer) -> None:
    liar = p.liar()
    liar.call(m.DetachWorker(0, p.worker))  # another connection's
    liar.call(m.DetachWorker(0, 999999))


def _store_jobs(p: Peer, submit: Callable[[FdLiar, int, int], m.Request]) -> None:
    liar = p.liar(FdLiar)
    assert isinstance(liar, FdLiar)
    ns = opened(p, liar)
    fd = memfd(256 * PAGE, sealed=True)
    r = liar.call_with(m.AttachWorker(0, ns, 0, [m.CacheDesc("memfd", 256, PAGE, 0)]), [fd])
    os.close(fd)
    if not isinstance(r, m.WorkerAttached):
        return
    for job in range(64):  # results never taken
        liar.send(submit(liar, r.worker, job))
    liar.call(m.Ping(0))


def gen_submit_store(p: Peer) -> None:
    def store(liar: FdLiar, worker: int, job: int) -> m.Request:
        return m.SubmitStore(0, worker, job, pack_ids([job]), pack_ids([job]))

    _store_jobs(p, store)


def gen_submit_load(p: Peer) -> None:
    def load(liar: FdLiar, worker: int, job: int) -> m.Request:
        return m.SubmitLoad(0, worker, job, pack_ids([job]), pack_ids([job]))

    _store_jobs(p, load)


def gen_get_finished(p: Peer) -> None:
    liar = p.liar()
    liar.call(m.GetFinished(0, p.worker))


def gen_wait_jobs(p: Peer) -> None:
    with contextlib.suppress(OSError):  # past the bound: a protocol error, then closed
        p.liar().call(m.WaitJobs(0, p.worker, list(range(100000))))
    # waits on jobs in flight, as many job ids as a connection may name: client
    # copies nobody reports (the second uid may copy for itself)
    liar = p.liar()
    ns = opened(p, liar)
    r = liar.call(m.AttachWorker(0, ns, 0, [m.CacheDesc("client", 64, PAGE)], client_copy=True))
    if not isinstance(r, m.WorkerAttached):
        return  # a uid that may not copy for itself
    plan = liar.call(m.PrepareStore(0, ns, keys(b"w", 8), KB))
    assert isinstance(plan, m.StorePlanReply), plan
    slots = unpack_ids(plan.slots).tolist()
    for job, slot in enumerate(slots):
        liar.call(m.SubmitStore(0, r.worker, job, pack_ids([job]), pack_ids([slot])))
    for _ in range(WAITS_PER_CONNECTION // len(slots) + 1):  # the last one refused
        liar.send(m.WaitJobs(liar.rid(), r.worker, list(range(len(slots)))))
    stats = liar.call(m.GetStats(0))  # every wait is in before this is answered
    assert isinstance(stats, m.StatsReply)
    assert stats.sections["ledger"]["lines"]["waits"]["total"] >= WAITS_PER_CONNECTION


def gen_get_stats(p: Peer) -> None:
    p.flood(encode_frame(m.GetStats(1)) * 2000, connections=2)


def gen_list_clients(p: Peer) -> None:
    p.flood(encode_frame(m.ListClients(1)) * 2000, connections=2)


def gen_evict(p: Peer) -> None:
    p.liar().call(m.Evict(0, None))  # not an admin


def gen_get_config(p: Peer) -> None:
    p.liar().call(m.GetConfig(0))


def gen_drop_namespace(p: Peer) -> None:
    liar = p.liar()  # not an admin: refused, whatever the name
    for name in ("census", "no-such-namespace", "n" * m.MAX_TEXT_CHARS):
        liar.call(m.DropNamespace(0, name))


GENERATORS: dict[type, Callable[[Peer], None]] = {
    m.Hello: gen_hello,
    m.Ping: gen_ping,
    m.OpenNamespace: gen_open_namespace,
    m.Lookup: gen_lookup,
    m.Probe: gen_probe,
    m.PrepareStore: gen_prepare_store,
    m.CompleteStore: gen_complete_store,
    m.PrepareLoad: gen_prepare_load,
    m.CompleteLoad: gen_complete_load,
    m.Touch: gen_touch,
    m.TakeEvents: gen_take_events,
    m.SyncKeys: gen_sync_keys,
    m.StepBatch: gen_step_batch,
    m.Wrote: gen_wrote,
    m.ClientCopyDone: gen_client_copy_done,
    m.AttachWorker: gen_attach_worker,
    m.DetachWorker: gen_detach_worker,
    m.SubmitStore: gen_submit_store,
    m.SubmitLoad: gen_submit_load,
    m.GetFinished: gen_get_finished,
    m.WaitJobs: gen_wait_jobs,
    m.GetStats: gen_get_stats,
    m.ListClients: gen_list_clients,
    m.Evict: gen_evict,
    m.GetConfig: gen_get_config,
    m.DropNamespace: gen_drop_namespace,
}


def test_every_request_type_has_a_census_generator() -> None:
    assert set(GENERATORS) == set(get_args(m.Request)), (
        f"no census generator for {set(get_args(m.Request)) - set(GENERATORS)}"
    )


def census(sock: str, hold: Hold) -> list[str]:
    """One uid: every generator in turn, holding after each (the test checks)."""
    p = Peer(sock)
    done = []
    try:
        for kind, gen in GENERATORS.items():
            try:
                gen(p)
            except (OSError, TimeoutError) as exc:  # cut off past a limit: as it should
                done.append(f"{kind.__name__}: {type(exc).__name__}")
            hold()
    finally:
        p.close()
    return done


class Check:
    """The parent's side: at each hold, the daemon's figures against its ledger."""

    def __init__(self, sock: str, pid: int, region_bytes: int, before: Figures) -> None:
        self.sock, self.pid, self.region_bytes, self.before = sock, pid, region_bytes, before
        self.checks = 0
        self.worst: dict[str, float] = {}

    def __call__(self) -> None:
        fig = figures(self.pid)
        with kvoffload.connect(self.sock) as admin:
            ledger = admin.stats()["ledger"]
        lines, b = ledger["lines"], self.before
        total = {name: line["total"] for name, line in lines.items()}
        heap, mapped = ledger["heap_bytes"], total["mapped_bytes"]
        bounds = {
            "fds": (fig.fds, b.fds + total["connections"] + total["descriptors"] + SLACK_FDS),
            "maps": (fig.maps, b.maps + total["mappings"] + SLACK_MAPS),
            "threads": (fig.threads, b.threads + SLACK_THREADS),
            "rss_anon": (fig.rss_anon_bytes, b.rss_anon_bytes + heap + SLACK_ANON_BYTES),
            "rss_shmem": (fig.rss_shmem_bytes, self.region_bytes + mapped + SLACK_SHMEM_BYTES),
            "pte": (fig.pte_bytes, b.pte_bytes + mapped // 512 + SLACK_PTE_BYTES),
        }
        self.checks += 1
        for what, (have, bound) in bounds.items():
            self.worst[what] = max(self.worst.get(what, 0.0), have / bound)
            assert have <= bound, (
                f"check {self.checks}: the daemon holds {what} {have}, more than its ledger "
                f"accounts for ({bound}); ledger {total}, heap {ledger['heap_bytes']}"
            )
        for name, line in lines.items():
            for uid, held in line["by_uid"].items():
                assert held <= line["limit_per_uid"], f"uid {uid} holds {held} {name}"


def held_after_everyone_left(sock: str, deadline_s: float = 20.0) -> dict[str, object]:
    """The ledger's totals once the attackers' connections are closed: the daemon notices a
    closed connection on its next turn and releases a leaver in slices, so this polls until
    only the canary's and this admin connection's are left, each charged at most one
    step of buffered bytes (or the deadline passes)."""
    end = time.monotonic() + deadline_s
    with kvoffload.connect(sock) as admin:
        while True:
            lines = admin.stats()["ledger"]["lines"]
            left: dict[str, object] = {n: x["total"] for n, x in lines.items() if x["total"]}
            conns, buffered = lines["connections"]["total"], lines["buffered_bytes"]["total"]
            settled = conns <= 2 and buffered <= 2 * CHARGE_STEP_BYTES
            if settled:
                left.pop("connections", None)
                left.pop("buffered_bytes", None)
            if (settled and not left) or time.monotonic() > end:
                if left:  # who is still connected, to say whose they are
                    left["clients"] = [(c.client_id, c.pid, c.uid, c.name) for c in admin.clients()]
                return left
            time.sleep(0.05)


def test_what_the_daemon_holds_is_what_its_ledger_accounts_for(run: Path) -> None:
    sock = str(run / "k.sock")
    config = f"client_copy_uids = [{UIDS[1]}]\n"
    with start(run, "128MiB", config) as d, Measure("census", d) as f:
        region_bytes = figures(d.pid).rss_shmem_bytes
        check = Check(sock, d.pid, region_bytes, f.before)
        second: list[str] = []
        holds = [0]

        def both_hold() -> None:
            check()
            holds[0] += 1
            if holds[0] == len(GENERATORS):  # the first uid holds everything it took:
                second.extend(f.attack(lambda hold: census(sock, hold), uid=UIDS[1], during=check))

        first = f.attack(lambda hold: census(sock, hold), uid=UIDS[0], during=both_hold)
        worst = {k: round(v, 2) for k, v in check.worst.items()}
        f.note(f"{check.checks} checks; worst share of each bound {worst}; {first + second}")
        left = held_after_everyone_left(sock)
    assert check.checks >= 2 * len(GENERATORS)
    assert not left, f"held after everyone left: {left}"
    f.assert_round_trips()


def _open_sockets() -> set[str]:
    """The sockets this process has open (by inode)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if (target := os.readlink(f"/proc/self/fd/{fd}")).startswith("socket:"):
                out.add(target)
    return out


def test_a_closed_client_leaves_no_descriptor_of_its_connection_in_its_process(run: Path) -> None:
    """A client's keeper thread watches the connection through a duplicate of its
    descriptor: were it let go only once the keeper next ran, a process forked right
    after ``close()`` (the census canary, after the test's first client) would hold the
    connection open for as long as it lived, and the daemon would count it."""
    with start(run, "64MiB") as d:
        before = _open_sockets()
        for _ in range(20):
            client = kvoffload.connect(d.socket_path)
            client.ping()
            client.close()
            assert _open_sockets() == before
