"""Emulate split-TF32 ("3xTF32") attention in NumPy against DESIGN.md's accuracy rule.

    PYTHONPATH=. python tools/emulate_3xtf32.py [seeds]
    PYTHONPATH=. python tools/emulate_3xtf32.py --backward [seeds]
    PYTHONPATH=. python tools/emulate_3xtf32.py --backward --forward-lse [seeds]

No GPU: products of TF32 operands are exact (float64), and the float32 accumulator is
rounded after every k-step of 8 (one wgmma .tf32 step), either to nearest or toward zero,
since the tensor cores' float32 accumulation is not IEEE. The online softmax runs in
float32 over 64-key tiles as the kernels do. Each scheme prints the largest
error / bound over the GPU matrix's shapes (head dims to 128) and the seeds; a scheme
passes below 1. docs/kernels.rst ("float32 'highest' on Hopper") has the results and the
choice they led to (small terms first, each tile's P V in fresh accumulators).

``--backward`` emulates the gradients the same way, as the backward kernels tile them
(dK, dV per 64-key block over 32-query tiles; dQ per query tile over 64-key tiles), for a
future split-TF32 backward: every product split (small terms first), the gradients
accumulated either in place or per tile in fresh accumulators added in float32; error /
bound with the gradients' 3x rule. ``--forward-lse`` takes out and lse from the emulated
split forward instead of the float64 reference, as the GPU tests take them from the
sm90_3xtf32 forward, and compares the score products' schemes (the tenth session's v0 and
v2, which the GPU measured at 1.55x and 0.61x the bound; and the contraction in two halves).
"""
import sys

import numpy as np

from cuattn.reference import (
    accuracy_bound,
    attention_backward_reference,
    attention_reference,
    naive_attention,
    naive_attention_backward,
)

SHAPES = [(1, 17, 32, 32), (17, 1, 59, 59), (113, 203, 64, 64), (203, 113, 111, 111),
          (1023, 1025, 128, 128), (1025, 1023, 64, 64), (40, 50, 64, 24)]
MASK = np.uint32(0xFFFFE000)


def tf32_nearest(x):
    """x rounded to TF32, to nearest with ties away (cvt.rna)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def tf32_truncated(x):
    """x as a TF32 instruction reads float32 data: the low 13 bits ignored."""
    return (np.asarray(x, np.float32).view(np.uint32) & MASK).view(np.float32)


def toward_zero(x64):
    """float64 values rounded to float32 toward zero."""
    f = x64.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(x64)
    f[over] = np.nextafter(f[over], np.float32(0))
    return f


def split(x, hi_truncated=False):
    """hi, lo of the split as the instruction reads them (lo truncated)."""
    hi = tf32_truncated(x) if hi_truncated else tf32_nearest(x)
    return hi, tf32_truncated((x - hi).astype(np.float32))


def accumulate(terms, rounding, acc=None, interleave=False):
    """acc + sum of A @ B over terms, the accumulator rounded after every k-step of 8; the
    terms one after another, or (interleave) all terms of a k-step before the next."""
    rnd = toward_zero if rounding == "toward zero" else (lambda x: x.astype(np.float32))
    acc = np.zeros((terms[0][0].shape[0], terms[0][1].shape[1]), np.float32) if acc is None else acc
    steps = [(a, b, k0) for a, b in terms for k0 in range(0, a.shape[1], 8)]
    if interleave:
        steps.sort(key=lambda t: t[2])
    for a, b, k0 in steps:
        exact = a[:, k0:k0 + 8].astype(np.float64) @ b[k0:k0 + 8].astype(np.float64)
        acc = rnd(acc.astype(np.float64) + exact)
    return acc


def product(a, b, scheme, rounding, acc=None):
    """a @ b (or acc + a @ b) by the scheme's split products."""
    ah, al = split(a, scheme == "hi truncated")
    bh, bl = split(b, scheme == "hi truncated")
    small_first = [(ah, bl), (al, bh), (ah, bh)]
    if scheme == "per k-step":
        return accumulate(small_first, rounding, acc, interleave=True)
    if scheme == "halves":  # the contraction in two halves (two blocks), each "separate"
        h = a.shape[1] // 2
        out = (product(a[:, :h], b[:h], "separate", rounding)
               + product(a[:, h:], b[h:], "separate", rounding)).astype(np.float32)
        return out if acc is None else (acc + out).astype(np.float32)
    if scheme == "separate":
        big = accumulate([(ah, bh)], rounding)
        small = accumulate([(ah, bl)], rounding) + accumulate([(al, bh)], rounding)
        out = (big + small).astype(np.float32)
        return out if acc is None else (acc + out).astype(np.float32)
    return accumulate(small_first, rounding, acc)


