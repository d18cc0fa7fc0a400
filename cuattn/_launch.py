"""The one launch path of every kernel: batch layout, parameter blocks and ``Launch``.

Kernels see a batch of at most three axes, each tensor described by five element strides
(b0, b1, b2, row, col): :func:`layout` collapses a call's broadcast batch axes into three
(the rest become a loop over pointer sets). A :class:`Launch` holds one kernel, its grid
and a parameter block filled by field name (``cuattn._params``), and launches it through
``cuLaunchKernel``, writing only the pointer fields per call.
"""
from __future__ import annotations

import functools
import struct
import threading

import numpy as np

__all__ = ["Launch", "LaunchLoop", "layout", "offset_sets", "broadcast_strides",
           "collapse_batch", "device_limits", "sm_count", "stride_fields"]


class Launch:
    """One kernel launch: grid (x, y), block size, dynamic shared memory and the kernel's
    parameter block (a 0-d structured array of :func:`~cuattn._params.block_dtype`), kept
    here. ``pointers`` names the consecutive 8-byte fields a call writes (its first
    argument, in that order; "p.q" names a field of a nested struct); ``per_call`` names
    one more field a call may write (the sm90_3xf16 kernels' ``magnitudes``); ``maps``
    (:class:`~cuattn._tma.TensorMaps`) writes the tensor maps of the first three pointers.
    Launched through ``cuLaunchKernel``: about 5 us less than CuPy's launch, which converts
    and packs every argument each call. The kernel
    is the one loaded for the current device. Thread-safe: the pointers are written and
    launched under a lock, and the driver copies the block before the launch returns. A
    thread's first launch makes the current device's context current in it (a new thread,
    a Dask worker's say, has none until a runtime call, and ``cuLaunchKernel`` needs one)."""

    def __init__(self, kernel, grid: tuple[int, int], threads: int, shared_mem: int,
                 block: np.ndarray, pointers: tuple[str, ...] = (), per_call: str | None = None,
                 maps=None):
        from cupy_backends.cuda.api import driver
        self._launch = driver.launchKernel
        self._function = kernel.kernel.ptr
        raw = block.tobytes()
        self._block = np.zeros(-(-len(raw) // 8), np.int64)
        self._bytes = memoryview(self._block).cast("B")
        self._bytes[:len(raw)] = raw
        self._pointers, self._pointer_offset = _run_of_fields(block.dtype, pointers)
        self._per_call = None if per_call is None else _field(block.dtype, per_call)[1]
        self._maps = maps
        self._argv = np.array([self._block.ctypes.data], np.int64)  # void* kernelParams[1]
        self._argv_ptr = self._argv.ctypes.data
        self._dims = (*grid, threads, shared_mem)
        self._lock = threading.Lock()

    def __call__(self, pointers, stream_ptr: int, per_call: int | None = None) -> None:
        grid_x, grid_y, threads, shared_mem = self._dims
        if not getattr(_thread, "has_context", False):
            _make_context_current()
        with self._lock:
            self._pointers.pack_into(self._bytes, self._pointer_offset, *pointers)
            if self._maps is not None:
                self._maps.write(self._bytes, pointers[:3])
            if per_call is not None:
                _INT64.pack_into(self._bytes, self._per_call, per_call)
            self._launch(self._function, grid_x, grid_y, 1, threads, 1, 1, shared_mem,
                         stream_ptr, self._argv_ptr, 0)


class LaunchLoop:
    """A launch repeated over batch axes that did not collapse into three, called as a
    :class:`Launch` with the base pointers of its slots: each launch adds its offsets to
    them (an absent slot's 0 stays 0). Holds offsets, not pointers, so a plan that loops
    is kept per call signature like one that does not."""

    def __init__(self, launch, offset_sets: list):
        self._launch, self._offset_sets = launch, offset_sets

    def __call__(self, pointers, stream_ptr: int, *per_call) -> None:
        for offsets in self._offset_sets:
            self._launch([p and p + o for p, o in zip(pointers, offsets)], stream_ptr,
                         *per_call)


def offset_sets(tensors, pointer_sets) -> list | None:
    """None where :func:`layout` found one launch, else each launch's pointers as offsets
    from the bases of ``tensors`` (the list given to :func:`layout`), for a
    :class:`LaunchLoop`."""
    if isinstance(pointer_sets, list):
        return None
    bases = [0 if x is None else x.data.ptr for x, _ in tensors]
    return [[p - b for p, b in zip(pointers, bases)] for pointers in pointer_sets]


_INT64 = struct.Struct("<q")
_thread = threading.local()


def _make_context_current() -> None:
    from cupy.cuda import runtime
    runtime.setDevice(runtime.getDevice())  # the device's primary context, now current here
    _thread.has_context = True


def _field(dtype: np.dtype, name: str) -> tuple[np.dtype, int]:
    """The dtype and byte offset of field ``name`` of ``dtype``; a dotted name ("p.q")
    names a field of a nested struct."""
    offset = 0
    for part in name.split("."):
        dtype, at = dtype.fields[part][:2]
        offset += at
    return dtype, offset


def _run_of_fields(dtype: np.dtype, names: tuple[str, ...]) -> tuple[struct.Struct, int]:
    """A struct packing the 8-byte fields ``names`` of ``dtype``, which must lie one after
    another, and their first offset."""
    if not names:
        return struct.Struct("<"), 0
    start = _field(dtype, names[0])[1]
    for i, name in enumerate(names):
        field, offset = _field(dtype, name)
        if field.itemsize != 8 or offset != start + 8 * i:
            raise ValueError(f"pointer fields {names} are not consecutive 8-byte fields")
    return struct.Struct(f"<{len(names)}q"), start


def broadcast_strides(x, shape) -> list[int]:
    """Element strides of ``x`` viewed as broadcast to ``shape`` (0 on broadcast axes),
    computed without making the view."""
    itemsize = x.itemsize
    return [0] * (len(shape) - x.ndim) + [0 if n == 1 else st // itemsize
                                          for n, st in zip(x.shape, x.strides)]


def collapse_batch(batch_shape, strides_per_array):
    """Merge adjacent batch axes that every array walks contiguously; drop size-1 axes.
    Returns [(extent, [stride of each array])], outermost first."""
    merged = []
    for axis, extent in enumerate(batch_shape):
        if extent == 1:
            continue
        strides = [s[axis] for s in strides_per_array]
        if merged:
            prev_extent, prev_strides = merged[-1]
            if all(ps == s * extent for ps, s in zip(prev_strides, strides)):
                merged[-1] = (prev_extent * extent, strides)
                continue
        merged.append((extent, strides))
    return merged


@functools.cache
def device_limits(device_id: int) -> tuple[tuple[int, int], int]:
    """(compute capability, opt-in shared memory per block) of a device."""
    import cupy
    dev = cupy.cuda.Device(device_id)
    cc = dev.compute_capability  # e.g. "90"
    return (int(cc[:-1]), int(cc[-1])), int(dev.attributes["MaxSharedMemoryPerBlockOptin"])


@functools.cache
def sm_count(device_id: int) -> int:
    """The number of SMs of a device."""
    import cupy
    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def layout(batch, tensors):
    """Collapse the batch axes of every present tensor into at most three kernel axes.

    ``tensors`` holds ``(array or None, strides over batch + its two last axes)`` per slot of
    the parameter block. Returns the three inner extents (outermost first), the flat list of
    5 strides per slot (b0, b1, b2, row, col; zeros for an absent array) and one list of slot
    pointers per launch: batch axes that did not collapse into three are a loop here."""
    nb = len(batch)
    present = [i for i, (x, _) in enumerate(tensors) if x is not None]
    groups = collapse_batch(batch, [tensors[i][1][:nb] for i in present])
    outer, inner = groups[:-3], groups[-3:]
    inner = [(1, [0] * len(present))] * (3 - len(inner)) + inner
    strides = [0] * (5 * len(tensors))
    for slot, i in enumerate(present):
        strides[5 * i:5 * i + 5] = [g[1][slot] for g in inner] + list(tensors[i][1][nb:])

    base = [0] * len(tensors)
    for i in present:
        base[i] = tensors[i][0].data.ptr
    if not outer:  # the common case: one launch
        return [g[0] for g in inner], strides, [base]

    def pointer_sets():
        for index in np.ndindex(*(g[0] for g in outer)):
            pointers = list(base)
            for slot, i in enumerate(present):
                offset = sum(ix * g[1][slot] for ix, g in zip(index, outer))
                pointers[i] += offset * tensors[i][0].itemsize
            yield pointers

    return [g[0] for g in inner], strides, pointer_sets()


def stride_fields(names, strides: list[int]) -> dict:
    """``{name + "_s": (b0, b1, b2, row, col)}`` of the slots ``names``, from the flat list
    of five strides per slot that :func:`layout` returns."""
    return {f"{n}_s": tuple(strides[5 * i:5 * i + 5]) for i, n in enumerate(names)}
