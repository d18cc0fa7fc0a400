"""Tile sweeps of the attention families: one GPU run, every candidate timed.

    PYTHONPATH=. python tools/sweep_tiles.py          # portable family
    PYTHONPATH=. python tools/sweep_tiles.py float32  # portable family, float32 rows only
    PYTHONPATH=. python tools/sweep_tiles.py --mma    # mma family
    PYTHONPATH=. python tools/sweep_tiles.py --sm90   # sm90 family (Hopper wgmma)
    PYTHONPATH=. python tools/sweep_tiles.py --f64    # mma_f64 family (float64, DMMA)
    PYTHONPATH=. python tools/sweep_tiles.py --f32    # mma_f32 family (float32 "tf32")
    PYTHONPATH=. python tools/sweep_tiles.py --sm90-tf32  # sm90_tf32 family (Hopper, "tf32")
    PYTHONPATH=. python tools/sweep_tiles.py --sm90-3xf16  # sm90_3xf16 family ("highest")

``--shape B,H,S`` times that shape instead of the default B4 H16 S4096 (B1 for float64),
e.g. ``--sm90 bfloat16 --shape 64,12,197`` for the vit suite's ViT-B/16; ``--batch N``
times N calls back to back per measurement (the kernels' own time, when one call is short
enough that the host's time per call would show).

Prints TFLOP/s per (dtype, shape, tiles); the winners go into
the family modules of cuattn/families/ (PORTABLE_TILES, MMA_TILES, MMA_F32_TILES,
MMA_F64_TILES, SM90_TILES, SM90_TF32_TILES, SM90_3XF16_TILES) with the measured reason.
"""
import math
import sys

import cupy as cp

from cuattn.attention import _attention
from cuattn.bench import _time
from cuattn.families.mma import MmaTiles
from cuattn.families.portable import Tiles
from cuattn.families.sm90 import Sm90Tiles
from cuattn.families.sm90_tf32 import PipedTiles

CANDIDATES = {
    ("float32", 64): [Tiles(128, 64, 64, 64, 1), Tiles(128, 128, 64, 64, 1),
                      Tiles(64, 64, 64, 64, 2), Tiles(128, 32, 64, 64, 1, warps=True),
                      Tiles(128, 16, 64, 64, 1, warps=True)],
    ("float32", 128): [Tiles(128, 64, 128, 128, 1), Tiles(128, 32, 128, 128, 1),
                       Tiles(64, 64, 128, 128, 1)],
    ("float64", 64): [Tiles(128, 64, 64, 64, 1, warps=True, lockstep=True),
                      Tiles(128, 32, 64, 64, 1, warps=True, lockstep=True),
                      Tiles(128, 32, 64, 64, 1, warps=True), Tiles(128, 16, 64, 64, 1, warps=True),
                      Tiles(64, 64, 64, 64, 1), Tiles(64, 32, 64, 64, 1),
                      Tiles(128, 32, 64, 64, 1), Tiles(32, 64, 64, 64, 1)],
    ("float64", 128): [Tiles(64, 32, 128, 128, 1), Tiles(32, 32, 128, 128, 1),
                       Tiles(64, 64, 128, 128, 1)],
}
MMA_CANDIDATES = {  # MmaTiles(block_m, block_n, m_tiles, min_blocks per SM)
    ("bfloat16", 64): [MmaTiles(128, 64, 2), MmaTiles(64, 64), MmaTiles(64, 64, 1, 3),
                       MmaTiles(64, 32, 1, 3), MmaTiles(64, 64, 1, 2), MmaTiles(64, 128, 1, 2),
                       MmaTiles(128, 128)],
    ("bfloat16", 128): [MmaTiles(128, 32, 2), MmaTiles(64, 16, 1, 3), MmaTiles(64, 32, 1, 3),
                        MmaTiles(64, 32, 1, 2), MmaTiles(64, 64, 1, 2), MmaTiles(128, 64)],
    ("bfloat16", 256): [MmaTiles(64, 32)],
}
F32_CANDIDATES = {  # MmaTiles(block_m = 16 * m_tiles * warps, block_n, m_tiles)
    ("float32", 64): [MmaTiles(64, 64), MmaTiles(128, 64, 2), MmaTiles(128, 32, 2),
                      MmaTiles(64, 32)],
    ("float32", 128): [MmaTiles(64, 32), MmaTiles(128, 32, 2), MmaTiles(128, 16, 2),
                       MmaTiles(64, 16)],
}
SM90_CANDIDATES = {  # Sm90Tiles(block_m = 64 * warpgroups, block_n, min_blocks, stages)
    ("bfloat16", 64): [Sm90Tiles(64, 64, 4), Sm90Tiles(64, 64, 4, 3), Sm90Tiles(64, 64, 3),
                       Sm90Tiles(64, 64, 3, 3), Sm90Tiles(64, 64, 3, 4), Sm90Tiles(64, 64),
                       Sm90Tiles(64, 128), Sm90Tiles(64, 128, 2, 3), Sm90Tiles(128, 64),
                       Sm90Tiles(128, 128), Sm90Tiles(128, 64, 1, 3)],
    ("bfloat16", 128): [Sm90Tiles(64, 64), Sm90Tiles(64, 64, 1, 3), Sm90Tiles(128, 64),
                        Sm90Tiles(128, 128), Sm90Tiles(128, 64, 1, 3)],
}
SM90_TF32_CANDIDATES = {  # Sm90Tiles(block_m = 64 * warpgroups, block_n, min_blocks,
    # prepare_from: 1 = the piped instance with PipedTiles(block_m, block_n, slots, qreg), K
    # and V prepared once per call)
    ("float32", 64): [Sm90Tiles(128, 128),
                      Sm90Tiles(128, 128, prepare_from=1, piped=PipedTiles(192, 64, 4, qreg=True)),
                      Sm90Tiles(128, 128, prepare_from=1, piped=PipedTiles(192, 64, 5, qreg=True)),
                      Sm90Tiles(128, 128, prepare_from=1, piped=PipedTiles(192, 32, 6, qreg=True)),
                      Sm90Tiles(128, 128, prepare_from=1,
                                piped=PipedTiles(128, 128, 3, qreg=True))],
    ("float32", 128): [Sm90Tiles(128, 64),
                       Sm90Tiles(128, 64, prepare_from=1, piped=PipedTiles(192, 32, 4)),
                       Sm90Tiles(128, 64, prepare_from=1, piped=PipedTiles(128, 64, 2))],
}
SM90_3XF16_CANDIDATES = {  # Sm90Tiles(block_m = 64 * warpgroups, block_n)
    ("float32", 64): [Sm90Tiles(128, 64), Sm90Tiles(64, 64), Sm90Tiles(128, 32)],
    ("float32", 128): [Sm90Tiles(128, 32), Sm90Tiles(64, 32)],
}
F64_CANDIDATES = {  # MmaTiles(block_m = 16 * warps, block_n)
    ("float64", 64): [MmaTiles(64, 32), MmaTiles(128, 32), MmaTiles(64, 16), MmaTiles(64, 16, 1, 3),
                      MmaTiles(32, 32)],
    ("float64", 128): [MmaTiles(128, 16), MmaTiles(64, 16)],
}


