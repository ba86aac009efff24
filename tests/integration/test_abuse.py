"""Clients that try to exhaust what all clients share: descriptors, memory, the loop's
time. Each scenario runs against a real daemon while a canary client pings it
without pause; the daemon must stay alive and keep serving the canary, cut off the
abuser, and come back to its descriptor count. Each prints one line of figures
(``pytest -s``): the daemon's RSS and descriptors before, during and after the abuse,
and the worst round trip the canary saw."""

from __future__ import annotations

import array
import contextlib
import os
import resource
import shutil
import signal
import socket
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from canary import Canary
from children import fork, reap
from helpers import poll
from hostile import NOBODY, as_uid, fd_count, requires_root, rss_bytes

import kvoffload
from kvoffload.protocol import messages as m
from kvoffload.protocol.connection import encode_frame
from kvoffloadbench.launch import DaemonProcess
from kvoffloadd.service.budgets import FD_TABLE_MAX

MIB = 1 << 20
RSS_SLACK_BYTES = 32 * MIB  # what a daemon may keep after the abuser left


@pytest.fixture
def limited_daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    """A daemon at a 1,024-descriptor limit (the usual default)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    d = DaemonProcess("64MiB", "--log-level", "error")
    import subprocess

    d.proc = subprocess.Popen(d.args, stdout=subprocess.PIPE, preexec_fn=limit)
    assert d.proc.stdout is not None
    d.banner = d.proc.stdout.readline().decode()
    assert "listening" in d.banner
    yield d
    assert d.alive(), "the daemon died"
    assert d.stop() == 0


def abuse(
    name: str,
    d: DaemonProcess,
    attack: Callable[[], socket.socket | list[socket.socket] | None],
) -> None:
    """Run ``attack`` against ``d`` with a canary; check and print the figures."""
    canary = Canary(d.socket_path, d.pid)
    time.sleep(0.05)
    rss0, fds0 = rss_bytes(d.pid), fd_count(d.pid)
    held = attack()
    rss1, fds1 = rss_bytes(d.pid), fd_count(d.pid)
    assert d.alive(), f"{name}: the daemon died"
    for s in held if isinstance(held, list) else [held] if held is not None else []:
        s.close()  # the abuser goes away (one as another uid is gone already)
    poll(lambda: fd_count(d.pid) <= fds0 + 2, f"{name}: descriptors back", deadline_s=20)
    # memory back too: buffers freed, the heap trimmed by the next cron turn (1 s)
    poll(lambda: rss_bytes(d.pid) <= rss0 + RSS_SLACK_BYTES, f"{name}: memory back", 10)
    rss2, fds2 = rss_bytes(d.pid), fd_count(d.pid)
    canary.stop()
    print(
        f"\n{name}: RSS {rss0 / MIB:.0f} -> {rss1 / MIB:.0f} -> {rss2 / MIB:.0f} MiB, fds "
        f"{fds0} -> {fds1} -> {fds2}, {canary.line()}"
    )
    canary.check(name)
    with kvoffload.connect(d.socket_path) as c:
        assert c.ping() > 0


def raw(path: str, hello: bool = True) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    if hello:
        s.sendall(encode_frame(m.Hello(1, m.PROTOCOL_VERSION, "abuser", 0)))
    return s


def test_a_connection_flood_at_the_descriptor_limit_is_shed(limited_daemon: DaemonProcess) -> None:
    """1,100 connections against a 1,024 limit: the daemon sheds what it cannot take."""
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    )

    def flood() -> list[socket.socket]:
        socks = []
        for _ in range(1100):
            with contextlib.suppress(OSError):
                socks.append(raw(limited_daemon.socket_path, hello=False))
        time.sleep(0.5)
        return socks

    abuse("1,100 connections at a 1,024 limit", limited_daemon, flood)
    with kvoffload.connect(limited_daemon.socket_path) as c:
        assert c.stats()["budgets"]["clients_shed_total"] > 0


def test_descriptors_parked_with_scm_rights_are_charged_and_cut_off(daemon: DaemonProcess) -> None:
    """20 connections each parking 1,000 descriptors that no message claims."""

    def park() -> list[socket.socket]:
        socks, spare = [], os.open("/dev/null", os.O_RDONLY)
        for _ in range(20):
            s = raw(daemon.socket_path)
            try:
                for _ in range(4):
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [spare] * 250))]
                    s.sendmsg([b"\0"], anc)
            except OSError:
                pass
            socks.append(s)
        os.close(spare)
        time.sleep(0.3)
        return socks

    abuse("20 x 1,000 parked descriptors", daemon, park)


@contextlib.contextmanager
def reachable_daemon(settings: dict[str, object] | None = None) -> Iterator[DaemonProcess]:
    """A daemon whose socket another uid reaches (its directory 0755, the socket
    0660: group 0); it must stop cleanly."""
    requires_root()
    run = Path(tempfile.mkdtemp(prefix="kvoffload-abuse-"))
    run.chmod(0o755)
    sock = str(run / "k.sock")
    with DaemonProcess("64MiB", "--log-level", "warning", socket_path=sock,
                       settings=settings) as d:  # fmt: skip
        yield d
        assert d.stop() == 0
    shutil.rmtree(run, ignore_errors=True)


def test_a_descriptor_whose_close_would_wait_never_holds_the_loop() -> None:
    """Another uid sends a TCP socket with unsent data nobody reads and a 60 s
    ``SO_LINGER`` with a ping, drops its own copy and hangs up. The daemon's close of
    what the connection parked is the socket's last: it would wait out the linger time
    on the loop (15 s stalls seen) if the daemon closed it there."""
    with reachable_daemon() as d:
        abuse("a lingering socket parked and left", d, lambda: as_uid(linger(d), NOBODY, 0))


def linger(d: DaemonProcess) -> Callable[[], None]:
    """The attack, to run as another uid."""
    path = d.socket_path

    def linger() -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        tcp = socket.socket()  # no name lookup: the child imports nothing new (idna)
        tcp.connect(listener.getsockname())
        peer, _ = listener.accept()  # never reads, while the daemon closes the socket
        tcp.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                tcp.send(b"x" * 65536)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 60))
        s = raw(path)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [tcp.fileno()]))]
        s.sendmsg([encode_frame(m.Ping(2))], anc)
        tcp.close()
        s.close()  # the daemon closes what the connection parked
        time.sleep(0.5)  # the canary pings on meanwhile
        peer.close()
        listener.close()

    return linger


def test_the_descriptor_table_is_grown_to_the_limit_at_start(daemon: DaemonProcess) -> None:
    """Grown later, by descriptors peers send, each doubling of the table waits for an RCU
    grace period inside the loop's recvmsg (20-30 ms each; 20,000 parked descriptors
    stalled the canary 84-133 ms)."""
    with kvoffload.connect(daemon.socket_path) as c:
        limit = c.stats()["budgets"]["fd_limit"]
    assert fd_table_size(daemon.pid) >= min(limit, FD_TABLE_MAX)


def fd_table_size(pid: int) -> int:
    """How many descriptors the process's table holds now (``FDSize``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("FDSize:"):
                return int(line.split()[1])
    raise AssertionError("no FDSize in /proc/<pid>/status")


