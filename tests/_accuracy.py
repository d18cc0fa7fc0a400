"""The one accuracy helper of the test suite (the accuracy rule of docs/semantics.rst, from
cuattn.reference)."""
import numpy as np

from cuattn.reference import accuracy_bound


def to_host(x):
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def assert_accurate(out, ref64, naive, *, factor=2.0, what="out"):
    """``max|out - ref64| <= factor/2 * (2 * max|naive - ref64|) + 1e-6``; non-finite
    reference entries must be matched exactly in kind (NaN where NaN, ±inf where ±inf)."""
    out = to_host(out).astype(np.float64)
    ref64 = np.asarray(ref64, dtype=np.float64)
    assert out.shape == ref64.shape, f"{what}: shape {out.shape} != {ref64.shape}"
    finite = np.isfinite(ref64)
    assert np.array_equal(np.isnan(out), np.isnan(ref64)), f"{what}: NaN pattern differs"
    assert np.array_equal(out[~finite & ~np.isnan(ref64)], ref64[~finite & ~np.isnan(ref64)]), \
        f"{what}: infinities differ"
    bound = accuracy_bound(naive, ref64) * factor / 2.0
    err = float(np.max(np.abs(out[finite] - ref64[finite]), initial=0.0))
    assert err <= bound, f"{what}: max error {err:.3g} exceeds the bound {bound:.3g}"
    return err, bound


def poison(x):
    """Fill an output with NaN (or a sentinel for integers) before a run, so that an
    unwritten element cannot pass."""
    if np.issubdtype(x.dtype, np.integer):
        x.fill(np.iinfo(x.dtype).min)
    else:
        x.fill(np.nan)
    return x
