"""Where a control-path request's time goes: the daemon's loop CPU and the client's.

``make bench`` gives the control rows as wall-clock percentiles beside a plain echo;
this breaks one request down, for working on the loop and the client library:

- **daemon CPU per request**: the loop thread's run time (``/proc/<pid>/task/<pid>/
  schedstat``, nanoseconds) over N requests, against the same for a plain Python epoll
  echo server (another process) over N echoes: what the daemon adds per request,
  whatever else the machine runs.
- **client CPU per call**: the calling thread's CPU time (``time.thread_time``) per
  call, for the library's calls and for a raw socket sending pre-encoded frames.
- **wall p50**, interleaved: blocks of echoes, bare-loop pings, raw pings and library
  calls alternate, so a neighbour's burst hits all of them alike.
- **the bare loop** (``wire``): a Python epoll loop in another process doing only the
  wire work the daemon does per request (``recvmsg_into`` with room for descriptors,
  decode of the request union, encode of the reply, one send), with no sessions,
  accounting or dispatch: the floor of any Python daemon, so that the gap from the
  echo splits into what the wire costs and what the daemon's own work does.
- Placement: every thread of the echo server and of the daemon pinned to the client's
  CPU, as ``make bench``'s target rows are (``echo_floor.placed``); ``--apart`` puts
  them on another CPU.
- ``--profile``: the daemon's loop under cProfile (a runner that wraps
  ``Server.serve_forever``), printed as function calls per request and the top
  functions by own time.

    python -m kvoffloadbench.bench_control [--n 20000] [--apart] [--profile ping|lookup|store]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pstats
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

import kvoffload
from kvoffload.protocol import encode_frame
from kvoffload.protocol import messages as m

from . import echo_floor
from .echo_floor import PING_FRAME, PONG_BYTES, EchoPeer, wire_peer
from .launch import BULK_STORES, DaemonProcess

if TYPE_CHECKING:
    from kvoffloadd.config import DaemonConfig

_replies: msgspec.msgpack.Decoder[m.Reply] = msgspec.msgpack.Decoder(m.Reply)

_RUNNER = """
import cProfile, os, sys
from kvoffloadd.server import server as srv
serve = srv.Server.serve_forever
def profiled(self):
    p = cProfile.Profile()
    p.enable()
    try:
        serve(self)
    finally:
        p.disable()
        p.dump_stats(os.environ["KVOFFLOAD_PROFILE_OUT"])
srv.Server.serve_forever = profiled
from kvoffloadd.main import main
sys.exit(main(sys.argv[1:]))
"""


def run_ns(pid: int, tid: int | None = None) -> int:
    """Nanoseconds thread ``tid`` of ``pid`` (default: its main thread) has run."""
    with open(f"/proc/{pid}/task/{tid or pid}/schedstat") as f:
        return int(f.read().split()[0])


def p50(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


class RawPing:
    """A bare socket to the daemon after a Hello: pre-encoded Ping frames, one recv."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.sendall(encode_frame(m.Hello(1, m.PROTOCOL_VERSION, "raw", os.getpid())))
        self.buf = bytearray(65536)
        self.sock.recv_into(self.buf)  # the Welcome (small: one read)

    def round_trip(self) -> None:
        self.sock.sendall(PING_FRAME)
        got = 0
        while got < PONG_BYTES:
            got += self.sock.recv_into(self.buf)


def per_call(fn: Callable[[], object], n: int, pid: int) -> dict[str, float]:
    """Wall p50, client thread CPU and daemon loop CPU per call, in µs."""
    walls = []
    d0, c0 = run_ns(pid), time.thread_time()
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    c1, d1 = time.thread_time(), run_ns(pid)
    return {
        "p50_us": p50(walls) * 1e6,
        "client_cpu_us": (c1 - c0) / n * 1e6,
        "daemon_cpu_us": (d1 - d0) / n / 1e3,
    }


def interleaved(fns: dict[str, Callable[[], object]], n: int, block: int = 200) -> dict[str, float]:
    """Wall p50 of each, measured in alternating blocks of ``block`` calls."""
    return {k: p50(v) * 1e6 for k, v in echo_floor.interleaved(fns, n, block).items()}


