"""The benchmark's records (cases, rows, results) and its timing: CUDA-event medians,
peak extra memory, a row per implementation."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np


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
    #: key-length cases: every entry's key length (k_lengths) in a cache of ``seqlen_k``
    #: keys (0: every key)
    k_length: int = 0

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
                    + (f" pages of {self.page_size}" if self.page_size else "")
                    + (f" lengths {self.k_length}" if self.k_length else ""))
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
        """Bytes of K and V a decode case reads (each K/V head once; a key-length case
        its lengths' keys)."""
        size = 8 if self.dtype == "float64" else 4 if self.dtype == "float32" else 2
        keys = self.k_length or self.seqlen_k
        return 2.0 * self.batch * self.heads_kv * keys * self.head_dim * size

    @property
    def unit(self) -> str:
        """The unit of the case's rate: GB/s for vector_add and decode cases, else TFLOP/s."""
        return "GB/s" if self.kind in ("vector_add", "decode") else "TFLOP/s"

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


def _torch_backends(torch):
    from torch.nn.attention import SDPBackend
    return (("torch flash", SDPBackend.FLASH_ATTENTION),
            ("torch cudnn", SDPBackend.CUDNN_ATTENTION),
            ("torch efficient", SDPBackend.EFFICIENT_ATTENTION),
            ("torch math", SDPBackend.MATH))
