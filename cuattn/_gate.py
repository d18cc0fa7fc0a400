"""The NVRTC resource gate: compile kernel instances without a GPU and read ptxas's report.

Used by the tests (``tests/test_gate.py``, ``python -m pytest -m gate``) and
``python -m cuattn check --gate``. Compiles through ``cuda.bindings.nvrtc`` with the options
the runtime uses (ours from ``_kernels.nvrtc_options`` plus the CuPy appends) and returns the
registers, spill bytes, stack frame and ptxas's log per instance.

The gate has two tiers (:func:`gate_plan`). A fast instance (no mask, no bias, aligned,
gradients in place) goes through ptxas for every target architecture, whose report must
show no spills. Every other instance dispatch can pick is compiled to PTX once, for the
first target that picks it: that is where a template fails (a static assertion, a missing
specialisation), at a third of ptxas's cost.
"""
from __future__ import annotations

import itertools
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

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


def compile_instance(filename: str, name_expression: str, arch: str,
                     ptx_only: bool = False) -> Resources:
    """Compile one instance for ``arch`` (e.g. ``sm_90``); raise RuntimeError with the log
    on a compile error. ``ptx_only`` stops at PTX (the virtual ``compute_XX`` target):
    registers and spills are then reported as 0."""
    from cuda.bindings import nvrtc

    source = read_source(filename).encode()
    err, prog = nvrtc.nvrtcCreateProgram(source, filename.encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        nvrtc.nvrtcAddNameExpression(prog, name_expression.encode())
        opts = list(nvrtc_options(arch, filename)) + list(CUPY_APPENDS)
        if ptx_only:
            opts = [o.replace("-arch=sm_", "-arch=compute_") for o in opts]
        else:
            opts.append("-Xptxas=-v")
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
        _, lowered = nvrtc.nvrtcGetLoweredName(prog, name_expression.encode())
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    if ptx_only:
        return Resources(name_expression, arch, 0, 0, 0, 0, log)
    # a file's plain (non-template) kernels compile into every module: read the report of
    # this instance's entry function, from its line to the next entry's
    entry = log.find(f"Compiling entry function '{lowered.decode()}'")
    end = log.find("Compiling entry function", entry + 1)
    section = log[entry:end if end >= 0 else len(log)] if entry >= 0 else ""
    usage, spill = _USAGE.search(section), _SPILL.search(section)
    if usage is None or spill is None:
        raise RuntimeError(f"no ptxas report for {name_expression} ({arch}):\n{log}")
    return Resources(name_expression, arch, int(usage.group(1)), int(spill.group(1)),
                     int(spill.group(2)), int(spill.group(3)), log)


def compile_instances(instances, workers: int | None = None) -> list:
    """:func:`compile_instance` over ``(filename, name_expression, arch, ptx_only)``
    tuples (``ptx_only`` may be left out), one
    process per core (ptxas is single-threaded and the instances are independent). Returns,
    in order, each instance's Resources or the RuntimeError its compile raised. The workers
    are spawned, not forked, so that a parent that has touched the CUDA runtime is safe."""
    workers = min(workers or os.cpu_count() or 1, len(instances))
    if workers <= 1:
        return [_compile_or_error(*i) for i in instances]
    instances = [tuple(i) + (False,) * (4 - len(i)) for i in instances]
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        return list(pool.map(_compile_or_error, *zip(*instances), chunksize=4))


def _compile_or_error(filename: str, name_expression: str, arch: str, ptx_only: bool = False):
    try:
        return compile_instance(filename, name_expression, arch, ptx_only)
    except RuntimeError as err:
        return err


#: (compute capability, opt-in shared memory per block) of the GPUs the gate compiles for:
#: A100, the 99 KB parts of Ampere/Ada (which take the fallback tiles), H100/H200
GATE_TARGETS = {"sm_80": ((8, 0), 166912), "sm_86": ((8, 6), 101376),
                "sm_90": ((9, 0), 232448)}

#: Head dims the gate enumerates: every D (= Dv) from 1 to 256, each dispatch's padding and
#: tile rows crossed, and the portable kernel's wider classes. D != Dv pairs take the
#: boundaries of every padding class (multiples of 16, 32 and 64 and one past them).
GATE_HEAD_DIMS = tuple(range(1, 257)) + (257, 384, 512, 513, 1024)
GATE_PAIR_DIMS = (1, 16, 17, 32, 33, 48, 64, 65, 96, 97, 128, 129, 160, 192, 193, 224, 256)


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _precisions(name: str):
    return ("highest", "tf32") if name == "float32" else (None,)


def gate_calls(family):
    """(dtype, head_dim, head_dim_v, bias dtype, mask, aligned, precision, fast) of the gate's
    calls for ``family`` (a dispatch table row): every feature combination at every D = Dv
    of GATE_HEAD_DIMS, and every D != Dv pair of GATE_PAIR_DIMS without mask or bias (the
    head dims and the features are independent template arguments)."""
    aligned_both = (family.name.startswith(("mma", "sm90"))
                    or any(n in ("float32", "float64") for n in family.dtypes))
    for name in family.dtypes:
        dtype = _np_dtype(name)
        heads = [(d, d) for d in GATE_HEAD_DIMS if d <= family.max_head_dim]
        pairs = [(d, dv) for d, dv in itertools.product(GATE_PAIR_DIMS, repeat=2)
                 if d != dv and max(d, dv) <= family.max_head_dim]
        for (d, dv), bias, has_mask, aligned, precision in itertools.product(
                heads, (None, name, "float32"), (False, True),
                (True, False) if aligned_both else (True,), _precisions(name)):
            bias_dtype = bias and _np_dtype(bias)
            yield dtype, d, dv, bias_dtype, has_mask, aligned, precision, \
                bias is None and not has_mask and aligned
        for (d, dv), aligned, precision in itertools.product(
                pairs, (True, False) if aligned_both else (True,), _precisions(name)):
            yield dtype, d, dv, None, False, aligned, precision, aligned


def forward_instances(arch: str):
    """Every (filename, name expression, fast) that dispatch picks on ``arch``, each family
    forced in turn as the tests do (see :func:`gate_calls`), dense, with packed sequences
    (no mask or bias), with key lengths and with paged keys. Fast: without mask and bias,
    aligned, and dispatch's own pick (not only a forced family's): these must not spill."""
    from ._dispatch import FAMILIES, _choose
    from .families._common import DENSE, KEY_LENGTHS, PACKED, PAGED
    from .families.sm90_tf32 import PREPARATIONS
    cc, limit = GATE_TARGETS[arch]
    seen = {}
    for family in FAMILIES:
        for (dtype, d, dv, bias_dtype, has_mask, aligned, precision, fast), ragged in \
                itertools.product(gate_calls(family), (DENSE, PACKED, KEY_LENGTHS, PAGED)):
            if ragged == PACKED and (has_mask or bias_dtype is not None):
                continue
            choice = _choose(dtype, d, dv, bias_dtype, has_mask, aligned, cc, limit,
                             family.name, None, precision, ragged)
            if choice is None or choice.ragged != ragged:
                continue
            # fast where dispatch itself picks it; a family reached only by forcing it
            # (the tests) must compile, and its speed there is not the product's
            fast = fast and choice == _choose(dtype, d, dv, bias_dtype, has_mask, aligned,
                                              cc, limit, None, None, precision, ragged)
            variants = [choice]
            if choice.fallback is not None:  # the instance taken where a map is refused
                variants.append(choice.fallback)
            if choice.prepared is not None:  # and its preparation kernels
                variants.append(choice.prepared)
                for kernel in PREPARATIONS:
                    seen[(choice.filename, kernel)] = True
            if choice.magnitudes is not None:
                seen[(choice.filename, choice.magnitudes)] = True
            for c in variants:
                key = (c.filename, c.name_expression)
                seen[key] = seen.get(key, False) or fast
    return [(f, e, fast) for (f, e), fast in seen.items()]


def backward_instances(arch: str):
    """Every (filename, name expression, fast) of the backward that dispatch picks on
    ``arch``, each family forced in turn (see :func:`gate_calls`), with either gradient
    storage (the input dtype, or the accumulator type for broadcast inputs), dense and for
    a packed call (no mask or bias). Fast: no bias, no mask, gradients in place, aligned,
    dispatch's own pick."""
    from ._dispatch import BACKWARD_FAMILIES, _choose_backward, tf32_forward
    from .families._common import DENSE, PACKED
    cc, limit = GATE_TARGETS[arch]
    seen = {}
    for family in BACKWARD_FAMILIES:
        for dtype, d, dv, bias_dtype, has_mask, aligned, precision, fast in gate_calls(family):
            acc = np.dtype("float64" if dtype == np.float64 else "float32")
            # the forward of the call as dispatch picks it: TF32 or not
            tf32 = precision == "tf32" and tf32_forward(dtype, d, dv, bias_dtype, has_mask,
                                                        aligned, cc, limit)
            for grads, ragged in itertools.product(((dtype, dtype), (acc, acc)),
                                                   (DENSE, PACKED)):
                if ragged == PACKED and (has_mask or bias_dtype is not None):
                    continue
                choice = _choose_backward(dtype, d, dv, bias_dtype, has_mask, grads, aligned,
                                          cc, limit, family.name, None, precision, tf32, ragged)
                if choice is None or choice.ragged != ragged:  # the family does not serve
                    continue
                picked = choice == _choose_backward(dtype, d, dv, bias_dtype, has_mask, grads,
                                                    aligned, cc, limit, None, None, precision,
                                                    tf32, ragged)
                for expr in (choice.magnitudes, choice.delta, choice.dkdv, choice.dq):
                    if expr is None:  # no magnitudes kernel
                        continue
                    key = (choice.filename, expr)
                    seen[key] = seen.get(key, False) or (fast and picked
                                                          and grads[0] == dtype)
    return [(f, e, fast) for (f, e), fast in seen.items()]


def gate_instances(arch: str) -> list[tuple[str, str, bool]]:
    """(filename, name expression, fast) of every instance the gate compiles for ``arch``:
    vector_add's, kv_cache_append's, merge_parts', and every forward and backward instance
    dispatch can pick."""
    from .cache import kv_cache_instances
    from .elementwise import VECTOR_ADD_DTYPES, vector_add_instance
    from .merge import merge_instances
    return ([("vector_add.cu", vector_add_instance(d), True) for d in VECTOR_ADD_DTYPES]
            + [("kv_cache.cu", expr, True) for expr in kv_cache_instances()]
            + [("merge.cu", expr, True) for expr in merge_instances()]
            + forward_instances(arch) + backward_instances(arch))


def gate_plan(archs=None) -> list[tuple[str, str, str, bool]]:
    """(arch, filename, name expression, ptx_only) of everything the gate compiles: each
    fast instance through ptxas for each architecture that picks it, and each other
    instance to PTX once, for the first architecture in ``archs`` (default: every
    GATE_TARGETS entry) that picks it."""
    plan, ptx_seen = [], set()
    for arch in archs or GATE_TARGETS:
        for filename, expr, fast in gate_instances(arch):
            if fast:
                plan.append((arch, filename, expr, False))
                ptx_seen.add((filename, expr))
            elif (filename, expr) not in ptx_seen:
                ptx_seen.add((filename, expr))
                plan.append((arch, filename, expr, True))
    return plan
