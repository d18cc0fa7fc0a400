"""The 16-bit forward's rounding steps emulated in NumPy, one head at a time, to see which
step's error dominates before a kernel changes.

    python tools/emulate_rounding.py [bfloat16 float16]

The emulation follows the mma and sm90 forwards (``cuda/common/mma_softmax.cuh``): float32
scores, a per-tile row max that raises ``m`` only past ``RESCALE_SLACK`` (log2 units), p =
exp2 of the fused argument ``fma(s, scale, -m)`` (rounded once) or of the unfused
``s * scale - m``, ``l`` summed from the float32 p, P rounded to the input dtype for P·V
(float32 accumulation), ``out = acc / l`` rounded to the input dtype. Each variant changes
one step; its largest error against float64 attention of the same 16-bit inputs is divided
by that of the exact running max (slack 0), over FlashAttention's (Sq, Sk) pairs with head
dims 64 and 128 (the order of the float32 accumulations inside a product is not modelled:
it is the same for every variant). Needs NumPy and ml_dtypes only.
"""
import sys

import ml_dtypes
import numpy as np

CASES = ((113, 203, 64), (128, 217, 128), (256, 512, 64), (512, 256, 128),
         (1024, 1024, 64), (1023, 1024, 128), (2048, 2048, 64))
VARIANTS = {
    "slack 8, fused exp2 argument (the kernels)": {},
    "exact running max (slack 0)": {"slack": 0.0},
    "slack 8, unfused exp2 argument": {"fused": False},
    "slack 8, l from the 16-bit P": {"l_from_rounded": True},
    "slack 0, l from the 16-bit P": {"slack": 0.0, "l_from_rounded": True},
    "slack 8, reciprocal of l": {"recip": True},
}


def forward(q, k, v, dtype, block_n=64, slack=8.0, fused=True, l_from_rounded=False,
            recip=False):
    f32 = np.float32
    scale_log2 = f32(q.shape[-1] ** -0.5 * np.log2(np.e))
    v64 = v.astype(np.float64)
    scores = (q.astype(np.float64) @ k.astype(np.float64).T).astype(f32)
    rows = scores.shape[0]
    m, l = np.full(rows, -np.inf, f32), np.zeros(rows, f32)
    acc = np.zeros((rows, v.shape[1]), f32)
    for n0 in range(0, scores.shape[1], block_n):
        s = scores[:, n0:n0 + block_n]
        tile_max = (s.max(axis=1) * scale_log2).astype(f32)
        if np.any(tile_max > m + f32(slack)):  # warp-uniform: every row of the tile
            m_new = np.maximum(m, tile_max)
            alpha = np.where(np.isneginf(m), 0, np.exp2((m - m_new).astype(np.float64)))
            l, acc, m = (l * alpha).astype(f32), (acc * alpha[:, None]).astype(f32), m_new
        if fused:
            arg = (s.astype(np.float64) * np.float64(scale_log2) - m[:, None]).astype(f32)
        else:
            arg = ((s * scale_log2).astype(f32) - m[:, None]).astype(f32)
        p = np.exp2(arg.astype(np.float64)).astype(f32)
        p16 = p.astype(dtype)
        l = (l + (p16.astype(f32) if l_from_rounded else p).sum(axis=1, dtype=f32)).astype(f32)
        acc = (acc + (p16.astype(np.float64) @ v64[n0:n0 + block_n]).astype(f32)).astype(f32)
    out = acc * (f32(1) / l)[:, None] if recip else acc / l[:, None]
    return out.astype(f32).astype(dtype)


def reference(q, k, v):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = q @ k.T * q.shape[-1] ** -0.5
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True) @ v


def main():
    for name in sys.argv[1:] or ["bfloat16", "float16"]:
        dtype = np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)
        rng = np.random.default_rng(0)
        errors = {label: [] for label in VARIANTS}
        for sq, sk, d in CASES:
            for _ in range(2):
                q, k, v = (rng.standard_normal((n, d)).astype(dtype) for n in (sq, sk, sk))
                ref = reference(q, k, v)
                for label, kw in VARIANTS.items():
                    got = forward(q, k, v, dtype, **kw).astype(np.float64)
                    errors[label].append(np.abs(got - ref).max())
        exact = np.array(errors["exact running max (slack 0)"])
        print(f"{name}: largest error / that of the exact running max")
        for label, errs in errors.items():
            r = np.array(errs) / exact
            print(f"  {label:44s} median {np.median(r):.3f}  p90 {np.quantile(r, 0.9):.3f}  "
                  f"max {r.max():.3f}")


if __name__ == "__main__":
    main()
