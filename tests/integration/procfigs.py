"""A process's own figures from /proc, and one way to measure an attack on kvoffloadd.

``figures(pid)`` reads what the kernel says a process holds: anonymous memory
(``RssAnon``: the heap), shared memory it has mapped in (``RssShmem``: the region and
engines' memfds), its page tables (``VmPTE``), descriptors, mappings and threads.

``Measure`` runs every hostile test the same way, so figures compare across tests and
across runs:

- before: the daemon's figures once its region is pre-faulted, a canary is pinging
  and nothing else moves;
- during: a thread samples the figures every few milliseconds and keeps each one's
  peak; when the attacker says it holds what it took (``hold()``), the figures are
  taken once they stopped moving (``held``), and the test's ``during`` runs (another
  tenant trying to work while the attacker holds);
- after: once the attacker's process is gone and the daemon's descriptors came back;
- the canary (canary.py): a client in its own process pinging without pause, from
  before the attack until after it; its worst round trip, less what the machine kept
  the daemon and it waiting for a CPU, is what another client waited. With a metrics
  port, ``/healthz`` is probed as a kubelet would, and non-200 answers counted.

It prints one line (``pytest -s``). The attacker is a forked child that drops to
another uid (as ``hostile.as_uid``): it imports nothing new, and its exceptions come
back as text. Every child is reaped, or killed, whatever the test does.
"""

from __future__ import annotations

import http.client
import os
import pickle
import select
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, fields
from types import TracebackType
from typing import Any, TypeVar

from canary import ROUND_TRIP_LIMIT_S, Canary
from children import fork, reap, receive, send
from hostile import NOBODY, requires_root

import kvoffload
from kvoffloadbench.launch import DaemonProcess, wait_prefault

MIB = 1 << 20
T = TypeVar("T")

SAMPLE_EVERY_S = 0.005
SETTLE_EVERY_S = 0.05
SETTLE_SAMPLES = 3  # equal samples in a row: the figures stopped moving
SETTLE_DEADLINE_S = 10.0
AFTER_FD_SLACK = 4  # descriptors the daemon may still hold once the attacker left
HEALTH_EVERY_S = 0.1
HEALTH_TIMEOUT_S = 3.0  # the DaemonSet's probe timeoutSeconds


@dataclass(frozen=True)
class Figures:
    rss_anon_bytes: int = 0
    rss_shmem_bytes: int = 0
    pte_bytes: int = 0
    fds: int = 0
    maps: int = 0
    threads: int = 0

    def top(self, other: Figures) -> Figures:
        """Each figure's larger value."""
        return Figures(*(max(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)))

    def minus(self, other: Figures) -> Figures:
        return Figures(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def moving(self) -> tuple[int, ...]:
        """The figures that settle (the heap's ``RssAnon`` jitters by itself)."""
        return self.rss_shmem_bytes, self.pte_bytes, self.fds, self.maps, self.threads


_STATUS_KEYS = {"RssAnon:": 0, "RssShmem:": 1, "VmPTE:": 2, "Threads:": 3}


def figures(pid: int) -> Figures:
    """The process's figures now; OSError once it is gone."""
    got = [0, 0, 0, 0]
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            head, _, rest = line.partition(b"\t")
            i = _STATUS_KEYS.get(head.decode())
            if i is not None:
                got[i] = int(rest.split()[0]) * (1 if i == 3 else 1024)
    with open(f"/proc/{pid}/maps", "rb") as f:
        maps = f.read().count(b"\n")
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return Figures(got[0], got[1], got[2], fds, maps, got[3])


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}" if abs(n) < 10 * MIB else f"{n / MIB:.0f}"


class Hold:
    """The attacker's side: ``hold()`` says it holds what it took, and returns once
    the test has measured (running ``poll`` meanwhile, if given)."""

    def __init__(self, ctl: int, release: int) -> None:
        self._ctl, self._release = ctl, release

    def __call__(self, poll: Callable[[], object] | None = None, timeout_s: float = 120.0) -> None:
        send(self._ctl, b"H")
        deadline = time.monotonic() + timeout_s
        while not select.select([self._release], [], [], 0.01 if poll else 1.0)[0]:
            if time.monotonic() > deadline:
                raise TimeoutError("the test never released the attacker")
            if poll is not None:
                poll()
        os.read(self._release, 1)  # b"R", or b"" when the test went away


