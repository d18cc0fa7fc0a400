"""compute-sanitizer over small cases of every kernel family: memcheck, racecheck, initcheck
and synccheck, one error summary per tool.

    PYTHONPATH=. python tools/sanitize.py                  # all four tools, every family
    PYTHONPATH=. python tools/sanitize.py --tool synccheck --family sm90_3xf16

The driver runs this file again under ``compute-sanitizer --tool T`` with ``--cases``: that
child runs the forward and the backward of every family the GPU's dispatch tables serve,
each forced in turn (as the tests force them), on small ragged shapes, plain and with a
mask, a bias and causal, and the decode paths as dispatch takes them (``--family decode``:
folded query groups, split keys, merge_attention, kv_cache_append, a paged cache), with
CuPy's memory
pool disabled so that every allocation is exact and an out-of-bounds access is not hidden
inside a pooled block. Every result is checked for NaN (all inputs are finite), so a case
that the sanitizer lets through but computes garbage fails too. Exit status 1 when any tool
reports an error or a case fails.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
#: (Sq, Sk, D, Dv): one tile and a ragged edge, a head dim per padded class
SHAPES = ((70, 130, 64, 64), (33, 65, 128, 128), (40, 24, 256, 256), (17, 90, 96, 40))
#: a query length that takes the prepared-operand (piped) forms of the float32 families
LONG = (2048, 160, 64, 64)
#: the piped sm90 forward with its mask and bias tiles staged (rows 16-byte multiples)
PIPED = (130, 144, 192, 192)
#: the piped sm90 forward on a persistent grid (forced): more work units than SMs
PERSISTENT = (17000, 144, 128, 128)
#: the families with packed instances and their packed cases: dispatch's tiles, and the
#: piped sm90 instance forced
PACKED_FAMILIES = {"sm90": ("packed", "packed piped"), "mma": ("packed",)}
#: the packed cases' sequences (query rows, keys): empty ones, one without keys, one row
PACKED_LENGTHS = ((3, 0, 70, 1, 130), (4, 2, 0, 130, 65))


def _cases(families=None):
    """(family, direction, dtype name, precision, shape, features) of every case the GPU
    serves, each family forced in turn."""
    import cupy

    from cuattn._dispatch import BACKWARD_FAMILIES, FAMILIES

    digits = cupy.cuda.Device().compute_capability  # e.g. "90"
    cc = (int(digits[:-1]), int(digits[-1]))
    out = []
    for direction, table in (("fwd", FAMILIES), ("bwd", BACKWARD_FAMILIES)):
        for fam in table:
            if not fam.serves(cc) or (families and fam.name not in families):
                continue
            for name in fam.dtypes:
                precisions = fam.precisions or (("highest",) if name == "float32" else (None,))
                for precision in precisions:
                    shapes = [s for s in SHAPES if max(s[2:]) <= fam.max_head_dim]
                    if name == "float32" and direction == "fwd":
                        shapes.append(LONG)
                    if fam.name == "sm90" and direction == "fwd":
                        shapes += [PIPED, PERSISTENT]
                    for shape in shapes:
                        for features in ("plain", "masked"):
                            out.append((fam.name, direction, name, precision, shape, features))
                    if fam.name in PACKED_FAMILIES and direction == "fwd":
                        out += [(fam.name, direction, name, precision, shape, features)
                                for shape in SHAPES[:3] for features in PACKED_FAMILIES[fam.name]]
    if not families or "decode" in families:  # dispatch's own decode paths, no family forced
        out += [("decode", "fwd", name, None, shape, "plain")
                for name in ("float16", "bfloat16", "float32", "float64")
                for shape in ((1, 300, 64, 64), (3, 2500, 128, 96))]
    return out


def _run_decode(dtype, shape, rng):
    """Query groups folded into rows (Sq 1, or 3 rows that every key serves), split keys
    (2,500 keys for 4 key heads: two chunks and the merge), merge_attention of three parts,
    kv_cache_append, and the keys as a paged cache (shuffled pages of 128 rows, read in
    place for 16-bit inputs, a device table with entries outside the pools past the
    lengths, device lengths); the results of every step."""
    import cupy
    import numpy as np

    import cuattn
    sq, sk, d, dv = shape
    q = cupy.asarray(rng.standard_normal((1, 4, 2, sq, d)).astype(dtype))
    k = cupy.asarray(rng.standard_normal((1, 4, 1, sk, d)).astype(dtype))
    v = cupy.asarray(rng.standard_normal((1, 4, 1, sk, dv)).astype(dtype))
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    cut = (sk // 3, 2 * sk // 3)
    parts = [cuattn.attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True)
             for a, b in zip((0, *cut), (*cut, sk))]
    merged, _ = cuattn.merge_attention(*zip(*parts))
    k_cache, v_cache = cupy.zeros((1, 4, 1, sk + 8, d), dtype), cupy.zeros((1, 4, 1, sk + 8, dv),
                                                                         dtype)
    lengths = cupy.asarray(rng.integers(0, 9, (1, 4, 1)))
    cuattn.kv_cache_append(k_cache, v_cache, k[..., :sk - 8, :], v[..., :sk - 8, :], lengths)
    page = 128
    per_entry = -(-sk // page)
    pools = []
    for x in (k, v):  # (1, 4, 1, sk, D) -> (pages, 4, 1, page, D), page j at pool row order[j]
        padded = cupy.zeros(x.shape[:-2] + (per_entry * page, x.shape[-1]), dtype)
        padded[..., :sk, :] = x
        pages = padded.reshape(4, per_entry, page, x.shape[-1]).transpose(1, 0, 2, 3)
        pools.append(pages[:, :, None])
    order = rng.permutation(per_entry)
    pools = [cupy.ascontiguousarray(p[cupy.asarray(np.argsort(order))]) for p in pools]
    table = np.concatenate([order, [-3, 10**6]])[None]  # columns past the length: anything
    paged = cuattn.attention(q, *pools, k_lengths=cupy.asarray([sk]),
                             block_table=cupy.asarray(table))
    return [out, lse.astype(cupy.float32), merged, k_cache, v_cache, paged]


def _run_case(family, direction, name, precision, shape, features, rng):
    import cupy
    import ml_dtypes
    import numpy as np

    from cuattn.attention import _attention, _attention_backward

    dtype = ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)
    if family == "decode":
        results = _run_decode(dtype, shape, rng)
        cupy.cuda.get_current_stream().synchronize()
        return all(not bool(cupy.isnan(r.astype(cupy.float32)).any()) for r in results)
    sq, sk, d, dv = shape
    if features.startswith("packed"):
        return _run_packed(family, dtype, d, features == "packed piped", rng)
    q = cupy.asarray(rng.standard_normal((1, 2, sq, d)).astype(dtype))
    k = cupy.asarray(rng.standard_normal((1, 2, sk, d)).astype(dtype))
    v = cupy.asarray(rng.standard_normal((1, 2, sk, dv)).astype(dtype))
    kw = {} if precision is None else {"precision": precision}
    if features == "masked":
        kw["mask"] = cupy.asarray(rng.random((1, 1, sq, sk)) > 0.2)
        bias_dtype = dtype if np.dtype(dtype).itemsize == 2 else np.float32
        kw["bias"] = cupy.asarray(rng.standard_normal((sq, sk)).astype(bias_dtype))
        kw["causal"] = True
    if direction == "fwd":
        if shape == PERSISTENT:
            from cuattn.families.sm90 import Sm90PipedTiles
            kw["tiles"] = Sm90PipedTiles(128, 2, persistent=True)
        out, lse = _attention(q, k, v, kernel=family, return_lse=True, **kw)
        results = [out]
    else:
        out, lse = _attention(q, k, v, return_lse=True, **kw)
        dout = cupy.asarray(rng.standard_normal(out.shape).astype(dtype))
        results = list(_attention_backward(dout, q, k, v, out, lse, kernel=family, **kw))
    cupy.cuda.get_current_stream().synchronize()
    return all(not bool(cupy.isnan(r.astype(cupy.float32)).any()) for r in results)


def _run_packed(family, dtype, d, piped, rng):
    """A packed call (PACKED_LENGTHS) in one grid, forced to ``family`` (and to the piped
    sm90 tiles); whether its rows are free of NaN."""
    import cupy
    import numpy as np

    from cuattn import _gpu
    from cuattn._checks import check_attention, lse_dtype
    from cuattn._checks_ragged import check_ragged
    from cuattn.families.sm90 import Sm90PipedTiles
    qo, ko = (np.concatenate([[0], np.cumsum(n)]) for n in PACKED_LENGTHS)
    q, k, v = (cupy.asarray(rng.standard_normal((2, int(o[-1]), d)).astype(dtype))
               for o in (qo, ko, ko))
    call = check_attention(q, k, v, causal=True, return_lse=True)
    out = cupy.empty(call.out_shape, call.dtype)
    lse = cupy.empty(call.lse_shape, lse_dtype(call.dtype))
    tiles = Sm90PipedTiles(128 if d <= 128 else 64, 2) if piped else None
    if not _gpu.forward_packed(call, check_ragged(call, qo, ko), out, lse, family, tiles):
        raise RuntimeError(f"{family} ran the packed call as dense parts")
    cupy.cuda.get_current_stream().synchronize()
    return not bool(cupy.isnan(out.astype(cupy.float32)).any())


def run_cases(families=None) -> int:
    """The child: every case once, CuPy's memory pool off; 1 if any case failed."""
    import cupy
    import numpy as np

    cupy.cuda.set_allocator(None)
    cupy.cuda.set_pinned_memory_allocator(None)
    rng = np.random.default_rng(0)
    failed = 0
    cases = _cases(families)
    for case in cases:
        try:
            ok = _run_case(*case, rng)
        except Exception as err:  # noqa: BLE001 - report every failing case, then fail
            ok = False
            print(f"case {case}: {type(err).__name__}: {str(err).splitlines()[0]}", flush=True)
        if not ok:
            failed += 1
            print(f"FAILED case {case}", flush=True)
    print(f"{len(cases)} cases, {failed} failed", flush=True)
    return 1 if failed else 0


