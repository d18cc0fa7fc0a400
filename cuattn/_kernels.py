"""The kernel loader: the only module that reads ``cuda/`` and calls NVRTC.

A kernel instance is one template instantiation of one ``.cu`` file, e.g.
``attention_fwd_portable<float, cuattn::NoBias, false, 64, 64, 64, 64, 2>``. It is built by
:func:`get_kernel` through ``cupy.RawModule(code=..., name_expressions=[...])`` after local
``#include "x.cuh"`` headers have been inlined into the text, so that CuPy's on-disk cache
key (a hash of the source) covers the headers too. Instances are cached per process by
(device, kernel directory, file, name expression, options) and on disk by CuPy
(``CUPY_CACHE_DIR``).

``CUATTN_KERNEL_DIR`` points the loader at another copy of the sources, for kernel
experiments; it is read at every call, so a test or a notebook can switch folders.
"""
from __future__ import annotations

import functools
import os
import re
import struct
import threading
from pathlib import Path

import numpy as np

__all__ = ["kernel_dir", "read_source", "nvrtc_options", "get_kernel", "KernelCompileError",
           "ATTN_PARAMS_DTYPE", "attn_params", "attn_params_tail", "ATTN_BWD_PARAMS_DTYPE",
           "pack_attn_bwd_params", "TF32_PREP_DTYPE", "c_type_name", "require_cupy",
           "KeptLaunch", "ForwardLaunch", "Tf32PrepLaunch"]

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_lock = threading.Lock()


class KernelCompileError(RuntimeError):
    """A ``.cu`` file failed to compile; the message holds the file name and NVRTC's log."""


def require_cupy():
    """Import CuPy, or say which extra installs it."""
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "cuattn needs CuPy for GPU arrays: install it with "
            "`pip install cuattn[cuda13]` (or `cuattn[cuda12]` for a CUDA 12 driver)") from exc
    return cupy


def kernel_dir() -> Path:
    """The folder the kernel sources are read from.

    ``CUATTN_KERNEL_DIR`` if set; else the sources packaged in the wheel
    (``cuattn/cuda``); else the ``cuda/`` folder of a source checkout or editable install.
    The variable is read at every call; the folder is looked up once per value.
    """
    return _resolve_kernel_dir(os.environ.get("CUATTN_KERNEL_DIR") or None)


@functools.lru_cache(maxsize=16)
def _resolve_kernel_dir(env: str | None) -> Path:
    if env:
        path = Path(env)
        if not (path / "common.cuh").is_file():
            raise FileNotFoundError(
                f"CUATTN_KERNEL_DIR={env!r} does not hold the kernel sources (no common.cuh)")
        return path
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda", here.parent / "cuda"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cuattn's kernel sources are missing: looked in {here / 'cuda'} "
                            f"and {here.parent / 'cuda'}")


def read_source(filename: str, directory: Path | None = None) -> str:
    """The text of ``filename`` with local ``#include "..."`` headers inlined, each once."""
    directory = kernel_dir() if directory is None else Path(directory)
    seen: set[str] = set()

    def inline(name: str) -> str:
        lines = []
        for line in (directory / name).read_text().splitlines():
            match = _INCLUDE.match(line)
            if match:
                header = match.group(1)
                if header not in seen:
                    seen.add(header)
                    lines.append(f"// ---- begin {header}")
                    lines.append(inline(header))
                    lines.append(f"// ---- end {header}")
            elif line.strip() != "#pragma once":
                lines.append(line)
        return "\n".join(lines)

    return inline(filename) + "\n"


#: Sources built for an architecture-specific target instead of the device's plain one:
#: wgmma exists only on sm_90a. Given ours and CuPy's appended -arch=sm_90, NVRTC 13.0 builds
#: for sm_90a (either order; sm_90 alone rejects wgmma); dispatch sends these files to
#: sm_90 devices only.
ARCH_SPECIFIC = {"attention_sm90.cu": "sm_90a", "attention_sm90_tf32.cu": "sm_90a",
                 "attention_backward_sm90.cu": "sm_90a",
                 "attention_backward_sm90_3xf16.cu": "sm_90a",
                 "attention_sm90_3xf16.cu": "sm_90a"}


def nvrtc_options(arch: str | None = None, filename: str | None = None) -> tuple[str, ...]:
    """Our NVRTC options. At run time CuPy appends ``-arch=sm_XX`` for the current device,
    ``-ftz=true`` and ``--device-as-default-execution-space``; the NVRTC gate
    (``cuattn._gate``) passes ``arch`` and the same appends, so that its register and spill
    counts are the runtime's. ``filename`` in ARCH_SPECIFIC gets that target."""
    opts = ("-std=c++17",)
    specific = ARCH_SPECIFIC.get(filename)
    if specific is not None:
        opts += (f"-arch={specific}",)
    elif arch is not None:
        opts += (f"-arch={arch}",)
    return opts


