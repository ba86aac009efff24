"""shared_kv_cache bookkeeping: memfds are closed when tensors die, without deadlock."""

from __future__ import annotations

import os

from kvoffload import cache, shared_kv_cache


def test_finalizer_inside_a_locked_section_does_not_deadlock() -> None:
    t = shared_kv_cache(4, 4096)
    _, fd = cache.describe_cache(t)
    base = t.data_ptr()
    with cache._lock:  # as if the GC ran the finalizer while describe_cache held it
        cache._forget(base)  # must return at once
        assert base in cache._buffers
    cache._reap()
    assert base not in cache._buffers
    try:
        os.fstat(fd)
        raise AssertionError("the memfd of a forgotten cache is still open")
    except OSError:
        pass
    del t


def test_memfd_closed_when_the_tensor_is_freed() -> None:
    t = shared_kv_cache(4, 4096)
    _, fd = cache.describe_cache(t)
    os.fstat(fd)
    del t  # no cycle: the storage and its finalizer go at once
    assert all(b.fd != fd for b in cache._buffers.values())