def main():
    print(f"{'dtype':8s} {'shape':22s} {'causal':6s} {'tiles':32s} {'ms':>8s} {'TFLOP/s':>8s}")
    table, family = ((MMA_CANDIDATES, "mma") if "--mma" in sys.argv else
                     (SM90_TF32_CANDIDATES, "sm90_tf32") if "--sm90-tf32" in sys.argv else
                     (SM90_3XF16_CANDIDATES, "sm90_3xf16") if "--sm90-3xf16" in sys.argv else
                     (SM90_CANDIDATES, "sm90") if "--sm90" in sys.argv else
                     (F64_CANDIDATES, "mma_f64") if "--f64" in sys.argv else
                     (F32_CANDIDATES, "mma_f32") if "--f32" in sys.argv else
                     (CANDIDATES, "portable"))
    extra = {"precision": "tf32"} if family in ("mma_f32", "sm90_tf32") else {}
    args = sys.argv[1:]
    shape, batch = None, 1
    if "--shape" in args:
        at = args.index("--shape")
        shape = tuple(int(x) for x in args[at + 1].split(","))
        del args[at:at + 2]
    if "--batch" in args:
        at = args.index("--batch")
        batch = int(args[at + 1])
        del args[at:at + 2]
    dtypes = [a for a in args if not a.startswith("--")]  # e.g. float32: only those
    for (dtype, d), cands in table.items():
        if dtypes and dtype not in dtypes:
            continue
        b, h, s = shape or ((1, 16, 4096) if dtype == "float64" else (4, 16, 4096))
        q, k, v = (cp.random.standard_normal((b, h, s, d)).astype(dtype) for _ in range(3))
        for causal in (False, True):
            flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
            for tiles in cands:
                label = " ".join(f"{k}={v}" for k, v in vars(tiles).items())
                try:
                    def call(q=q, k=k, v=v, causal=causal, tiles=tiles):
                        for _ in range(batch):
                            _attention(q, k, v, causal=causal, tiles=tiles, kernel=family,
                                       **extra)
                    ms = _time(call, cp, max_reps=10, budget_s=0.5) / batch
                    rate = f"{flops / ms / 1e9:8.1f}"
                except Exception as exc:  # noqa: BLE001 - report and go on
                    ms, rate = math.nan, f"{type(exc).__name__}"
                print(f"{dtype:8s} {str((b, h, s, d)):22s} {str(causal):6s} {label:32s} "
                      f"{ms:8.3f} {rate}")


if __name__ == "__main__":
    main()