@functools.cache
def _module(device_id: int, directory: str, filename: str, name_expression: str,
            options: tuple[str, ...]):
    cupy = require_cupy()
    source = read_source(filename, Path(directory))
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=source, options=options, name_expressions=[name_expression])
        try:
            return module.get_function(name_expression)
        except cupy.cuda.compiler.CompileException as exc:
            raise KernelCompileError(
                f"compiling {name_expression} from {Path(directory) / filename} failed:\n"
                f"{exc.get_message() if hasattr(exc, 'get_message') else exc}") from None


_ready: dict = {}  # (device, folder, file, expression, options, shared_mem) -> RawKernel


def get_kernel(filename: str, name_expression: str, *, shared_mem: int = 0,
               options: tuple[str, ...] | None = None):
    """The compiled ``cupy.RawKernel`` for one template instance on the current device.

    ``shared_mem`` above 48 KB is opted into with ``max_dynamic_shared_size_bytes``, after a
    check against the device's ``MaxSharedMemoryPerBlockOptin``. After the first call the
    lookup is one dictionary access.
    """
    cupy = require_cupy()
    device_id = cupy.cuda.runtime.getDevice()
    options = nvrtc_options(filename=filename) if options is None else options
    key = (device_id, kernel_dir(), filename, name_expression, options, shared_mem)
    kernel = _ready.get(key)
    if kernel is not None:
        return kernel
    with _lock:  # one compile per instance even when threads race to the first call
        kernel = _module(device_id, str(key[1]), filename, name_expression, options)
        if shared_mem > 48 * 1024:
            limit = cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"]
            if shared_mem > limit:
                raise NotImplementedError(
                    f"{name_expression} needs {shared_mem} bytes of shared memory but this GPU "
                    f"allows {limit} per block")
            if kernel.max_dynamic_shared_size_bytes < shared_mem:
                kernel.max_dynamic_shared_size_bytes = shared_mem
        _ready[key] = kernel
    return kernel


_C_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float",
            "float64": "double", "int32": "int", "int64": "long long"}


def c_type_name(dtype) -> str:
    """The CUDA C++ type of a NumPy dtype, as the kernels' templates spell it."""
    return _C_TYPES[np.dtype(dtype).name]


_STRIDES = [(f, np.int64) for f in ("b0", "b1", "b2", "row", "col")]
_STRIDES_DTYPE = np.dtype(_STRIDES)
#: The parameter block of the attention kernels, field for field ``AttnParams`` in
#: ``cuda/common.cuh``. All fields are 8 bytes wide, so no padding rule can differ.
ATTN_PARAMS_DTYPE = np.dtype(
    [(f, np.int64) for f in ("q", "k", "v", "out", "lse", "mask", "bias", "batch1", "batch2",
                             "seqlen_q", "seqlen_k", "head_dim", "head_dim_v", "window_left",
                             "window_right", "num_m_blocks", "num_dv_tiles")]
    + [("scale", np.float64), ("softcap", np.float64)]
    + [(f"{t}_s", _STRIDES_DTYPE) for t in ("q", "k", "v", "out", "lse", "mask", "bias")]
    + [("magnitudes", np.int64)],
    align=True)
_POINTERS_STRUCT = struct.Struct("<7q")
_PARAMS_TAIL_STRUCT = struct.Struct("<10q2d35qq")
#: byte offset of the magnitudes field (the last), which a ForwardLaunch may write per call
_MAGNITUDES_OFFSET = ATTN_PARAMS_DTYPE.fields["magnitudes"][1]
_MAGNITUDES_STRUCT = struct.Struct("<q")
assert _POINTERS_STRUCT.size + _PARAMS_TAIL_STRUCT.size == ATTN_PARAMS_DTYPE.itemsize


def attn_params_tail(ints: list[int], scale: float, softcap: float, strides: list[int],
                     magnitudes: int = 0) -> bytes:
    """The AttnParams block after its seven pointers, packed: ``ints`` are the ten integer
    fields batch1 .. num_dv_tiles, ``magnitudes`` the last field. A call signature's launch
    plan keeps these bytes, and each call adds its pointers (:func:`attn_params`)."""
    return _PARAMS_TAIL_STRUCT.pack(*ints, scale, softcap, *strides, magnitudes)


def attn_params(pointers: list[int], tail: bytes) -> np.void:
    """The AttnParams block of seven pointers (q, k, v, out, lse, mask, bias) and a packed
    tail (:func:`attn_params_tail`): the bytes a :class:`ForwardLaunch` launches with."""
    return np.frombuffer(_POINTERS_STRUCT.pack(*pointers) + tail, ATTN_PARAMS_DTYPE)[0]


