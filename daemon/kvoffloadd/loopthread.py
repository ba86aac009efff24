"""Which thread is the loop's, so that work that must never run there can say so.

DESIGN.md invariant 15: nothing that maps, faults or waits on a driver runs on the loop
thread; another client's round trip would wait behind it. The calls that do such work
(``copies.imports.map_file`` and the unmapping in ``FileMapping.release``, ``copies.gpu``
importing a CUDA IPC handle) start with
``off_loop``, which raises ``AssertionError`` on the loop thread: a broken internal
invariant, so the loop logs its stats and exits (systemd restarts it) and every test
that drives such a call through the daemon fails, rather than the daemon stalling every
client by a mapping's cost.

Rules:
- ``Server.serve_forever`` claims the loop for its thread and gives it back on return;
  before and after (start-up, recovery, shutdown) any thread may map.
- One comparison per call: cheap enough to keep on in production.
"""

from __future__ import annotations

import threading

_loop_ident: int | None = None


def claim() -> None:
    """The calling thread is the loop's from now on."""
    global _loop_ident
    _loop_ident = threading.get_ident()


def release() -> None:
    global _loop_ident
    _loop_ident = None


def off_loop(what: str) -> None:
    """Refuse ``what`` (a phrase naming the work) on the loop thread."""
    if _loop_ident is not None and threading.get_ident() == _loop_ident:
        raise AssertionError(f"{what} on the loop thread (DESIGN.md invariant 15)")
