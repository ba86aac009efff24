"""The canary: a client in its own process pinging a daemon without pause while a test
attacks it. Its worst round trip is what another client waited (DESIGN.md invariant 15:
under ``ROUND_TRIP_LIMIT_S`` in every hostile test).

A round trip is charged to the daemon less the time the kernel kept the daemon's loop
thread or the canary waiting for a CPU over that round trip (``run_delay``, the second
figure of ``/proc/<pid>/task/<tid>/schedstat``, in nanoseconds), and less what a
hypervisor took from the machine's CPUs over it (``steal`` in ``/proc/stat``, in ticks:
a stolen vCPU shows its thread neither running nor waiting): that is what the
machine's other work cost, not what the daemon made the canary wait. So the bound holds
on a loaded machine (the suites side by side, on 2 vCPUs) and still catches a loop that
served something else first, or a handler that ran long: those are the loop's own time.
Both worsts are reported, the wall one and the charged one.

Rules:
- The canary is a process of its own (``children.fork``): no lock or interpreter of the
  test's is between it and the daemon.
- It speaks the protocol raw (``liar.Liar``), one Ping at a time, and sleeps
  ``pause_s`` between pings.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import time

from children import fork, reap, receive, send
from liar import Liar

from kvoffload.protocol import messages as m

ROUND_TRIP_LIMIT_S = 0.100  # DESIGN.md invariant 15: another client's worst round trip
GIVE_UP_S = 60.0  # a ping unanswered this long ends the canary (reported)
_NS_PER_TICK = 10**9 // os.sysconf("SC_CLK_TCK")  # /proc/stat counts in these


class RunQueueWaits:
    """Nanoseconds the daemon's loop thread (its main thread) and the calling thread have
    spent waiting for a CPU, together, and the loop thread on a CPU. Open it on the
    thread that pings."""

    def __init__(self, daemon_pid: int) -> None:
        self._fds = [
            os.open(f"/proc/{daemon_pid}/task/{daemon_pid}/schedstat", os.O_RDONLY),
            os.open("/proc/thread-self/schedstat", os.O_RDONLY),
            os.open("/proc/stat", os.O_RDONLY),
        ]

    def ns(self) -> tuple[int, int, int, int]:
        """(the loop thread's waits for a CPU, the calling thread's, the loop thread's
        time on a CPU, the time a hypervisor took from this machine's CPUs, all of them
        together: ``steal`` in ``/proc/stat``, kept in ticks of ``USER_HZ``)."""
        loop = os.pread(self._fds[0], 128, 0).split()
        mine = os.pread(self._fds[1], 128, 0).split()
        cpus = os.pread(self._fds[2], 256, 0).split(b"\n", 1)[0].split()
        return int(loop[1]), int(mine[1]), int(loop[0]), int(cpus[8]) * _NS_PER_TICK

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)


def _ping(path: str, daemon_pid: int, pause_s: float, stop: int, out: int) -> None:
    """The canary's process: ping until told to stop, then report."""
    worst_s = worst_wall_s = 0.0
    # the worst charged one's wall time, and each thread's waits and the loop's running
    worst_split = (0.0, 0.0, 0.0, 0.0, 0.0)
    pings, error = 0, ""
    waits: RunQueueWaits | None = None
    t0 = time.perf_counter()
    try:
        liar = Liar(path, timeout_s=GIVE_UP_S)
        waits = RunQueueWaits(daemon_pid)
        ping = m.Ping(0)
        while not select.select([stop], [], [], pause_s)[0]:
            before, t0 = waits.ns(), time.perf_counter()
            liar.call(ping)
            wall_s = time.perf_counter() - t0
            loop_wait, my_wait, loop_ran, stolen = (b - a for a, b in zip(before, waits.ns()))
            charged_s = wall_s - (loop_wait + my_wait + stolen) / 1e9
            worst_wall_s = max(worst_wall_s, wall_s)
            if charged_s > worst_s:
                split = (wall_s, loop_wait / 1e9, my_wait / 1e9, loop_ran / 1e9, stolen / 1e9)
                worst_s, worst_split = charged_s, split
            pings += 1
            if pings == 1:
                send(out, b"S")
    except BaseException as exc:  # the daemon cut it off, or stalled past giving up
        worst_wall_s = max(worst_wall_s, time.perf_counter() - t0)
        worst_s = max(worst_s, worst_wall_s)
        error = repr(exc)
        if pings == 0:
            send(out, b"S")
    finally:
        if waits is not None:
            waits.close()
    send(out, b"D", pickle.dumps((worst_s, worst_wall_s, worst_split, pings, error)))


