"""Tile sweeps of the attention families: one GPU run, every candidate timed.

    PYTHONPATH=. python tools/sweep_tiles.py          # portable family
    PYTHONPATH=. python tools/sweep_tiles.py --mma    # mma family

Prints TFLOP/s per (dtype, shape, tiles); the winners go into
cuattn/_dispatch.py (PORTABLE_TILES, MMA_TILES) with the measured reason.
"""
import math
import sys

import cupy as cp

from cuattn._dispatch import MmaTiles, Tiles
from cuattn.attention import _attention
from cuattn.bench import _time

CANDIDATES = {
    ("float32", 64): [Tiles(128, 64, 64, 64, 1), Tiles(64, 128, 64, 64, 1),
                      Tiles(64, 64, 64, 64, 1), Tiles(64, 64, 64, 64, 2)],
    ("float32", 128): [Tiles(64, 64, 128, 128, 1), Tiles(128, 32, 128, 128, 1),
                       Tiles(64, 32, 128, 128, 1), Tiles(64, 32, 128, 128, 2)],
    ("float64", 64): [Tiles(64, 64, 64, 64, 1), Tiles(64, 32, 64, 64, 1),
                      Tiles(128, 32, 64, 64, 1), Tiles(32, 64, 64, 64, 1)],
    ("float64", 128): [Tiles(64, 32, 128, 128, 1), Tiles(32, 32, 128, 128, 1),
                       Tiles(64, 64, 128, 128, 1)],
}
MMA_CANDIDATES = {  # MmaTiles(block_m, block_n, m_tiles, min_blocks per SM)
    ("bfloat16", 64): [MmaTiles(128, 64, 2), MmaTiles(64, 64), MmaTiles(64, 64, 1, 3),
                       MmaTiles(64, 32, 1, 3)],
    ("bfloat16", 128): [MmaTiles(128, 32, 2), MmaTiles(64, 16, 1, 3), MmaTiles(64, 32, 1, 3),
                        MmaTiles(64, 32, 1, 2)],
    ("bfloat16", 256): [MmaTiles(64, 32)],
}


def main():
    print(f"{'dtype':8s} {'shape':22s} {'causal':6s} {'tiles':32s} {'ms':>8s} {'TFLOP/s':>8s}")
    only_mma = "--mma" in sys.argv
    for (dtype, d), cands in (MMA_CANDIDATES if only_mma else CANDIDATES).items():
        b, h, s = (1, 16, 4096) if dtype == "float64" else (4, 16, 4096)
        q, k, v = (cp.random.standard_normal((b, h, s, d)).astype(dtype) for _ in range(3))
        for causal in (False, True):
            flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
            for tiles in cands:
                label = " ".join(f"{k}={v}" for k, v in vars(tiles).items())
                try:
                    def call(q=q, k=k, v=v, causal=causal, tiles=tiles):
                        return _attention(q, k, v, causal=causal, tiles=tiles)
                    ms = _time(call, cp, max_reps=10, budget_s=0.5)
                    rate = f"{flops / ms / 1e9:8.1f}"
                except Exception as exc:  # noqa: BLE001 - report and go on
                    ms, rate = math.nan, f"{type(exc).__name__}"
                print(f"{dtype:8s} {str((b, h, s, d)):22s} {str(causal):6s} {label:32s} "
                      f"{ms:8.3f} {rate}")


if __name__ == "__main__":
    main()