def filled(client: kvoffload.Client) -> tuple[kvoffload.Namespace, list[bytes]]:
    """The bench's namespace with 1,000 stored keys."""
    ns = client.namespace("ctl", kvoffload.KVLayout(tensor_page_bytes=[16384]))
    w = ns.attach_worker([kvoffload.shared_kv_cache(1000, 16384)])
    keys = [b"ctl-%08d" % i for i in range(1000)]
    plan = ns.prepare_store(keys)
    assert plan is not None
    w.submit_store(1, np.arange(1000), plan.slots)
    w.wait([1])
    ns.complete_store(keys)
    assert ns.lookup(keys) == 1000
    return ns, keys


def store_rounds(ns: kvoffload.Namespace) -> Callable[[], None]:
    count = iter(range(1 << 40))

    def store_round() -> None:
        i = next(count)
        ks = [b"r%07d-%03d" % (i, j) for j in range(16)]  # 12 bytes, as the namespace's
        ns.prepare_store(ks)
        ns.complete_store(ks, success=False)

    return store_round


def measure(n: int, apart: bool = False) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        echo = EchoPeer(message=PING_FRAME)  # the same bytes as a raw ping
        stack.callback(echo.close)
        wire = wire_peer()
        stack.callback(wire.close)
        d = stack.enter_context(
            DaemonProcess("256MiB", "--log-level", "warning", settings=BULK_STORES)
        )
        client = kvoffload.connect(d.socket_path)
        stack.callback(client.close)
        ns, keys = filled(client)
        servers = [echo.proc.pid, wire.proc.pid, d.pid]
        if not stack.enter_context(echo_floor.placed(servers, apart)):
            raise SystemExit("--apart needs two CPUs this process may use")
        return _measured(n, echo, wire, d, client, ns, keys)


