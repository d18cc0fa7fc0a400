"""Tensor maps of the piped Hopper forward (``attention_fwd_sm90_piped``): the descriptors
through which the copy engine (TMA) brings tiles of q, k and v into shared memory.

A map describes one tensor as rank 5, innermost first: head dim, sequence, and the
kernel's batch axes 2, 1, 0 (:func:`~cuattn._launch.layout`; an axis the tensor broadcasts
along has extent 1 there and the kernel asks for coordinate 0). Its boxes are 64 columns
(128 bytes, the span of the 128-byte swizzle that the warpgroup MMA reads) by ``rows``
rows; elements past the sequence or head dim arrive as zeros. The maps hold the tensors'
addresses, so a launch re-encodes them when its pointers change
(:class:`TensorMaps`), through ``cuTensorMapEncodeTiled`` of the CUDA driver.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np

__all__ = ["MapShape", "map_shape", "TensorMaps", "MAP_BYTES"]

#: bytes of one CUtensorMap (and its alignment)
MAP_BYTES = 128
_UINT16, _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_256B, _OOB_ZEROS = 1, 0, 3, 3, 0
#: largest extent and byte stride a map takes
_MAX_EXTENT, _MAX_STRIDE = 2 ** 32, 2 ** 40


@dataclass(frozen=True)
class MapShape:
    """One tensor's map, pointer aside: extents and byte strides (innermost first; the
    strides of dims 1..4) and the box."""
    extents: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]


def map_shape(cols: int, rows: int, extents, strides, itemsize: int, box_rows: int):
    """The map of a tensor with ``cols`` head-dim columns and ``rows`` sequence rows whose
    five element strides are ``strides`` (b0, b1, b2, row, col, as :func:`layout` gives
    them) over the batch ``extents`` (three, outermost first), or None where the copy
    engine cannot read it: a column stride other than 1, or a byte stride that is not a
    multiple of 16 (or 2^40 and more)."""
    b0, b1, b2, row, col = strides
    if col != 1 and cols > 1:
        return None
    # a single row: its stride is never walked (a lone query's may be anything)
    dims, byte_strides = [cols, rows], [row * itemsize if rows > 1 else 16]
    for extent, stride in ((extents[2], b2), (extents[1], b1), (extents[0], b0)):
        # a broadcast axis (stride 0) or one of extent 1: extent 1, any valid stride
        walks = stride != 0 and extent > 1
        dims.append(extent if walks else 1)
        byte_strides.append(stride * itemsize if walks else 16)
    if any(s % 16 or not 0 < s < _MAX_STRIDE for s in byte_strides):
        return None
    if any(not 0 < d <= _MAX_EXTENT for d in dims):
        return None
    return MapShape(tuple(dims), tuple(byte_strides), (64, box_rows, 1, 1, 1))


_driver = None


def _encode_function():
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _driver = fn
    return _driver


class TensorMaps:
    """The maps of a launch's tensors (``shapes``, one MapShape each, in the order of the
    kernel's map fields), written into its parameter block at ``offsets`` for the tensors'
    addresses. One launch's: :meth:`write` re-encodes and rewrites only when the
    addresses differ from the last call's, whose maps the block still holds."""

    def __init__(self, shapes, offsets, encode=None):
        self._shapes, self._offsets = list(shapes), list(offsets)
        self._encode = encode or _encode_function()
        self._last = [None] * len(self._shapes)  # the address each map holds
        self._unwritten = set()  # maps encoded since the block last took them
        # one 64-byte aligned map buffer and the argument arrays of each map
        self._raw = np.zeros(MAP_BYTES * (len(self._shapes) + 1), np.uint8)
        start = -self._raw.ctypes.data % 64
        self._maps = self._raw[start:start + MAP_BYTES * len(self._shapes)]
        self._args = []
        for shape in self._shapes:
            dims = np.array(shape.extents, np.uint64)
            strides = np.array(shape.strides, np.uint64)
            box = np.array(shape.box, np.uint32)
            ones = np.ones(len(shape.extents), np.uint32)
            self._args.append((dims, strides, box, ones))
        self._lock = threading.Lock()
        self.refusal = ""  # the driver's answer where :meth:`check` failed

    def check(self, pointers) -> bool:
        """Does the driver encode the maps of the tensors at ``pointers``? The plan's test
        before it takes the piped kernel; the maps are kept for the first launch."""
        try:
            self.write(None, pointers)
        except RuntimeError as error:
            self.refusal = str(error)
            return False
        return True

    def write(self, block_bytes, pointers) -> None:
        """The maps of the tensors at ``pointers`` into ``block_bytes`` (a writable byte
        view of the parameter block; None: encode only). Only the maps whose address
        changed are encoded again (a decoding step's new q beside the same cache). Raises
        RuntimeError when the driver refuses one."""
        with self._lock:
            for i, pointer in enumerate(pointers):
                if pointer == self._last[i]:
                    continue
                self._last[i] = None
                dims, strides, box, ones = self._args[i]
                result = self._encode(
                    self._maps.ctypes.data + MAP_BYTES * i, _UINT16, len(dims), pointer,
                    dims.ctypes.data, strides.ctypes.data, box.ctypes.data, ones.ctypes.data,
                    _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_256B, _OOB_ZEROS)
                if result != 0:
                    raise RuntimeError(f"cuTensorMapEncodeTiled refused the map "
                                       f"{self._shapes[i]} at {pointer:#x}: CUresult {result}")
                self._last[i] = pointer
                self._unwritten.add(i)
            if block_bytes is not None:
                for i in self._unwritten:
                    at = self._offsets[i]
                    block_bytes[at:at + MAP_BYTES] = self._maps[
                        MAP_BYTES * i:MAP_BYTES * (i + 1)].data
                self._unwritten.clear()
