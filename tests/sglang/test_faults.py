"""kvoffloadd faults never hurt an SGLang engine (SGLang's real controller, in process).

At each boundary the daemon is killed, stopped or restarted; what must hold: every
request finishes (acks arrive), no backend call outlives its deadline, a backup that
did not finish is never visible, and a prefetch loads the stored bytes or reports the
pages missing, never other bytes.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvoffload.sglang.link import PageLink, PoolWorker
from kvoffloadbench import sglang_rig as rig
from kvoffloadbench.launch import DaemonProcess

PAGE = 4
PAGES = 8
DEADLINE_S = 0.3
SLACK_S = 0.15  # thread wake-ups on a loaded 2-core machine


class Daemons:
    """One daemon at one socket path, killed, stopped and restarted warm or cold."""

    def __init__(self) -> None:
        self.instance = f"t{uuid.uuid4().hex[:10]}"
        self.first = DaemonProcess("64MiB", "--log-level", "warning", instance=self.instance)
        self.socket_path = self.first.socket_path
        self.current: DaemonProcess | None = self.first.start()
        self.instances = {self.instance}

    def kill(self) -> None:
        assert self.current is not None
        self.current.kill()

    def signal(self, sig: int) -> None:
        assert self.current is not None
        os.kill(self.current.pid, sig)

    def restart(self, warm: bool) -> None:
        if self.current is not None and self.current.alive():
            self.current.kill()
        instance = self.instance if warm else f"t{uuid.uuid4().hex[:10]}"
        self.instances.add(instance)
        self.current = DaemonProcess(
            "64MiB", "--log-level", "warning", instance=instance, socket_path=self.socket_path
        ).start()

    def close(self) -> None:
        if self.current is not None and self.current.alive():
            self.current.stop()
        for name in self.instances:
            path = f"/dev/shm/kvoffload-{name}"
            if os.path.exists(path):
                os.unlink(path)


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    d = Daemons()
    try:
        yield d
    finally:
        d.close()


def instance(d: Daemons, allocator: str) -> rig.Instance:
    extra = {"socket_path": d.socket_path, "allocator": allocator, "deadline_s": DEADLINE_S}
    return rig.Instance(rig.Model(), "page_first", PAGE, 64, extra)


def assert_in_time(inst: rig.Instance) -> None:
    b = inst.backend
    for name, seconds, pages in inst.calls:
        budget = b.deadline_s + (
            0 if name == "batch_exists" else b.deadline_per_ki_token_s * pages * PAGE / 1024
        )
        assert seconds <= budget + SLACK_S, f"{name} of {pages} pages took {seconds:.3f} s"


def reconnected(inst: rig.Instance) -> None:
    for client in inst.backend._clients:
        assert client.wait_connected(10.0)


def written(inst: rig.Instance, seed: int) -> tuple[Any, list[bytes], list[int]]:
    host = inst.alloc(PAGES)
    return host, inst.fill(host, seed), rig.page_tokens(seed, PAGES, PAGE)


def loads_exactly(inst: rig.Instance, tokens: list[int], want: list[bytes]) -> int:
    """Prefetch; whatever SGLang says loaded must be the stored bytes. Loaded pages."""
    got = inst.prefetch(tokens, keep=True)
    if got.host_indices is None:
        return 0
    pages = got.loaded_tokens // PAGE
    assert inst.page_bytes(got.host_indices)[:pages] == want[:pages]
    inst.free(got.host_indices)
    return pages


def hook(monkeypatch: pytest.MonkeyPatch, allocator: str, action: Callable[[], object]) -> None:
    """Run ``action`` once, in the backend, while a job is under way: daemon copies
    (``shm``) after the job went to the daemon, before its result is read; client
    copies after the daemon planned the copy, before the client runs it."""
    done: list[bool] = []

    def once() -> None:
        if not done:
            done.append(True)
            action()

    if allocator == "shm":
        wait = PageLink._wait

        def hooked_wait(self: PageLink, job: int, deadline: Any, epoch: int) -> bool:
            self.client.flush()
            once()
            return wait(self, job, deadline, epoch)

        monkeypatch.setattr(PageLink, "_wait", hooked_wait)
    else:
        copy = PoolWorker.copy_plan

        def hooked_copy(self: PoolWorker, plan: Any, is_store: bool) -> None:
            once()
            copy(self, plan, is_store)

        monkeypatch.setattr(PoolWorker, "copy_plan", hooked_copy)


@pytest.mark.parametrize("allocator", ["default", "shm"])
def test_killed_during_a_backup(
    daemons: Daemons, allocator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    inst = instance(daemons, allocator)
    try:
        host, want, tokens = written(inst, 1)
        hook(monkeypatch, allocator, daemons.kill)
        assert inst.backup(host, tokens) == 0  # SGLang sees a failed backup
        monkeypatch.undo()
        daemons.restart(warm=True)
        reconnected(inst)
        assert inst.prefetch(tokens, keep=False).hit_tokens == 0  # never committed
        assert inst.backup(host, tokens) == PAGES * PAGE
        assert loads_exactly(inst, tokens, want) == PAGES
        assert_in_time(inst)
    finally:
        inst.close()


@pytest.mark.parametrize("allocator", ["default", "shm"])
def test_killed_during_a_prefetch_then_warm_restart(
    daemons: Daemons, allocator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    inst = instance(daemons, allocator)
    try:
        host, want, tokens = written(inst, 2)
        assert inst.backup(host, tokens) == PAGES * PAGE
        inst.clear(host)
        hook(monkeypatch, allocator, daemons.kill)
        got = inst.prefetch(tokens, keep=False)
        assert (got.hit_tokens, got.loaded_tokens) == (PAGES * PAGE, 0)
        monkeypatch.undo()
        daemons.restart(warm=True)
        reconnected(inst)
        assert loads_exactly(inst, tokens, want) == PAGES  # warm restart kept the blocks
        assert_in_time(inst)
    finally:
        inst.close()


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_killed_between_hit_query_and_prefetch(daemons: Daemons, warm: bool) -> None:
    inst = instance(daemons, "shm")
    try:
        host, want, tokens = written(inst, 3)
        assert inst.backup(host, tokens) == PAGES * PAGE
        got = inst.prefetch(tokens, keep=False, between=daemons.kill)
        assert (got.hit_tokens, got.loaded_tokens) == (PAGES * PAGE, 0)
        daemons.restart(warm=warm)
        reconnected(inst)
        assert loads_exactly(inst, tokens, want) == (PAGES if warm else 0)
        assert inst.backup(host, tokens) == PAGES * PAGE  # and backups work again
        assert loads_exactly(inst, tokens, want) == PAGES
        assert_in_time(inst)
    finally:
        inst.close()


def test_never_back_every_call_returns_in_time(daemons: Daemons) -> None:
    inst = instance(daemons, "shm")
    try:
        host, _want, tokens = written(inst, 4)
        assert inst.backup(host, tokens) == PAGES * PAGE
        daemons.kill()
        for _ in range(5):
            assert inst.backup(host, tokens) == 0
            got = inst.prefetch(tokens, keep=False)
            assert (got.hit_tokens, got.loaded_tokens) == (0, 0)
        assert_in_time(inst)
    finally:
        inst.close()


@pytest.mark.parametrize("allocator", ["default", "shm"])
def test_a_hung_daemon_costs_a_deadline_and_never_writes_late(
    daemons: Daemons, allocator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scenario: the daemon stops (SIGSTOP) while a load is under way (daemon copies:
    submitted; client copies: planned). The prefetch reports nothing loaded once its
    deadline passes; SGLang reuses the host pages; the daemon resumes: nothing is
    written into them any more."""
    inst = instance(daemons, allocator)
    try:
        host, want, tokens = written(inst, 5)
        assert inst.backup(host, tokens) == PAGES * PAGE
        hook(monkeypatch, allocator, lambda: daemons.signal(signal.SIGSTOP))
        got = inst.prefetch(tokens, keep=True)
        monkeypatch.undo()
        assert (got.hit_tokens, got.loaded_tokens) == (PAGES * PAGE, 0)
        assert got.host_indices is not None
        marker = inst.fill(got.host_indices, seed=99)  # SGLang reused the pages
        daemons.signal(signal.SIGCONT)
        time.sleep(0.5)
        assert inst.page_bytes(got.host_indices) == marker
        inst.free(got.host_indices)
        # a hung daemon costs each call its deadline, never more
        daemons.signal(signal.SIGSTOP)
        assert inst.backup(host, tokens) == 0
        assert inst.prefetch(tokens, keep=False).loaded_tokens == 0
        daemons.signal(signal.SIGCONT)
        reconnected(inst)
        assert loads_exactly(inst, tokens, want) == PAGES
        assert_in_time(inst)
    finally:
        inst.close()


def test_sglang_fault_injection(daemons: Daemons, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's own injector (random delays up to 50 ms, 30% of calls failing) around
    kvoffload: every request finishes and nothing wrong is ever loaded."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.05")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    inst = instance(daemons, "shm")
    try:
        assert type(inst.controller.storage_backend._inner).__name__ == (
            "HiCacheStorageFailureInjector"
        )
        # The injector draws from an unseeded random per thread: a backup and a load
        # each take several calls that may fail, so twelve rounds all failing happens
        # (once in CI). Go on, up to 48 rounds, until one got through.
        loaded, rounds = 0, 0
        for seed in range(10, 58):
            host, want, tokens = written(inst, seed)
            inst.backup(host, tokens)
            inst.free(host)
            loaded += loads_exactly(inst, tokens, want)
            rounds += 1
            if rounds >= 12 and loaded:
                break
        assert loaded > 0, f"nothing got through in {rounds} rounds"
        assert_in_time(inst)  # the injected delays included
    finally:
        inst.close()
