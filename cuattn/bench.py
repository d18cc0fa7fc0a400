"""``python -m cuattn bench``: cuattn and its peers, timed side by side in one process.

Peers join when importable: naive CuPy attention always; PyTorch SDPA restricted to one
backend at a time (flash = FlashAttention-2, cudnn, efficient, math) on the same memory
through DLPack; for vector_add, ``cupy.add``, a device-to-device copy (the bandwidth
ceiling) and a Triton kernel. Times are CUDA-event medians after warm-up; inputs are drawn
with ``standard_normal``. FLOPs follow FlashAttention: forward ``4·B·H·Sq·Sk·D``, halved
for causal; backward 2.5× that. A backward row times the gradients alone: cuattn's
``attention_backward`` from a saved ``out`` and ``lse``, the PyTorch peers'
``torch.autograd.grad`` through a retained graph of one forward. Peak extra device memory
is the CuPy pool's (or PyTorch's) high-water mark of one call minus what was held before
it. ``--report DIR`` writes the performance page of the docs from the run.

The ``vit`` suite also times whole layers on ViT-B/16 shapes: ``multi_head_attention``
(with separate weights, and with Q, K and V weights packed in one ``(E, 3E)`` array)
against the same layer in PyTorch (``x @ w + b`` projections, SDPA, ``@ w_o + b_o``), and
the encoder block of the docs' ViT page against ``torch.nn.TransformerEncoderLayer``. Their
FLOPs are 2·M·E² per projection (M = B·N tokens) plus attention's, and 16·M·E² more for
the block's MLP.

The ``dask`` suite times one call against the same call on Dask arrays of CuPy chunks
(threaded scheduler). The ``decode`` suite times a few query rows against long keys (GQA
included) against SDPA's flash and cuDNN backends; its rate is the bytes of K and V read
per second. The ``paged`` suite times decoding on a paged cache (shuffled pages, a device
block table) against the same call on the contiguous cache, at the same rate.

This module holds the suites, the attention and vector_add rows and :func:`run`; the
records and timing are in ``_bench_core``, the layer rows in ``_bench_layers``, the ragged
and decoding rows in ``_bench_ragged``, the tables and the page in ``_bench_report``.
"""
from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import asdict

import numpy as np

from ._bench_core import (
    LAYERS,
    Case,
    Result,
    Row,
    _time,
    _timed_rows,
    _torch_backends,
    _try_import,
)
from ._bench_layers import _layer_rows
from ._bench_ragged import _dask_rows, _decode_rows, _varlen_rows
from ._bench_report import _plot, environment, format_tables, write_readme, write_report

__all__ = ["SUITES", "Case", "run", "format_tables", "write_report", "write_readme"]


def _attn_cases(suite, shapes, dtypes, causals=(False, True), precisions=(None,),
                directions=("fwd",), sides=(None,)):
    return [Case(suite, "attention", dt, b, h, s, d, c, p, direction=di, side=sd)
            for di in directions for (b, h, s, d) in shapes
            for dt in dtypes for sd in sides for c in causals for p in precisions]


def _layer_cases(suite, batches, dtypes, heads=12, seqlen=197, head_dim=64):
    return [Case(suite, kind, dt, b, heads, seqlen, head_dim)
            for kind in LAYERS for b in batches for dt in dtypes]