def attention(q, k, v, scheme, rounding, pv_into_o):
    """Online softmax over 64-key tiles in float32; P V accumulated into O itself
    (pv_into_o) or into fresh accumulators added to O."""
    scale_log2 = np.float32(np.log2(np.e) / np.sqrt(q.shape[1]))
    m = np.full(q.shape[0], -np.inf, np.float32)
    l = np.zeros(q.shape[0], np.float32)
    o = np.zeros((q.shape[0], v.shape[1]), np.float32)
    for n0 in range(0, k.shape[0], 64):
        s = product(q, np.ascontiguousarray(k[n0:n0 + 64].T), scheme, rounding)
        x = (s * scale_log2).astype(np.float32)
        m_new = np.maximum(m, x.max(axis=1))
        alpha = np.exp2((m - m_new).astype(np.float64)).astype(np.float32)
        p = np.exp2((x - m_new[:, None]).astype(np.float64)).astype(np.float32)
        l = (l * alpha + p.sum(axis=1, dtype=np.float32)).astype(np.float32)
        o = (o * alpha[:, None]).astype(np.float32)
        if pv_into_o:
            o = product(p, v[n0:n0 + 64], scheme, rounding, acc=o)
        else:
            o = (o + product(p, v[n0:n0 + 64], scheme, rounding)).astype(np.float32)
        m = m_new
    return (o / l[:, None]).astype(np.float32)


def split_forward(q, k, v, rounding):
    """out and lse of the sm90_3xtf32 forward as emulated here: scores with the terms apart
    ("separate": hh + (hl + lh)), each tile's P V fresh; lse in natural units."""
    scale_log2 = np.float32(np.log2(np.e) / np.sqrt(q.shape[1]))
    m = np.full(q.shape[0], -np.inf, np.float32)
    l = np.zeros(q.shape[0], np.float32)
    o = np.zeros((q.shape[0], v.shape[1]), np.float32)
    for n0 in range(0, k.shape[0], 64):
        s = product(q, np.ascontiguousarray(k[n0:n0 + 64].T), "separate", rounding)
        x = (s * scale_log2).astype(np.float32)
        m_new = np.maximum(m, x.max(axis=1))
        alpha = np.exp2((m - m_new).astype(np.float64)).astype(np.float32)
        p = np.exp2((x - m_new[:, None]).astype(np.float64)).astype(np.float32)
        l = (l * alpha + p.sum(axis=1, dtype=np.float32)).astype(np.float32)
        o = (o * alpha[:, None] + product(p, v[n0:n0 + 64], "small first", rounding))
        o = o.astype(np.float32)
        m = m_new
    lse = ((m + np.log2(l)) / np.float32(np.log2(np.e))).astype(np.float32)
    return (o / l[:, None]).astype(np.float32), lse


SCHEMES = [  # (label, scheme, P V into O)
    ("per k-step (hi lo, lo hi, hi hi), P V into O", "per k-step", True),
    ("small terms first, P V into O", "small first", True),
    ("small terms first, fresh P V per tile", "small first", False),
    ("hi truncated too, fresh P V per tile", "hi truncated", False),
    ("separate accumulators, fresh P V per tile", "separate", False),
]


def gradients(q, k, v, dout, out, lse, rounding, in_place, scheme="small first",
              score_scheme=None):
    """dq, dk, dv by split products per (query tile, key tile), P rebuilt from lse; scheme
    "hi truncated": every hi part is the operand as the instruction reads float32 data
    (low 13 bits ignored), so that a tile as loaded serves as its own hi part;
    score_scheme: S and dP by another scheme ("separate": each term apart, summed in
    float32), the gradient products by ``scheme``."""
    score_scheme = score_scheme or scheme
    scale = np.float32(1 / np.sqrt(q.shape[1]))
    scale_log2 = np.float32(scale * np.log2(np.e))
    lse_log2 = (lse * np.float32(np.log2(np.e))).astype(np.float32)
    delta = (dout * out).sum(axis=1, dtype=np.float32)
    dq = np.zeros(q.shape, np.float32)
    dk = np.zeros(k.shape, np.float32)
    dv = np.zeros(v.shape, np.float32)

    def add(acc, a, b):
        if in_place:
            return product(a, b, scheme, rounding, acc=acc)
        return (acc + product(a, b, scheme, rounding)).astype(np.float32)

    for m0 in range(0, q.shape[0], 32):
        qi, doi = q[m0:m0 + 32], dout[m0:m0 + 32]
        for n0 in range(0, k.shape[0], 64):
            kj, vj = k[n0:n0 + 64], v[n0:n0 + 64]
            s = product(qi, np.ascontiguousarray(kj.T), score_scheme, rounding)
            p = np.exp2((s * scale_log2 - lse_log2[m0:m0 + 32, None]).astype(np.float64))
            p = p.astype(np.float32)
            dp = product(doi, np.ascontiguousarray(vj.T), score_scheme, rounding)
            ds = (p * (dp - delta[m0:m0 + 32, None])).astype(np.float32)
            dv[n0:n0 + 64] = add(dv[n0:n0 + 64], np.ascontiguousarray(p.T), doi)
            dk[n0:n0 + 64] = add(dk[n0:n0 + 64], np.ascontiguousarray(ds.T), qi)
            dq[m0:m0 + 32] = add(dq[m0:m0 + 32], ds, kj)
    return (dq * scale).astype(np.float32), (dk * scale).astype(np.float32), dv


