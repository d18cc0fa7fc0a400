"""``python -m cuattn check``: the kernel experimenter's loop.

Copy ``cuda/`` somewhere, edit a kernel, and run
``CUATTN_KERNEL_DIR=that/folder python -m cuattn check``: every GPU family × dtype × feature
on a few ragged shapes, against the float64 reference with the accuracy rule, printing what
passed, what failed and by how much. ``check --gate`` needs no GPU: it compiles the
instances dispatch can pick for one architecture (``--match`` keeps those whose name has a
given word) and prints ptxas's registers, spills and stack frame, and whether it serialized
the warpgroup MMAs; fast instances (no mask, no bias, aligned) must have none of those.
"""
from __future__ import annotations

import time

import ml_dtypes
import numpy as np

from ._dispatch import FAMILIES
from .reference import accuracy_bound, attention_reference, naive_attention

FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (40, 7)},
    "softcap": {"softcap": 3.0},
    "mask": "mask",
    "bias": "bias",
}
DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


def run_check(quick: bool = False) -> int:
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        print("check runs the CUDA kernels and needs a GPU")
        return 2
    from ._launch import device_limits as _device_limits
    from .attention import _attention
    shapes = [(113, 203, 64), (257, 100, 128)] if quick else \
        [(1, 17, 32), (113, 203, 64), (257, 100, 128), (77, 77, 256), (40, 30, 1000)]
    failures, t0 = 0, time.perf_counter()
    print(f"{'family':9s} {'dtype':9s} {'feature':8s} {'shape':14s} {'max error':>10s} "
          f"{'bound':>10s}  result")
    cc, _ = _device_limits(cupy.cuda.Device().id)
    for family in FAMILIES:
        if not family.serves(cc):
            print(f"{family.name:9s} not on compute capability {cc[0]}.{cc[1]}: {family.reason}")
            continue
        # a family that serves only some float32 precisions (mma_f32: "tf32") runs with it
        fam_kw = ({"precision": family.precisions[0]}
                  if family.precisions and "highest" not in family.precisions else {})
        for dtype in (d for d in DTYPES if np.dtype(d).name in family.dtypes):
            for fname, kw in FEATURES.items():
                for sq, sk, d in (x for x in shapes if x[2] <= family.max_head_dim):
                    rng = np.random.default_rng(sq + sk + d)
                    q, k, v = (rng.standard_normal((2, n, d)).astype(dtype) for n in (sq, sk, sk))
                    if kw == "mask":
                        kw = {"mask": rng.random((sq, sk)) > 0.3}
                    elif kw == "bias":
                        kw = {"bias": rng.standard_normal((sq, sk)).astype(np.float32)}
                    kw = {**kw, **fam_kw}
                    ref, _ = attention_reference(q, k, v, **kw)
                    bound = accuracy_bound(naive_attention(q, k, v, **kw), ref)
                    dev_kw = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x
                              for n, x in kw.items()}
                    try:
                        got = cupy.asnumpy(_attention(*(cupy.asarray(x) for x in (q, k, v)),
                                                      kernel=family.name, **dev_kw))
                        got = got.astype(np.float64)
                        err = float(np.max(np.abs(got - ref)))
                        ok = bool(np.isfinite(got).all()) and err <= bound
                        status = "pass" if ok else "FAIL"
                    except Exception as exc:  # noqa: BLE001 - report and carry on
                        err, ok, status = float("nan"), False, f"ERROR {type(exc).__name__}: {exc}"
                    failures += not ok
                    print(f"{family.name:9s} {np.dtype(dtype).name:9s} {fname:8s} "
                          f"{f'{sq}x{sk}x{d}':14s} {err:10.2e} {bound:10.2e}  {status}")
                    kw = FEATURES[fname]
    print(f"{failures} failure(s); {time.perf_counter() - t0:.1f} s")
    return 1 if failures else 0


def run_gate(arch: str = "sm_90", match: tuple[str, ...] = ()) -> int:
    """Compile the instances dispatch can pick on ``arch`` (those whose file or name has
    every word of ``match``) and print their resources; 1 if a fast one is not clean."""
    from ._gate import GATE_TARGETS, compile_instance, gate_instances
    if arch not in GATE_TARGETS:
        print(f"unknown architecture {arch!r}; one of {', '.join(GATE_TARGETS)}")
        return 2
    try:
        from cuda.bindings import nvrtc  # noqa: F401 - the gate compiles through it
    except ImportError:
        print("check --gate needs NVRTC's Python bindings: pip install \"cuattn[gate]\"")
        return 2
    instances = [i for i in gate_instances(arch) if all(w in f"{i[0]} {i[1]}" for w in match)]
    print(f"{'regs':>4s} {'stack':>5s} {'spill st/ld':>11s} {'wgmma':>10s}  fast  "
          f"instance ({arch})")
    bad, t0 = 0, time.perf_counter()
    for filename, expr, fast in instances:
        res = compile_instance(filename, expr, arch)
        flag = "serialized" if res.wgmma_serialized else "-"
        failed = fast and not res.clean
        bad += failed
        print(f"{res.registers:4d} {res.stack_frame:5d} {res.spill_stores:5d}/"
              f"{res.spill_loads:<5d} {flag:>10s}  {'yes ' if fast else 'no  '}  {expr} "
              f"({filename})" + ("  <- FAIL" if failed else ""), flush=True)
    print(f"{len(instances)} instances, {bad} fast ones not clean, "
          f"{time.perf_counter() - t0:.0f} s")
    return 1 if bad else 0