def test_partial_frames_stay_within_the_buffer_budget(daemon: DaemonProcess) -> None:
    """40 clients each start a 16 MiB frame and never finish it: 640 MiB if unbounded."""

    def start_frames() -> list[socket.socket]:
        socks = []
        for _ in range(40):
            s = raw(daemon.socket_path)
            with contextlib.suppress(OSError):
                s.sendall(struct.pack("<I", 16 * MIB - 64) + b"\x91" + b"\0" * (15 * MIB))
            socks.append(s)
        time.sleep(0.3)
        return socks

    rss0 = rss_bytes(daemon.pid)
    abuse("40 unfinished 16 MiB frames", daemon, start_frames)
    assert rss_bytes(daemon.pid) - rss0 < 400 * MIB


def never_reading(daemon: DaemonProcess) -> Callable[[], list[socket.socket]]:
    """The attack of 30 clients that pipeline requests with large replies and never read
    them, one of which writes 4,000 GetStats in one go (64 namespaces make each reply
    some 40 KB)."""
    with kvoffload.connect(daemon.socket_path) as c:
        for i in range(64):
            c.namespace(f"ns-{i:03d}", kvoffload.KVLayout([4096]))

    def pipeline() -> list[socket.socket]:
        socks = []
        for i in range(31):
            s = raw(daemon.socket_path)
            n = 4000 if i == 0 else 200
            frames = b"".join(encode_frame(m.GetStats(rid)) for rid in range(2, n + 2))
            s.setblocking(False)
            with contextlib.suppress(OSError):
                s.send(frames)
            socks.append(s)
        time.sleep(1.0)
        return socks

    return pipeline