class KeptLaunch:
    """One launch of a call signature: kernel, grid, block, shared memory and the kernel's
    parameter block, kept here with its leading pointers written per call
    (``pointer_struct``) and launched through ``cuLaunchKernel`` (about 5 us less than
    CuPy's launch, which converts and packs every argument each call). The kernel is the
    one loaded for the current device; the caller keeps one per device. Thread-safe: the
    pointers are written and launched under a lock, and the driver copies the block before
    the launch returns."""

    def __init__(self, kernel, grid: tuple[int, int], threads: int, shared_mem: int,
                 block: bytes, pointer_struct: struct.Struct):
        from cupy_backends.cuda.api import driver
        self._launch = driver.launchKernel
        self._function = kernel.kernel.ptr
        self._block = np.zeros(-(-len(block) // 8), np.int64)
        self._bytes = memoryview(self._block).cast("B")
        self._bytes[:len(block)] = block
        self._pack = pointer_struct.pack_into
        self._argv = np.array([self._block.ctypes.data], np.int64)  # void* kernelParams[1]
        self._argv_ptr = self._argv.ctypes.data
        self._dims = (*grid, threads, shared_mem)
        self._lock = threading.Lock()

    def __call__(self, pointers, stream_ptr: int, magnitudes: int | None = None) -> None:
        grid_x, grid_y, threads, shared_mem = self._dims
        with self._lock:
            self._pack(self._bytes, 0, *pointers)
            if magnitudes is not None:  # a ForwardLaunch's per-call magnitudes (sm90_3xf16)
                _MAGNITUDES_STRUCT.pack_into(self._bytes, _MAGNITUDES_OFFSET, magnitudes)
            self._launch(self._function, grid_x, grid_y, 1, threads, 1, 1, shared_mem,
                         stream_ptr, self._argv_ptr, 0)


class ForwardLaunch(KeptLaunch):
    """A forward kernel's :class:`KeptLaunch`: the AttnParams block from its packed tail
    (:func:`attn_params_tail`), a call writing its seven pointers."""

    def __init__(self, kernel, grid: int, threads: int, shared_mem: int, tail: bytes):
        super().__init__(kernel, (grid, 1), threads, shared_mem,
                         bytes(_POINTERS_STRUCT.size) + tail, _POINTERS_STRUCT)


#: The backward's parameter block, ``AttnBwdParams`` in ``cuda/common.cuh``: the forward's
#: block, then the backward's own pointers, grid sizes and strides.
ATTN_BWD_PARAMS_DTYPE = np.dtype(
    [("f", ATTN_PARAMS_DTYPE)]
    + [(f, np.int64) for f in ("dout", "delta", "dq", "dk", "dv", "num_row_blocks",
                               "num_col_tiles")]
    + [(f"{t}_s", _STRIDES_DTYPE) for t in ("dout", "delta", "dq", "dk", "dv")],
    align=True)
_ATTN_BWD_PARAMS_STRUCT = struct.Struct("<17q2d35qq7q25q")
assert _ATTN_BWD_PARAMS_STRUCT.size == ATTN_BWD_PARAMS_DTYPE.itemsize


def pack_attn_bwd_params(ints: list[int], scale: float, softcap: float, strides: list[int],
                         bwd_ints: list[int], bwd_strides: list[int],
                         magnitudes: int = 0) -> np.void:
    """The AttnBwdParams block: the forward's 17 integer fields (seven pointers, then the ten of
    :func:`attn_params_tail`), then
    ``bwd_ints`` (dout, delta, dq, dk, dv pointers, num_row_blocks, num_col_tiles) and
    ``bwd_strides`` (25 stride fields: dout, delta, dq, dk, dv); ``magnitudes`` is the
    forward block's last field (the sm90_3xf16 kernels' largest magnitudes per batch entry,
    a device address)."""
    buf = _ATTN_BWD_PARAMS_STRUCT.pack(*ints, scale, softcap, *strides, magnitudes, *bwd_ints,
                                       *bwd_strides)
    return np.frombuffer(buf, ATTN_BWD_PARAMS_DTYPE)[0]


#: The parameter block of tf32_image_k / tf32_image_vt, ``Tf32Prep`` in
#: ``cuda/attention_sm90_tf32.cu``.
TF32_PREP_DTYPE = np.dtype(
    [(f, np.int64) for f in ("src", "dst", "entries", "batch1", "batch2", "rows", "cols",
                             "src_rows", "src_cols")]
    + [("src_s", _STRIDES_DTYPE)], align=True)
_TF32_PREP_STRUCT = struct.Struct("<14q")
_TF32_PREP_POINTERS = struct.Struct("<2q")  # its leading src and dst
assert _TF32_PREP_STRUCT.size == TF32_PREP_DTYPE.itemsize


class Tf32PrepLaunch(KeptLaunch):
    """One tf32_image_k / tf32_image_vt :class:`KeptLaunch` (256 threads per block): the
    Tf32Prep block from its 14 integer fields in declaration order (the source's five
    strides last), a call writing its two pointers (source, images)."""

    def __init__(self, kernel, grid: tuple[int, int], fields: list[int]):
        super().__init__(kernel, grid, 256, 0, _TF32_PREP_STRUCT.pack(*fields),
                         _TF32_PREP_POINTERS)
