"""The command line: ``python -m cuattn {info,demo,bench,check}``."""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np


def _gpu():
    """CuPy if a GPU is usable, else None."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # noqa: BLE001 - no CuPy / driver / device
        pass
    return None


def cmd_info(args) -> int:
    import ml_dtypes

    import cuattn
    from cuattn._checks import check_attention
    from cuattn._dispatch import backward_kernels, forward_kernel
    from cuattn._kernels import kernel_dir
    from cuattn._launch import device_limits
    print(f"cuattn {cuattn.__version__}  numpy {np.__version__}  ml_dtypes {ml_dtypes.__version__}"
          f"  python {sys.version.split()[0]}")
    print(f"kernel sources: {kernel_dir()}"
          + ("  (CUATTN_KERNEL_DIR)" if os.environ.get("CUATTN_KERNEL_DIR") else ""))
    cupy = _gpu()
    if cupy is None:
        print("GPU: none usable (NumPy inputs run on the CPU backend)")
        return 0
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    cc = dev.compute_capability
    print(f"cupy {cupy.__version__}  NVRTC {'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))}"
          f"  driver {cupy.cuda.runtime.driverGetVersion()}")
    print(f"GPU {dev.id}: {props['name'].decode()}  compute capability {cc[:-1]}.{cc[-1]}  "
          f"{dev.attributes['MultiProcessorCount']} SMs  "
          f"{dev.attributes['MaxSharedMemoryPerBlockOptin']} B shared memory per block (opt-in)")
    print(f"kernel cache: {os.environ.get('CUPY_CACHE_DIR', '~/.cupy/kernel_cache')}")
    capability, smem = device_limits(dev.id)
    print("dispatch (forward, then backward dK/dV) for contiguous (1, D) inputs:")
    for dtype, precision in (("float16", None), ("bfloat16", None), ("float32", None),
                             ("float32", "tf32"), ("float64", None)):
        for d in (64, 128):
            # device arrays: dispatch reads their alignment
            x = cupy.empty((1, d), ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
            call = check_attention(x, x, x, precision=precision)
            fwd = forward_kernel(call, capability, smem)
            bwd = backward_kernels(call, capability, smem, (call.dtype, call.dtype), x)
            label = dtype + (f" {precision}" if precision else "")
            print(f"  {label:13s} D={d:<4d} -> {fwd.family}: {fwd.name_expression}")
            print(f"  {'':13s} {'':6s} -> {bwd.family}: {bwd.dkdv}")
    return 0


def _vit_inputs(rng):
    """A 224x224x3 image cut into 196 patches of 16x16, embedded to E=768, plus a class
    token: x of shape (1, 197, 768), and the four projections and four biases of a 12-head
    layer, all float64."""
    image = rng.standard_normal((224, 224, 3))
    patches = image.reshape(14, 16, 14, 16, 3).transpose(0, 2, 1, 3, 4).reshape(196, 768)
    embed = rng.standard_normal((768, 768)) / math.sqrt(768)
    tokens = np.concatenate([rng.standard_normal((1, 768)), patches @ embed])[None]
    weights = [rng.standard_normal((768, 768)) / math.sqrt(768) for _ in range(4)]
    biases = [0.1 * rng.standard_normal(768) for _ in range(4)]
    return tokens, weights, biases


def _torch_on_gpu():
    """PyTorch if it imports and sees a GPU, else None."""
    try:
        import torch
        if torch.cuda.is_available():
            return torch
    except Exception:  # noqa: BLE001 - no PyTorch, or one without CUDA
        pass
    return None


def _mean_ms(fn, cupy, warmup: int, reps: int):
    """(mean milliseconds per call, last result) of ``fn`` after ``warmup`` calls; on the
    GPU the device is synchronised before and after the timed calls, so work that either
    CuPy or PyTorch queued is inside the time."""
    for _ in range(warmup):
        result = fn()
    if cupy is not None:
        cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        result = fn()
    if cupy is not None:
        cupy.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / reps * 1e3, result


def _torch_layer_ms(torch, cupy, x, weights, biases, heads, warmup, reps) -> float:
    """The same layer in PyTorch on the same device memory (DLPack), float32 products
    without TF32 as cuattn's."""
    from cuattn._bench_layers import _torch_layer
    tx, tw, tb = (torch.from_dlpack(x), [torch.from_dlpack(w) for w in weights],
                  [torch.from_dlpack(b) for b in biases])
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.inference_mode():
            ms, _ = _mean_ms(lambda: _torch_layer(torch, tx, tw, tb, heads), cupy, warmup, reps)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    return ms


