"""Tile sweep of the tensor-core backward: one GPU run, every candidate timed.

    PYTHONPATH=. python tools/sweep_backward.py          # mma family
    PYTHONPATH=. python tools/sweep_backward.py --sm90   # sm90 family (Hopper wgmma)
    PYTHONPATH=. python tools/sweep_backward.py --sm90 64  # only head dim 64
    PYTHONPATH=. python tools/sweep_backward.py --f32    # mma_f32 family (float32 "tf32")
    PYTHONPATH=. python tools/sweep_backward.py --sm90 --first 2  # each head dim's first two
    PYTHONPATH=. python tools/sweep_backward.py --sm90 --mask --bias  # with a key-padding-like
                                           # bool mask (B, 1, S, S) and a bias (1, 1, S, S)

Times the whole backward (delta, dK/dV, dQ) of B·S = 16k tokens, H·D = 2048 at S = 4096
for each MmaBwdTiles (Sm90BwdTiles, MmaF32BwdTiles) candidate; the winners go into
the family modules of cuattn/families/ (MMA_BACKWARD_TILES, SM90_BACKWARD_TILES,
MMA_F32_BACKWARD_TILES) with
the measured reason. bfloat16 inputs, float32 with --f32 (precision "tf32"). FLOPs: 2.5x
the forward's.
"""
import math
import sys

import cupy as cp

from cuattn.attention import _attention_backward
from cuattn.bench import _time
from cuattn.families.mma import MmaBwdTiles
from cuattn.families.mma_wide import MmaF32BwdTiles
from cuattn.families.sm90 import Sm90BwdTiles

T = MmaBwdTiles
CANDIDATES = {  # head dim -> (dkdv_warps, block_m, dq_warps, block_n[, min blocks per SM])
    64: [T(4, 32, 4, 64), T(4, 32, 4, 32), T(4, 32, 4, 32, 3, 3), T(4, 32, 4, 64, 3, 1),
         T(4, 64, 4, 32, 1, 3)],
    128: [T(4, 64, 4, 64), T(4, 64, 4, 32), T(4, 64, 4, 32, 2, 3), T(4, 32, 4, 32, 2, 3)],
    256: [T(8, 32, 4, 32), T(8, 32, 4, 16), T(8, 32, 4, 16, 1, 3), T(8, 32, 4, 32, 1, 2)],
}


S = Sm90BwdTiles
SM90_CANDIDATES = {  # head dim -> (query tile of dK/dV, key tile of dQ[, min blocks per SM]
    #                   [, overlapped forms]); the table's choice first
    64: [S(64, 64, 2, 3, dkdv_overlap=True, dq_overlap=True, dkdv_stats_ahead=True),
         S(64, 64, 2, 3, dkdv_overlap=True, dq_overlap=True),
         S(64, 64, 2, 3),
         S(64, 64, 2, 3, dkdv_overlap=True), S(32, 64, 3, 3),
         S(32, 64), S(32, 128, 3, 2)],
    128: [S(64, 64, dkdv_stats_ahead=True), S(64, 64), S(64, 64, dq_overlap=True),
          S(32, 64, dkdv_overlap=True), S(32, 64), S(32, 128), S(64, 128)],
}


F = MmaF32BwdTiles
F32_CANDIDATES = {  # head dim -> tiles, for the mma_f32 family ("tf32")
    64: [F(4, 32, 4, 32, 2, 3, preround=True), F(4, 32, 4, 32, 3, 3, preround=True),
         F(4, 32, 4, 64, 2, 2, preround=True), F(4, 32, 4, 32, 2, 3)],
    128: [F(4, 16, 4, 16, 2, 2, preround=True), F(4, 16, 4, 32, 2, 1, preround=True)],
}


def main():
    import cuattn
    kw, dtype = {}, "bfloat16"
    if "--sm90" in sys.argv:
        table, family = SM90_CANDIDATES, "sm90"
    elif "--f32" in sys.argv:
        table, family, dtype = F32_CANDIDATES, "mma_f32", "float32"
        kw["precision"] = "tf32"
    else:
        table, family = CANDIDATES, "mma"
    s = 4096
    print(" ".join(a for a in ("--mask", "--bias") if a in sys.argv) or "no mask, no bias")
    print(f"{'shape':22s} {'causal':6s} {'tiles':44s} {'ms':>8s} {'TFLOP/s':>8s}")
    args = sys.argv[1:]
    first = None
    if "--first" in args:  # only each head dim's first N candidates
        first = int(args.pop(args.index("--first") + 1))
    heads = [int(a) for a in args if a.isdigit()]  # e.g. 64: only that head dim
    for d, cands in table.items():
        if heads and d not in heads:
            continue
        b, h = 16384 // s, 2048 // d
        q, k, v = (cp.random.standard_normal((b, h, s, d)).astype(dtype) for _ in range(3))
        features = {}
        if "--mask" in args:
            features["mask"] = cp.random.random((b, 1, s, s)) > 0.1
        if "--bias" in args:
            features["bias"] = cp.random.standard_normal((1, 1, s, s)).astype(dtype)
        for causal in (False, True):
            out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True, **features,
                                        **kw)
            dout = cp.random.standard_normal(out.shape).astype(dtype)
            flops = 2.5 * 4.0 * b * h * s * s * d / (2 if causal else 1)
            for fam, tiles in [(family, t) for t in cands[:first]]:
                label = " ".join(f"{k}={v}" for k, v in vars(tiles).items())
                try:
                    def call(tiles=tiles, fam=fam, causal=causal, ft=features,
                             args=(dout, q, k, v, out, lse)):
                        return _attention_backward(*args, causal=causal, kernel=fam,
                                                   tiles=tiles, **ft, **kw)
                    ms = _time(call, cp, max_reps=10, budget_s=0.5)
                    rate = f"{flops / ms / 1e9:8.1f}"
                except Exception as exc:  # noqa: BLE001 - report and go on
                    ms, rate = math.nan, f"{type(exc).__name__}: {str(exc)[:60]}"
                print(f"{str((b, h, s, d)):22s} {str(causal):6s} {label:44s} {ms:8.3f} {rate}",
                      flush=True)


if __name__ == "__main__":
    main()