BACKWARD_SHAPES = [(1, 17, 32, 32), (113, 203, 64, 64), (203, 113, 111, 111),
                   (257, 300, 128, 128)]


def inputs(seeds, shapes):
    """q, k, v and dout of every seed and shape (q, k, v are drawn first, as before dout
    existed, so the forward's inputs do not depend on it)."""
    for seed in range(seeds):
        for sq, sk, d, dv in shapes:
            rng = np.random.default_rng(100 * seed + sq)
            q, k = (rng.standard_normal((n, d)).astype(np.float32) for n in (sq, sk))
            v = rng.standard_normal((sk, dv)).astype(np.float32)
            yield q, k, v, rng.standard_normal((sq, dv)).astype(np.float32)


def forward_ratio(q, k, v, scheme, rounding, pv_into_o):
    ref = attention_reference(q, k, v)[0]
    bound = accuracy_bound(naive_attention(q, k, v), ref)
    return float(np.abs(attention(q, k, v, scheme, rounding, pv_into_o) - ref).max()) / bound


def backward_ratio(q, k, v, dout, rounding, case, forward_lse=False):
    """Worst error / bound of the gradients; out and lse from the float64 reference, or
    (forward_lse) from the emulated split forward, as the GPU tests take them."""
    in_place, scheme, *score_scheme = case
    if forward_lse:
        out, lse = split_forward(q, k, v, rounding)
    else:
        out, lse = (x.astype(np.float32) for x in attention_reference(q, k, v))
    got = gradients(q, k, v, dout, out, lse, rounding, in_place, scheme, *score_scheme)
    worst = 0.0
    for g, r, n in zip(got, attention_backward_reference(dout, q, k, v),
                       naive_attention_backward(dout, q, k, v)):
        bound = 3 * float(np.abs(np.asarray(n, np.float64) - r).max()) + 1e-6
        worst = max(worst, float(np.abs(g - r).max()) / bound)
    return worst


def main():
    backward = "--backward" in sys.argv
    forward_lse = "--forward-lse" in sys.argv
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    seeds = int(args[0]) if args else 1
    if backward and forward_lse:
        cases = [("scores per k-step in one accumulator (v0)", (False, "small first",
                                                               "per k-step")),
                 ("scores small first, one accumulator", (False, "small first")),
                 ("scores with the terms apart (v2)", (False, "small first", "separate")),
                 ("scores in two contraction halves, apart", (False, "small first",
                                                              "halves"))]
    elif backward:
        cases = [("gradients accumulated in place", (True, "small first")),
                 ("each tile's products in fresh accumulators", (False, "small first")),
                 ("fresh accumulators, hi truncated", (False, "hi truncated")),
                 ("fresh, score terms apart", (False, "small first", "separate"))]
    else:
        cases = [(label, (scheme, pv_into_o)) for label, scheme, pv_into_o in SCHEMES]
    for rounding in ("nearest", "toward zero"):
        for label, case in cases:
            if backward:
                worst = max(backward_ratio(q, k, v, dout, rounding, case, forward_lse)
                            for q, k, v, dout in inputs(seeds, BACKWARD_SHAPES))
            else:
                worst = max(forward_ratio(q, k, v, case[0], rounding, case[1])
                            for q, k, v, _ in inputs(seeds, SHAPES))
            print(f"{rounding:12s} {label:48s} error / bound {worst:5.2f}", flush=True)


if __name__ == "__main__":
    main()
