"""The kernel loader: the only module that reads ``cuda/`` and calls NVRTC.

A kernel instance is one template instantiation of one ``.cu`` file, e.g.
``attention_fwd_portable<float, cuattn::NoBias, false, 64, 64, 64, 64, 2>``. It is built by
:func:`get_kernel` through ``cupy.RawModule(code=..., name_expressions=[...])`` after local
``#include "x.cuh"`` headers have been inlined into the text, so that CuPy's on-disk cache
key (a hash of the source) covers the headers too. Instances are cached per process by
(device, kernel directory, file, name expression, options) and on disk by CuPy
(``CUPY_CACHE_DIR``). :func:`get_kernels` fetches the instances of one call (the
backward's three kernels), compiling the missing ones side by side.

``CUATTN_KERNEL_DIR`` points the loader at another copy of the sources, for kernel
experiments; it is read at every call, so a test or a notebook can switch folders.
"""
from __future__ import annotations

import functools
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

__all__ = ["kernel_dir", "read_source", "nvrtc_options", "get_kernel", "get_kernels",
           "KernelCompileError", "c_type_name", "require_cupy"]

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_lock = threading.Lock()  # guards _locks
_locks: dict = {}  # instance key -> its lock: one compile per instance, others side by side


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
        if not (path / "common/common.cuh").is_file():
            raise FileNotFoundError(f"CUATTN_KERNEL_DIR={env!r} does not hold the kernel "
                                    f"sources (no common/common.cuh)")
        return path
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda", here.parent / "cuda"):
        if (candidate / "common/common.cuh").is_file():
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
ARCH_SPECIFIC = {"sm90/attention_sm90.cu": "sm_90a", "sm90/attention_sm90_tf32.cu": "sm_90a",
                 "sm90/attention_backward_sm90.cu": "sm_90a",
                 "sm90/attention_backward_sm90_3xf16.cu": "sm_90a",
                 "sm90/attention_sm90_3xf16.cu": "sm_90a"}


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
    return _kernel(cupy, cupy.cuda.runtime.getDevice(), filename, name_expression, shared_mem,
                   options)


def get_kernels(filename: str, instances) -> list:
    """:func:`get_kernel` for each ``(name_expression, shared_mem)`` of one file on the
    current device. The instances not compiled yet compile side by side, one thread each
    (NVRTC runs without the GIL), so a first call waits for its slowest compile rather than
    for their sum."""
    cupy = require_cupy()
    device_id = cupy.cuda.runtime.getDevice()
    instances = list(instances)

    def one(instance):
        return _kernel(cupy, device_id, filename, *instance)

    if sum(_key(device_id, filename, *i) not in _ready for i in instances) < 2:
        return [one(i) for i in instances]
    with ThreadPoolExecutor(max_workers=len(instances)) as pool:
        return list(pool.map(one, instances))


def _key(device_id: int, filename: str, name_expression: str, shared_mem: int = 0,
         options: tuple[str, ...] | None = None) -> tuple:
    options = nvrtc_options(filename=filename) if options is None else options
    return (device_id, kernel_dir(), filename, name_expression, options, shared_mem)


def _kernel(cupy, device_id: int, filename: str, name_expression: str, shared_mem: int = 0,
            options: tuple[str, ...] | None = None):
    key = _key(device_id, filename, name_expression, shared_mem, options)
    kernel = _ready.get(key)
    if kernel is not None:
        return kernel
    with _lock:
        lock = _locks.setdefault(key, threading.Lock())
    with lock, cupy.cuda.Device(device_id):  # a thread of get_kernels starts on device 0
        kernel = _ready.get(key)  # compiled while this thread waited
        if kernel is not None:
            return kernel
        kernel = _module(device_id, str(key[1]), filename, name_expression, key[4])
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
