"""``merge_attention``: attention over disjoint key sets, combined exactly."""
from __future__ import annotations

from ._checks import check_merge, lse_dtype

__all__ = ["merge_attention"]


def merge_attention(outs, lses):
    """Combine attention results computed over disjoint key sets into the result over all.

    Each part is ``attention(q, k_i, v_i, return_lse=True, ...)`` for one set of keys; the
    merge is exact up to rounding: ``lse = logsumexp_i(lse_i)`` and
    ``out = sum_i exp(lse_i - lse) * out_i``, accumulated in float32 (float64 for float64)
    in the order of the parts and rounded once. It is the building block of split-key
    decoding and of sequence parallelism across devices or Dask chunks.

    Parameters
    ----------
    outs : sequence of (..., Sq, Dv) ndarray
        The parts' outputs: one kind (numpy or cupy), dtype and shape, on one device.
    lses : sequence of (..., Sq) ndarray
        The parts' ``lse``: float32 (float64 for float64 outputs), -inf for a row with no
        allowed key in that part.

    Returns
    -------
    out : (..., Sq, Dv) ndarray
        dtype of the outputs; 0 in a row with no allowed key in any part.
    lse : (..., Sq) ndarray
        -inf in such a row.

    Raises
    ------
    TypeError, ValueError
        No parts, parts of different kinds, dtypes, shapes or devices, or lses that do not
        match the outputs.

    Examples
    --------
    >>> import numpy as np, cuattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 16)) for _ in range(3))
    >>> parts = [cuattn.attention(q, k[:, :2], v[:, :2], return_lse=True),
    ...          cuattn.attention(q, k[:, 2:], v[:, 2:], return_lse=True)]
    >>> out, lse = cuattn.merge_attention(*zip(*parts))
    >>> np.allclose(out, cuattn.attention(q, k, v), rtol=0, atol=1e-14)
    True
    """
    outs, lses, xp = check_merge(outs, lses)
    acc = lse_dtype(outs[0].dtype)
    m = lses[0].astype(acc, copy=True)
    for lse in lses[1:]:
        m = xp.maximum(m, lse)
    empty = m == -xp.inf  # no allowed key in any part
    m = xp.where(empty, acc.type(0), m)
    total = xp.zeros(m.shape, acc)
    weights = []
    for lse in lses:
        w = xp.exp(lse.astype(acc, copy=False) - m)  # exp(-inf) = 0 for an empty part
        weights.append(w)
        total += w
    total = xp.where(empty, acc.type(1), total)
    out = xp.zeros(outs[0].shape, acc)
    for w, o in zip(weights, outs):
        out += (w / total)[..., None] * o.astype(acc, copy=False)
    lse = xp.where(empty, acc.type(-xp.inf), m + xp.log(total))
    return out.astype(outs[0].dtype), lse
