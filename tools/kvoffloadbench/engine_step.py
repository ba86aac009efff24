"""One point of ``make bench-engine``: vLLM's real scheduler step, three ways, in turn.

N decoding requests (block_size 16) run in three engines built by ``engine_rig`` from
vLLM's own planning: no connector, vLLM's own ``CPUOffloadingManager`` (its worker
needs CUDA, so a stand-in completes its jobs at once: the lower bound of what
offloading costs the scheduler), and ``KVOffloadSpec`` with its real worker copying in
the engine's process (client copies, as vLLM's uniprocessor executor runs a TP=1
worker). A second engine process runs the same workload with prompts of its own in
the same namespace for the whole point, so both views follow both engines' stores.

Timed per step: ``schedule()`` + ``update_from_output()``, the worker's part excluded
(it stands where the forward pass runs), in wall time and in the engine thread's CPU
time (wall time above CPU time is time the engine waited for a CPU). The three run in
blocks of ``block`` steps, one block each per pass, the first of a pass rotating. The
blocks are short (20 steps: 18 ms at N=16, 0.3 s at N=256) because this machine's speed
moves by up to a half over fractions of a second: three identical vLLM engines timed
in blocks of 100-200 steps came out up to 1.8x apart per block and 7% apart per run,
in blocks of 10 within 3%. The first ``SETTLE_STEPS`` steps of each block run
untimed: what the previous engine's steps caused (the daemon waking on its writes, the
second engine reading its stores) lands in them, not in another engine's figures.
The kvoffload engine reads its batch interval on a clock that stands still between its
blocks (``OwnClock``), so it writes and reads once per interval of its own steps, as
an engine running alone does, in timed steps as often as in untimed ones.
Prompt lengths are spread over a block's 16 tokens, so with
``offload_prompt_only=False`` N/16 requests fill a block, a store, in nearly every
step; with vLLM's default ``True`` only prompts store.

What the kvoffload engine's process spends in the client is split (``ClientTime``)
into writes to the daemon (``send``), reads of its pushes (``recv``) and applying them
(``apply``), for the scheduler's step and the worker's part, each in wall and thread
CPU time: a write whose wall time exceeds its CPU time waited for a CPU the daemon,
just woken by it, took. That timing runs in one more block of kvoffload's steps after
the measured ones (its clock reads would land in kvoffload's timed steps only); in the
measured blocks, steps are counted by which part wrote or read in them from the
clients' counters, read outside the timed calls.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

from kvoffloadbench.launch import DaemonProcess

PROMPT_TOKENS = 40
WARMUP_STEPS = 30
BLOCK_TOKENS = 16
SPECS = ("none", "vllm", "kvoffload")
SECOND_ENGINE_START_S = 300.0  # importing vLLM in a fresh process, on a loaded machine
SETTLE_STEPS = 2  # untimed steps at the start of each block
PROFILE_STEPS = 200  # kvoffload's steps with its client's calls timed, after the others
PREEMPTED_MS = 0.2  # a step whose wall time passes its CPU time by this much waited for a CPU


def prompt(i: int, n: int, salt: int = 0) -> list[int]:
    """Lengths spread over a block: the N requests fill their blocks in turn."""
    length = PROMPT_TOKENS + (i * BLOCK_TOKENS // max(1, n)) % BLOCK_TOKENS
    return [(i * 131 + j * 7 + salt * 17) % 997 + 1 for j in range(length)]


def make_engine(
    spec: str,
    n: int,
    prompt_only: bool,
    sock: str,
    eid: str,
    steps: int,
    salt: int = 0,
    max_tokens: list[int] | None = None,
) -> Any:
    """An engine of N decoding requests (request i of ``max_tokens[i]`` tokens at
    most), warmed up, its KV cache big enough for each request to decode ``steps``
    more tokens (no request is preempted for room)."""
    from .engine_rig import MAX_MODEL_LEN, Engine

    limits = max_tokens or [100_000] * n
    longest = PROMPT_TOKENS + BLOCK_TOKENS + WARMUP_STEPS + min(steps, max(limits))
    if longest > MAX_MODEL_LEN:
        raise ValueError(
            f"{steps} steps take requests to {longest} tokens, past the engine's "
            f"max_model_len of {MAX_MODEL_LEN}: measure fewer steps (passes x block)"
        )
    e = Engine(
        spec,
        socket_path=sock,
        engine_id=eid,
        num_blocks=n * (-(-longest // BLOCK_TOKENS) + 1),
        max_num_seqs=n,
        offload_prompt_only=prompt_only,
        verify=False,
    )
    for i in range(n):
        e.add(f"{eid}-{i}", prompt(i, n, salt), limits[i])
    for _ in range(WARMUP_STEPS):
        e.step()
    return e


class Churn:
    """An engine that runs for good: requests of ``REQUEST_TOKENS`` tokens at most
    (their lengths spread, so some finish every few steps), each replaced by a new one
    with a prompt of its own as it finishes; N requests decode in every step."""

    REQUEST_TOKENS = 512

    def __init__(self, n: int, prompt_only: bool, sock: str, eid: str, salt: int) -> None:
        self.n, self.eid, self.salt = n, eid, salt
        tokens = [self._tokens(i) for i in range(n)]
        self.engine = make_engine(
            "kvoffload", n, prompt_only, sock, eid, self.REQUEST_TOKENS, salt, tokens
        )
        self.slots = [f"{eid}-{i}" for i in range(n)]
        self.made = n

    def _tokens(self, i: int) -> int:
        return self.REQUEST_TOKENS // 2 + i * self.REQUEST_TOKENS // (2 * self.n)

    def step(self) -> tuple[float, float]:
        e, live = self.engine, self.engine.scheduler.requests
        for i, req_id in enumerate(self.slots):
            if req_id not in live:
                self.made += 1
                self.slots[i] = f"{self.eid}-{self.made}"
                e.add(self.slots[i], prompt(i, self.n, self.salt + self.made), self._tokens(i))
        a, b = e.step()
        return a, b


def counters(e: Any) -> tuple[int, int, int]:
    """(scheduler round trips, worker round trips, one-way frames) so far."""
    if e.spec != "kvoffload":
        return 0, 0, 0
    sched = e.manager.client
    workers = [w.client for w in e.offload_workers]
    return (
        sched.round_trips_total,
        sum(w.round_trips_total for w in workers),
        sum(c.posts_total for c in (sched, *workers)),
    )


class ClientTime:
    """Time the engine process spends in the client while ``part`` is set: writes
    (``send``: a flush with bytes queued), reads (``recv``) and applying what was read
    (``apply``), each in wall and thread CPU seconds, per part ("scheduler", "worker").
    ``io`` holds the parts that wrote or read since it was last cleared."""

    WHAT = (("flush", "send"), ("poll", "recv"), ("_route", "apply"))

    def __init__(self) -> None:
        self.part = ""
        self.io: set[str] = set()
        self.wall_s: dict[str, float] = {}
        self.cpu_s: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.msgs: dict[str, int] = {}
        self._undo: list[tuple[type, str, Any]] = []

    def __enter__(self) -> ClientTime:
        from kvoffload.client import Client
        from kvoffload.link.transport import Transport

        for name, what in self.WHAT:
            cls: type = Client if name == "_route" else Transport
            orig = getattr(cls, name)
            self._undo.append((cls, name, orig))
            setattr(cls, name, self._timed(orig, what))
        return self

    def _timed(self, fn: Any, what: str) -> Any:
        def timed(obj: Any, *args: Any, **kw: Any) -> Any:
            if not self.part or (what == "send" and not obj.unsent_bytes):
                return fn(obj, *args, **kw)
            if what == "apply" and not args[0]:
                return fn(obj, *args, **kw)
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return fn(obj, *args, **kw)
            finally:
                key = f"{self.part}_{what}"
                self.wall_s[key] = self.wall_s.get(key, 0.0) + time.perf_counter() - t0
                self.cpu_s[key] = self.cpu_s.get(key, 0.0) + time.thread_time() - c0
                self.calls[key] = self.calls.get(key, 0) + 1
                if what == "apply":  # the messages read: pushes per read
                    self.msgs[key] = self.msgs.get(key, 0) + len(args[0])
                self.io.add(self.part)

        return timed

    def __exit__(self, *exc: object) -> None:
        for cls, name, orig in self._undo:
            setattr(cls, name, orig)

    def report(self, steps: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for k in sorted(self.calls):
            out[f"{k}_us_per_step"] = self.wall_s[k] / steps * 1e6
            out[f"{k}_cpu_us_per_step"] = self.cpu_s[k] / steps * 1e6
            out[f"{k}_calls_per_step"] = self.calls[k] / steps
            if k in self.msgs:
                out[f"{k}_msgs_per_call"] = self.msgs[k] / self.calls[k]
        return out


def io_total(clients: list[Any]) -> int:
    """Writes and reads the clients made so far (plain counters: nothing is timed)."""
    return sum(c.writes_total + c.reads_total for c in clients)


class OwnClock:
    """A monotonic clock that stands still while stopped: what the kvoffload engine
    reads its batch interval on, so the interval counts its own steps' time. On the
    wall clock the other engines' blocks had always passed it by the start of its next
    block, so each of its blocks wrote and read in the first, untimed step and (at N =
    16, a block shorter than the interval) never in a timed one; an engine that runs
    alone does I/O once per interval of its own steps, wherever that falls."""

    def __init__(self) -> None:
        self.stood_s = 0.0
        self._since: float | None = None

    def __call__(self) -> float:
        now = self._since if self._since is not None else time.monotonic()
        return now - self.stood_s

    def stop(self) -> None:
        if self._since is None:
            self._since = time.monotonic()

    def go(self) -> None:
        if self._since is not None:
            self.stood_s += time.monotonic() - self._since
            self._since = None


def step(
    e: Any, clock: ClientTime | None = None, io: set[str] | None = None
) -> tuple[float, float]:
    """One step: its engine-side milliseconds (``schedule()`` +
    ``update_from_output()``), in wall time and in the thread's CPU time. With ``io``,
    the parts of a kvoffload engine that wrote to or read from the daemon are added to
    it, from the clients' counters read outside the timed calls (no wrapper runs in
    them, so the kvoffload engine's steps carry no more instrumentation than the
    others'); with ``clock``, the client's calls are timed (``ClientTime``)."""
    sched = workers = None
    if io is not None and e.spec == "kvoffload":
        sched, workers = [e.manager.client], [w.client for w in e.offload_workers]
        s0, w0 = io_total(sched), io_total(workers)
    if clock is not None:
        clock.part = "scheduler"
    c0, t0 = time.thread_time(), time.perf_counter()
    out = e.scheduler.schedule()
    t1, c1 = time.perf_counter(), time.thread_time()
    if clock is not None:
        clock.part = "worker"
    if sched is not None:
        s1 = io_total(sched)
    result = e.execute(out)
    if workers is not None:
        w1 = io_total(workers)
    if clock is not None:
        clock.part = "scheduler"
    c2, t2 = time.thread_time(), time.perf_counter()
    e.scheduler.update_from_output(out, result)
    t3, c3 = time.perf_counter(), time.thread_time()
    if clock is not None:
        clock.part = ""
    if io is not None and sched is not None and workers is not None:
        if io_total(sched) != s0 or s1 != s0:  # nothing of the worker's runs between
            io.add("scheduler")
        if w1 != w0 or io_total(workers) != w1:
            io.add("worker")
    return (t1 - t0 + t3 - t2) * 1e3, (c1 - c0 + c3 - c2) * 1e3


def cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def second_engine(sock: str, n: int, prompt_only: bool, stop: Any, steps: Any) -> None:
    """The second engine sharing the namespace, stepping until told to stop. Its own
    prompts: both engines store (and both views follow both engines' stores)."""
    bg = Churn(n, prompt_only, sock, f"bg{n}{int(prompt_only)}", salt=1)
    while not stop.is_set():
        bg.step()
        with steps.get_lock():
            steps.value += 1
    bg.engine.shutdown()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def measure_point(
    d: DaemonProcess, n: int, prompt_only: bool, passes: int, block: int
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    stop, bg_steps = ctx.Event(), ctx.Value("q", 0)
    bg = ctx.Process(target=second_engine, args=(d.socket_path, n, prompt_only, stop, bg_steps))
    bg.start()
    try:
        return _measure(d, n, prompt_only, passes, block, bg, bg_steps)
    finally:
        stop.set()
        bg.join(60)


def _measure(
    d: DaemonProcess, n: int, prompt_only: bool, passes: int, block: int, bg: Any, bg_steps: Any
) -> dict[str, Any]:
    steps = passes * (SETTLE_STEPS + block) + PROFILE_STEPS
    engines = {s: make_engine(s, n, prompt_only, d.socket_path, f"{s}{n}", steps) for s in SPECS}
    deadline = time.monotonic() + SECOND_ENGINE_START_S
    while bg_steps.value < WARMUP_STEPS:  # the second engine steps before we measure
        if not bg.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the second engine did not start stepping (N={n})")
        time.sleep(0.1)
    times: dict[str, list[float]] = {s: [] for s in SPECS}
    cpu: dict[str, list[float]] = {s: [] for s in SPECS}
    io_steps: list[str] = []
    stores = dict.fromkeys(SPECS, 0)
    kvo = engines["kvoffload"]
    before = counters(kvo)
    load0, cpu0, bg0 = os.getloadavg()[0], cpu_s(d.pid), bg_steps.value
    order = list(engines.items())
    io: set[str] = set()
    own = OwnClock()  # kvoffload's batch interval runs only while its blocks do
    kvo.manager.clock = own
    for w in kvo.offload_workers:
        w.clock = own
    own.stop()
    for p in range(passes):  # one block each, the first rotating
        for j in range(len(order)):
            spec, e = order[(p + j) % len(order)]
            if e is kvo:
                own.go()
            for _ in range(SETTLE_STEPS):
                step(e)
            for _ in range(block):
                io.clear()
                wall_ms, cpu_ms = step(e, io=io)
                times[spec].append(wall_ms)
                cpu[spec].append(cpu_ms)
                stores[spec] += bool(e.last_stores)
                if e is kvo:
                    io_steps.append(" and ".join(sorted(io)) or "neither")
            if e is kvo:
                own.stop()
    own.go()
    measured = passes * block
    taken = passes * (SETTLE_STEPS + block)  # each engine's steps, untimed ones included
    cpu1, bg1, load1 = cpu_s(d.pid), bg_steps.value, os.getloadavg()[0]
    after = counters(kvo)
    # Where the client's time goes, from more of kvoffload's steps with its calls
    # timed: kept out of the measured blocks, which the timing would slow.
    with ClientTime() as clock:
        for _ in range(PROFILE_STEPS):
            step(kvo, clock)
    views = kvo.manager.views
    point: dict[str, Any] = {"n": n, "offload_prompt_only": prompt_only}
    for spec, xs in times.items():
        point[spec] = {
            "p50_ms": statistics.median(xs),
            "p99_ms": pct(xs, 0.99),
            "cpu_p50_ms": statistics.median(cpu[spec]),
            "cpu_p99_ms": pct(cpu[spec], 0.99),
            # steps the kernel gave the CPU away in: wall past CPU by PREEMPTED_MS
            "preempted": sum(w - c > PREEMPTED_MS for w, c in zip(xs, cpu[spec])) / len(xs),
            "steps_with_stores": stores[spec] / measured,
        }
    point["ratio_p50"] = point["kvoffload"]["p50_ms"] / point["vllm"]["p50_ms"]
    point["ratio_p99"] = point["kvoffload"]["p99_ms"] / point["vllm"]["p99_ms"]
    point["steps_with_stores"] = stores["kvoffload"] / measured
    point["scheduler_round_trips_per_step"] = (after[0] - before[0]) / taken
    point["worker_round_trips_per_step"] = (after[1] - before[1]) / taken
    point["one_way_frames_per_step"] = (after[2] - before[2]) / taken
    point["lease_fallbacks_total"] = sum(v.lease_fallbacks_total for v in views)
    point["feed_resyncs_total"] = sum(v.resyncs_total for v in views)
    by_io: dict[str, list[float]] = {}
    for t, parts in zip(times["kvoffload"], io_steps):
        by_io.setdefault(parts, []).append(t)
    point["io_steps"] = {  # which parts wrote or read: share of steps, their p50
        parts: {"share": len(xs) / measured, "p50_ms": statistics.median(xs)}
        for parts, xs in sorted(by_io.items())
    }
    point["profile"] = clock.report(PROFILE_STEPS)
    engine_steps = taken + (bg1 - bg0)
    point["daemon_cpu_us_per_engine_step"] = (cpu1 - cpu0) / max(1, engine_steps) * 1e6
    point["load_average"] = [load0, load1]
    for e in engines.values():
        e.shutdown()
    return point
