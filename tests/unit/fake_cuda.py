"""A fake of ``kvoffload.cuda.driver.CudaApi`` for machines without a GPU.

"Device memory" is host memory (numpy buffers), so copies are real memmoves and
their bytes can be checked. Streams are ordered operation queues that run as far as
they can: a stream stops at a wait on an event that has not completed, exactly the
ordering a real CUDA stream gives. ``hold``/``release`` model an engine whose kernels
are still running. IPC handles and event handles are opaque 64-byte tokens, so the
daemon code under test cannot tell the fake from the driver.

Modules load the shipped PTX: the fake reads each ``.entry``'s parameter count and
``.maxntid`` from it and refuses launches that do not match. A launch of the gather
kernel runs, in stream order, what gather.cu does: it reads the tile records from
"device memory" and copies every tile, so the descriptors the daemon plans are checked
byte for byte.
"""

from __future__ import annotations

import ctypes
import itertools
import re
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.cuda.driver import IPC_HANDLE_BYTES, CudaError

I64 = npt.NDArray[np.int64]
DEADLINE_S = 10.0


class FakeCuda:
    def __init__(
        self,
        uuids: tuple[bytes, ...] = (b"\x11" * 16,),
        *,
        has_batch: bool = True,
        ipc_capable: bool = True,
        fail_register_at: int | None = None,
        multiprocessors: int = 4,
        host_pointer_ok: bool = True,
        module_error: str = "",
    ) -> None:
        self.uuids = list(uuids)
        self.has_batch = has_batch
        self._ipc_capable = ipc_capable
        self._fail_register_at = fail_register_at
        self._allocs: dict[int, npt.NDArray[np.uint8]] = {}
        self._handles: dict[bytes, int] = {}
        self.open_refs: Counter[int] = Counter()
        self.closed: list[int] = []
        self._done: dict[int, bool] = {}
        self._streams: dict[int, list[tuple[Any, ...]]] = {0: []}  # 0: an engine's stream
        self._ids = itertools.count(1)
        self._cv = threading.Condition()
        self.registered: list[tuple[int, int]] = []
        self.calls: Counter[str] = Counter()
        self.attributes = {16: multiprocessors, 75: 8, 91: int(host_pointer_ok)}
        self._module_error = module_error
        self._modules: dict[int, dict[str, tuple[int, int]]] = {}  # entry: (params, maxntid)
        self._functions: dict[int, tuple[int, str]] = {}
        self.launches: list[tuple[int, int, int]] = []  # (grid, block, tiles)

    # ------------------------------------------------------------ test helpers

    def alloc(self, nbytes: int) -> npt.NDArray[np.uint8]:
        buf = np.zeros(nbytes, dtype=np.uint8)
        self._allocs[int(buf.ctypes.data)] = buf
        return buf

    def hold(self, stream: int = 0) -> int:
        """Block ``stream`` (as a running kernel would) until ``release``."""
        with self._cv:
            gate = next(self._ids)
            self._done[gate] = False
            self._streams[stream].append(("wait", gate))
            return gate

    def release(self, gate: int) -> None:
        with self._cv:
            self._done[gate] = True
            self._run_all()

    # ------------------------------------------------------------ stream engine

    def _run_all(self) -> None:
        progress = True
        while progress:
            progress = False
            for ops in self._streams.values():
                while ops:
                    op = ops[0]
                    if op[0] == "wait" and not self._done.get(op[1], True):
                        break
                    ops.pop(0)
                    progress = True
                    if op[0] == "copy":
                        ctypes.memmove(op[1], op[2], op[3])
                    elif op[0] == "gather":
                        self._gather(op[1], op[2])
                    elif op[0] == "record":
                        self._done[op[1]] = True
        self._cv.notify_all()

    def _gather(self, tiles_ptr: int, num_tiles: int) -> None:
        """What gather.cu's kvo_gather does, on host memory."""
        records = np.ctypeslib.as_array(
            (ctypes.c_uint64 * (3 * num_tiles)).from_address(tiles_ptr)
        ).reshape(num_tiles, 3)
        for dst, src, n in records.tolist():
            ctypes.memmove(dst, src, n)

    def _enqueue(self, stream: int, *op: Any) -> None:
        with self._cv:
            self._streams[stream].append(op)
            self._run_all()

    # ------------------------------------------------------------ CudaApi

    def device_count(self) -> int:
        return len(self.uuids)

    def device_uuid(self, ordinal: int) -> bytes:
        return self.uuids[ordinal]

    def device_name(self, ordinal: int) -> str:
        return f"FakeGPU{ordinal}"

    def set_device(self, ordinal: int) -> None:
        assert 0 <= ordinal < len(self.uuids)

    def address_range(self, ptr: int) -> tuple[int, int]:
        for base, buf in self._allocs.items():
            if base <= ptr < base + buf.size:
                return base, buf.size
        raise CudaError("cuPointerGetAttribute", 1, "CUDA_ERROR_INVALID_VALUE")

    def ipc_capable(self, ptr: int) -> bool:
        return self._ipc_capable

    def ipc_get_mem_handle(self, base: int) -> bytes:
        handle = b"M" + base.to_bytes(8, "little") + bytes(IPC_HANDLE_BYTES - 9)
        self._handles[handle] = base
        return handle

    def ipc_open_mem_handle(self, handle: bytes) -> int:
        base = self._handles.get(handle)
        if base is None:
            raise CudaError("cuIpcOpenMemHandle", 400, "CUDA_ERROR_INVALID_HANDLE")
        self.open_refs[base] += 1
        return base

    def ipc_close_mem_handle(self, ptr: int) -> None:
        assert self.open_refs[ptr] > 0, "closing a handle that is not open"
        self.open_refs[ptr] -= 1
        self.closed.append(ptr)

    def event_create(self, *, interprocess: bool = False) -> int:
        with self._cv:
            ev = next(self._ids)
            self._done[ev] = True  # never recorded: complete, as in CUDA
            return ev

    def event_destroy(self, event: int) -> None:
        self.calls["event_destroy"] += 1

    def ipc_get_event_handle(self, event: int) -> bytes:
        return b"E" + event.to_bytes(8, "little") + bytes(IPC_HANDLE_BYTES - 9)

    def ipc_open_event_handle(self, handle: bytes) -> int:
        if handle[:1] != b"E":
            raise CudaError("cuIpcOpenEventHandle", 400, "CUDA_ERROR_INVALID_HANDLE")
        return int.from_bytes(handle[1:9], "little")

    def event_record(self, event: int, stream: int) -> None:
        with self._cv:
            self._done[event] = False
            self._streams[stream].append(("record", event))
            self._run_all()

    def event_synchronize(self, event: int) -> None:
        self.calls["event_synchronize"] += 1
        with self._cv:
            if not self._cv.wait_for(lambda: self._done[event], timeout=DEADLINE_S):
                raise CudaError("cuEventSynchronize", 702, "CUDA_ERROR_LAUNCH_TIMEOUT")

    def stream_create(self) -> int:
        with self._cv:
            stream = next(self._ids)
            self._streams[stream] = []
            return stream

    def stream_destroy(self, stream: int) -> None:
        with self._cv:
            assert not self._streams.pop(stream), "destroying a stream with queued work"

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._enqueue(stream, "wait", event)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.calls["memcpy_async"] += 1
        self._enqueue(stream, "copy", dst, src, nbytes)

    def memcpy_batch_async(
        self, dst: I64, src: I64, nbytes: I64, stream: int, device: int, to_host: bool
    ) -> None:
        self.calls["memcpy_batch_async"] += 1
        host = dst if to_host else src
        for a, n in zip(host.tolist(), nbytes.tolist()):  # as the driver: one registration
            if any(r <= a < r + size for r, size in self.registered) and not any(
                r <= a and a + n <= r + size for r, size in self.registered
            ):
                raise CudaError("cuMemcpyBatchAsync", 1, "CUDA_ERROR_INVALID_VALUE")
        with self._cv:
            ops = self._streams[stream]
            ops.extend(
                ("copy", d, s, n) for d, s, n in zip(dst.tolist(), src.tolist(), nbytes.tolist())
            )
            self._run_all()

    def host_register(self, ptr: int, nbytes: int) -> None:
        if self._fail_register_at is not None and len(self.registered) == self._fail_register_at:
            raise CudaError("cuMemHostRegister", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        self.registered.append((ptr, nbytes))

    def host_unregister(self, ptr: int) -> None:
        self.registered = [r for r in self.registered if r[0] != ptr]

    def device_attribute(self, ordinal: int, attr: int) -> int:
        return self.attributes[attr]

    def mem_alloc(self, nbytes: int) -> int:
        self.calls["mem_alloc"] += 1
        return int(self.alloc(nbytes).ctypes.data)

    def mem_free(self, ptr: int) -> None:
        self.calls["mem_free"] += 1
        del self._allocs[ptr]

    def host_alloc(self, nbytes: int) -> int:
        self.calls["host_alloc"] += 1
        return int(self.alloc(nbytes).ctypes.data)

    def host_free(self, ptr: int) -> None:
        self.calls["host_free"] += 1
        del self._allocs[ptr]

    def module_load_data(self, image: bytes) -> int:
        if self._module_error:
            raise CudaError("cuModuleLoadData", 222, self._module_error)
        text = image.decode()
        entries = {}
        for m in re.finditer(r"\.entry (\w+)\(([^)]*)\)\s*(?:\.maxntid (\d+))?", text):
            entries[m.group(1)] = (m.group(2).count(".param"), int(m.group(3) or 1024))
        module = next(self._ids)
        self._modules[module] = entries
        return module

    def module_unload(self, module: int) -> None:
        del self._modules[module]

    def module_get_function(self, module: int, name: str) -> int:
        if name not in self._modules[module]:
            raise CudaError("cuModuleGetFunction", 500, "CUDA_ERROR_NOT_FOUND")
        fn = next(self._ids)
        self._functions[fn] = (module, name)
        return fn

    def launch_kernel(
        self, function: int, grid: int, block: int, stream: int, args: tuple[int, ...]
    ) -> None:
        module, name = self._functions[function]
        params, maxntid = self._modules[module][name]
        if len(args) != params or not 0 < block <= maxntid or grid <= 0:
            raise CudaError("cuLaunchKernel", 1, "CUDA_ERROR_INVALID_VALUE")
        self.launches.append((grid, block, args[1]))
        self._enqueue(stream, "gather", args[0], args[1])


@dataclass
class _Device:
    index: int


class FakeCudaTensor:
    """Just enough of a CUDA ``torch.Tensor`` for ``export_cuda_caches``."""

    is_cuda = True

    def __init__(self, rows: npt.NDArray[np.uint8], device: int = 0) -> None:
        assert rows.ndim == 2
        self.rows = rows
        self.device = _Device(device)

    def dim(self) -> int:
        return 2

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape

    def stride(self, i: int) -> int:
        return int(self.rows.strides[i])

    def element_size(self) -> int:
        return 1

    def data_ptr(self) -> int:
        return int(self.rows.ctypes.data)
