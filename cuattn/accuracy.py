"""Accuracy of cuattn next to its peers, against float64 attention from the same inputs.

:func:`run` measures; :func:`format_report` prints the tables. Four sections:

* ``half``, a grid in the manner of FlashAttention's output tests (:func:`half_grid`):
  float16 and bfloat16, the (Sq, Sk) pairs of ``SEQLENS``, the head dims of
  ``HEAD_DIMS``, causal or not, MHA / GQA / MQA (6 query heads on 6, 2 or 1 K/V heads),
  layouts BHSD and BSHD, batch 2. Peers: PyTorch SDPA's flash backend
  (FlashAttention-2) and its cuDNN backend.
* ``float32``: cuattn with ``precision="highest"``; peers SDPA's math and efficient
  backends in float32, TF32 off.
* ``float64``: each error over a 4-ulp bound, ``max|x - ref| / (4 · eps · max|ref|)`` with
  ``eps = 2**-52`` (float64's unit roundoff times two): 1 or less means the largest
  error is within four units in the last place of the quantity's largest magnitude.
  Peer: SDPA's math backend in float64.
* ``one_key``: rows with one allowed key, for every dtype: ``Sk = 1``, and causal
  ``Sq = Sk`` whose first row sees only the first key (``dout`` zero on the other rows).
  Their probabilities are exactly 1, so ``out`` must equal v's row bit for bit, and dk
  (and dq) must be exactly 0; the section reports whether they are.

Errors. For each case, quantity (out, dq, dk, dv) and implementation: the max (and mean)
absolute difference from :func:`dense_attention_grads` of the same inputs upcast to
float64, on the same device, for a fixed standard-normal ``dout``. The ratio of a case
and quantity is cuattn's max error over the smallest max error among the peers that ran
it; each section's summary gives their count, median, p90, max and the fraction at most
``WITHIN``.

Peers run only on CuPy arrays, when PyTorch imports and sees the GPU: SDPA restricted to
one backend by ``torch.nn.attention.sdpa_kernel``, on the same memory through DLPack
(B, H, S, D) views, strided for BSHD (cuattn takes q as (B, Hkv, G, S, D) and k, v as
(B, Hkv, 1, S, D) views of it), gradients by ``torch.autograd.grad``. GQA
and MQA repeat K and V over each group's query heads inside the autograd graph, so dk and
dv are summed over the group in the input dtype, as FlashAttention-2 sums its expanded
gradients. Causal: SDPA's ``is_causal`` is top-left aligned and cuattn's bottom-right,
the same for Sq = Sk, where the peers get ``is_causal=True``; for Sq != Sk they get
``torch.nn.attention.bias.causal_lower_right(Sq, Sk)``, which PyTorch runs natively on
the flash backend (FlashAttention-2's causal mask is bottom-right aligned) and the
efficient one, and as a materialised bool mask on the others (cuDNN runs it or raises;
rows with no allowed key, Sq > Sk, may come out NaN). A peer that raises is recorded as
None with its message, one whose result is not finite as None noted "non-finite".

Without a GPU, :func:`run` uses cuattn's NumPy backend on NumPy arrays and no peers.

The grid and the float64 reference live in ``_accuracy_grid``, the tables in
``_accuracy_report``; this module measures and runs.
"""
from __future__ import annotations

import json
import math
import platform
import sys
import time
import warnings
import zlib
from dataclasses import asdict

import ml_dtypes
import numpy as np

from ._accuracy_grid import (
    FLOAT32_CASES,
    FLOAT64_CASES,
    ONE_KEY_CASES,
    ONE_KEY_DTYPES,
    QUANTITIES,
    QUICK_CASES,
    SDPA_BACKENDS,
    SECTIONS,
    ULPS,
    WITHIN,
    AccuracyCase,
    dense_attention,
    dense_attention_grads,
    half_grid,
)
from ._accuracy_report import _max_error, format_report
from .attention import attention, attention_backward

__all__ = ["AccuracyCase", "half_grid", "dense_attention", "dense_attention_grads", "run",
           "format_report"]
