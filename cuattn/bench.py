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
"""
from __future__ import annotations

import functools
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

__all__ = ["SUITES", "run", "write_report"]


@dataclass
class Case:
    suite: str
    kind: str                 # "attention", "vector_add", "dask", "decode", "layer", "block"
    dtype: str
    batch: int = 1
    heads: int = 1
    seqlen: int = 0
    head_dim: int = 0
    causal: bool = False
    precision: str | None = None
    n: int = 0
    direction: str = "fwd"    # "fwd" or "bwd" (attention only)
    #: "mask": a bool mask (B, 1, S, S), about 90 % True; "bias": a float bias (1, 1, S, S)
    #: of the inputs' dtype; both given to PyTorch's SDPA as its attn_mask
    side: str | None = None
    #: decode cases: keys (``seqlen`` is then the query rows) and K/V heads (GQA)
    seqlen_k: int = 0
    heads_kv: int = 0
    #: paged decode cases: rows per page of the pools (0: a contiguous cache)
    page_size: int = 0

    @property
    def lengths(self) -> list[int]:
        """A varlen case's sequence lengths: ``batch`` draws from 64 to ``seqlen``, the same
        on every run."""
        rng = np.random.default_rng(self.batch)
        return [int(n) for n in rng.integers(64, self.seqlen + 1, self.batch)]

    @property
    def label(self) -> str:
        if self.kind == "vector_add":
            return f"vector_add n=2^{int(math.log2(self.n))} {self.dtype}"
        if self.kind in LAYERS:
            return (f"{LAYERS[self.kind]} B{self.batch} N{self.seqlen} "
                    f"E{self.heads * self.head_dim} H{self.heads} {self.dtype}")
        if self.kind == "decode":
            heads = (f"H{self.heads}" if self.heads_kv == self.heads else
                     f"Hq{self.heads} Hk{self.heads_kv}")
            return (f"B{self.batch} {heads} Sq{self.seqlen} Sk{self.seqlen_k} "
                    f"D{self.head_dim} {self.dtype}"
                    + (f" pages of {self.page_size}" if self.page_size else ""))
        if self.kind == "varlen":
            return (f"varlen B{self.batch} H{self.heads} L64-{self.seqlen} D{self.head_dim} "
                    f"{self.dtype}" + (" causal" if self.causal else ""))
        extra = (" causal" if self.causal else "")
        extra += f" {self.precision}" if self.precision else ""
        extra += f" {self.side}" if self.side else ""
        extra += " bwd" if self.direction == "bwd" else ""
        return (f"B{self.batch} H{self.heads} S{self.seqlen} D{self.head_dim} "
                f"{self.dtype}{extra}")

    @property
    def flops(self) -> float:
        squares = (sum(n * n for n in self.lengths) if self.kind == "varlen" else
                   self.batch * self.seqlen * self.seqlen)
        f = 4.0 * self.heads * squares * self.head_dim
        f = f / 2 if self.causal else f
        if self.kind in LAYERS:  # four projections, and the block's MLP of 4E
            tokens_e2 = self.batch * self.seqlen * (self.heads * self.head_dim) ** 2
            return f + 8.0 * tokens_e2 + (16.0 * tokens_e2 if self.kind == "block" else 0.0)
        return 2.5 * f if self.direction == "bwd" else f

    @property
    def kv_bytes(self) -> float:
        """Bytes of K and V a decode case reads (each K/V head once)."""
        size = 8 if self.dtype == "float64" else 4 if self.dtype == "float32" else 2
        return 2.0 * self.batch * self.heads_kv * self.seqlen_k * self.head_dim * size

    def rate(self, ms: float) -> float:
        """The case's rate at ``ms`` per call: GB/s of K and V for decode cases, TFLOP/s
        otherwise."""
        return self.kv_bytes / ms / 1e6 if self.kind == "decode" else self.flops / ms / 1e9


#: the whole-layer case kinds and the names their labels start with
LAYERS = {"layer": "multi_head_attention", "block": "vit_block"}


@dataclass
class Row:
    impl: str
    ms: float | None = None
    rate: float | None = None      # TFLOP/s or GB/s
    extra_mb: float | None = None
    note: str = ""


@dataclass
class Result:
    case: Case
    rows: list[Row] = field(default_factory=list)


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
    # paged caches (pages of 256 rows, shuffled in the pool) against the contiguous cache
    "paged": [Case("paged", "decode", "bfloat16", b, hq, 1, 128, seqlen_k=sk, heads_kv=hk,
                   page_size=256)
              for b, hq, hk, sk in ((1, 32, 32, 32768), (16, 32, 32, 8192),
                                    (64, 32, 8, 4096))],
    # packed sequences of 64-4096 tokens (bf16, H16, D128), 16 and 64 of them
    "varlen": [Case("varlen", "varlen", "bfloat16", b, 16, 4096, 128, c)
               for b in (16, 64) for c in (False, True)],
}
#: the chunkings of the dask suite's rows: (label, query chunks, key chunks)
DASK_SPLITS = (("dask 4 key chunks", 1, 4), ("dask 4 query chunks", 4, 1),
               ("dask 2x2 chunks", 2, 2))


# ---- timing and memory ---------------------------------------------------------------

def _time(fn, cupy, *, warmup=3, max_reps=50, budget_s=1.5) -> float:
    """Median milliseconds of fn() over up to max_reps CUDA-event-timed calls."""
    for _ in range(warmup):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    times, t_end = [], time.perf_counter() + budget_s
    while len(times) < max_reps and (len(times) < 5 or time.perf_counter() < t_end):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def _peak_extra_mb(fn, cupy, torch) -> float:
    """Peak extra device memory of one call: CuPy allocations go to a fresh pool that keeps
    every freed block, so its size afterwards is the call's high-water mark; PyTorch's own
    peak counter covers the torch peers."""
    pool = cupy.cuda.MemoryPool()
    cupy.cuda.Device().synchronize()
    if torch is not None:
        torch.cuda.reset_peak_memory_stats()
        t_before = torch.cuda.memory_allocated()
    with cupy.cuda.using_allocator(pool.malloc):
        result = fn()
        cupy.cuda.Device().synchronize()
        del result
    extra = pool.total_bytes()
    pool.free_all_blocks()
    if torch is not None:
        extra += torch.cuda.max_memory_allocated() - t_before
    return extra / 2**20


def _try_import(name):
    try:
        return __import__(name)
    except Exception:  # noqa: BLE001 - a peer that does not import is simply absent
        return None


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


def _timed_rows(impls: dict, case: Case, cupy, torch, tf32: bool = False) -> list[Row]:
    """A row per implementation: time, rate and peak extra memory, or the error it raised.
    PyTorch's float32 products use TF32 only when ``tf32`` (cuattn's precision)."""
    rows = []
    for name, fn in impls.items():
        allow_tf32 = None
        try:
            if torch is not None and case.dtype == "float32":
                allow_tf32 = torch.backends.cuda.matmul.allow_tf32
                torch.backends.cuda.matmul.allow_tf32 = tf32
            ms = _time(fn, cupy)
            mb = _peak_extra_mb(fn, cupy, torch if name.startswith("torch") else None)
            rows.append(Row(name, ms, case.rate(ms), mb))
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run this case
            rows.append(Row(name, note=f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"))
        finally:
            if allow_tf32 is not None:
                torch.backends.cuda.matmul.allow_tf32 = allow_tf32
            cupy.get_default_memory_pool().free_all_blocks()
            if torch is not None:
                torch.cuda.empty_cache()
    return rows


def _dask_rows(case: Case, cupy):
    """One attention call against the same call on Dask arrays of CuPy chunks (threaded
    scheduler), the graph built and computed inside each timed call. Needs Dask."""
    import cuattn
    dtype = np.dtype(case.dtype)
    shape = (case.batch, case.heads, case.seqlen, case.head_dim)
    q, k, v = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(dtype)
               for _ in range(3))
    impls = {"cuattn": lambda: cuattn.attention(q, k, v, causal=case.causal)}
    try:
        import dask.array as da
    except ImportError:
        da = None
    for label, q_parts, k_parts in DASK_SPLITS:
        def chunked(x, parts):
            return da.from_array(x, chunks=shape[:2] + (case.seqlen // parts, case.head_dim),
                                 asarray=False)
        if da is not None:
            dq, dk, dv = chunked(q, q_parts), chunked(k, k_parts), chunked(v, k_parts)
            impls[label] = (lambda dq=dq, dk=dk, dv=dv: cuattn.attention(
                dq, dk, dv, causal=case.causal).compute(scheduler="threads"))
    rows = _timed_rows(impls, case, cupy, None)
    if da is None:
        rows.append(Row("dask", note="Dask is not installed (pip install \"cuattn[dask]\")"))
    return rows


def _paged_impls(case: Case, q, k, v, cupy) -> dict:
    """A paged decode case: the cache's pages shuffled in pools, a device block table and
    every entry at full length; against the same call on the contiguous cache."""
    import cuattn
    b, page = case.batch, case.page_size
    per_entry = case.seqlen_k // page
    order = np.random.default_rng(0).permutation(b * per_entry)
    table = cupy.asarray(order.reshape(b, per_entry))
    pools = []
    for x in (k, v):  # (b, hk, 1, sk, d) -> pages (b * per_entry, hk, 1, page, d), shuffled
        pages = x.reshape(b, x.shape[1], 1, per_entry, page, x.shape[-1])
        pages = cupy.ascontiguousarray(pages.transpose(0, 3, 1, 2, 4, 5))
        pool = cupy.empty_like(pages.reshape((b * per_entry,) + pages.shape[2:]))
        pool[cupy.asarray(order)] = pages.reshape(pool.shape)
        pools.append(pool)
    lengths = np.full((b, 1, 1), case.seqlen_k)
    return {"cuattn": lambda: cuattn.attention(q, *pools, k_lengths=lengths,
                                               block_table=table),
            "cuattn contiguous": lambda: cuattn.attention(q, k, v, k_lengths=lengths)}


def _decode_rows(case: Case, cupy, torch):
    """Decoding: q (B, Hkv, G, Sq, D) against k, v (B, Hkv, 1, Sk, D) for cuattn (GQA is
    broadcasting), the same memory as (B, Hq, Sq, D) and (B, Hkv, Sk, D) for PyTorch's SDPA
    with ``enable_gqa``; no causal band (for one query row it allows every key). The rate
    is the bytes of K and V read per second."""
    import cuattn
    dtype = np.dtype(case.dtype)
    groups = case.heads // case.heads_kv
    b, hk, d = case.batch, case.heads_kv, case.head_dim
    q = cupy.random.standard_normal((b, hk, groups, case.seqlen, d),
                                    dtype=cupy.float32).astype(dtype)
    k, v = (cupy.random.standard_normal((b, hk, 1, case.seqlen_k, d),
                                        dtype=cupy.float32).astype(dtype) for _ in range(2))
    if case.page_size:
        return _timed_rows(_paged_impls(case, q, k, v, cupy), case, cupy, None)
    impls = {"cuattn": lambda: cuattn.attention(q, k, v)}
    if torch is not None:
        from torch.nn.attention import sdpa_kernel
        tq = torch.from_dlpack(q.reshape(b, case.heads, case.seqlen, d))
        tk, tv = (torch.from_dlpack(x.reshape(b, hk, case.seqlen_k, d)) for x in (k, v))
        for name, backend in _torch_backends(torch)[:2]:  # flash, cudnn

            def call(backend=backend):
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(
                        tq, tk, tv, enable_gqa=groups > 1)
            impls[name] = call
    return _timed_rows(impls, case, cupy, torch)


def _varlen_rows(case: Case, cupy, torch):
    """Packed sequences: cuattn with ``q_offsets``/``k_offsets`` on (H, T, D) views of
    (T, H, D) tokens; cuattn's dense call on B sequences of the length that does the same
    work (the root mean square length); PyTorch's SDPA on nested (jagged) tensors of the
    same tokens with its flash and cuDNN backends."""
    import cuattn
    dtype = np.dtype(case.dtype)
    lengths = case.lengths
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    h, d = case.heads, case.head_dim
    tokens = [cupy.random.standard_normal((int(offsets[-1]), h, d), dtype=cupy.float32)
              .astype(dtype) for _ in range(3)]
    q, k, v = (x.swapaxes(0, 1) for x in tokens)          # (H, T, D) views
    side = math.isqrt(sum(n * n for n in lengths) // case.batch)
    dq, dk, dv = (cupy.random.standard_normal((case.batch, h, side, d), dtype=cupy.float32)
                  .astype(dtype) for _ in range(3))
    impls = {"cuattn": lambda: cuattn.attention(q, k, v, causal=case.causal,
                                                q_offsets=offsets, k_offsets=offsets),
             "cuattn dense": lambda: cuattn.attention(dq, dk, dv, causal=case.causal)}
    if torch is not None:
        from torch.nn.attention import sdpa_kernel
        t_offsets = torch.as_tensor(offsets, device="cuda")
        tq, tk, tv = (torch.nested.nested_tensor_from_jagged(torch.from_dlpack(x), t_offsets)
                      .transpose(1, 2) for x in tokens)
        for name, backend in _torch_backends(torch)[:2]:  # flash, cudnn

            def call(backend=backend):
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(
                        tq, tk, tv, is_causal=case.causal)
            impls[f"{name} nested"] = call
    return _timed_rows(impls, case, cupy, torch)


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


def _torch_backends(torch):
    from torch.nn.attention import SDPBackend
    return (("torch flash", SDPBackend.FLASH_ATTENTION),
            ("torch cudnn", SDPBackend.CUDNN_ATTENTION),
            ("torch efficient", SDPBackend.EFFICIENT_ATTENTION),
            ("torch math", SDPBackend.MATH))


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


# ---- whole layers: multi_head_attention and the ViT encoder block -----------------------

def _layer_rows(case: Case, cupy, torch):
    """cuattn's layer or block and the same computation in PyTorch, timed as the attention
    rows are (float32 PyTorch products without TF32, as cuattn's)."""
    dtype = np.dtype(case.dtype)
    rng = np.random.default_rng(0)
    e = case.heads * case.head_dim
    x = cupy.asarray(rng.standard_normal((case.batch, case.seqlen, e)).astype(dtype))
    impls = (_layer_impls if case.kind == "layer" else _block_impls)(case, cupy, torch, x, rng)
    return _timed_rows(impls, case, cupy, torch)


def _normal(xp, rng, shape, scale, dtype, mean=0.0):
    return xp.asarray((mean + scale * rng.standard_normal(shape)).astype(dtype))


def _layer_impls(case: Case, cupy, torch, x, rng):
    import cuattn
    e, heads = x.shape[-1], case.heads
    ws = [_normal(cupy, rng, (e, e), e ** -0.5, x.dtype) for _ in range(4)]
    bs = [_normal(cupy, rng, e, 0.1, x.dtype) for _ in range(4)]
    w_qkv, b_qkv = cupy.concatenate(ws[:3], axis=1), cupy.concatenate(bs[:3])
    pw = [w_qkv[:, i * e:(i + 1) * e] for i in range(3)]
    pb = [b_qkv[i * e:(i + 1) * e] for i in range(3)]
    impls = {
        "cuattn": lambda: cuattn.multi_head_attention(
            x, *ws, num_heads=heads, b_q=bs[0], b_k=bs[1], b_v=bs[2], b_o=bs[3]),
        "cuattn packed qkv": lambda: cuattn.multi_head_attention(
            x, *pw, ws[3], num_heads=heads, b_q=pb[0], b_k=pb[1], b_v=pb[2], b_o=bs[3]),
    }
    if torch is not None:
        tx, tws, tbs = (torch.from_dlpack(x), [torch.from_dlpack(w) for w in ws],
                        [torch.from_dlpack(b) for b in bs])

        def torch_layer():
            with torch.inference_mode():
                return _torch_layer(torch, tx, tws, tbs, heads)
        impls["torch layer"] = torch_layer
    return impls


def _torch_layer(torch, x, ws, bs, heads):
    """multi_head_attention in PyTorch: ``x @ w + b`` projections, SDPA, ``@ w_o + b_o``."""
    b, n, e = x.shape
    q, k, v = ((x @ w + bias).view(b, n, heads, e // heads).transpose(1, 2)
               for w, bias in zip(ws[:3], bs[:3]))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(b, n, e) @ ws[3] + bs[3]


def _block_impls(case: Case, cupy, torch, x, rng):
    e = x.shape[-1]
    p = _block_params(cupy, rng, e, 4 * e, x.dtype)
    impls = {"cuattn": lambda: _vit_block(x, p, case.heads)}
    if torch is not None:
        tx = torch.from_dlpack(x)
        layer = torch.nn.TransformerEncoderLayer(
            e, case.heads, 4 * e, activation="gelu", batch_first=True, norm_first=True,
            device=tx.device, dtype=tx.dtype).eval()

        def torch_block():
            with torch.inference_mode():
                return layer(tx)
        impls["torch TransformerEncoderLayer"] = torch_block
    return impls


def _block_params(xp, rng, embed, hidden, dtype):
    """Random parameters of the docs' ViT block (its ``init_block``)."""
    n = functools.partial(_normal, xp, rng, dtype=dtype)
    return {"ln1_g": n(embed, 0.1, mean=1.0), "ln1_b": n(embed, 0.1),
            "w_qkv": n((embed, 3 * embed), embed ** -0.5), "b_qkv": n(3 * embed, 0.1),
            "w_o": n((embed, embed), embed ** -0.5), "b_o": n(embed, 0.1),
            "ln2_g": n(embed, 0.1, mean=1.0), "ln2_b": n(embed, 0.1),
            "w_fc1": n((embed, hidden), embed ** -0.5), "b_fc1": n(hidden, 0.1),
            "w_fc2": n((hidden, embed), hidden ** -0.5), "b_fc2": n(embed, 0.1)}


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy
    return cupy


def _work_dtype(dtype):
    return np.float64 if dtype == np.float64 else np.float32


def _layer_norm(x, gamma, beta, eps=1e-6):
    a = x.astype(_work_dtype(x.dtype))
    mean = a.mean(axis=-1, keepdims=True)
    var = ((a - mean) ** 2).mean(axis=-1, keepdims=True)
    return ((a - mean) / _xp(x).sqrt(var + eps) * gamma + beta).astype(x.dtype)


def _gelu_tanh(a):
    return 0.5 * a * (1 + _xp(a).tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))


def _vit_block(x, p, num_heads):
    """The pre-norm encoder block of docs/vit.rst (``vit_block``), step for step; the tests
    hold the two to the same bits."""
    import cuattn
    e = x.shape[-1]
    w, b = p["w_qkv"], p["b_qkv"]
    h = _layer_norm(x, p["ln1_g"], p["ln1_b"])
    x = x + cuattn.multi_head_attention(
        h, w[:, :e], w[:, e:2 * e], w[:, 2 * e:], p["w_o"], num_heads=num_heads,
        b_q=b[:e], b_k=b[e:2 * e], b_v=b[2 * e:], b_o=p["b_o"])
    work = _work_dtype(x.dtype)
    h = _layer_norm(x, p["ln2_g"], p["ln2_b"]).reshape(-1, e)
    h = _gelu_tanh((h @ p["w_fc1"]).astype(work) + p["b_fc1"]).astype(x.dtype)
    h = ((h @ p["w_fc2"]).astype(work) + p["b_fc2"]).astype(x.dtype)
    return x + h.reshape(x.shape)


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


# ---- report --------------------------------------------------------------------------

def _format(results: list[Result]) -> str:
    lines = []
    for suite in dict.fromkeys(r.case.suite for r in results):
        group = [r for r in results if r.case.suite == suite]
        unit = "GB/s" if group[0].case.kind in ("vector_add", "decode") else "TFLOP/s"
        peers = list(dict.fromkeys(row.impl for r in group for row in r.rows))
        lines.append(f"\n### suite {suite} ({unit}; ratio = peer time / cuattn time, >1 means "
                     f"cuattn is faster; extra MB = peak extra device memory)")
        header = ["case"] + [f"{p}" for p in peers] + ["cuattn extra MB"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for r in group:
            by = {row.impl: row for row in r.rows}
            ours = by.get("cuattn")
            cells = [r.case.label]
            for p in peers:
                row = by.get(p)
                if row is None or row.ms is None:
                    cells.append("—")
                elif p == "cuattn" or ours is None or ours.ms is None:
                    cells.append(f"{row.rate:.1f}")
                else:
                    cells.append(f"{row.rate:.1f} ({row.ms / ours.ms:.2f}x)")
            cells.append("—" if ours is None or ours.extra_mb is None else f"{ours.extra_mb:.1f}")
            lines.append("| " + " | ".join(cells) + " |")
            if ours is not None and ours.note:
                lines.append(f"|   ↳ cuattn: {ours.note} |" + " |" * (len(header) - 1))
    return "\n".join(lines)


def _plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [r.case.label for r in results]
    impls = list(dict.fromkeys(row.impl for r in results for row in r.rows))
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 5))
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        vals = [next((row.rate or 0 for row in r.rows if row.impl == impl), 0) for r in results]
        ax.bar(np.arange(len(labels)) + i * width, vals, width, label=impl)
    ax.set_xticks(np.arange(len(labels)) + 0.4)
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s (attention) or GB/s (vector_add, decode)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def environment(cupy) -> dict:
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    torch = sys.modules.get("torch")
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": props["name"].decode(),
            "compute_capability": dev.compute_capability,
            "driver": cupy.cuda.runtime.driverGetVersion(),
            "cupy": cupy.__version__, "numpy": np.__version__,
            "torch": getattr(torch, "__version__", None),
            "python": platform.python_version(),
            "command": " ".join(["python -m cuattn" if sys.argv[0].endswith("__main__.py")
                                 else sys.argv[0], *sys.argv[1:]])}


