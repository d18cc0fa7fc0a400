"""Host memory standing in for device memory, to check a CuPy launch path without a GPU.

``HostDevice`` arrays look like CuPy arrays to the launch code (``.data.ptr`` is the host
address); :func:`fake_cupy` installs a CuPy module with what such paths call, a stand-in
for ``get_kernel`` and a ``Launch`` that hands each launch's parameter block and pointers
to an emulation of the kernel. :class:`Memory` is what an emulation reads and writes: by
address, only inside the arrays of the call, so a wrong stride fails the test instead of
touching other memory.
"""
import ctypes
import sys
import types

import numpy as np


class HostDevice(np.ndarray):
    """A host array that a CuPy launch path takes for a device array."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0], device_id=0)


def on_device(x):
    return np.asarray(x).view(HostDevice)


class Memory:
    """Reads and writes by address inside the byte ranges of ``arrays`` (a list that the
    CuPy stand-in's allocations join)."""

    def __init__(self, arrays: list):
        self.arrays = arrays

    def _at(self, address, size):
        from cuattn._checks import byte_bounds
        address = int(address)
        ranges = [byte_bounds(np.asarray(x)) for x in self.arrays]
        assert any(lo <= address and address + size <= hi for lo, hi in ranges), \
            f"address {address:#x} is outside every array of the call"
        return address

    def read(self, address, dtype):
        dtype = np.dtype(dtype)
        raw = (ctypes.c_char * dtype.itemsize).from_address(self._at(address, dtype.itemsize))
        return np.frombuffer(raw, dtype)[0]

    def write(self, address, value, dtype):
        dtype = np.dtype(dtype)
        data = np.asarray(value, dtype).tobytes()
        ctypes.memmove(self._at(address, dtype.itemsize), data, dtype.itemsize)

    def view(self, address, dtype, shape, strides):
        """The array of ``shape`` and element ``strides`` (not negative) at ``address``,
        inside one array of the call, to read and write in place."""
        from cuattn._checks import byte_bounds
        dtype = np.dtype(dtype)
        address = int(address)
        end = address + (sum((n - 1) * st for n, st in zip(shape, strides)) + 1) * dtype.itemsize
        for x in self.arrays:
            lo, hi = byte_bounds(np.asarray(x))
            if lo <= address and end <= hi:
                memory = (ctypes.c_char * (hi - lo)).from_address(lo)
                return np.ndarray(shape, dtype, buffer=memory, offset=address - lo,
                                  strides=[st * dtype.itemsize for st in strides])
        raise AssertionError(f"address {address:#x} is outside every array of the call")

    def copy(self, to, fro, size):
        ctypes.memmove(self._at(to, size), self._at(fro, size), size)


def fields(block) -> dict:
    """A parameter block's fields by name (nested structs as structured scalars)."""
    return {name: block[name][()] for name in block.dtype.names}


def batch_offset(s, b, f):
    """common.cuh's batch_offset: element offset of batch entry b under strides s."""
    b2, b01 = b % f["batch2"], b // f["batch2"]
    return (b01 // f["batch1"]) * s["b0"] + (b01 % f["batch1"]) * s["b1"] + b2 * s["b2"]


def fake_cupy(monkeypatch, emulate, expected_pointers, threads, arrays: list):
    """Install a CuPy stand-in, ``get_kernel`` and ``Launch``: every launch calls
    ``emulate(block, pointers, grid)``; the stand-in's allocations join ``arrays``.
    Returns the list of launch grids."""
    import cuattn._kernels
    import cuattn._launch
    grids = []

    class FakeLaunch:
        def __init__(self, fn, grid, block_threads, shared_mem, block, pointers=()):
            assert fn == "kernel" and shared_mem == 0 and block_threads == threads
            assert pointers == expected_pointers
            self.grid, self.block = grid, block

        def __call__(self, pointers, stream):
            grids.append(self.grid)
            emulate(self.block, pointers, self.grid)

    def allocated(x):
        arrays.append(x)
        return x

    def asarray(x, dtype=None):
        return allocated(np.ascontiguousarray(x, dtype=dtype).view(HostDevice))

    fake = types.SimpleNamespace(
        asarray=asarray, ascontiguousarray=asarray,
        empty=lambda shape, dtype: allocated(np.empty(shape, dtype).view(HostDevice)),
        cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=0)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cuattn._kernels, "get_kernel", lambda filename, expr: "kernel")
    monkeypatch.setattr(cuattn._launch, "Launch", FakeLaunch)
    return grids
