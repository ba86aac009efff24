"""An SGLang instance in a spawned child process (``sglang_rig.Instance``), driven over
a pipe, so tests run several instances of different shapes against one daemon at
once (SGLang's runtime context is per process).

Every command answers ``("ok", result)`` or ``("error", type name, message)``.
Pages are compared by digest: ``store`` fills pages from a seed and returns each
page's SHA-256, ``load`` returns the digests of the pages SGLang prefetched.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any


def _serve(conn: Connection, kwargs: dict[str, Any]) -> None:
    from . import sglang_rig as rig

    model = rig.Model(**kwargs.pop("model", {}))
    try:
        inst = rig.Instance(model, **kwargs)
    except Exception as exc:
        conn.send(("error", type(exc).__name__, str(exc)))
        return
    conn.send(("ok", inst.backend.namespaces))
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "exit":
                inst.close()
                conn.send(("ok", None))
                return
            if cmd == "store":  # (prompt seed, pages, split) -> (tokens backed up, digests)
                seed, pages, split = args
                host = inst.alloc(pages)
                inst.fill(host, seed)
                want = inst.page_bytes(host, split)  # per page (and head shard)
                done = inst.backup(host, rig.page_tokens(seed, pages, inst.page_size))
                inst.free(host)
                result: Any = (done, [hashlib.sha256(p).hexdigest() for p in want])
            elif cmd == "load":  # (prompt seed, pages) -> (hit tokens, loaded, digests)
                seed, pages = args
                got = inst.prefetch(rig.page_tokens(seed, pages, inst.page_size))
                digests = []
                if got.host_indices is not None:
                    loaded = got.loaded_tokens // inst.page_size
                    pages_bytes = inst.page_bytes(got.host_indices)[:loaded]
                    digests = [hashlib.sha256(p).hexdigest() for p in pages_bytes]
                    inst.free(got.host_indices)
                result = (got.hit_tokens, got.loaded_tokens, digests)
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", result))
        except Exception as exc:
            conn.send(("error", type(exc).__name__, str(exc)))


class InstanceProcess:
    """``Instance(**kwargs)`` in a child; ``model`` is a dict of ``Model`` fields."""

    def __init__(self, timeout_s: float = 120.0, **kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kwargs), daemon=True)
        self.proc.start()
        child.close()
        self.timeout_s = timeout_s
        self.namespaces: list[str] = self._answer()

    def _answer(self) -> Any:
        if not self._conn.poll(self.timeout_s):
            raise TimeoutError("the SGLang instance did not answer in time")
        reply = self._conn.recv()
        if reply[0] != "ok":
            raise RuntimeError(f"{reply[1]}: {reply[2]}")
        return reply[1]

    def call(self, cmd: str, *args: Any) -> Any:
        self._conn.send((cmd, args))
        return self._answer()

    def store(self, seed: int, pages: int, split: int = 1) -> tuple[int, list[str]]:
        """Back up ``pages`` filled pages of prompt ``seed``: (tokens SGLang says were
        backed up, each page's digest; with ``split``, each head shard's)."""
        result: tuple[int, list[str]] = self.call("store", seed, pages, split)
        return result

    def load(self, seed: int, pages: int) -> tuple[int, int, list[str]]:
        result: tuple[int, int, list[str]] = self.call("load", seed, pages)
        return result

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit")
            finally:
                self.proc.join(30)
        self._conn.close()

    def __enter__(self) -> InstanceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