# ---- one case ---------------------------------------------------------------------------


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _inputs(case: AccuracyCase, xp):
    """``(plain, grouped)``: q, k, v and dout as (B, H, S, D) arrays (views of BSHD memory
    for that layout) for the peers, and as the grouped views cuattn takes, q and dout
    (B, Hkv, G, Sq, D), k and v (B, Hkv, 1, Sk, D). Drawn from a seed of the label, so a
    case has the same inputs in every run."""
    rng = np.random.default_rng(zlib.crc32(case.label.encode()))
    dtype = _np_dtype(case.dtype)
    b, hkv, d = case.batch, case.heads_kv, case.head_dim

    def draw(seqlen, groups):
        heads = hkv * groups
        shape = (b, seqlen, heads, d) if case.layout == "bshd" else (b, heads, seqlen, d)
        base = xp.asarray(rng.standard_normal(shape).astype(dtype))
        if case.layout == "bshd":
            return (base.swapaxes(1, 2),
                    base.reshape(b, seqlen, hkv, groups, d).transpose(0, 2, 3, 1, 4))
        return base, base.reshape(b, hkv, groups, seqlen, d)

    (q4, q5), (k4, k5), (v4, v5) = (draw(case.seqlen_q, case.groups),
                                    draw(case.seqlen_k, 1), draw(case.seqlen_k, 1))
    # dout is contiguous, like the output it stands for
    dout4 = xp.asarray(rng.standard_normal((b, case.heads_q, case.seqlen_q, d)).astype(dtype))
    dout5 = dout4.reshape(b, hkv, case.groups, case.seqlen_q, d)
    return (q4, k4, v4, dout4), (q5, k5, v5, dout5)


def _canonical(case: AccuracyCase, out, dq, dk, dv) -> dict:
    """out and dq as (B, Hq, Sq, D), dk and dv as (B, Hkv, Sk, D)."""
    rows = (case.batch, case.heads_q, case.seqlen_q, case.head_dim)
    keys = (case.batch, case.heads_kv, case.seqlen_k, case.head_dim)
    return {"out": out.reshape(rows), "dq": dq.reshape(rows), "dk": dk.reshape(keys),
            "dv": dv.reshape(keys)}


def _cuattn(case: AccuracyCase, q, k, v, dout) -> dict:
    kw = {"causal": case.causal}
    if case.dtype == "float32":
        kw["precision"] = "highest"
    out, lse = attention(q, k, v, return_lse=True, **kw)
    return _canonical(case, out, *attention_backward(dout, q, k, v, out, lse, **kw))


def _torch_causal(case: AccuracyCase) -> tuple:
    """SDPA's ``(attn_mask, is_causal)`` for cuattn's (bottom-right) causal band."""
    if not case.causal:
        return None, False
    if case.seqlen_q == case.seqlen_k:
        return None, True
    from torch.nn.attention.bias import causal_lower_right
    return causal_lower_right(case.seqlen_q, case.seqlen_k), False


def _torch_sdpa(torch, peer: str, case: AccuracyCase, q, k, v, dout) -> dict:
    """One SDPA backend's out and gradients on the (B, H, S, D) arrays, as CuPy float64."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, SDPA_BACKENDS[peer])
    tq, tk, tv = (torch.from_dlpack(x).detach().requires_grad_() for x in (q, k, v))
    kx, vx = (t.repeat_interleave(case.groups, dim=1) if case.groups > 1 else t
              for t in (tk, tv))
    # a backend that cannot run a case warns before it raises; the raise is recorded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mask, is_causal = _torch_causal(case)
        allow_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 peers in full float32
        try:
            with sdpa_kernel([backend]):
                # the mask goes by position: that is where a CausalBias takes over SDPA
                out = torch.nn.functional.scaled_dot_product_attention(
                    tq, kx, vx, mask, is_causal=is_causal,
                    scale=1.0 / math.sqrt(case.head_dim))
                grads = torch.autograd.grad(out, (tq, tk, tv), torch.from_dlpack(dout))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    cupy = sys.modules["cupy"]
    return dict(zip(QUANTITIES, (cupy.from_dlpack(t.detach().to(torch.float64))
                                 for t in (out, *grads))))


def _reason(exc: Exception) -> str:
    first = (str(exc).splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:120]}"


def _error(got, ref, xp) -> dict | None:
    """Max and mean absolute error in float64; None when ``got`` is not finite."""
    if got.shape != ref.shape:
        raise ValueError(f"result of shape {got.shape}, reference {ref.shape}")
    diff = xp.abs(got.astype(xp.float64) - ref)
    largest = float(diff.max())
    return {"max": largest, "mean": float(diff.mean())} if math.isfinite(largest) else None


def _measure(case: AccuracyCase, xp, torch, peers) -> dict:
    """Errors of cuattn and of each peer on one case (None for one that could not run)."""
    plain, grouped = _inputs(case, xp)
    q5, k5, v5, dout5 = grouped
    ref = _canonical(case, *dense_attention_grads(dout5, q5, k5, v5, causal=case.causal))
    entry = {**asdict(case), "label": case.label, "grouping": case.grouping,
             "reference_max": {n: float(xp.abs(ref[n]).max()) for n in QUANTITIES},
             "errors": {}, "notes": {}}
    impls = {"cuattn": lambda: _cuattn(case, *grouped)}
    for peer in peers:
        impls[peer] = lambda peer=peer: _torch_sdpa(torch, peer, case, *plain)
    for name, fn in impls.items():
        try:
            got = fn()
            errors = {n: _error(got[n], ref[n], xp) for n in QUANTITIES}
        except Exception as exc:  # noqa: BLE001 - an implementation that cannot run this case
            entry["errors"][name], entry["notes"][name] = None, _reason(exc)
            continue
        entry["errors"][name] = errors
        bad = [n for n in QUANTITIES if errors[n] is None]
        if bad:
            entry["notes"][name] = "non-finite " + ", ".join(bad)
    return entry


def _ratios(entry: dict, peers) -> dict:
    """cuattn's max error over the best peer's, per quantity (None without both)."""
    ratios = {}
    for n in QUANTITIES:
        ours = _max_error(entry, "cuattn", n)
        theirs = [e for e in (_max_error(entry, p, n) for p in peers) if e is not None]
        if ours is None or not theirs:
            ratios[n] = None
        elif min(theirs) > 0:
            ratios[n] = ours / min(theirs)
        else:
            ratios[n] = 1.0 if ours == 0 else None
    return ratios


def _ulp_ratios(entry: dict) -> dict:
    """Each implementation's max error over the 4-ulp bound, per quantity."""
    eps = float(np.finfo(np.float64).eps)
    out = {}
    for name in entry["errors"]:
        out[name] = {}
        for n in QUANTITIES:
            err, bound = _max_error(entry, name, n), ULPS * eps * entry["reference_max"][n]
            out[name][n] = None if err is None or bound == 0 else err / bound
    return out


