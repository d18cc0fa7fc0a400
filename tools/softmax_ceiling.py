"""How fast the float64 portable warp form could be with a cheaper softmax: the committed
kernel timed beside two timing-only variants whose softmax does less (docs/kernels.rst,
twenty-sixth session).

    PYTHONPATH=. python tools/softmax_ceiling.py            (on the GPU machine)
    PYTHONPATH=. python tools/softmax_ceiling.py --source   (no GPU: print the two patches)

The tool copies the kernel sources (``CUATTN_KERNEL_DIR`` or ``cuda/``) to a temporary
folder three times and patches ``attention_fwd_portable_warps``'s softmax in two of them:

- ``no exp2``: the stale-max path stores p = s c - m instead of its exp2 and never finds a
  score over the stale max, so every tile after a row's first takes that path with one FMA,
  one add and one store per score. The max, the row sums and the exact step stay.
- ``P = S``: the softmax stores the scores as they are as P and returns: no arithmetic at
  all, only the stores, the K copy's row steps where the committed softmax issues them, and
  the warp's sync. What is left is the products, the copies, the barriers and the waits.

Both give wrong outputs (the tool prints the largest difference, which also shows that the
variant ran); only their times mean anything. It runs the B1 H16 S4096 D64 float64 forward
(``CUATTN_KERNEL=portable``), causal and not, twice in turn, with the bench's timer, and with
PyTorch importable also PyTorch's math backend on the same inputs, so that each rate comes
with its ratio to that backend (issue 3 asks for 2x). Each patch replaces a piece of the
source found exactly once; if the kernel changes, the tool stops and names the piece.
"""
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

SOFTMAX_HEAD = ("    auto softmax = [&](const auto& between) {\n"
                "        const long long n0")
STALE_EXP = ("                        const A x = fma(s[i][j], c, -m[i]);\n"
             "                        over |= x > A(LAZY_LOG2);\n"
             "                        const A pij = exp2_row(x);\n")
PATCHES = {
    "no exp2": (STALE_EXP,
                "                        const A x = fma(s[i][j], c, -m[i]);\n"
                "                        const A pij = x;  // TIMING ONLY: no exp2, never over\n"),
    "P = S": (SOFTMAX_HEAD,
              "    auto softmax = [&](const auto& between) {\n"
              "        if constexpr (sizeof(A) == 8) {  // TIMING ONLY: P = S, no arithmetic\n"
              "#pragma unroll\n"
              "            for (int i = 0; i < RM; ++i)\n"
              "#pragma unroll\n"
              "                for (int j = 0; j < TN; ++j) {\n"
              "                    if (j % 4 == 0) between(2 * i + j / 4);\n"
              "                    p_w[(4 * ly + i) * PP + lx + 8 * j] = s[i][j];\n"
              "                }\n"
              "            __syncwarp();\n"
              "            return;\n"
              "        }\n"
              "        const long long n0"),
}


def patched(text: str, name: str) -> str:
    old, new = PATCHES[name]
    if text.count(old) != 1:
        raise SystemExit(f"softmax_ceiling: the piece for {name!r} occurs {text.count(old)} "
                         f"times in attention_portable.cu:\n{old}")
    return text.replace(old, new)


def main():
    from cuattn._kernels import kernel_dir
    source_dir = kernel_dir()
    text = (source_dir / "attention_portable.cu").read_text()
    variants = {"as committed": text, **{name: patched(text, name) for name in PATCHES}}
    if "--source" in sys.argv:
        for name, (old, new) in PATCHES.items():
            print(f"--- {name}: replaces\n{old.rstrip()}\n--- with\n{new.rstrip()}\n")
        return
    import cupy as cp
    import numpy as np

    import cuattn
    from cuattn.bench import _time
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None

    work = Path(tempfile.mkdtemp(prefix="softmax_ceiling_"))
    for i, source in enumerate(variants.values()):
        shutil.copytree(source_dir, work / f"v{i}")
        (work / f"v{i}" / "attention_portable.cu").write_text(source)

    os.environ["CUATTN_KERNEL"] = "portable"
    rng = np.random.default_rng(0)
    b, h, s, d = 1, 16, 4096, 64
    q, k, v = (cp.asarray(rng.standard_normal((b, h, s, d))) for _ in range(3))
    if torch is not None:
        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    rates = {}  # (variant, causal) -> TFLOP/s of each pass
    diffs, math = {}, {}
    for _ in range(2):
        for causal in (False, True):
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            fn = functools.partial(cuattn.attention, q, k, v, causal=causal)
            outs = {}
            for i, name in enumerate(variants):
                os.environ["CUATTN_KERNEL_DIR"] = str(work / f"v{i}")
                outs[name] = fn().get()
                ms = _time(fn, cp, warmup=2, max_reps=20, budget_s=4)
                rates.setdefault((name, causal), []).append(flops / ms / 1e9)
                diffs[name, causal] = float(np.abs(outs[name] - outs["as committed"]).max())
            if torch is not None:
                def peer(causal=causal):
                    with sdpa_kernel([SDPBackend.MATH]):
                        return torch.nn.functional.scaled_dot_product_attention(
                            tq, tk, tv, is_causal=causal)
                ms = _time(peer, cp, warmup=1, max_reps=10, budget_s=4)
                math.setdefault(causal, []).append(flops / ms / 1e9)
    shutil.rmtree(work)

    print(f"\nB{b} H{h} S{s} D{d} float64, TFLOP/s of two passes (ratio: to torch math in the "
          "same pass)")
    if math:
        print(f"torch math: {' / '.join(f'{x:.1f}' for x in math[False])} non-causal, "
              f"{' / '.join(f'{x:.1f}' for x in math[True])} causal")
    print("| variant | non-causal | causal | largest difference (non-causal / causal) |")
    print("|---|---|---|---|")
    for name in variants:
        cells = []
        for c in (False, True):
            cells.append(" / ".join(
                f"{x:.2f}" + (f" ({x / m:.2f}x)" if math else "")
                for x, m in zip(rates[name, c], math.get(c, rates[name, c]))))
        diff = ("—" if name == "as committed" else
                " / ".join(f"{diffs[name, c]:.2g}" for c in (False, True)))
        print(f"| {name} | {cells[0]} | {cells[1]} | {diff} |")

if __name__ == "__main__":
    main()
