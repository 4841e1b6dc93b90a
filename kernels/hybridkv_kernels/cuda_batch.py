"""The CUDA driver's batched memcpy (cuMemcpyBatchAsync, CUDA 12.8+), through ctypes.

One driver call enqueues every page copy of a plan on a stream: the copy engines then run them back to
back, without the gap a separate cudaMemcpyAsync per page leaves between copies, so it comes closer to the
PCIe ceiling than one copy per page or the Triton kernel (kernels/README.md, "Batched DMA";
`bench/bench_copy_variants.py`).

`available()` says whether this process can use it: a CUDA driver that exports the entry point (the
CUDA 13 `_v2` signature, or 12.8's with `failIdx`), and the batched path not turned off by `set_enabled(False)`
(the switch that keeps the one-copy-per-run path for comparisons; only the process's edge calls it: a benchmark's
command line, a test). Nothing here runs or loads on a machine without CUDA.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

MAX_COPIES_PER_CALL = 4096  # the driver states no limit; bounded anyway so one call stays short
# CUmemcpySrcAccessOrder: `stream` (what the library runs) reads a source in stream order, after the work queued
# before the copy; `during_api_call` and `any` let the driver read it earlier, which only a probe may ask for (a
# store's pages are written by the model's kernels queued right before it)
SRC_ACCESS_ORDERS = {"stream": 1, "during_api_call": 2, "any": 3}
MEMCPY_FLAGS = {"default": 0, "prefer_overlap_with_compute": 1}  # CUmemcpyFlags
_SRC_ACCESS_ORDER_STREAM = SRC_ACCESS_ORDERS["stream"]


class _Attrs(ctypes.Structure):
    """CUmemcpyAttributes: access order, source and destination location hints (type, id), flags."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", ctypes.c_int * 2),
                ("dstLocHint", ctypes.c_int * 2), ("flags", ctypes.c_uint)]


class BatchMemcpy:
    """The driver entry point and what each call needs; one per process (`get()`)."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        self.v2 = hasattr(lib, "cuMemcpyBatchAsync_v2")
        self._fn = lib.cuMemcpyBatchAsync_v2 if self.v2 else lib.cuMemcpyBatchAsync
        self._attrs = _Attrs(_SRC_ACCESS_ORDER_STREAM, (0, 0), (0, 0), 0)
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self._local = threading.local()

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed with CUDA driver error {rc} ({(name.value or b'?').decode()})")

    def _ensure_context(self, device_index: int) -> None:
        """Make `device_index`'s primary context current in this thread (a worker thread that only ever
        called the driver here may have none; the runtime that torch uses shares the primary context)."""
        if getattr(self._local, "device", None) == device_index:
            current = ctypes.c_void_p()
            self._check(self._lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
            if current.value:
                return
        dev = ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self._check(self._lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self._local.device = device_index

    def __call__(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int, device_index: int) -> None:
        """Enqueue copies `src[i] -> dst[i]` of `sizes[i]` bytes on `stream` (a CUstream handle), in order
        with the stream's earlier work; the arrays are read during the call only."""
        if not len(dst) == len(src) == len(sizes):
            raise ValueError(f"batched memcpy: {len(dst)} destinations, {len(src)} sources, {len(sizes)} sizes")
        self._ensure_context(device_index)
        d = np.ascontiguousarray(dst, dtype=np.uint64)
        s = np.ascontiguousarray(src, dtype=np.uint64)
        n = np.ascontiguousarray(sizes, dtype=np.uint64)
        for lo in range(0, len(d), MAX_COPIES_PER_CALL):
            count = min(MAX_COPIES_PER_CALL, len(d) - lo)
            args: list = [ctypes.c_void_p(d.ctypes.data + 8 * lo), ctypes.c_void_p(s.ctypes.data + 8 * lo),
                          ctypes.c_void_p(n.ctypes.data + 8 * lo), ctypes.c_size_t(count),
                          ctypes.byref(self._attrs), self._attr_idx, ctypes.c_size_t(1)]
            if not self.v2:
                fail = ctypes.c_size_t(0)
                args.append(ctypes.byref(fail))
            args.append(ctypes.c_void_p(stream))
            self._check(self._fn(*args), "cuMemcpyBatchAsync")


_enabled = True


def set_enabled(on: bool) -> None:
    """Let page copies on CUDA use the batched driver call (the default), or not: off, `auto` picks as on a
    driver without it and each run of pages is its own copy (for comparisons). Plans run after the call see it."""
    global _enabled
    _enabled = bool(on)


def get() -> BatchMemcpy | None:
    """The process's batched memcpy, or None where the driver lacks it or `set_enabled(False)` turned it off."""
    return _driver() if _enabled else None


@functools.cache
def _driver() -> BatchMemcpy | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if not (hasattr(lib, "cuMemcpyBatchAsync_v2") or hasattr(lib, "cuMemcpyBatchAsync")):
        return None
    return BatchMemcpy(lib)


def set_attributes(src_access_order: str = "stream", flags: str = "default") -> None:
    """The attributes every batched copy of this process runs with from now on (`SRC_ACCESS_ORDERS`, `MEMCPY_FLAGS`);
    the defaults are what the library runs. For probes only, at the process's edge (a benchmark's command line):
    any source order but `stream` may read a store's pages before the kernels writing them are done."""
    if src_access_order not in SRC_ACCESS_ORDERS:
        raise ValueError(f"src_access_order must be one of {sorted(SRC_ACCESS_ORDERS)}, got {src_access_order!r}")
    if flags not in MEMCPY_FLAGS:
        raise ValueError(f"flags must be one of {sorted(MEMCPY_FLAGS)}, got {flags!r}")
    batch = _driver()
    if batch is None:
        raise RuntimeError("no batched memcpy here (no CUDA driver, or one before 12.8 without cuMemcpyBatchAsync): "
                           "its attributes cannot be set")
    batch._attrs.srcAccessOrder = SRC_ACCESS_ORDERS[src_access_order]
    batch._attrs.flags = MEMCPY_FLAGS[flags]


def available() -> bool:
    """True when page copies on CUDA go through one batched driver call per plan."""
    return get() is not None
