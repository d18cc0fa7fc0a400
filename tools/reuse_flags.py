"""Operand-reuse flags that ptxas leaves off the DFMAs of an sm_90 cubin, set after the fact:
an experiment on the portable float64 forward (docs/kernels.rst, twenty-fourth session).
Nothing in cuattn loads a patched cubin; this tool measures what the flags are worth.

    PYTHONPATH=. python tools/reuse_flags.py [MODES]     (on the GPU machine)
    PYTHONPATH=. python tools/reuse_flags.py --count     (no GPU: NVRTC, counts only)

MODES (comma-separated, default orig,reuse,shortyield,longyield):
  orig        the cubin as ptxas wrote it
  reuse       on a DFMA whose successor is a DFMA reading the same register in the same slot,
              set that slot's reuse flag and the no-yield bit (ptxas never writes a reuse flag
              on a yielding instruction, and cuobjdump does not show one there); only where the
              DFMA stalls at most 2 cycles and no instruction of the next 16 reads its result
  shortyield  control: only the no-yield bit, on the same kind of DFMA, no flag
  longyield   negative control: the no-yield bit on DFMAs that stall 5 cycles or more
It times the products of tools/bench_fp64_products.py and cuattn.attention on float64
(B1 H16 S4096 D64, CUATTN_KERNEL=portable; queries also scaled by 20), and compares every
output bit for bit with the unpatched cubin's (the flags change no arithmetic).

The 128-bit encoding (Volta and later, as read from cuobjdump): opcode bits 0-11, predicate
12-15, Rd 16-23, Ra 24-31, Rb 32-39, Rc 64-71; stall 105-108, yield 109 (1: stay on this
warp), write and read scoreboards 110-115, wait mask 116-121, reuse A, B, C 122-124.
"""
import functools
import os
import struct
import sys
from pathlib import Path

REUSE_BITS = (122, 123, 124)
STAY_BIT = 109
DFMA_RRR = 0x722B  # DFMA Rd, Ra, Rb, Rc, unpredicated


def text_sections(blob: bytes):
    """(name, offset, size) of every .text.* section of an ELF64 cubin."""
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    names = hdrs[shstrndx][4]
    for h in hdrs:
        name = blob[names + h[0]: blob.index(b"\0", names + h[0])].decode()
        if name.startswith(".text."):
            yield name, h[4], h[5]


def _sources(w: int):
    return ((w >> 24) & 0xFF, (w >> 32) & 0xFF, (w >> 64) & 0xFF)


def _overlaps(dest: int, reg: int) -> bool:  # register pairs (doubles)
    return dest != 255 and reg != 255 and dest <= reg + 1 and reg <= dest + 1


def _read_soon(ws, i: int, window: int = 16) -> bool:
    dest = (ws[i] >> 16) & 0xFF
    return any(_overlaps(dest, r) for w in ws[i + 1: i + 1 + window] for r in _sources(w))