def cmd_demo(args) -> int:
    import functools

    import ml_dtypes

    import cuattn
    from cuattn.reference import attention_reference
    rng = np.random.default_rng(0)
    x64, w64, b64 = _vit_inputs(rng)
    heads, dh = 12, 64

    def reference():
        proj = [(x64 @ w + b).reshape(1, 197, heads, dh).swapaxes(1, 2)
                for w, b in zip(w64[:3], b64[:3])]
        out, _ = attention_reference(*proj)
        return out.swapaxes(1, 2).reshape(1, 197, 768) @ w64[3] + b64[3]

    want = reference()
    cupy = _gpu()
    torch = _torch_on_gpu() if cupy is not None else None
    where = "GPU (cuattn CUDA kernels)" if cupy is not None else "CPU (NumPy backend; no GPU found)"
    print("ViT-B/16 self-attention: 224x224x3 image -> 196 patches of 16x16 + class token "
          f"= 197 tokens, E=768, 12 heads of 64, biases on the four projections\n"
          f"running on {where}")
    if torch is not None:
        print(f"PyTorch {torch.__version__}: the same layer (x @ w + b projections, "
              "scaled_dot_product_attention, @ w_o + b_o), timed the same way in this process")
    dtypes = [np.float32, np.float16, ml_dtypes.bfloat16] if cupy is not None else [np.float32]
    ok = True
    for dtype in dtypes:
        xp = cupy if cupy is not None else np
        x = xp.asarray(x64.astype(dtype))
        w = [xp.asarray(m.astype(dtype)) for m in w64]
        b = [xp.asarray(v.astype(dtype)) for v in b64]
        biases = dict(zip(("b_q", "b_k", "b_v", "b_o"), b))
        # on the GPU, 100 calls first (the clocks rise from idle and the kernels compile),
        # then the mean of 200: a few calls after the first vary twofold on an H200
        warmup, reps = (100, 200) if cupy is not None else (1, 20)
        layer = functools.partial(cuattn.multi_head_attention, x, *w, num_heads=heads, **biases)
        ms, y = _mean_ms(layer, cupy, warmup, reps)
        peer = ""
        if torch is not None:
            try:
                torch_ms = _torch_layer_ms(torch, cupy, x, w, b, heads, warmup, reps)
                peer = f" (PyTorch {torch_ms:7.3f} ms)"
            except Exception as exc:  # noqa: BLE001 - a PyTorch that cannot run this dtype
                peer = f" (PyTorch: {type(exc).__name__})"
        got = (cupy.asnumpy(y) if cupy is not None else y).astype(np.float64)
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        tol = 1e-5 if dtype == np.float32 else 3e-2
        ok &= err <= tol
        print(f"  {np.dtype(dtype).name:8s}: {ms:7.3f} ms per layer{peer}, max error vs "
              f"float64 reference {err:.2e} (relative to max|y|; tolerance {tol:.0e}) "
              f"{'ok' if err <= tol else 'FAILED'}")
    return 0 if ok else 1