def _train_shapes():
    return [(16384 // s, 2048 // d, s, d) for d in (64, 128, 256)
            for s in (512, 1024, 2048, 4096, 8192, 16384)]


SUITES = {
    "vector_add": [Case("vector_add", "vector_add", dt, n=1 << 28)
                   for dt in ("float32", "float16")],
    "vit": _attn_cases("vit", [(64, 12, 197, 64)], ("float16", "bfloat16", "float32"), (False,))
    + _layer_cases("vit", (1, 64), ("float16", "bfloat16", "float32")),
    "fp32": _attn_cases("fp32", [(4, 16, 4096, 64), (4, 16, 4096, 128)], ("float32",),
                        precisions=("highest", "tf32"), directions=("fwd", "bwd")),
    "long": _attn_cases("long", [(1, 16, 16384, 128), (1, 16, 32768, 128)],
                        ("bfloat16", "float32", "float64"), directions=("fwd", "bwd")),
    "train": _attn_cases("train", _train_shapes(), ("bfloat16", "float16"),
                         directions=("fwd", "bwd")),
    "fp64": _attn_cases("fp64", [(1, 16, 4096, 64)], ("float64",)),
    "masked": _attn_cases("masked", [(4, 32, 4096, 64), (4, 16, 4096, 128)], ("bfloat16",),
                          directions=("fwd", "bwd"), sides=("mask", "bias")),
    "dask": [Case("dask", "dask", dt, 1, 16, 32768, 128, c)
             for dt in ("bfloat16", "float32") for c in (False, True)],
    # the decode rows, then Sk 4k / 32k / 128k x B 1 / 16 (H32, one query row)
    "decode": [Case("decode", "decode", "bfloat16", b, hq, sq, 128, seqlen_k=sk, heads_kv=hk)
               for b, hq, hk, sq, sk in ((1, 32, 32, 1, 32768), (8, 32, 32, 1, 8192),
                                         (64, 32, 8, 1, 4096), (1, 32, 8, 1, 131072),
                                         (16, 32, 8, 4, 16384), (1, 32, 32, 1, 4096),
                                         (16, 32, 32, 1, 4096), (16, 32, 32, 1, 32768),
                                         (1, 32, 32, 1, 131072), (16, 32, 32, 1, 131072))],
    # device key lengths (half the cache) against the dense call on those keys
    "lengths": [Case("lengths", "decode", "bfloat16", b, hq, sq, 128, seqlen_k=sk, heads_kv=hk,
                     k_length=sk // 2)
                for b, hq, hk, sq, sk in ((16, 32, 8, 1, 16384), (1, 32, 32, 1, 131072),
                                          (64, 32, 8, 1, 8192), (4, 16, 16, 4096, 8192))],
    # paged caches (pages of 256 rows, shuffled in the pool) against the contiguous cache
    "paged": [Case("paged", "decode", "bfloat16", b, hq, 1, 128, seqlen_k=sk, heads_kv=hk,
                   page_size=256)
              for b, hq, hk, sk in ((1, 32, 32, 32768), (16, 32, 32, 8192),
                                    (64, 32, 8, 4096))],
    # packed sequences of 64-4096 tokens (bf16, H16, D128), 16 and 64 of them
    "varlen": [Case("varlen", "varlen", "bfloat16", b, 16, 4096, 128, c)
               for b in (16, 64) for c in (False, True)],
}


# ---- attention -----------------------------------------------------------------------


def _naive(cupy, q, k, v, causal, scale):
    s = (q @ k.swapaxes(-1, -2)).astype(cupy.float32) * scale
    if causal:
        n = s.shape[-1]
        s = cupy.where(cupy.tri(n, dtype=bool), s, -cupy.inf)
    s -= s.max(axis=-1, keepdims=True)
    p = cupy.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return p.astype(q.dtype) @ v


def _attention_rows(case: Case, cupy, torch, backward_kernel=None):
    dtype = np.dtype(case.dtype) if case.dtype != "bfloat16" else np.dtype("bfloat16")
    shape = (case.batch, case.heads, case.seqlen, case.head_dim)
    q, k, v = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(dtype)
               for _ in range(3))
    scale = 1.0 / math.sqrt(case.head_dim)
    side = _side_inputs(case, cupy, dtype)
    if case.direction == "bwd":
        impls = _backward_impls(case, cupy, torch, q, k, v, scale, side, backward_kernel)
    else:
        impls = _forward_impls(case, cupy, torch, q, k, v, scale, side)
    return _timed_rows(impls, case, cupy, torch, tf32=case.precision == "tf32")


def _side_inputs(case: Case, cupy, dtype) -> dict:
    """The case's mask or bias keyword for cuattn (empty without one)."""
    s = case.seqlen
    if case.side == "mask":
        return {"mask": cupy.random.random((case.batch, 1, s, s)) > 0.1}
    if case.side == "bias":
        return {"bias": cupy.random.standard_normal((1, 1, s, s), dtype=cupy.float32)
                .astype(dtype)}
    return {}


def _torch_side(torch, side: dict) -> dict:
    """The same as PyTorch's attn_mask (True: take part; a float mask is added)."""
    if "mask" in side:
        return {"attn_mask": torch.from_dlpack(side["mask"].view("uint8")).bool()}
    if "bias" in side:
        return {"attn_mask": torch.from_dlpack(side["bias"])}
    return {}


def _math_fits(case: Case, dtype) -> bool:
    """Does PyTorch's math backend (which materialises the scores) fit the GPU?"""
    score_bytes = case.batch * case.heads * case.seqlen**2 * 4
    factor = 3 if case.direction == "fwd" else 6
    return score_bytes * factor * dtype.itemsize / 4 <= 60 * 2**30


def _forward_impls(case: Case, cupy, torch, q, k, v, scale, side):
    import cuattn
    dtype = q.dtype
    impls = {"cuattn": lambda: cuattn.attention(q, k, v, causal=case.causal,
                                                precision=case.precision, **side)}
    score_bytes = case.batch * case.heads * case.seqlen**2 * 4
    if score_bytes * 3 < 60 * 2**30 and case.precision != "tf32" and not side:
        impls["naive cupy"] = lambda: _naive(cupy, q, k, v, case.causal, scale)
    if torch is not None:
        from torch.nn.attention import sdpa_kernel
        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
        tside = _torch_side(torch, side)
        for name, backend in _torch_backends(torch):
            if name == "torch math" and not _math_fits(case, dtype):
                continue

            def call(backend=backend):
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(
                        tq, tk, tv, is_causal=case.causal, scale=scale, **tside)
            impls[name] = call
    return impls


def _backward_impls(case: Case, cupy, torch, q, k, v, scale, side, backward_kernel=None):
    """Gradient-only callables: cuattn from a saved out and lse (its backward family forced
    to ``backward_kernel`` when given, the forward dispatched as usual); PyTorch through
    autograd on one retained forward graph per backend (built lazily, inside the timing's
    warm-up). A bias is a constant for both (no gradient asked for it)."""
    import cuattn

    from .attention import _attention_backward
    dtype = q.dtype
    out, lse = cuattn.attention(q, k, v, causal=case.causal, precision=case.precision,
                                return_lse=True, **side)
    dout = cupy.random.standard_normal(out.shape, dtype=cupy.float32).astype(dtype)
    backward = (cuattn.attention_backward if backward_kernel is None else functools.partial(
        _attention_backward, kernel=backward_kernel))
    impls = {"cuattn": lambda: backward(dout, q, k, v, out, lse, causal=case.causal,
                                        precision=case.precision, **side)}
    if torch is not None:
        from torch.nn.attention import sdpa_kernel
        tdo = torch.from_dlpack(dout)
        tside = _torch_side(torch, side)
        for name, backend in _torch_backends(torch):
            if name == "torch math" and not _math_fits(case, dtype):
                continue
            graph = {}

            def call(backend=backend, graph=graph):
                if not graph:
                    tq, tk, tv = (torch.from_dlpack(x).detach().requires_grad_()
                                  for x in (q, k, v))
                    with sdpa_kernel([backend]):
                        graph["out"] = torch.nn.functional.scaled_dot_product_attention(
                            tq, tk, tv, is_causal=case.causal, scale=scale, **tside)
                    graph["inputs"] = (tq, tk, tv)
                return torch.autograd.grad(graph["out"], graph["inputs"], tdo,
                                           retain_graph=True)
            impls[name] = call
    return impls


# ---- vector add ----------------------------------------------------------------------


def _triton_add(torch, triton):
    import triton.language as tl

    @triton.jit
    def add_kernel(a_ptr, b_ptr, c_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(c_ptr + offs, tl.load(a_ptr + offs, mask=ok) + tl.load(b_ptr + offs, mask=ok),
                 mask=ok)

    def run(a, b, c):
        n = a.numel()
        add_kernel[(triton.cdiv(n, 4096),)](a, b, c, n, BLOCK=4096)
    return run


def _vector_add_rows(case: Case, cupy, torch):
    import cuattn
    a, b = (cupy.random.standard_normal(case.n, dtype=cupy.float32).astype(case.dtype)
            for _ in range(2))
    c = cupy.empty_like(a)
    nbytes = a.nbytes
    impls = {
        "cuattn": (lambda: cuattn.vector_add(a, b, out=c), 3 * nbytes),
        "cupy.add": (lambda: cupy.add(a, b, out=c), 3 * nbytes),
        "device copy": (lambda: cupy.cuda.runtime.memcpyAsync(
            c.data.ptr, a.data.ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice,
            cupy.cuda.get_current_stream().ptr), 2 * nbytes),
    }
    triton = _try_import("triton")
    if torch is not None and triton is not None:
        try:
            add = _triton_add(torch, triton)
            ta, tb, tc = (torch.from_dlpack(x) for x in (a, b, c))
            impls["triton"] = (lambda: add(ta, tb, tc), 3 * nbytes)
        except Exception:  # noqa: BLE001
            pass
    rows = []
    for name, (fn, moved) in impls.items():
        try:
            ms = _time(fn, cupy)
            rows.append(Row(name, ms, moved / ms / 1e6, 0.0))
        except Exception as exc:  # noqa: BLE001
            rows.append(Row(name, note=f"{type(exc).__name__}: {exc}"[:90]))
    by = {r.impl: r for r in rows}
    if by["cuattn"].rate and by["device copy"].rate:
        by["cuattn"].note = (f"{100 * by['cuattn'].rate / by['device copy'].rate:.1f}% of the "
                             f"device-copy bandwidth")
    return rows


# ---- a run ---------------------------------------------------------------------------


def run(suites, json_path=None, plot_path=None, progress=print, direction=None,
        max_seqlen=None, match=(), backward_kernel=None, peers=True) -> list[Result]:
    """Run the named suites (only the ``direction`` rows, "fwd" or "bwd", sequences up to
    ``max_seqlen``, and labels containing every string of ``match``, when given; cuattn's
    backward rows through the family ``backward_kernel``, when given; without the PyTorch
    peers unless ``peers``); print a progress line per case and return the results."""
    from ._kernels import require_cupy
    cupy = require_cupy()
    torch = _try_import("torch") if peers else None
    if torch is not None and not torch.cuda.is_available():
        torch = None
    results = []
    for name in suites:
        for case in SUITES[name]:
            if case.kind != "vector_add" and (
                    (direction is not None and case.direction != direction)
                    or (max_seqlen is not None and case.seqlen > max_seqlen)
                    or not all(m in case.label.split() for m in match)):
                continue
            t0 = time.perf_counter()
            rows = (_vector_add_rows(case, cupy, torch) if case.kind == "vector_add" else
                    _layer_rows(case, cupy, torch) if case.kind in LAYERS else
                    _dask_rows(case, cupy) if case.kind == "dask" else
                    _decode_rows(case, cupy, torch) if case.kind == "decode" else
                    _varlen_rows(case, cupy, torch) if case.kind == "varlen" else
                    _attention_rows(case, cupy, torch, backward_kernel))
            results.append(Result(case, rows))
            ours = next((r for r in rows if r.impl == "cuattn"), None)
            rate = "failed: " + ours.note if ours is None or ours.ms is None else f"{ours.rate:.1f}"
            progress(f"[{name}] {case.label}: cuattn {rate} ({time.perf_counter() - t0:.1f} s)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"environment": environment(cupy),
                       "results": [{"case": asdict(r.case), "rows": [asdict(x) for x in r.rows]}
                                   for r in results]}, f, indent=1)
    if plot_path:
        try:
            _plot(results, plot_path)
        except ImportError:
            progress("matplotlib is not installed: no plot")
    return results