def _ulp_summary(cases: list) -> dict:
    """Per implementation and quantity: the largest ratio to the 4-ulp bound, and the
    fraction of cases at most 1."""
    names = dict.fromkeys(name for c in cases for name in c["ulp_ratios"])
    summary = {}
    for name in names:
        summary[name] = {}
        for n in QUANTITIES:
            r = np.array([c["ulp_ratios"][name][n] for c in cases
                          if c["ulp_ratios"].get(name, {}).get(n) is not None])
            summary[name][n] = {"count": int(r.size)} if not r.size else {
                "count": int(r.size), "max": float(r.max()), "within": float(np.mean(r <= 1))}
    return summary


def _summary(cases: list, peers) -> dict:
    """Count, median, p90, max and fraction within ``WITHIN`` of the ratios, per quantity."""
    summary = {}
    for n in QUANTITIES:
        r = np.array([c["ratios"][n] for c in cases if c["ratios"][n] is not None])
        summary[n] = {"count": int(r.size)} if not r.size else {
            "count": int(r.size), "median": float(np.median(r)),
            "p90": float(np.percentile(r, 90)), "max": float(r.max()),
            "within": float(np.mean(r <= WITHIN))}
    if not peers:
        summary["note"] = "no peer was available"
    elif not any(summary[n]["count"] for n in QUANTITIES):
        summary["note"] = "no peer ran any case"
    return summary


# ---- one allowed key --------------------------------------------------------------------


def _one_key(kind: str, dtype: str, xp, forward=attention, backward=attention_backward):
    """Whether ``out`` equals v's row exactly and dk and dq are exactly 0 on rows with one
    allowed key (``kind`` is one of ``ONE_KEY_CASES``); ``forward`` and ``backward`` are
    the implementation under test."""
    rng = np.random.default_rng(0)
    b, h, s, d = 2, 3, 77, 64
    causal = kind != "Sk=1"
    sk = s if causal else 1
    host = [rng.standard_normal(shape).astype(_np_dtype(dtype))
            for shape in ((b, h, s, d), (b, h, sk, d), (b, h, sk, d), (b, h, s, d))]
    if causal:
        host[3][..., 1:, :] = 0  # only the first row's gradient flows back
    q, k, v, dout = (xp.asarray(x) for x in host)
    kw = {"causal": causal, **({"precision": "highest"} if dtype == "float32" else {})}
    entry = {"dtype": dtype, "case": kind}
    try:
        out, lse = forward(q, k, v, return_lse=True, **kw)
        dq, dk, _ = backward(dout, q, k, v, out, lse, **kw)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        return {**entry, "error": _reason(exc)}
    rows = out[..., :1, :] if causal else out
    wide = [x.astype(xp.float64) for x in (rows, v[..., :1, :], dq, dk)]
    dk_max = float(xp.abs(wide[3]).max())
    return {**entry, "out_exact": bool(xp.all(wide[0] == wide[1])),
            "dk_zero": bool(xp.all(wide[3] == 0)), "dq_zero": bool(xp.all(wide[2] == 0)),
            "dk_max": dk_max if math.isfinite(dk_max) else None}