def _measured(
    n: int,
    echo: EchoPeer,
    wire: EchoPeer,
    d: DaemonProcess,
    client: kvoffload.Client,
    ns: kvoffload.Namespace,
    keys: list[bytes],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    raw = RawPing(d.socket_path)
    echo_rt, wire_rt = echo.round_trip, wire.round_trip

    # daemon loop CPU per request against the echo server's per echo
    e0 = run_ns(echo.proc.pid)
    for _ in range(n):
        echo_rt()
    out["echo_server_cpu_us"] = (run_ns(echo.proc.pid) - e0) / n / 1e3
    out["raw_ping"] = per_call(raw.round_trip, n, d.pid)
    out["echo"] = per_call(echo_rt, n, d.pid)
    out["wire"] = per_call(wire_rt, n, wire.proc.pid)
    out["ping"] = per_call(client.ping, n, d.pid)
    out["lookup1000"] = per_call(lambda: ns.lookup(keys), n // 4, d.pid)
    out["store_round16"] = per_call(store_rounds(ns), n // 8, d.pid)
    out["wall_interleaved"] = interleaved(
        {"echo": echo_rt, "wire": wire_rt, "raw_ping": raw.round_trip, "ping": client.ping}, n
    )
    raw.sock.close()
    return out


def loop_config() -> DaemonConfig:
    """The in-process loop's configuration: its region is named after this process."""
    from kvoffloadd.config import DaemonConfig

    return DaemonConfig(instance=f"l{os.getpid()}", region_size="64MiB", max_writing_fraction=1.0)


class InProcess:
    """A real ``Server`` and ``Service`` in this process, driven one loop turn at a
    time from a raw client socket: the loop's time per request with nothing else
    between (the median of per-turn wall times, single-threaded)."""

    def __init__(self) -> None:
        from kvoffloadd.copies.copier import CpuCopier
        from kvoffloadd.region.region import Geometry, SharedOffloadRegion
        from kvoffloadd.server.listener import bind_listener
        from kvoffloadd.server.server import Server
        from kvoffloadd.service.service import Service

        # what is made is released in reverse, by close() or by a failed start
        with contextlib.ExitStack() as made:
            self._tmp = tempfile.mkdtemp(prefix="kvoffload-loop-")
            made.callback(shutil.rmtree, self._tmp, True)
            cfg = loop_config()
            plan = Geometry.plan(64 << 20, 2 << 20, 16384)
            self.region = SharedOffloadRegion(cfg.region_name, plan)
            made.callback(self.region.close)
            self.copier = CpuCopier(1)
            made.callback(self.copier.close)
            path = os.path.join(self._tmp, "s.sock")
            self.server = Server(Service(cfg, self.region, self.copier), bind_listener(path))
            made.callback(self.server.listener.close)
            made.callback(self.server.close)
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            made.callback(self.sock.close)
            self.sock.connect(path)
            self.buf = bytearray(1 << 20)
            self._setup()
            self._made = made.pop_all()

    def _setup(self) -> None:
        self.server.turn(0.0)  # accept
        self.call(m.Hello(1, m.PROTOCOL_VERSION, "loop", os.getpid()))
        layout = kvoffload.KVLayout(tensor_page_bytes=[16384])
        opened = self.call(m.OpenNamespace(2, "ctl", layout))
        assert isinstance(opened, m.NamespaceOpened), opened
        self.ns = opened.ns
        self.keys = [b"ctl-%08d" % i for i in range(1000)]
        index = self.server.service.namespaces[self.ns]
        plan = index.prepare_store(self.keys, 0)
        assert plan is not None
        index.mark_written(plan.slots, 0)
        index.complete_store(self.keys, True, 0)

    def call(self, req: m.Request) -> m.Reply:
        self.sock.sendall(encode_frame(req))
        self.server.turn(0.0)
        n = self.sock.recv_into(self.buf)
        return _replies.decode(memoryview(self.buf)[4:n])

    def per_turn(self, frames: list[bytes], n: int) -> float:
        """Median µs of a loop turn serving each of ``frames`` in turn (a request and
        its reply each; replies are read and dropped outside the timing)."""
        took = []
        sock, turn, buf = self.sock, self.server.turn, self.buf
        for i in range(n):
            sock.sendall(frames[i % len(frames)])
            t0 = time.perf_counter()
            turn(0.0)
            took.append(time.perf_counter() - t0)
            sock.recv_into(buf)
        return p50(took) * 1e6

    def engine_cycle_us(self, batch: int, n: int) -> float:
        """Median µs per block of an engine's store cycle on the namespace's index, as
        a step batch drives it: a lease refill of ``batch`` slots (evicting to make room
        once the region is full), their claims, the worker's copy report, the commits."""
        index = self.server.service.namespaces[self.ns]
        token, client = 7, 3

        def cycle(i: int) -> None:
            slots = index.lease(token, batch, client)
            keys = [b"c%011d" % (i * batch + j) for j in range(len(slots))]
            index.claim(token, client, keys, slots)
            index.mark_written(slots, 0)
            index.commit(token, client, keys, True)

        for i in range(n // 10):  # warm: the pool's slots all cycled once
            cycle(i)
        took = []
        for i in range(n // 10, n // 10 + n):
            t0 = time.perf_counter()
            cycle(i)
            took.append(time.perf_counter() - t0)
        return p50(took) * 1e6 / batch

    def close(self) -> None:
        self._made.close()


def echo_turn_us(n: int) -> float:
    """The same for a plain epoll echo in this process: poll, receive, send."""
    import select

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.setblocking(False)
    ep = select.epoll()
    ep.register(b.fileno(), select.EPOLLIN)
    buf, rbuf = bytearray(65536), bytearray(65536)
    took = []
    for _ in range(n):
        a.sendall(PING_FRAME)
        t0 = time.perf_counter()
        for _fd, _ev in ep.poll(0):
            k = b.recv_into(buf)
            b.send(memoryview(buf)[:k])
        took.append(time.perf_counter() - t0)
        a.recv_into(rbuf)
    ep.close()
    a.close()
    b.close()
    return p50(took) * 1e6


def loop_costs(n: int) -> dict[str, float]:
    """µs of loop per request, in this process: echo, ping, lookup of 1,000 keys,
    prepare and complete of 16 keys; and µs per block of an engine's store cycle on
    the index, for a step batch of 4 and of 17 blocks."""
    lp = InProcess()
    try:
        ns, keys = lp.ns, lp.keys
        packed = b"".join(keys)
        out = {"echo": echo_turn_us(n)}
        out["ping"] = lp.per_turn([encode_frame(m.Ping(3))], n)
        out["lookup1000"] = lp.per_turn([encode_frame(m.Lookup(4, ns, packed, 12))], n // 4)
        rounds = []
        for i in range(n // 4):
            ks = b"".join(b"r%07d-%03d" % (i, j) for j in range(16))
            rounds.append(encode_frame(m.PrepareStore(5, ns, ks, 12)))
            rounds.append(encode_frame(m.CompleteStore(6, ns, ks, 12, False)))
        out["store_round16"] = 2 * lp.per_turn(rounds, len(rounds))
        for batch in (4, 17):  # a step's stores at N = 64 and N = 256 (16-token blocks)
            out[f"engine_store_per_block_of_{batch}"] = lp.engine_cycle_us(batch, n // 10)
    finally:
        lp.close()
    return out


def profile(what: str, n: int, top: int) -> str:
    tmp = tempfile.mkdtemp(prefix="kvoffload-prof-")
    out = os.path.join(tmp, "loop.prof")
    env = dict(os.environ, KVOFFLOAD_NO_REEXEC="1", KVOFFLOAD_PROFILE_OUT=out)
    command = (sys.executable, "-c", _RUNNER)
    with DaemonProcess(
        "256MiB", "--log-level", "warning", settings=BULK_STORES, command=command, env=env
    ) as d:
        client = kvoffload.connect(d.socket_path)
        ns, keys = filled(client)
        fn: Callable[[], object] = {
            "ping": client.ping,
            "raw": RawPing(d.socket_path).round_trip,
            "lookup": lambda: ns.lookup(keys),
            "store": store_rounds(ns),
        }[what]
        calls = 2 if what == "store" else 1  # a store round is two requests
        for _ in range(n):
            fn()
        client.close()
    stats = pstats.Stats(out)
    os.unlink(out)
    os.rmdir(tmp)
    total = stats.total_calls  # type: ignore[attr-defined]
    lines = [f"{what}: {n * calls} requests, {total / (n * calls):.1f} function calls each"]
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
    lines.append(f"{'own us/req':>10} {'calls/req':>9}  function")
    for (file, line, name), (_cc, nc, tt, _ct, _callers) in rows[:top]:
        lines.append(
            f"{tt / (n * calls) * 1e6:10.2f} {nc / (n * calls):9.2f}  "
            f"{os.path.basename(file)}:{line} {name}"
        )
    return "\n".join(lines)


def report(r: dict[str, Any]) -> str:
    lines = [f"echo server CPU per echo: {r['echo_server_cpu_us']:.1f} us"]
    lines.append(f"{'':14} {'p50 us':>8} {'client CPU':>10} {'daemon CPU':>10}")
    for k in ("echo", "wire", "raw_ping", "ping", "lookup1000", "store_round16"):
        x = r[k]
        lines.append(
            f"{k:14} {x['p50_us']:8.1f} {x['client_cpu_us']:10.1f} {x['daemon_cpu_us']:10.1f}"
        )
    w = r["wall_interleaved"]
    lines.append(
        "interleaved p50: "
        + ", ".join(f"{k} {v:.1f} us" for k, v in w.items())
        + "; / echo: "
        + ", ".join(f"{k} {w[k] / w['echo']:.2f}" for k in ("wire", "raw_ping", "ping"))
    )
    lines.append("(wire: the bare loop's CPU in the daemon CPU column)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvoffloadbench.bench_control")
    p.add_argument("--n", type=int, default=20000, help="requests per figure")
    p.add_argument("--profile", choices=["ping", "raw", "lookup", "store"])
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--loop", action="store_true", help="the loop in this process only")
    p.add_argument("--apart", action="store_true", help="servers on another CPU than the client")
    args = p.parse_args(argv)
    if args.loop:
        costs = loop_costs(args.n)
        print(
            "loop turn p50 in this process: "
            + ", ".join(f"{k} {v:.1f} us" for k, v in costs.items())
        )
    elif args.profile:
        print(profile(args.profile, args.n, args.top))
    else:
        print(report(measure(args.n, args.apart)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