def test_clients_that_never_read_are_paused_not_fed(daemon: DaemonProcess) -> None:
    """Nobody waits behind 31 clients that never read their replies."""
    attack = never_reading(daemon)
    rss0 = rss_bytes(daemon.pid)
    abuse("31 non-reading clients", daemon, attack)
    assert rss_bytes(daemon.pid) - rss0 < 200 * MIB


@contextlib.contextmanager
def sharing_a_cpu(pid: int) -> Iterator[None]:
    """Every thread of ``pid`` on one CPU with a process that spins there: the kernel
    takes that CPU from the daemon for milliseconds at a time, in the middle of whatever
    it serves."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: one shared with the daemon, one for the canary")
    shared = {cpus[0]}
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), shared)

    def spin() -> None:
        os.sched_setaffinity(0, shared)
        while True:
            pass

    hog = fork(spin)
    try:
        yield
    finally:
        os.kill(hog, signal.SIGKILL)
        reap(hog)


def test_a_client_is_not_charged_for_the_time_the_kernel_took_the_cpu(
    daemon: DaemonProcess,
) -> None:
    """The same attack with the daemon sharing its CPU with a spinning process. The loop
    orders a uid's connections by the loop time each used; charged in wall time, a ping
    during which the kernel ran other work for 4 ms put the canary behind rounds of the
    31 others' units (41-100 ms beside another suite). A queued unit is charged no more
    than the loop thread's CPU time. A stress run of invariant 15; the regression test is
    test_loop_clock's fake CPU clock."""
    attack = never_reading(daemon)
    with sharing_a_cpu(daemon.pid):
        abuse("31 non-reading clients, the daemon's CPU shared", daemon, attack)


def test_a_request_of_a_million_keys_is_refused_before_it_holds_the_loop(
    daemon: DaemonProcess,
) -> None:
    def huge() -> socket.socket:
        s = raw(daemon.socket_path)
        s.sendall(encode_frame(m.OpenNamespace(2, "big", kvoffload.KVLayout([4096]))))
        s.sendall(encode_frame(m.Lookup(3, 0, b"k" * 8 * 1_000_000, 8)))
        time.sleep(0.3)
        return s

    abuse("a lookup of 1,000,000 keys", daemon, huge)
    with kvoffload.connect(daemon.socket_path) as c:  # past the schema's bound: at decode
        assert c.stats()["errors"].get("PROTOCOL_ERROR", 0) >= 1


def test_a_refused_uid_is_disconnected_at_once(tmp_path: Path) -> None:
    """A uid the config does not allow gets one PERMISSION_DENIED and is closed: it
    holds no connection slot and can park nothing."""
    requires_root()
    cfg = tmp_path / "allow.toml"
    cfg.write_text("allow_uids = [4243]\n")
    run = Path(tempfile.mkdtemp(prefix="kvoffload-refuse-"))  # reachable by other uids
    run.chmod(0o755)
    sock = str(run / "k.sock")
    with DaemonProcess("32MiB", "--config", str(cfg), socket_path=sock) as d:

        def knock() -> bytes:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)  # a guard: the daemon answers before the Hello, then closes
            s.connect(sock)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            return data

        data = as_uid(knock, NOBODY, gid=0)  # gid 0 reaches the 0660 socket
        reply = msgspec.msgpack.decode(data[4:], type=m.Reply)
        assert isinstance(reply, m.ErrorReply) and reply.code == 5  # refused, then closed
        with kvoffload.connect(sock) as c:
            assert c.stats()["clients"]["connected"] == 1  # only us
        assert d.stop() == 0
    shutil.rmtree(run, ignore_errors=True)