def patch(blob: bytes, mode: str):
    """The cubin with ``mode`` applied (see the module docstring), and how many DFMAs changed."""
    out, changed = bytearray(blob), 0
    for _, off, size in text_sections(blob):
        ws = [int.from_bytes(out[off + 16 * i: off + 16 * i + 16], "little")
              for i in range(size // 16)]
        for i, w in enumerate(ws):
            if w & 0xFFFF != DFMA_RRR:
                continue
            stall, stays = (w >> 105) & 15, (w >> STAY_BIT) & 1
            if mode == "longyield":
                if stall >= 5 and not stays:
                    ws[i] = w | 1 << STAY_BIT
                    changed += 1
                continue
            if stall > 2 or (not stays and _read_soon(ws, i)):
                continue
            if mode == "shortyield":
                if not stays:
                    ws[i] = w | 1 << STAY_BIT
                    changed += 1
                continue
            nxt = ws[i + 1] if i + 1 < len(ws) else 0
            if nxt & 0xFFFF != DFMA_RRR or (nxt >> 116) & 0x3F:  # next waits: leave it
                continue
            dest = (w >> 16) & 0xFF
            slots = [s for s, r in enumerate(_sources(w))
                     if r != 255 and r == _sources(nxt)[s] and not _overlaps(dest, r)]
            new = w
            for s in slots:
                new |= 1 << REUSE_BITS[s] | 1 << STAY_BIT
            if new != w:
                ws[i] = new
                changed += 1
        for i, w in enumerate(ws):
            out[off + 16 * i: off + 16 * i + 16] = w.to_bytes(16, "little")
    return bytes(out), changed


def nvrtc_cubin(source: str, filename: str, options, expressions, arch: str):
    """(cubin, {expression: lowered name}) through cuda.bindings.nvrtc."""
    from cuda.bindings import nvrtc

    from cuattn._gate import cuda_include_dir
    _, prog = nvrtc.nvrtcCreateProgram(source.encode(), filename.encode(), 0, [], [])
    for e in expressions:
        nvrtc.nvrtcAddNameExpression(prog, e.encode())
    opts = [*options, f"-arch={arch}"]
    if cuda_include_dir():
        opts.append(f"--include-path={cuda_include_dir()}")
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(log.decode(errors="replace"))
    low = {e: nvrtc.nvrtcGetLoweredName(prog, e.encode())[1].decode() for e in expressions}
    _, n = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = b" " * n
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    nvrtc.nvrtcDestroyProgram(prog)
    return bytes(cubin), low


FORWARD = "attention_fwd_portable_warps<double, cuattn::NoBias, false, 64, 64, 64, true, true>"
PRODUCT_OPTS = ("-std=c++17", "--device-as-default-execution-space", "-Icuda")


def products_source() -> str:
    text = (Path(__file__).parent / "bench_fp64_products.py").read_text()
    return text.split("PRODUCTS = r'''")[1].split("'''")[0]


def count(modes):
    from cuattn._gate import CUPY_APPENDS
    from cuattn._kernels import nvrtc_options, read_source
    blob, _ = nvrtc_cubin(read_source("attention_portable.cu"), "attention_portable.cu",
                          [*nvrtc_options(), *CUPY_APPENDS], [FORWARD], "sm_90")
    prod, _ = nvrtc_cubin(products_source(), "p.cu", PRODUCT_OPTS,
                          [f"products<{i}>" for i in range(4)], "sm_90")
    for m in modes:
        print(f"{m}: forward {patch(blob, m)[1]} DFMAs changed, products {patch(prod, m)[1]}")


def main(modes):
    import cupy as cp
    import numpy as np

    import cuattn
    import cuattn._kernels as K
    from cuattn._gate import CUPY_APPENDS
    from cuattn.bench import _time

    def load(cubin, tag):
        path = f"/tmp/reuse_flags_{tag}_{os.getpid()}.cubin"
        Path(path).write_bytes(cubin)
        return cp.RawModule(path=path)

    arch = "sm_" + cp.cuda.Device().compute_capability
    unpatched = K._module.__wrapped__

    def module(device_id, directory, filename, name_expression, options):
        mode = Path(directory).name.removeprefix("reuse_flags_")
        if mode == Path(directory).name or mode == "orig" or filename != "attention_portable.cu":
            return unpatched(device_id, directory, filename, name_expression, options)
        blob, low = nvrtc_cubin(K.read_source(filename, Path(directory)), filename,
                                [*options, *CUPY_APPENDS], [name_expression], arch)
        return load(patch(blob, mode)[0], mode).get_function(low[name_expression])
    K._module = functools.cache(module)

    def median_ms(fn, reps=10):  # the bench's timer, a fixed number of calls
        return _time(fn, cp, warmup=2, max_reps=reps, budget_s=60)

    def same(x, ref):
        if ref is None:
            return "reference"
        return "bit-identical" if np.array_equal(x, ref) else \
            f"DIFFERENT (max {np.abs(x - ref).max():.3g})"

    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    smem = (128 * 66 + 2 * 64 * 66 + 128 * 66) * 8
    dfma = {0: 2048 + 32, 1: 2048, 2: 2048, 3: 4096 + 32}
    exprs = [f"products<{i}>" for i in dfma]
    prod, low = nvrtc_cubin(products_source(), "p.cu", PRODUCT_OPTS, exprs, arch)
    refs = {}
    for m in modes:
        mod = load(prod if m == "orig" else patch(prod, m)[0], "p" + m)
        for i, e in enumerate(exprs):
            f = mod.get_function(low[e])
            f.max_dynamic_shared_size_bytes = smem
            out, iters = cp.zeros(sms * 256), 2000
            ms = median_ms(functools.partial(f, (sms,), (256,), (out, np.int32(iters)),
                                             shared_mem=smem), 5)
            print(f"{e} {m}: {2.0 * dfma[i] * iters * sms * 256 / ms / 1e9:.2f} TFLOP/s, "
                  f"{same(out.get(), refs.get(e))}", flush=True)
            refs.setdefault(e, out.get())

    os.environ["CUATTN_KERNEL"] = "portable"
    rng = np.random.default_rng(0)
    b, h, s, d = 1, 16, 4096, 64
    q, k, v = (cp.asarray(rng.standard_normal((b, h, s, d))) for _ in range(3))
    q20 = q * 20
    for m in modes:
        folder = Path("/tmp") / f"reuse_flags_{m}"
        if not folder.is_dir():
            import shutil
            shutil.copytree(K.kernel_dir(), folder)
        os.environ["CUATTN_KERNEL_DIR"] = str(folder)
        for causal in (False, True):
            for name, qq in (("q", q), ("20q", q20)):
                fn = functools.partial(cuattn.attention, qq, k, v, causal=causal)
                out = fn().get()
                ms = median_ms(fn)
                key = (name, causal)
                tf = 4 * b * h * s * s * d / (2 if causal else 1) / ms / 1e9
                print(f"attention float64 {name:>3} {'causal' if causal else 'plain '} {m}: "
                      f"{tf:.2f} TFLOP/s, {same(out, refs.get(key))}", flush=True)
                refs.setdefault(key, out)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--count"]
    modes = args[0].split(",") if args else ["orig", "reuse", "shortyield", "longyield"]
    (count if "--count" in sys.argv else main)(modes)