def cmd_bench(args) -> int:
    from cuattn import bench
    if args.accuracy:
        from cuattn import accuracy
        json_path = args.json or "cuattn-accuracy.json"
        result = accuracy.run(quick=args.quick, json_path=json_path)
        print(accuracy.format_report(result))
        print(f"results: {json_path}")
        return 0
    suites = args.suite or ["vector_add", "vit", "fp32", "fp64"]
    unknown = [s for s in suites if s not in bench.SUITES]
    if unknown:
        print(f"unknown suite(s) {unknown}; choose from {list(bench.SUITES)}", file=sys.stderr)
        return 2
    if _gpu() is None:
        print("bench needs a GPU", file=sys.stderr)
        return 2
    results = bench.run(suites, json_path=args.json or "cuattn-bench.json", plot_path=args.plot,
                        direction=args.direction, max_seqlen=args.max_seqlen,
                        match=args.match or (), backward_kernel=args.backward_kernel,
                        peers=not args.no_peers)
    print(bench.format_tables(results))
    if args.report or args.readme:
        from cuattn._kernels import require_cupy
        env = bench.environment(require_cupy())
        if args.report:
            print(f"performance page: {bench.write_report(results, args.report, env)}")
        if args.readme:
            bench.write_readme(results, args.readme, env)
            print(f"performance table: {args.readme}")
    return 0


def cmd_check(args) -> int:
    from cuattn.check import run_check, run_gate
    if args.gate:
        return run_gate(args.arch, tuple(args.match or ()))
    return run_check(quick=args.quick)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cuattn",
        description="cuattn's command line: versions and dispatch (info), the ViT demo "
                    "(demo), benchmarks against the peers (bench), and the kernel checks "
                    "(check).")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, GPU, kernel sources, dispatch").set_defaults(fn=cmd_info)
    sub.add_parser("demo", help="ViT self-attention end to end, checked and timed"
                   ).set_defaults(fn=cmd_demo)
    b = sub.add_parser("bench", help="cuattn against its peers, one run")
    b.add_argument("--suite", action="append",
                   help="vector_add, vit, fp32, fp64, long, train, masked, dask, decode, "
                        "lengths, paged, varlen")
    b.add_argument("--direction", choices=("fwd", "bwd"), help="only forward or backward rows")
    b.add_argument("--max-seqlen", type=int, help="skip attention cases with longer sequences")
    b.add_argument("--match", action="append",
                   help="keep cases whose label has this word (e.g. bfloat16, D128, causal)")
    b.add_argument("--backward-kernel", metavar="FAMILY",
                   help="force cuattn's backward rows to this backward family (e.g. "
                        "sm90_3xf16); the forward is dispatched as usual")
    b.add_argument("--no-peers", action="store_true",
                   help="time cuattn (and the naive CuPy baseline) without the PyTorch peers")
    b.add_argument("--json", help="write results here (default cuattn-bench.json, or "
                                  "cuattn-accuracy.json with --accuracy)")
    b.add_argument("--plot", default="cuattn-bench.png", help="write a PNG plot here")
    b.add_argument("--report", metavar="DIR",
                   help="write the performance page (performance.rst and its plots) into DIR, "
                        "e.g. docs")
    b.add_argument("--readme", metavar="FILE",
                   help="rewrite the short performance table between FILE's markers "
                        "(README.md)")
    b.add_argument("--accuracy", action="store_true",
                   help="instead of times: cuattn's errors against float64 next to the peers' "
                        "on the same inputs (a FlashAttention-style grid), and their ratios; "
                        "on the NumPy backend without a GPU")
    b.add_argument("--quick", action="store_true", help="with --accuracy: a few small cases")
    b.set_defaults(fn=cmd_bench)
    c = sub.add_parser("check", help="correctness matrix of the GPU kernels "
                                     "(honours CUATTN_KERNEL_DIR)")
    c.add_argument("--quick", action="store_true", help="fewer shapes")
    c.add_argument("--gate", action="store_true",
                   help="no GPU: compile the instances dispatch can pick and report ptxas's "
                        "registers, spills, stack and wgmma serialization")
    c.add_argument("--arch", default="sm_90", help="with --gate: sm_80, sm_86 or sm_90")
    c.add_argument("--match", action="append",
                   help="with --gate: keep instances whose file or name has this word")
    c.set_defaults(fn=cmd_check)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