#: the error count: "ERROR SUMMARY: N errors", racecheck's "RACECHECK SUMMARY: ... (N errors, ..."
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: .*?\((\d+) error")
_CASES = re.compile(r"(\d+) cases, (\d+) failed")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tool", action="append", choices=TOOLS,
                        help="a sanitizer tool (repeatable; default: all four)")
    parser.add_argument("--family", action="append", help="only this family (repeatable)")
    parser.add_argument("--log-dir", default=None, help="write each tool's full log here")
    parser.add_argument("--cases", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cases:
        return run_cases(args.family)

    rows, status = [], 0
    for tool in args.tool or TOOLS:
        cmd = ["compute-sanitizer", "--tool", tool, "--print-limit", "20"]
        if tool == "racecheck":
            cmd += ["--racecheck-report", "all"]
        cmd += [sys.executable, os.path.abspath(__file__), "--cases"]
        for fam in args.family or ():
            cmd += ["--family", fam]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        log = res.stdout + res.stderr
        if args.log_dir:
            os.makedirs(args.log_dir, exist_ok=True)
            with open(os.path.join(args.log_dir, f"sanitize-{tool}.log"), "w") as f:
                f.write(log)
        summary, cases = _SUMMARY.findall(log), _CASES.findall(log)
        errors = int("".join(summary[-1])) if summary else -1
        n_cases, n_failed = (int(c) for c in cases[-1]) if cases else (-1, -1)
        bad = errors != 0 or n_failed != 0 or res.returncode != 0
        status |= bad
        rows.append((tool, errors, n_cases, n_failed, res.returncode, seconds))
        if bad:
            print("\n".join(log.splitlines()[-60:]), file=sys.stderr)
    print(f"{'tool':10s} {'errors':>6s} {'cases':>6s} {'failed':>6s} {'rc':>3s} {'s':>6s}")
    for tool, errors, n, failed, rc, seconds in rows:
        print(f"{tool:10s} {errors:6d} {n:6d} {failed:6d} {rc:3d} {seconds:6.0f}")
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
