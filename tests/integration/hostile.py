"""Acting as another local user: a forked child that drops to an unprivileged uid.

The suite runs as root (CI and the development machine), so the child can ``setuid``
to ``nobody`` and do what any other user on the node could: plant files, connect,
flood. Its result comes back over a pipe; its exceptions come back as text. The child
cannot import anything new (the interpreter's files may be root's alone): import
what it needs before calling.
"""

from __future__ import annotations

import os
import pickle
import resource
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

NOBODY = 65534

T = TypeVar("T")


def requires_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as a second uid")


def as_uid(
    fn: Callable[[], T], uid: int = NOBODY, gid: int | None = None, timeout_s: float = 60.0
) -> T:
    """Run ``fn`` in a child process as ``uid`` (group ``gid``, default the same number)
    and return its result."""
    requires_root()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(uid if gid is None else gid)
            os.setuid(uid)
            result: Any = ("ok", fn())
        except BaseException:
            result = ("error", traceback.format_exc())
        with os.fdopen(w, "wb") as f:
            pickle.dump(result, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    if kind == "error":
        raise AssertionError(f"the child as uid {uid} failed:\n{value}")
    returned: T = value  # what ``fn`` returned, unpickled
    return returned


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_bytes(pid: int) -> int:
    """The process's own resident memory (RssAnon): not the region's shared pages,
    which pre-faulting adds in the background (VmRSS counted them, so a figure taken
    before pre-faulting ended made memory look held after an abuse)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def limit_fds(n: int) -> None:
    """For a child about to exec the daemon: a small descriptor limit."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
