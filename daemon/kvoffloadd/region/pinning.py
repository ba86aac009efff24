"""Page-locking the region for GPU DMA: cuMemHostRegister in chunks, in the background.

Rules:
- The region is registered in chunks of at most ``MAX_CHUNK_BYTES`` (64 GiB: recent
  drivers fail single registrations of hundreds of GiB), each a multiple of the extent
  size, so no slot straddles two chunks; GPU copy runs are cut at chunk boundaries
  (``kvoffload.datapath.copyplan.split_at_boundaries``) because a batched copy may not span two.
- Registration runs on its own thread after start-up (after pre-faulting, which makes
  it cheaper) and reports progress in ``pinned_bytes``; the daemon serves meanwhile,
  and copies of not-yet-pinned memory are pageable copies (slower, still correct).
- If a registration fails, the thread logs why and stops: the daemon keeps working
  with pageable copies. ``close`` unregisters every chunk it registered, before the
  region is unmapped.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from kvoffload.cuda.driver import CudaApi, CudaError

log = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 64 << 30


def plan_chunks(
    region_bytes: int, align_bytes: int, max_chunk_bytes: int = MAX_CHUNK_BYTES
) -> list[tuple[int, int]]:
    """(offset, bytes) of each registration: aligned, at most ``max_chunk_bytes``."""
    per = max(align_bytes, max_chunk_bytes // align_bytes * align_bytes)
    return [(off, min(per, region_bytes - off)) for off in range(0, region_bytes, per)]


class RegionPinner:
    def __init__(
        self,
        api: CudaApi,
        base_address: int,
        chunks: list[tuple[int, int]],
        before: Callable[[], None] | None = None,
    ) -> None:
        self._api = api
        self._base = base_address
        self.chunks = chunks
        self.chunk_bytes = chunks[0][1] if chunks else 0
        self.total_bytes = sum(n for _, n in chunks)
        self.pinned_bytes = 0
        self.error = ""
        self.seconds = 0.0
        self.done = threading.Event()
        self._before = before
        self._stop = threading.Event()
        self._registered: list[int] = []
        self._thread = threading.Thread(target=self._run, name="kvoffload-pin", daemon=True)

    @property
    def fully_pinned(self) -> bool:
        return self.done.is_set() and self.pinned_bytes == self.total_bytes

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._before is not None:
                self._before()
            t0 = time.monotonic()
            self._api.set_device(0)
            for off, n in self.chunks:
                if self._stop.is_set():
                    return
                self._api.host_register(self._base + off, n)
                self._registered.append(self._base + off)
                self.pinned_bytes += n
            self.seconds = time.monotonic() - t0
            log.info(
                "pinned the region for GPU copies: %d MiB in %d chunks in %.2f s",
                self.pinned_bytes >> 20,
                len(self.chunks),
                self.seconds,
            )
        except CudaError as exc:
            self.error = str(exc)
            log.warning(
                "pinning the region stopped after %d MiB: %s; GPU copies of the rest "
                "stay pageable (slower)",
                self.pinned_bytes >> 20,
                exc,
            )
        finally:
            self.done.set()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for ptr in reversed(self._registered):
            with contextlib.suppress(CudaError):
                self._api.host_unregister(ptr)
        self._registered.clear()