def test_idle_connections_to_the_metrics_port_are_bounded() -> None:
    """1,100 idle TCP connections to the metrics port: one thread, at most 64 held."""
    from kvoffloadbench.server_process import free_port

    port = free_port()
    with DaemonProcess("64MiB", "--metrics-port", str(port), "--log-level", "error") as d:

        def flood() -> list[socket.socket]:
            socks = []
            for _ in range(1100):
                with contextlib.suppress(OSError):
                    socks.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            time.sleep(0.3)
            assert fd_count(d.pid) < 13 + 64 + 16
            assert len(os.listdir(f"/proc/{d.pid}/task")) < 16  # no thread per connection
            return socks

        abuse("1,100 idle metrics connections", d, flood)
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            assert r.status == 200
        assert d.stop() == 0


BAD_FRAMES = 3000  # a warning line each: past what the pipe, the writer and its queue hold


def test_a_log_reader_that_stops_reading_holds_nobody_up() -> None:
    """The daemon's stderr is a pipe whose reader has stopped reading (journald behind
    a slow disk), and another uid makes it log a warning per connection (3,000 bad
    frames): the canary is served throughout, the lines past what waits for the writer
    are dropped and counted, and once the reader reads again the count is told."""
    run = Path(tempfile.mkdtemp(prefix="kvoffload-abuse-"))
    run.chmod(0o755)  # the other uid reaches the socket
    fifo = str(run / "log")
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # open, and never read until the end
    d = DaemonProcess(
        "64MiB", "--log-level", "warning", socket_path=str(run / "k.sock"), log_path=fifo
    ).start()
    try:
        canary = Canary(d.socket_path, d.pid)

        def bad_frames() -> int:
            for _ in range(BAD_FRAMES):
                with raw(d.socket_path) as s:
                    s.sendall(b"\xff" * 64)  # not a frame: one warning, then closed
                    s.settimeout(30)
                    while s.recv(4096):  # the error reply, then the end
                        pass
            return BAD_FRAMES

        assert as_uid(bad_frames, NOBODY, gid=0) == BAD_FRAMES  # group 0 reaches the socket
        with kvoffload.connect(d.socket_path) as c:
            poll(lambda: c.stats()["errors"].get("PROTOCOL_ERROR", 0) >= BAD_FRAMES,
                 "every bad frame refused", deadline_s=60)  # fmt: skip
        canary.stop()
        print(f"\nlog reader stopped, {BAD_FRAMES} bad frames: {canary.line()}")
        canary.check("a log reader that stopped")
        assert d.alive()
        text = b""
        deadline = time.monotonic() + 30
        while b"log lines dropped" not in text:  # it reads again; one more line tells
            assert time.monotonic() < deadline, "no line told what was dropped"
            with contextlib.suppress(BlockingIOError):
                text += os.read(reader, 1 << 20)
            with raw(d.socket_path) as s:  # one more warning, after the drops
                s.sendall(b"\xff" * 64)
                with contextlib.suppress(OSError):
                    s.recv(4096)  # its error reply: the line is written by then
    finally:
        with contextlib.suppress(OSError):
            while os.read(reader, 1 << 20):  # the rest, so the daemon can stop
                pass
        assert d.stop() == 0
        os.close(reader)
        shutil.rmtree(run, ignore_errors=True)


QUOTED_FRAMES = 24


