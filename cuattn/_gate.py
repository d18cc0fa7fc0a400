"""The NVRTC resource gate: compile kernel instances without a GPU and read ptxas's report.

Used by the tests (``tests/test_gate.py``) and ``python -m cuattn check --gate``. Compiles
through ``cuda.bindings.nvrtc`` with the options the runtime uses (ours from
``_kernels.nvrtc_options`` plus the CuPy appends) and returns the registers, spill bytes,
stack frame and ptxas's log per instance.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from ._kernels import nvrtc_options, read_source

# what cupy.cuda.compiler adds to every NVRTC compile (CuPy 14.2)
CUPY_APPENDS = ("-ftz=true", "--device-as-default-execution-space")
_USAGE = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
# ptxas's C75xx notes that it serialized a kernel's warpgroup MMAs (each one waited for
# before the next issues): correct, and far slower
_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized")


@dataclass
class Resources:
    name_expression: str
    arch: str
    registers: int
    stack_frame: int
    spill_stores: int
    spill_loads: int
    log: str

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    @property
    def wgmma_serialized(self) -> bool:
        """ptxas serialized the instance's warpgroup MMAs (a C75xx note in the log)."""
        return bool(_SERIALIZED.search(self.log))

    @property
    def clean(self) -> bool:
        """What a fast instance must be: no spills, no stack frame, no serialized wgmma."""
        return not self.spills and self.stack_frame == 0 and not self.wgmma_serialized


def cuda_include_dir() -> str | None:
    """The CUDA headers of the nvidia-cuda-runtime wheel (cuda_fp16.h, cuda_bf16.h)."""
    try:
        import nvidia.cu13
        roots = list(nvidia.cu13.__path__)
    except ImportError:
        return None
    for root in roots:
        if (Path(root) / "include" / "cuda_fp16.h").is_file():
            return str(Path(root) / "include")
    return None


def compile_instance(filename: str, name_expression: str, arch: str) -> Resources:
    """Compile one instance for ``arch`` (e.g. ``sm_90``); raise RuntimeError with the log
    on a compile error."""
    from cuda.bindings import nvrtc

    source = read_source(filename).encode()
    err, prog = nvrtc.nvrtcCreateProgram(source, filename.encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        nvrtc.nvrtcAddNameExpression(prog, name_expression.encode())
        opts = list(nvrtc_options(arch, filename)) + list(CUPY_APPENDS) + ["-Xptxas=-v"]
        include = cuda_include_dir()
        if include:
            opts.append(f"--include-path={include}")
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.decode(errors="replace").rstrip("\x00 ")
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{name_expression} ({filename}, {arch}) failed to compile:\n{log}")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    usage, spill = _USAGE.search(log), _SPILL.search(log)
    if usage is None or spill is None:
        raise RuntimeError(f"no ptxas report for {name_expression} ({arch}):\n{log}")
    return Resources(name_expression, arch, int(usage.group(1)), int(spill.group(1)),
                     int(spill.group(2)), int(spill.group(3)), log)


def compile_instances(instances, workers: int | None = None) -> list:
    """:func:`compile_instance` over ``(filename, name_expression, arch)`` triples, one
    process per core (ptxas is single-threaded and the instances are independent). Returns,
    in order, each instance's Resources or the RuntimeError its compile raised. The workers
    are spawned, not forked, so that a parent that has touched the CUDA runtime is safe."""
    workers = min(workers or os.cpu_count() or 1, len(instances))
    if workers <= 1:
        return [_compile_or_error(*i) for i in instances]
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        return list(pool.map(_compile_or_error, *zip(*instances), chunksize=4))


def _compile_or_error(filename: str, name_expression: str, arch: str):
    try:
        return compile_instance(filename, name_expression, arch)
    except RuntimeError as err:
        return err


def gate_instances(arch: str) -> list[tuple[str, str, bool]]:
    """(filename, name expression, fast) of every instance the gate compiles for ``arch``:
    vector_add's, and every forward and backward instance dispatch can pick."""
    from ._dispatch import backward_instances, forward_instances
    from .elementwise import VECTOR_ADD_DTYPES, vector_add_instance
    return ([("vector_add.cu", vector_add_instance(d), True) for d in VECTOR_ADD_DTYPES]
            + forward_instances(arch) + backward_instances(arch))
