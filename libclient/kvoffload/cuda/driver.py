"""The one thin seam to the CUDA driver API (ctypes over ``libcuda.so.1``).

Rules:
- Every CUDA call kvoffload makes, in the client (export) and in the daemon (import,
  pinning, copies), goes through ``CudaApi``. ``DriverApi`` is the real one; unit tests
  use a fake with the same methods, so everything above this module runs and is tested
  on machines without a GPU.
- Only the driver is needed (it ships with the NVIDIA kernel driver): no CUDA toolkit,
  runtime or Python CUDA package. ``load_driver()`` returns None where there is none.
- Addresses, streams and events are plain ints; IPC handles are ``bytes`` of 64.
- A failed call raises ``CudaError`` naming the call and the driver's error name.
- ``set_device`` makes a device's primary context (the one PyTorch uses) current on the
  calling thread; call it once per thread before any other call for that device.
- Kernels come as PTX the project ships, loaded with ``module_load_data`` (the driver
  compiles it for the device) and launched with ``launch_kernel``; their arguments are
  64-bit integers only.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

IPC_HANDLE_BYTES = 64
UUID_BYTES = 16

_LAZY_ENABLE_PEER_ACCESS = 1
_EVENT_BLOCKING_SYNC = 1
_EVENT_DISABLE_TIMING = 2
_EVENT_INTERPROCESS = 4
_STREAM_NON_BLOCKING = 1
_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_DEVICEMAP = 2  # the GPU may read and write it (copy kernels)
_HOST_ALLOC_PORTABLE = 1
_HOST_ALLOC_DEVICEMAP = 2
_ATTR_IS_LEGACY_IPC_CAPABLE = 10
_ATTR_RANGE_START = 11
_ATTR_RANGE_SIZE = 12
_SRC_ACCESS_ORDER_STREAM = 1
_SRC_ACCESS_ORDER_ANY = 3
_LOCATION_DEVICE = 1
_LOCATION_HOST = 2
# Device attributes (CUdevice_attribute)
ATTR_MULTIPROCESSOR_COUNT = 16
ATTR_COMPUTE_CAPABILITY_MAJOR = 75
ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
# Descriptors per cuMemcpyBatchAsync call: bounded so one call never builds huge arrays.
BATCH_MAX = 8192

I64 = npt.NDArray[np.int64]


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call, self.code, self.name = call, code, name


class CudaApi(Protocol):
    """What kvoffload asks of CUDA; see the module rules."""

    has_batch: bool

    def device_count(self) -> int: ...
    def device_uuid(self, ordinal: int) -> bytes: ...
    def device_name(self, ordinal: int) -> str: ...
    def set_device(self, ordinal: int) -> None: ...
    def address_range(self, ptr: int) -> tuple[int, int]: ...
    def ipc_capable(self, ptr: int) -> bool: ...
    def ipc_get_mem_handle(self, base: int) -> bytes: ...
    def ipc_open_mem_handle(self, handle: bytes) -> int: ...
    def ipc_close_mem_handle(self, ptr: int) -> None: ...
    def event_create(self, *, interprocess: bool = False) -> int: ...
    def event_destroy(self, event: int) -> None: ...
    def ipc_get_event_handle(self, event: int) -> bytes: ...
    def ipc_open_event_handle(self, handle: bytes) -> int: ...
    def event_record(self, event: int, stream: int) -> None: ...
    def event_synchronize(self, event: int) -> None: ...
    def stream_create(self) -> int: ...
    def stream_destroy(self, stream: int) -> None: ...
    def stream_wait_event(self, stream: int, event: int) -> None: ...
    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...
    def memcpy_batch_async(
        self, dst: I64, src: I64, nbytes: I64, stream: int, device: int, to_host: bool
    ) -> None: ...
    def host_register(self, ptr: int, nbytes: int) -> None: ...
    def host_unregister(self, ptr: int) -> None: ...
    def device_attribute(self, ordinal: int, attr: int) -> int: ...
    def mem_alloc(self, nbytes: int) -> int: ...
    def mem_free(self, ptr: int) -> None: ...
    def host_alloc(self, nbytes: int) -> int: ...
    def host_free(self, ptr: int) -> None: ...
    def module_load_data(self, image: bytes) -> int: ...
    def module_unload(self, module: int) -> None: ...
    def module_get_function(self, module: int, name: str) -> int: ...
    def launch_kernel(
        self, function: int, grid: int, block: int, stream: int, args: tuple[int, ...]
    ) -> None: ...


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CopyAttrs(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _Location),
        ("dstLocHint", _Location),
        ("flags", ctypes.c_uint),
    ]


_u64 = ctypes.c_uint64
_vp = ctypes.c_void_p
_sz = ctypes.c_size_t
_BATCH_V13 = ctypes.CFUNCTYPE(ctypes.c_int, _vp, _vp, _vp, _sz, _vp, _vp, _sz, _vp)
_BATCH_V128 = ctypes.CFUNCTYPE(ctypes.c_int, _vp, _vp, _vp, _sz, _vp, _vp, _sz, _vp, _vp)


class DriverApi:
    """``CudaApi`` over the real driver."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._check("cuInit", lib.cuInit(0))
        version = ctypes.c_int()
        self._check("cuDriverGetVersion", lib.cuDriverGetVersion(ctypes.byref(version)))
        self.driver_version = version.value
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._ctx_lock = threading.Lock()
        self._batch13 = self._batch128 = None
        if self.driver_version >= 13000:
            self._batch13 = self._proc("cuMemcpyBatchAsync", 13000, _BATCH_V13)
        elif self.driver_version >= 12080:
            self._batch128 = self._proc("cuMemcpyBatchAsync", 12080, _BATCH_V128)
        self.has_batch = self._batch13 is not None or self._batch128 is not None

    # -------------------------------------------------------------- plumbing

    def _check(self, call: str, rc: int) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(rc, ctypes.byref(name))
            raise CudaError(call, rc, (name.value or b"CUDA_ERROR_UNKNOWN").decode())

    def _proc(self, symbol: str, version: int, proto: Any) -> Any:
        fn = _vp()
        status = ctypes.c_int()
        get = self._lib.cuGetProcAddress_v2
        rc = get(symbol.encode(), ctypes.byref(fn), version, _u64(0), ctypes.byref(status))
        if rc != 0 or not fn.value:
            return None
        return proto(fn.value)

    def _device(self, ordinal: int) -> int:
        dev = ctypes.c_int()
        self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(dev), ordinal))
        return dev.value

    def _attr(self, ptr: int, attr: int, ctype: type) -> int:
        out = ctype()
        self._check(
            "cuPointerGetAttribute",
            self._lib.cuPointerGetAttribute(ctypes.byref(out), attr, _u64(ptr)),
        )
        return int(out.value)

    # -------------------------------------------------------------- devices

    def device_count(self) -> int:
        n = ctypes.c_int()
        self._check("cuDeviceGetCount", self._lib.cuDeviceGetCount(ctypes.byref(n)))
        return n.value

    def device_uuid(self, ordinal: int) -> bytes:
        buf = ctypes.create_string_buffer(UUID_BYTES)
        self._check("cuDeviceGetUuid", self._lib.cuDeviceGetUuid_v2(buf, self._device(ordinal)))
        return buf.raw

    def device_name(self, ordinal: int) -> str:
        buf = ctypes.create_string_buffer(256)
        self._check("cuDeviceGetName", self._lib.cuDeviceGetName(buf, 256, self._device(ordinal)))
        return buf.value.decode(errors="replace")

    def set_device(self, ordinal: int) -> None:
        with self._ctx_lock:
            ctx = self._contexts.get(ordinal)
            if ctx is None:
                ctx = _vp()
                self._check(
                    "cuDevicePrimaryCtxRetain",
                    self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self._device(ordinal)),
                )
                self._contexts[ordinal] = ctx
        self._check("cuCtxSetCurrent", self._lib.cuCtxSetCurrent(ctx))

    # -------------------------------------------------------------- pointers and IPC

    def address_range(self, ptr: int) -> tuple[int, int]:
        return (
            self._attr(ptr, _ATTR_RANGE_START, ctypes.c_uint64),
            self._attr(ptr, _ATTR_RANGE_SIZE, ctypes.c_size_t),
        )

    def ipc_capable(self, ptr: int) -> bool:
        return bool(self._attr(ptr, _ATTR_IS_LEGACY_IPC_CAPABLE, ctypes.c_int))

    def ipc_get_mem_handle(self, base: int) -> bytes:
        h = _Handle()
        self._check("cuIpcGetMemHandle", self._lib.cuIpcGetMemHandle(ctypes.byref(h), _u64(base)))
        return ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_BYTES)

    def ipc_open_mem_handle(self, handle: bytes) -> int:
        ptr = _u64()
        h = _Handle.from_buffer_copy(handle)
        self._check(
            "cuIpcOpenMemHandle",
            self._lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS),
        )
        return ptr.value

    def ipc_close_mem_handle(self, ptr: int) -> None:
        self._check("cuIpcCloseMemHandle", self._lib.cuIpcCloseMemHandle(_u64(ptr)))

    # -------------------------------------------------------------- events and streams

    def event_create(self, *, interprocess: bool = False) -> int:
        # Interprocess events must not record timing; our own completion events block
        # (rather than spin) the thread that waits on them.
        flags = _EVENT_DISABLE_TIMING | (_EVENT_INTERPROCESS if interprocess else 0)
        flags |= 0 if interprocess else _EVENT_BLOCKING_SYNC
        ev = _vp()
        self._check("cuEventCreate", self._lib.cuEventCreate(ctypes.byref(ev), flags))
        return int(ev.value or 0)

    def event_destroy(self, event: int) -> None:
        self._check("cuEventDestroy", self._lib.cuEventDestroy_v2(_vp(event)))

    def ipc_get_event_handle(self, event: int) -> bytes:
        h = _Handle()
        self._check(
            "cuIpcGetEventHandle", self._lib.cuIpcGetEventHandle(ctypes.byref(h), _vp(event))
        )
        return ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_BYTES)

    def ipc_open_event_handle(self, handle: bytes) -> int:
        ev = _vp()
        h = _Handle.from_buffer_copy(handle)
        self._check("cuIpcOpenEventHandle", self._lib.cuIpcOpenEventHandle(ctypes.byref(ev), h))
        return int(ev.value or 0)

    def event_record(self, event: int, stream: int) -> None:
        self._check("cuEventRecord", self._lib.cuEventRecord(_vp(event), _vp(stream)))

    def event_synchronize(self, event: int) -> None:
        self._check("cuEventSynchronize", self._lib.cuEventSynchronize(_vp(event)))

    def stream_create(self) -> int:
        s = _vp()
        self._check(
            "cuStreamCreate", self._lib.cuStreamCreate(ctypes.byref(s), _STREAM_NON_BLOCKING)
        )
        return int(s.value or 0)

    def stream_destroy(self, stream: int) -> None:
        self._check("cuStreamDestroy", self._lib.cuStreamDestroy_v2(_vp(stream)))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._check("cuStreamWaitEvent", self._lib.cuStreamWaitEvent(_vp(stream), _vp(event), 0))

    # -------------------------------------------------------------- copies and pinning

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(
            "cuMemcpyAsync",
            self._lib.cuMemcpyAsync(_u64(dst), _u64(src), _sz(nbytes), _vp(stream)),
        )

    def memcpy_batch_async(
        self, dst: I64, src: I64, nbytes: I64, stream: int, device: int, to_host: bool
    ) -> None:
        """One cuMemcpyBatchAsync per BATCH_MAX runs.

        GPU->host copies read their source in stream order (after the engine's event);
        host->GPU copies may read the pinned source early (it cannot change while the
        load runs), which lets the driver overlap descriptor processing.
        """
        attrs = _CopyAttrs()
        attrs.srcAccessOrder = _SRC_ACCESS_ORDER_STREAM if to_host else _SRC_ACCESS_ORDER_ANY
        dev, host = _Location(_LOCATION_DEVICE, device), _Location(_LOCATION_HOST, 0)
        attrs.srcLocHint, attrs.dstLocHint = (dev, host) if to_host else (host, dev)
        idx = _sz(0)
        fail = _sz(0)
        for a in range(0, dst.size, BATCH_MAX):
            d = np.ascontiguousarray(dst[a : a + BATCH_MAX], dtype=np.uint64)
            s = np.ascontiguousarray(src[a : a + BATCH_MAX], dtype=np.uint64)
            n = np.ascontiguousarray(nbytes[a : a + BATCH_MAX], dtype=np.uint64)
            args = (d.ctypes.data, s.ctypes.data, n.ctypes.data, d.size, ctypes.addressof(attrs))
            if self._batch13 is not None:
                rc = self._batch13(*args, ctypes.addressof(idx), 1, stream)
            elif self._batch128 is not None:
                rc = self._batch128(*args, ctypes.addressof(idx), 1, ctypes.addressof(fail), stream)
            else:
                raise CudaError("cuMemcpyBatchAsync", 801, "CUDA_ERROR_NOT_SUPPORTED")
            self._check("cuMemcpyBatchAsync", rc)

    def host_register(self, ptr: int, nbytes: int) -> None:
        flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_DEVICEMAP
        self._check(
            "cuMemHostRegister", self._lib.cuMemHostRegister_v2(_vp(ptr), _sz(nbytes), flags)
        )

    def host_unregister(self, ptr: int) -> None:
        self._check("cuMemHostUnregister", self._lib.cuMemHostUnregister(_vp(ptr)))

    # -------------------------------------------------------------- memory and kernels

    def device_attribute(self, ordinal: int, attr: int) -> int:
        out = ctypes.c_int()
        self._check(
            "cuDeviceGetAttribute",
            self._lib.cuDeviceGetAttribute(ctypes.byref(out), attr, self._device(ordinal)),
        )
        return out.value

    def mem_alloc(self, nbytes: int) -> int:
        ptr = _u64()
        self._check("cuMemAlloc", self._lib.cuMemAlloc_v2(ctypes.byref(ptr), _sz(nbytes)))
        return ptr.value

    def mem_free(self, ptr: int) -> None:
        self._check("cuMemFree", self._lib.cuMemFree_v2(_u64(ptr)))

    def host_alloc(self, nbytes: int) -> int:
        """Pinned host memory the GPU reaches at the same address."""
        ptr = _vp()
        flags = _HOST_ALLOC_PORTABLE | _HOST_ALLOC_DEVICEMAP
        self._check(
            "cuMemHostAlloc", self._lib.cuMemHostAlloc(ctypes.byref(ptr), _sz(nbytes), flags)
        )
        return int(ptr.value or 0)

    def host_free(self, ptr: int) -> None:
        self._check("cuMemFreeHost", self._lib.cuMemFreeHost(_vp(ptr)))

    def module_load_data(self, image: bytes) -> int:
        """Load a module from PTX (NUL-terminated here) or a cubin, in the current context."""
        mod = _vp()
        data = ctypes.create_string_buffer(image + b"\0")
        self._check("cuModuleLoadData", self._lib.cuModuleLoadData(ctypes.byref(mod), data))
        return int(mod.value or 0)

    def module_unload(self, module: int) -> None:
        self._check("cuModuleUnload", self._lib.cuModuleUnload(_vp(module)))

    def module_get_function(self, module: int, name: str) -> int:
        fn = _vp()
        self._check(
            "cuModuleGetFunction",
            self._lib.cuModuleGetFunction(ctypes.byref(fn), _vp(module), name.encode()),
        )
        return int(fn.value or 0)

    def launch_kernel(
        self, function: int, grid: int, block: int, stream: int, args: tuple[int, ...]
    ) -> None:
        values = [_u64(a) for a in args]
        params = (_vp * len(values))(*(ctypes.addressof(v) for v in values))
        self._check(
            "cuLaunchKernel",
            self._lib.cuLaunchKernel(
                _vp(function),
                ctypes.c_uint(grid),
                ctypes.c_uint(1),
                ctypes.c_uint(1),
                ctypes.c_uint(block),
                ctypes.c_uint(1),
                ctypes.c_uint(1),
                ctypes.c_uint(0),
                _vp(stream),
                params,
                None,
            ),
        )


_driver: DriverApi | None = None
_driver_error = ""
_driver_lock = threading.Lock()


def load_driver() -> DriverApi | None:
    """The process's driver API, or None (``driver_error()`` says why)."""
    global _driver, _driver_error
    with _driver_lock:
        if _driver is None and not _driver_error:
            try:
                _driver = DriverApi(ctypes.CDLL("libcuda.so.1"))
            except OSError as exc:
                _driver_error = f"no CUDA driver ({exc})"
            except CudaError as exc:
                _driver_error = str(exc)
        return _driver


def driver_error() -> str:
    return _driver_error
