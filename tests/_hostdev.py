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
    """A parameter block's fields by name (nested structs as structured scalars); the
    piped forward's (FwdTmaParams) are those of its AttnParams."""
    if "p" in block.dtype.names:
        block = block["p"]
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
        ndarray=HostDevice, asarray=asarray, ascontiguousarray=asarray,
        empty=lambda shape, dtype: allocated(np.empty(shape, dtype).view(HostDevice)),
        cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=0)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cuattn._kernels, "get_kernel", lambda filename, expr: "kernel")
    monkeypatch.setattr(cuattn._launch, "Launch", FakeLaunch)
    return grids


def packed_blocks(memory, f):
    """The row blocks of a packed call's table (AttnParams.packed, common.cuh's
    PackedBlock), in the grid's order: [(first query row, first key, query rows, keys,
    row block)]."""
    n = int(f["num_packed"])
    table = memory.view(f["packed"], np.int32, (n, 8), (8, 1))
    return [tuple(int(x) for x in row[:5]) for row in table]


def packed_sequences(memory, f):
    """The sequences of a packed call's table: [(first query row, first key, query rows,
    keys)], each once, in the order of their first row block."""
    return list(dict.fromkeys(b[:4] for b in packed_blocks(memory, f)))


def emulate_forward(memory, dtype):
    """A forward kernel (AttnParams) on host memory: per batch entry (and per packed
    sequence, AttnParams.packed), q, k, v and the mask read by their strides, the first
    k_lengths[b] - k_lengths_from - (b's index along batch axis 2) x k_lengths_step keys
    where key lengths are given (within 0 .. Sk), with paged keys and values (AttnParams.pages)
    each key's row found through the table as key_rows in common.cuh does,
    ``attention_reference``, out (and lse where its pointer is set) written by theirs. No
    bias."""
    from cuattn._checks import lse_dtype
    from cuattn.reference import attention_reference
    dtype = np.dtype(dtype)

    def run(block, pointers, grid):
        f = fields(block)
        # the call's work units: a block each, or FwdTmaParams.units (a persistent grid)
        units = int(block["units"]) if "units" in block.dtype.names else grid[0]
        q, k, v, out, lse, mask = pointers[:6]
        lengths = pointers[7] if len(pointers) > 7 else 0
        table = pointers[8] if len(pointers) > 8 else 0
        sq, sk, d, dv = (int(f[n]) for n in ("seqlen_q", "seqlen_k", "head_dim", "head_dim_v"))
        window = tuple(None if w < 0 else int(w) for w in (f["window_left"], f["window_right"]))
        kw = {"scale": float(f["scale"]), "softcap": float(f["softcap"]) or None,
              "window": None if window == (None, None) else window}
        sequences = packed_sequences(memory, f) if f["packed"] else [(0, 0, sq, sk)]
        for b in range(units // (f["num_m_blocks"] * f["num_dv_tiles"])):
            keys = None
            if lengths:
                dt = np.dtype(np.int64 if f["k_lengths_size"] == 8 else np.int32)
                n = memory.read(lengths + int(batch_offset(f["k_lengths_s"], b, f)) *
                                dt.itemsize, dt)
                n -= f["k_lengths_from"] + b % f["batch2"] * f["k_lengths_step"]
                keys = int(min(max(n, 0), sk))
            for q0, k0, rows, cols in sequences:
                cols = cols if keys is None else keys
                def at(ptr, s, shape, row0, dt=dtype, b=b):
                    offset = int(batch_offset(s, b, f) + row0 * s["row"]) * dt.itemsize
                    return memory.view(ptr + offset, dt, shape,
                                       (s["row"], s["col"])[:len(shape)])
                allowed = at(mask, f["mask_s"], (rows, cols), 0, np.dtype(bool)) if mask \
                    else None
                if table:
                    keys_of = paged_rows(memory, f, table, b, cols, dtype)
                    kk, vv = keys_of(k, "k", d), keys_of(v, "v", dv)
                else:
                    kk, vv = at(k, f["k_s"], (cols, d), k0), at(v, f["v_s"], (cols, dv), k0)
                o, row_lse = attention_reference(at(q, f["q_s"], (rows, d), q0), kk, vv,
                                                 mask=allowed, **kw)
                at(out, f["out_s"], (rows, dv), q0)[...] = o
                if lse:
                    at(lse, f["lse_s"], (rows,), q0, lse_dtype(dtype))[...] = row_lse
    return run


def paged_rows(memory, f, table, b, cols, dtype):
    """A function of (pool address, "k" or "v", columns) giving batch entry b's first
    ``cols`` keys or values of paged pools (AttnParams.pages): key j of the call's chunk is
    row (j0 + j) % page_size of page table[b][(j0 + j) // page_size], j0 the chunk's first
    key, the page clamped to the pools (key_rows in common.cuh)."""
    at_table = table + int(batch_offset(f["pages_s"], b, f)) * 4
    j0 = int(f["k_lengths_from"] + b % f["batch2"] * f["k_lengths_step"])
    size, col = int(f["page_size"]), int(f["pages_s"]["col"])

    def rows(pool, name, width):
        s = f[f"{name}_s"]
        out = np.empty((cols, width), dtype)
        for j in range(cols):
            page = int(memory.read(at_table + (j0 + j) // size * col * 4, np.int32))
            page = min(max(page, 0), int(f["num_pages"]) - 1)
            offset = (batch_offset(s, b, f) + page * int(f[f"{name}_page"])
                      + (j0 + j) % size * int(s["row"]))
            out[j] = memory.view(pool + int(offset) * dtype.itemsize, dtype, (width,),
                                 (int(s["col"]),))
        return out
    return rows


def fake_gpu(monkeypatch, arrays: list, launches: list, dtype, emulations=None):
    """A CuPy stand-in for the GPU backend's forward path, on host memory: the class it
    returns makes arrays that cuattn takes for CuPy arrays (allocations join ``arrays``);
    kernels are emulated, the forward's by :func:`emulate_forward` on inputs of ``dtype``,
    others by ``emulations`` (name prefix -> emulation), at once (streams only record what
    they are asked: ``sys.modules["cupy"].streams``); each launch is appended to
    ``launches`` as (kernel, pointers, stream). Plans made here stay here."""
    import cuattn._checks
    import cuattn._gpu
    import cuattn._gpu_plan
    import cuattn._kernels
    import cuattn._launch
    import cuattn._tma
    from cuattn import merge

    class Device(HostDevice):
        maps, map_result = [], 0  # the tensor maps encoded; what the driver answers

        def __new__(cls, shape, dtype):
            x = np.ndarray.__new__(cls, shape, dtype)
            arrays.append(x)
            return x

        def __array_finalize__(self, obj):  # a new array of this kind (astype, say)
            if obj is not None and self.base is None:
                arrays.append(self)

    forward = emulate_forward(Memory(arrays), dtype)
    emulations = emulations or {}

    def encode(tensor_map, data_type, rank, address, dims, strides, box, element_strides,
               interleave, swizzle, l2_promotion, oob_fill):
        """cuTensorMapEncodeTiled: records the map (Device.maps) and answers
        Device.map_result (0: encoded)."""
        def read(at, ctype, n):
            return tuple(int(x) for x in (ctype * n).from_address(at))
        Device.maps.append((address, read(dims, ctypes.c_uint64, rank),
                            read(strides, ctypes.c_uint64, rank - 1),
                            read(box, ctypes.c_uint32, rank)))
        return Device.map_result

    class Launch:
        def __init__(self, fn, grid, threads, shared_mem, block, pointers=(), per_call=None,
                     maps=None):
            self.fn, self.grid, self.block, self.maps = fn, grid, block, maps
            self.slots = pointers
            self.bytes = memoryview(bytearray(block.nbytes))

        def __call__(self, pointers, stream, *per_call):
            # the real Launch packs exactly one pointer per slot
            assert len(pointers) == len(self.slots), (self.fn, len(pointers), self.slots)
            launches.append((self.fn, tuple(pointers), stream))
            if self.maps is not None:
                self.maps.write(self.bytes, pointers[:3])
            run = next((e for name, e in emulations.items() if self.fn.startswith(name)),
                       forward)
            run(self.block, pointers, self.grid)

    class Stream:
        """A stream: its ptr, the events it recorded and waited for, and as a context
        manager the current stream."""
        current = None

        def __init__(self, non_blocking=False):
            self.ptr, self.recorded, self.waited = 1 + len(streams), [], []
            streams.append(self)

        def record(self):
            event = object()
            self.recorded.append(event)
            return event

        def wait_event(self, event):
            self.waited.append(event)

        def __enter__(self):
            self.previous, Stream.current = Stream.current, self
            return self

        def __exit__(self, *exc):
            Stream.current = self.previous

    streams = []
    Stream.current = Stream()  # the null stream, ptr 1
    def asarray(x):
        device = Device(np.shape(x), np.asarray(x).dtype)
        device[...] = x
        return device

    fake = types.SimpleNamespace(
        ndarray=Device, empty=Device, asarray=asarray, copyto=np.copyto,
        ascontiguousarray=np.ascontiguousarray,
        broadcast_to=lambda x, shape: np.broadcast_to(x, shape, subok=True),
        where=np.where, clip=np.clip, int32=np.int32,
        lib=np.lib, streams=streams,
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                   Stream=Stream, get_current_stream=lambda: Stream.current))
    real_as_array = cuattn._checks.as_array
    monkeypatch.setitem(sys.modules, "cupy", fake)
    for module in [m for n, m in sys.modules.items() if n.startswith("cuattn")]:
        if getattr(module, "as_array", None) is real_as_array:
            monkeypatch.setattr(module, "as_array", lambda x, name: (
                (x, fake) if isinstance(x, Device) else real_as_array(x, name)))
    monkeypatch.setattr(cuattn._gpu_plan, "get_kernel", lambda f, expr, shared_mem=0: expr)
    monkeypatch.setattr(cuattn._kernels, "get_kernel", lambda f, expr, shared_mem=0: expr)
    monkeypatch.setattr(cuattn._gpu_plan, "Launch", Launch)
    monkeypatch.setattr(cuattn._launch, "Launch", Launch)
    monkeypatch.setattr(cuattn._tma, "_encode_function", lambda: encode)
    for module in (cuattn._gpu, cuattn._gpu_plan):
        monkeypatch.setattr(module, "sm_count", lambda device: 8)
    monkeypatch.setattr(cuattn._gpu, "device_limits", lambda device: ((9, 0), 232448))
    for module, name in ((cuattn._gpu, "_forward_plans"), (cuattn._gpu, "_repeated"),
                         (cuattn._gpu, "_part_streams"), (merge, "_stacked_plans")):
        monkeypatch.setattr(module, name, {})
    return Device