def _healthz(port: int) -> int:
    """One kubelet-like probe: the status, or 0 when none came in time."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HEALTH_TIMEOUT_S)
    try:
        conn.request("GET", "/healthz")
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


# --------------------------------------------------------------------- measure


class Measure:
    """Figures of ``daemon`` before, during and after an attack, with a canary."""

    def __init__(self, name: str, daemon: DaemonProcess, metrics_port: int = 0) -> None:
        self.name = name
        self.daemon = daemon
        self.metrics_port = metrics_port
        self.before = self.peak = self.held = self.after = Figures()
        self.canary: Canary | None = None  # pinging from before the attack until after it
        self.health_probes = 0
        self.health_bad = 0
        self.during_result: Any = None
        self.daemon_gone = False  # by the time the attacker had left
        self.notes: list[str] = []
        self._stop = threading.Event()
        self._peak_lock = threading.Lock()  # the sampler's and the settling's peaks
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------ the test's side

    def note(self, text: str) -> None:
        """Figures of this attack's own, printed with the line."""
        self.notes.append(text)

    @property
    def growth(self) -> Figures:
        """Each figure's peak during the attack, less its value before."""
        return self.peak.minus(self.before)

    def attack(
        self,
        fn: Callable[[Hold], T],
        uid: int = NOBODY,
        gid: int = 0,
        during: Callable[[], object] | None = None,
        timeout_s: float = 120.0,
    ) -> T:
        """Run ``fn(hold)`` in a child as ``uid`` (group ``gid``: 0 reaches the 0660
        socket) and return its result. When it calls ``hold()``: measure ``held``,
        run ``during``, then let it go on."""
        requires_root()
        ctl_r, ctl_w = os.pipe()
        rel_r, rel_w = os.pipe()

        def child() -> None:
            os.close(ctl_r)
            os.close(rel_w)
            try:
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                result: Any = ("ok", fn(Hold(ctl_w, rel_r)))
            except BaseException:
                result = ("error", traceback.format_exc())
            send(ctl_w, b"D", pickle.dumps(result))

        pid = fork(child)
        os.close(ctl_w)
        os.close(rel_r)
        try:
            deadline = time.monotonic() + timeout_s
            while (got := receive(ctl_r, deadline))[0] == b"H":
                self.held = self._settled()
                if during is not None:
                    self.during_result = during()
                os.write(rel_w, b"R")
            kind, value = pickle.loads(got[1])
        finally:
            os.close(ctl_r)
            os.close(rel_w)
            reap(pid)
        if kind == "error":
            raise AssertionError(f"the attacker (uid {uid}) failed:\n{value}")
        result: T = value
        return result

    def assert_round_trips(self, limit_s: float = ROUND_TRIP_LIMIT_S) -> None:
        """Invariant 15: the canary never waited ``limit_s`` or longer (canary.py)."""
        assert self.canary is not None, f"{self.name}: no canary ran"
        self.canary.check(self.name, limit_s)

    def assert_healthy(self) -> None:
        assert self.health_probes > 0, f"{self.name}: /healthz was never probed"
        assert self.health_bad == 0, (
            f"{self.name}: /healthz failed {self.health_bad} of {self.health_probes} probes"
        )

    # ------------------------------------------------------------ context

    def __enter__(self) -> Measure:
        with kvoffload.connect(self.daemon.socket_path) as c:
            wait_prefault(c, deadline_s=60)
        self.canary = Canary(self.daemon.socket_path, self.daemon.pid, pause_s=0.0)
        try:
            self.before = self.peak = self._settled()
            self._spawn(self._sample)
            if self.metrics_port:
                self._spawn(self._probe)
        except BaseException:
            self._finish()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            limit = self.before.fds + AFTER_FD_SLACK
            self.after = self._settled(lambda f: f.fds <= limit)
        except OSError:
            self.daemon_gone = True  # the test says so
        finally:
            self._finish()
            print(f"\n{self.line()}")

    def line(self) -> str:
        b, p, a = self.before, self.peak, self.after

        def trio(get: Callable[[Figures], int], mib: bool = True) -> str:
            show = _mib if mib else str
            return f"{show(get(b))}->{show(get(p))}->{'gone' if self.daemon_gone else show(get(a))}"

        parts = [
            f"{self.name}:",
            f"RssAnon {trio(lambda f: f.rss_anon_bytes)} MiB,",
            f"RssShmem {trio(lambda f: f.rss_shmem_bytes)} MiB,",
            f"VmPTE {trio(lambda f: f.pte_bytes)} MiB,",
            f"fds {trio(lambda f: f.fds, False)},",
            f"maps {trio(lambda f: f.maps, False)},",
            f"threads {trio(lambda f: f.threads, False)} (before->peak->after);",
            self.canary.line() if self.canary else "no canary",
        ]
        line = " ".join(parts)
        if self.metrics_port:
            line += f"; /healthz not 200: {self.health_bad} of {self.health_probes}"
        return "; ".join([line, *self.notes])

    # ------------------------------------------------------------ internals

    def _finish(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(HEALTH_TIMEOUT_S + 5)
        if self.canary is not None:
            self.canary.stop()

    def _spawn(self, target: Callable[[], None]) -> None:
        t = threading.Thread(target=target, daemon=True)
        t.start()
        self._threads.append(t)

    def _sample(self) -> None:
        pid = self.daemon.pid
        while not self._stop.is_set():
            try:
                self._record(figures(pid))
            except OSError:
                return  # the daemon is gone
            self._stop.wait(SAMPLE_EVERY_S)

    def _record(self, now: Figures) -> None:
        with self._peak_lock:
            self.peak = self.peak.top(now)

    def _probe(self) -> None:
        while not self._stop.wait(HEALTH_EVERY_S):
            status = _healthz(self.metrics_port)
            self.health_probes += 1
            self.health_bad += status != 200

    def _settled(self, also: Callable[[Figures], bool] = lambda f: True) -> Figures:
        """The daemon's figures once the settling ones stopped moving (and ``also``
        holds), or as they are after ``SETTLE_DEADLINE_S``."""
        pid = self.daemon.pid
        deadline = time.monotonic() + SETTLE_DEADLINE_S
        last, same = figures(pid), 0
        while time.monotonic() < deadline:
            time.sleep(SETTLE_EVERY_S)
            now = figures(pid)
            self._record(now)
            same = same + 1 if now.moving() == last.moving() else 0
            last = now
            if same >= SETTLE_SAMPLES - 1 and also(now):
                break
        return last
