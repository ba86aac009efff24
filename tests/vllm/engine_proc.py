"""An engine process: vLLM 0.33's real scheduler and connector (``engine_rig.Engine``)
in a spawned child, driven step by step over a pipe, so a test can act on the daemon
at exactly one boundary of a step (after ``schedule``, before ``execute``).

Every command answers ``("ok", result)`` or ``("error", type name, message)``: an
exception inside vLLM or kvoffload reaches the test as data, never as a dead pipe.
The child records every log line of vLLM and kvoffload at warning level or above
(``logs``) and kvoffload's info lines (``notes``: which layout, which namespaces).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

STEP_LIMIT_S = 2.0  # a step slower than this is a stall


class _Collect(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


def _views(engine: Any) -> list[Any]:
    """The scheduler's engine views, one per namespace."""
    return list(engine.manager.views)


def _clients(engine: Any) -> list[Any]:
    return [engine.manager.client, *(w.client for w in engine.offload_workers)]


def _serve(conn: Connection, kwargs: dict[str, Any]) -> None:
    logs, notes = _Collect(logging.WARNING), _Collect(logging.INFO)
    for name in ("vllm", "kvoffload"):
        logging.getLogger(name).addHandler(logs)
    logging.getLogger("kvoffload").addHandler(notes)
    logging.getLogger("kvoffload").setLevel(logging.INFO)
    from kvoffloadbench.engine_rig import Engine

    engine = Engine(**kwargs)
    conn.send(("ok", None))
    pending = None
    slowest = 0.0
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "exit":
                engine.shutdown()
                conn.send(("ok", None))
                return
            t0 = time.perf_counter()
            if cmd == "add":
                for req_id, prompt, max_tokens in args:
                    engine.add(req_id, prompt, max_tokens)
                result: Any = None
            elif cmd == "schedule":
                pending = engine.scheduler.schedule()
                meta = pending.kv_connector_metadata
                loads = getattr(meta, "load_jobs", {})
                result = {
                    "stores": len(getattr(meta, "store_jobs", ())),
                    "loads": len(loads),
                    "load_blocks": sum(len(j.dst_spec.block_ids) for j in loads.values()),
                    "scheduled": dict(pending.num_scheduled_tokens),
                }
            elif cmd == "execute":
                assert pending is not None, "execute without schedule"
                engine.scheduler.update_from_output(pending, engine.execute(pending))
                pending = None
                result = None
            elif cmd == "run":  # args: wall seconds allowed
                steps = 0
                deadline = time.monotonic() + args
                while engine.unfinished or engine.scheduler.has_requests():
                    s0 = time.perf_counter()
                    engine.step()
                    slowest = max(slowest, time.perf_counter() - s0)
                    steps += 1
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"requests unfinished after {args} s")
                result = steps
            elif cmd == "connected":
                deadline = time.monotonic() + args
                while True:
                    for c in _clients(engine):
                        c.poll()  # notices a daemon that went away meanwhile
                    _idle_step(engine)
                    views = _views(engine)
                    if all(c._transport for c in _clients(engine)) and all(
                        v.connected and v.leases for v in views
                    ):
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError("the engine did not (re)connect")
                    time.sleep(0.01)
                result = None
            elif cmd == "namespaces":
                result = [v.ns.name for v in _views(engine)]
            elif cmd == "ready_keys":  # an idle step: what the views hold now
                _idle_step(engine)
                result = sum(len(v.ready) for v in _views(engine))
            elif cmd == "reset_prefix_cache":
                result = engine.scheduler.reset_prefix_cache()
            elif cmd == "stats":
                workers = engine.offload_workers
                result = {
                    "bad_blocks": engine.bad_blocks,
                    "loads": engine.loaded_blocks,
                    "unfinished": engine.unfinished,
                    "slowest_step_s": slowest,
                    "blocking_calls": engine.manager.blocking_calls_total,
                    "stores_dropped": sum(w.stores_dropped_total for w in workers),
                    "loads_recovered": sum(w.loads_recovered_total for w in workers),
                    "logs": list(logs.lines),
                    "notes": list(notes.lines),
                }
                logs.lines.clear()
                notes.lines.clear()
                slowest = 0.0
            else:
                raise ValueError(f"unknown command {cmd!r}")
            if cmd in ("schedule", "execute"):
                slowest = max(slowest, time.perf_counter() - t0)
            conn.send(("ok", result))
        except BaseException as exc:
            conn.send(("error", type(exc).__name__, str(exc)))


def _idle_step(engine: Any) -> None:
    """A step that schedules nothing: the manager reads its pushes and sends its
    batches (what an idle vLLM engine's ``has_requests`` check does)."""
    mgr = engine.manager
    mgr.on_schedule_end(None)
    mgr.has_pending_work()


class EngineProc:
    """The test's handle on one engine process."""

    def __init__(self, **kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kwargs), daemon=True)
        self.proc.start()
        child.close()

    def ready(self, timeout_s: float = 120.0) -> EngineProc:
        self._reply(timeout_s)
        return self

    def _reply(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"engine did not answer within {timeout_s} s")
        answer = self._conn.recv()
        if answer[0] == "error":
            raise EngineError(answer[1], answer[2])
        return answer[1]

    def call(self, cmd: str, args: Any = None, timeout_s: float = 120.0) -> Any:
        self._conn.send((cmd, args))
        return self._reply(timeout_s)

    def add(self, *requests: tuple[str, list[int], int]) -> None:
        self.call("add", list(requests))

    def schedule(self) -> dict[str, Any]:
        result: dict[str, Any] = self.call("schedule")
        return result

    def execute(self) -> None:
        self.call("execute")

    def run(self, max_s: float = 60.0) -> int:
        steps: int = self.call("run", max_s, timeout_s=max_s + 30)
        return steps

    def connected(self, timeout_s: float = 20.0) -> None:
        """Wait until the engine's clients are connected and its first leases came."""
        self.call("connected", timeout_s, timeout_s=timeout_s + 10)

    def sees(self, blocks: int, timeout_s: float = 20.0) -> None:
        """Wait until the engine's view holds at least ``blocks`` stored blocks."""
        deadline = time.monotonic() + timeout_s
        while self.call("ready_keys") < blocks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine's view never held {blocks} blocks")
            time.sleep(0.01)

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self.call("stats")
        return result

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(EngineError, TimeoutError, OSError):
                self.call("exit", timeout_s=30)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self._conn.close()


class EngineError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