class Canary:
    """Pings the daemon at ``path`` (pid ``daemon_pid``) from a child process, from
    construction until ``stop()``; then ``worst_s`` (charged), ``worst_wall_s``,
    ``pings`` and ``error`` (how it ended early, if it did) say what it saw."""

    def __init__(self, path: str, daemon_pid: int, pause_s: float = 0.001) -> None:
        self.worst_s = self.worst_wall_s = 0.0
        self.worst_split = (0.0, 0.0, 0.0, 0.0, 0.0)
        self.pings = 0
        self.error = ""
        stop_r, self._stop = os.pipe()
        self._out, out_w = os.pipe()

        def child() -> None:
            os.close(self._stop)
            os.close(self._out)
            _ping(path, daemon_pid, pause_s, stop_r, out_w)

        self._pid = fork(child)
        os.close(stop_r)
        os.close(out_w)
        tag, _ = receive(self._out, time.monotonic() + 20)
        assert tag == b"S", "the canary never started"

    def stop(self) -> None:
        if not self._pid:
            return
        try:
            with contextlib.suppress(OSError):  # it may have ended already
                os.write(self._stop, b"x")
            _, payload = receive(self._out, time.monotonic() + GIVE_UP_S + 10)
            report = pickle.loads(payload)
            self.worst_s, self.worst_wall_s, self.worst_split, self.pings, self.error = report
        except (OSError, EOFError, TimeoutError) as exc:
            self.error = f"no report from the canary: {exc!r}"
        finally:
            os.close(self._stop)
            os.close(self._out)
            reap(self._pid)
            self._pid = 0

    def line(self) -> str:
        """Its figures, for the test's printed line."""
        text = (
            f"canary worst {self.worst_s * 1e3:.1f} ms charged to the daemon "
            f"({self.worst_wall_s * 1e3:.1f} ms wall) over {self.pings} pings"
        )
        if self.worst_s >= ROUND_TRIP_LIMIT_S / 2:
            text += f" [{self.split()}]"
        return f"{text} (ended: {self.error})" if self.error else text

    def split(self) -> str:
        """Where the worst charged round trip went: the loop thread on a CPU, waiting
        for one, or neither (blocked: a lock, the kernel; or the host took the CPU), and
        what the canary waited for a CPU."""
        wall_s, loop_wait_s, my_wait_s, loop_ran_s, stolen_s = self.worst_split
        blocked_s = wall_s - loop_ran_s - loop_wait_s
        return (
            f"worst {wall_s * 1e3:.1f} ms wall: the loop thread {loop_ran_s * 1e3:.1f} on a"
            f" CPU, {loop_wait_s * 1e3:.1f} waiting for one, {blocked_s * 1e3:.1f} neither;"
            f" the canary {my_wait_s * 1e3:.1f} waiting for a CPU; the hypervisor took"
            f" {stolen_s * 1e3:.0f} of the CPUs"
        )

    def check(self, name: str, limit_s: float = ROUND_TRIP_LIMIT_S) -> None:
        """Invariant 15: the canary served throughout, never waiting ``limit_s``."""
        assert not self.error, f"{name}: the canary failed: {self.error}"
        assert self.worst_s < limit_s, (
            f"{name}: another client waited {self.worst_s * 1e3:.0f} ms for a ping "
            f"({self.worst_wall_s * 1e3:.0f} ms wall; {self.split()})"
        )