# ---- the run ----------------------------------------------------------------------------


def _default_module():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # noqa: BLE001 - no CuPy, driver or device: the NumPy backend
        pass
    return np


def _torch_for(xp):
    """PyTorch when the run is on the GPU and PyTorch sees it, else None."""
    if xp is np:
        return None
    try:
        import torch
    except Exception:  # noqa: BLE001 - no PyTorch, or one that does not import
        return None
    return torch if torch.cuda.is_available() else None


def _environment(xp, torch) -> dict:
    from . import __version__
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "backend": xp.__name__,
           "cuattn": __version__, "numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__,
           "python": platform.python_version(),
           "torch": None if torch is None else torch.__version__}
    if xp is not np:
        device = xp.cuda.Device()
        props = xp.cuda.runtime.getDeviceProperties(device.id)
        env.update(cupy=xp.__version__, gpu=props["name"].decode(),
                   compute_capability=device.compute_capability)
    return env


def _release(xp, torch):
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


def _progress_line(key: str, i: int, n: int, entry: dict, seconds: float) -> str:
    cells = []
    for q in QUANTITIES:
        err = _max_error(entry, "cuattn", q)
        cell = f"{q} {'-' if err is None else f'{err:.2e}'}"
        ratio = entry.get("ratios", {}).get(q)
        cells.append(cell + ("" if ratio is None else f" (x{ratio:.2f})"))
    return f"[{key} {i}/{n}] {entry['label']}: {'  '.join(cells)}  ({seconds:.1f} s)"


def run(*, quick=False, json_path=None, progress=print, xp=None) -> dict:
    """Measure cuattn's errors and its peers' against float64 attention.

    Parameters
    ----------
    quick : bool, optional
        Run ``QUICK_CASES`` (a few small cases per section) instead of the whole grid.
    json_path : str or path, optional
        Where to write the result as JSON.
    progress : callable, optional
        Called with one line of text per case.
    xp : module, optional
        ``numpy`` or ``cupy``: the arrays the run uses. Default CuPy when a GPU is usable,
        else NumPy (cuattn's NumPy backend, and no peers).

    Returns
    -------
    dict
        JSON-able: ``environment``; ``half``, ``float32`` and ``float64``, each with
        ``title``, ``peers`` (those tried), ``cases`` and ``summary``. A case holds its
        fields, ``label``, ``errors`` per implementation and quantity (``{"max", "mean"}``,
        or None where it could not run or was not finite, ``notes`` saying why),
        ``reference_max``, and ``ratios`` per quantity (``ulp_ratios`` per implementation
        and quantity in ``float64``). A summary holds per quantity the ratios' ``count``,
        ``median``, ``p90``, ``max`` and ``within`` (the fraction at most ``WITHIN``), and
        a ``note`` when no peer was available or none ran; the float64 summary holds per
        implementation and quantity the largest ratio to the bound and the fraction at
        most 1. Then ``one_key``, one entry per dtype and case; ``within``, ``ulps`` and
        ``quick``.

    Examples
    --------
    >>> import numpy as np
    >>> from cuattn import accuracy
    >>> result = accuracy.run(quick=True, xp=np, progress=lambda line: None)
    >>> result["half"]["summary"]["note"]
    'no peer was available'
    """
    xp = _default_module() if xp is None else xp
    torch = _torch_for(xp)
    result = {"environment": _environment(xp, torch), "quick": bool(quick), "within": WITHIN,
              "ulps": ULPS}
    for key, (title, peers) in SECTIONS.items():
        peers = peers if torch is not None else ()
        cases = QUICK_CASES[key] if quick else (
            half_grid() if key == "half" else FLOAT32_CASES if key == "float32" else
            FLOAT64_CASES)
        entries = []
        for i, case in enumerate(cases, 1):
            t0 = time.perf_counter()
            entry = _measure(case, xp, torch, peers)
            _release(xp, torch)
            if key == "float64":
                entry["ulp_ratios"] = _ulp_ratios(entry)
            else:
                entry["ratios"] = _ratios(entry, peers)
            entries.append(entry)
            progress(_progress_line(key, i, len(cases), entry, time.perf_counter() - t0))
        result[key] = {"title": title, "peers": list(peers), "cases": entries,
                       "summary": (_ulp_summary(entries) if key == "float64" else
                                   _summary(entries, peers))}
    result["one_key"] = [_one_key(kind, dtype, xp) for dtype in ONE_KEY_DTYPES
                         for kind in ONE_KEY_CASES]
    _release(xp, torch)
    if json_path is not None:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1, allow_nan=False)
    return result
