"""Where the float64 portable warp form spends a key tile: clock64 around each phase of its
lockstep loop with spread copies (docs/kernels.rst, twenty-fifth session).

    PYTHONPATH=. python tools/phase_cycles.py            (on the GPU machine)
    PYTHONPATH=. python tools/phase_cycles.py --source   (no GPU: print the instrumented loop)

The tool copies the kernel sources (``CUATTN_KERNEL_DIR`` or ``cuda/``) to a temporary
folder and inserts, into the ``SPREAD`` loop of ``attention_fwd_portable_warps``, a clock64
read after each phase; lane 0 of every warp adds the cycles since the last read to a
shared-memory counter per phase, and at the end of the loop to a global array, with the
number of key tiles. It runs the B1 H16 S4096 D64 float64 forward (``CUATTN_KERNEL=portable``,
causal and not) from the original and from the instrumented sources, times both with the
bench's timer, checks that the outputs are bit-identical, and prints cycles per warp and key
tile by phase. The reads cost a few percent of the kernel's time (the table says how much).
Two warps share each scheduler, so a phase's cycles are wall cycles of the pair.

Each insertion point is a line of the loop found exactly once; if the loop changes, the
tool stops and names the line it could not find.
"""
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

PHASES = ("wait for K, barrier 1", "Q K^T, V copy spread", "wait for V, barrier 2",
          "softmax, P stored, K copy spread", "P V")
# (line after which a phase ends, phase index); each line occurs once in the SPREAD loop;
# a copy's remainder loop ends its phase with the commit on the next line
MARKS = (("__syncthreads();     // ... for every thread, and every warp is done with V (t - 1)", 0),
         ("for (; left > 0; --left) vc.next(p.v_s.row);", 1),
         ("__syncthreads();     // ... for every thread, and every warp is done with K (t)", 2),
         ("for (; left > 0; --left) kc.next(p.k_s.row);", 3),
         ("if (take) pv();", 4))
LOOP_START, LOOP_END = "    if constexpr (SPREAD) {", "    } else if constexpr (LOCKSTEP) {"
GLOBAL = "cuattn_phase_cycles"


def instrument(text: str) -> str:
    """The kernel source with the phase clocks in the SPREAD loop."""
    if text.count(LOOP_START) != 1 or text.count(LOOP_END) != 1:
        raise SystemExit(f"phase_cycles: the SPREAD loop ({LOOP_START.strip()!r}) is not found")
    head, rest = text.split(LOOP_START)
    loop, tail = rest.split(LOOP_END)
    lines = loop.split("\n")

    def find(needle):
        hits = [i for i, line in enumerate(lines) if line.strip() == needle]
        if len(hits) != 1:
            raise SystemExit(f"phase_cycles: {needle!r} occurs {len(hits)} times in the loop")
        return hits[0]

    inserts = {}
    for needle, phase in MARKS:
        at = find(needle)
        if needle.startswith("for (; left"):  # the copy's commit closes the phase
            if lines[at + 1].strip() != "cp_async_commit();":
                raise SystemExit(f"phase_cycles: no cp_async_commit() after {needle!r}")
            at += 1
        inserts[at] = phase
    close = max(inserts) + 1  # the loop body's closing brace follows P V
    if lines[close] != "        }":
        raise SystemExit("phase_cycles: the loop body does not end with P V")
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        if i in inserts:
            out.append(f"            PHASE_CLOCK({inserts[i]});")
        if i == close:
            out.append("        if (lane == 0) {\n"
                       f"            for (int k2 = 0; k2 < {len(PHASES)}; ++k2)\n"
                       f"                atomicAdd(&{GLOBAL}[k2], phase_s[warp][k2]);\n"
                       f"            atomicAdd(&{GLOBAL}[{len(PHASES)}],\n"
                       "                      (unsigned long long)tiles);\n"
                       "        }")
    setup = ("    __shared__ unsigned long long phase_s[THREADS / 32][8];\n"
             "    if (lane < 8) phase_s[warp][lane] = 0;\n"
             "    long long phase_last = clock64();\n"
             "#define PHASE_CLOCK(K) do { const long long now = clock64(); if (lane == 0) "
             "phase_s[warp][K] += (unsigned long long)(now - phase_last); phase_last = now; "
             "} while (0)\n")
    anchor = "template <typename T, typename BiasT, bool HAS_MASK, int HEAD_DIM, int HEAD_DIM_V,"
    if head.count(anchor) != 1:
        raise SystemExit("phase_cycles: the warp form's template line is not found")
    head = head.replace(anchor, f"__device__ unsigned long long {GLOBAL}[8];\n{anchor}")
    return head + setup + LOOP_START + "\n".join(out) + LOOP_END + tail


def main():
    from cuattn._kernels import kernel_dir
    source_dir = kernel_dir()
    text = instrument((source_dir / "attention_portable.cu").read_text())
    if "--source" in sys.argv:
        print(text[text.index(f"__device__ unsigned long long {GLOBAL}"):][:200], "...")
        print(text[text.index("    __shared__ unsigned long long phase_s"):
                   text.index(LOOP_END)])
        return
    import cupy as cp
    import numpy as np

    import cuattn
    import cuattn._kernels as K
    from cuattn.bench import _time

    work = Path(tempfile.mkdtemp(prefix="phase_cycles_"))
    shutil.copytree(source_dir, work / "plain")
    shutil.copytree(source_dir, work / "clocked")
    (work / "clocked" / "attention_portable.cu").write_text(text)
    modules = {}

    def module(device_id, directory, filename, name_expression, options):
        with cp.cuda.Device(device_id):
            m = cp.RawModule(code=K.read_source(filename, Path(directory)), options=options,
                             name_expressions=[name_expression])
            modules[Path(directory).name] = m
            return m.get_function(name_expression)
    K._module = functools.cache(module)

    os.environ["CUATTN_KERNEL"] = "portable"
    rng = np.random.default_rng(0)
    b, h, s, d = 1, 16, 4096, 64
    q, k, v = (cp.asarray(rng.standard_normal((b, h, s, d))) for _ in range(3))
    for causal in (False, True):
        fn = functools.partial(cuattn.attention, q, k, v, causal=causal)
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        outs, rates = {}, {}
        for name in ("plain", "clocked"):
            os.environ["CUATTN_KERNEL_DIR"] = str(work / name)
            outs[name] = fn().get()
            rates[name] = flops / _time(fn, cp, warmup=2, max_reps=20, budget_s=5) / 1e9
        counters = cp.ndarray((8,), cp.uint64, modules["clocked"].get_global(GLOBAL))
        counters[:] = 0
        fn()
        cp.cuda.Device().synchronize()
        sums = counters.get().astype(float)
        per_tile = sums[:len(PHASES)] / sums[len(PHASES)]
        same = "bit-identical" if np.array_equal(outs["plain"], outs["clocked"]) else "DIFFERENT"
        print(f"\nB{b} H{h} S{s} D{d} float64{' causal' if causal else ''}: "
              f"{rates['plain']:.2f} TFLOP/s, clocked {rates['clocked']:.2f} ({same})")
        print("| phase | cycles per warp and key tile |\n|---|---|")
        for phase, cycles in zip(PHASES, per_tile):
            print(f"| {phase} | {cycles:,.0f} |")
        print(f"| total | {per_tile.sum():,.0f} |")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