def _rst_table(rows: list[list[str]]) -> list[str]:
    """A reStructuredText grid-free "simple table" of string cells (first row: header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    rule = "  ".join("=" * w for w in widths)
    fmt = [("  ".join(c.ljust(w) for c, w in zip(r, widths))).rstrip() for r in rows]
    return [rule, fmt[0], rule, *fmt[1:], rule]


def write_report(results: list[Result], directory, env: dict | None = None) -> str:
    """Write ``performance.rst`` into ``directory`` from one run's results: the environment
    (date, GPU, driver, versions, command), one table per suite (cuattn's rate, each peer's
    with the ratio peer time / cuattn time, cuattn's peak extra memory) and a plot for each
    of the first four suites. Returns the page's path."""
    import os

    os.makedirs(directory, exist_ok=True)
    if env is None:
        from ._kernels import require_cupy
        env = environment(require_cupy())
    lines = ["Performance", "===========", "",
             "One run of ``python -m cuattn bench`` on one GPU, every implementation timed in "
             "the same process on the same inputs (CUDA-event medians after warm-up). "
             "Attention rates are TFLOP/s by FlashAttention's count (forward 4·B·H·Sq·Sk·D, "
             "halved under causal masking; backward 2.5 times that), vector_add's GB/s, and "
             "decode rates GB/s of K and V read. "
             "A ratio is the peer's time over cuattn's: above 1, cuattn is faster. This page "
             "is generated; to regenerate it on a GPU machine run the command below.", "",
             f"- date: {env['date']}", f"- GPU: {env['gpu']} (compute capability "
             f"{env['compute_capability']}), driver {env['driver']}",
             f"- CuPy {env['cupy']}, NumPy {env['numpy']}, PyTorch {env.get('torch') or '-'}, "
             f"Python {env['python']}", f"- command: ``{env['command']}``", ""]
    suites = list(dict.fromkeys(r.case.suite for r in results))
    for i, suite in enumerate(suites):
        group = [r for r in results if r.case.suite == suite]
        unit = "GB/s" if group[0].case.kind in ("vector_add", "decode") else "TFLOP/s"
        peers = [p for p in dict.fromkeys(row.impl for r in group for row in r.rows)
                 if p != "cuattn"]
        table = [["case", f"cuattn {unit}", *peers, "cuattn extra MB"]]
        for r in group:
            by = {row.impl: row for row in r.rows}
            ours = by.get("cuattn")
            ok = ours is not None and ours.ms is not None
            cells = [r.case.label, f"{ours.rate:.1f}" if ok else "failed"]
            for p in peers:
                row = by.get(p)
                cells.append("-" if row is None or row.ms is None else
                             f"{row.rate:.1f} ({row.ms / ours.ms:.2f}x)" if ok else
                             f"{row.rate:.1f}")
            cells.append(f"{ours.extra_mb:.1f}" if ok and ours.extra_mb is not None else "-")
            table.append(cells)
        title = f"Suite ``{suite}``"
        lines += [title, "-" * len(title), "", *_rst_table(table), ""]
        if i < 4:
            try:
                name = f"performance-{suite}.png"
                _plot(group, os.path.join(directory, name))
                lines += [f".. image:: {name}", f"   :alt: {suite} suite, {unit}", ""]
            except ImportError:
                pass
    path = os.path.join(directory, "performance.rst")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


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
