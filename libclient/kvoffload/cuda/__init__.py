"""The CUDA driver seam (ctypes over ``libcuda.so.1``) and exporting GPU caches.

Rules:
- Only the driver API: neither the client nor the daemon needs a CUDA toolkit or a
  Python CUDA package; tests swap the driver for a fake behind ``driver.CudaApi``.
- Exports are raw IPC handles of an allocation plus an offset; memory CUDA IPC cannot
  export (expandable segments) is refused with the reason.
"""