def test_a_frame_its_decoder_would_quote_whole_costs_neither_memory_nor_log() -> None:
    """Scenario: another uid, the daemon's log reader stopped, sends on each of 24
    connections a Hello and a 4 MiB frame whose tag is backslashes (the decoder's error
    quotes an unknown tag whole, and a log line escapes every backslash: 8 MiB a line,
    held in the log's queue). Each is refused with a reply of a few hundred bytes, and
    the daemon's own memory stays where it was."""
    run = Path(tempfile.mkdtemp(prefix="kvoffload-abuse-"))
    run.chmod(0o755)  # the other uid reaches the socket
    fifo = str(run / "log")
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # never read until the end
    d = DaemonProcess(
        "64MiB", "--log-level", "warning", socket_path=str(run / "k.sock"), log_path=fifo
    ).start()
    body = msgspec.msgpack.encode(["\\" * (4 << 20), 1])
    frame = struct.pack("<I", len(body)) + body  # after raw()'s Hello
    try:
        before = rss_bytes(d.pid)

        def quoted() -> list[int]:
            answers = []
            for _ in range(QUOTED_FRAMES):
                with raw(d.socket_path) as s:
                    s.sendall(frame)
                    s.settimeout(30)
                    got = b""
                    while chunk := s.recv(1 << 16):  # the Welcome, the error, the end
                        got += chunk
                    answers.append(len(got))
            return answers

        answers = as_uid(quoted, NOBODY, gid=0)  # group 0 reaches the socket
        assert len(answers) == QUOTED_FRAMES and max(answers) < 1024, answers
        assert d.alive()
        assert rss_bytes(d.pid) - before < 32 << 20
    finally:
        with contextlib.suppress(OSError):
            while os.read(reader, 1 << 20):  # the rest, so the daemon can stop
                pass
        assert d.stop() == 0
        os.close(reader)
        shutil.rmtree(run, ignore_errors=True)


def test_a_wait_is_charged_per_job_it_names_and_ends_with_its_last_job() -> None:
    """Each WaitJobs keeps a set of the jobs it waits for, and finishing a job once
    walked every wait of the connection: 1,024 waits of 4,096 jobs each grew a daemon
    by 540 MiB its ledger did not see, and held the loop for 594 ms. A wait is charged
    per job it names (``waits``: 65,536 per connection), and a finished job ends only
    the waits on it. The waiter is another uid, one allowed to copy for itself."""
    with reachable_daemon({"client_copy_uids": [NOBODY]}) as d:
        as_uid(lambda: wait_on_jobs(d.socket_path), NOBODY, 0)


def wait_on_jobs(path: str) -> None:
    """The attack and its checks, as the waiting uid (the ledger's totals are
    everyone's to read)."""
    from liar import Liar

    from kvoffload.protocol.packing import pack_ids, unpack_ids

    def waits_held() -> int:
        with kvoffload.connect(path) as c:
            return int(c.stats()["ledger"]["lines"]["waits"]["total"])

    jobs = 8
    liar = Liar(path)
    try:
        ns = liar.open("waits", m.KVLayout([4096])).ns
        cache = m.CacheDesc("client", 64, 4096)
        attached = liar.call(m.AttachWorker(0, ns, 0, [cache], client_copy=True))
        assert isinstance(attached, m.WorkerAttached), attached
        w = attached.worker
        plan = liar.call(m.PrepareStore(0, ns, b"".join(b"w%07d" % i for i in range(jobs)), 8))
        assert isinstance(plan, m.StorePlanReply), plan
        slots = unpack_ids(plan.slots)
        for j in range(jobs):  # client copies nobody reports: in flight until said
            copy = liar.call(m.SubmitStore(0, w, j, pack_ids([j]), pack_ids([slots[j]])))
            assert isinstance(copy, m.CopyPlanReply), copy
        per_connection = 65536 // jobs  # waits on all the jobs that one connection may keep
        rids = [liar.rid() for _ in range(per_connection + 1)]
        for rid in rids:
            liar.send(m.WaitJobs(rid, w, list(range(jobs))))
        refused = liar.call(m.Ping(0))  # every wait is in before this is answered
        assert isinstance(refused, m.Pong)
        errors = [r for r in liar.pushes if isinstance(r, m.ErrorReply)]
        assert [e.rid for e in errors] == [rids[-1]]  # past 65,536 job ids: refused
        assert waits_held() == 65536
        for j in range(jobs - 1):
            assert isinstance(liar.call(m.ClientCopyDone(0, w, j, True)), m.OkReply)
        assert not [r for r in liar.pushes if isinstance(r, m.OkReply)]  # one job left
        assert waits_held() == per_connection
        assert isinstance(liar.call(m.ClientCopyDone(0, w, jobs - 1, True)), m.OkReply)
        deadline = time.monotonic() + 20
        while len([r for r in liar.pushes if isinstance(r, m.OkReply)]) < per_connection:
            liar._keep(liar.next(deadline))
        answered = {r.rid for r in liar.pushes if isinstance(r, m.OkReply)}
        assert answered == set(rids[:-1])
        assert waits_held() == 0
    finally:
        liar.close()
