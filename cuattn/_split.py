"""Split-key forward: calls whose grid would leave most SMs idle (decoding: a few query rows
against many keys, in few batch entries) cut their keys into chunks that become one more
batch axis of the same launch, and merge the chunks' partial results.

The first ``n - 1`` chunks hold ``L = Sk // n`` keys each and are one launch over the
views ``k[..., :(n-1) L, :]`` reshaped to ``(..., n - 1, L, D)`` (q broadcast over the new
axis); the last chunk, the remaining keys, is a second launch that keeps the causal band,
which the earlier chunks lie wholly inside (see :func:`split_count`). Both write their
outputs into one ``(..., n, Sq, Dv)`` buffer, and :func:`cuattn.merge_attention` combines
the n parts in order (one kernel launch on CuPy), so the result is deterministic. The
partial outputs are rounded to the input dtype before the merge rounds once more.
"""
from __future__ import annotations

import math

from ._checks import AttentionCall, check_attention

__all__ = ["split_count", "forward"]

#: fewest keys per chunk: shorter chunks cost more in merging than they gain in blocks
MIN_CHUNK = 1024
#: most chunks: the parts one merge launch combines (cuda/merge.cu)
MAX_CHUNKS = 8
#: query rows per block that the count of blocks assumes (the forward tiles' BLOCK_M)
ROWS_PER_BLOCK = 64


def split_count(call: AttentionCall, sm_count: int) -> int:
    """How many key chunks a call runs in (1: no split). Only calls whose blocks would fill
    under half of the SMs, without mask or bias, and without a left window bound, with
    enough keys for two chunks of MIN_CHUNK; the last chunk must hold the rows' causal or
    right-window band, so every earlier key is seen by every row."""
    if call.mask is not None or call.bias is not None or call.window_left >= 0:
        return 1
    blocks = math.prod(call.batch_shape) * -(-call.seqlen_q // ROWS_PER_BLOCK)
    if blocks == 0 or 2 * blocks > sm_count:
        return 1
    n = min(MAX_CHUNKS, -(-2 * sm_count // blocks), call.seqlen_k // MIN_CHUNK)
    if n < 2:
        return 1
    tail = call.seqlen_k - (n - 1) * (call.seqlen_k // n)
    if call.window_right >= 0 and tail < call.seqlen_q - call.window_right:
        return 1
    return n


def forward(call: AttentionCall, n: int, run):
    """``(out, lse)`` of a validated call in ``n`` key chunks; ``run(call)`` computes a
    validated call's ``(out, lse)`` without splitting it again."""
    from .merge import merge_attention
    xp = call.xp
    sq, sk = call.seqlen_q, call.seqlen_k
    width = sk // n
    head = (n - 1) * width  # keys of the first n - 1 chunks
    batch = call.batch_shape
    buf = xp.empty(batch + (n, sq, call.head_dim_v), call.dtype)
    common = dict(call.keywords(), return_lse=True)

    def chunked(x):  # (..., Sk, D) -> (..., n - 1, L, D): a view
        return x[..., :head, :].reshape(x.shape[:-2] + (n - 1, width, x.shape[-1]))

    # every row sees every key of the first chunks (split_count): no band there
    first = check_attention(call.q[..., None, :, :], chunked(call.k), chunked(call.v),
                            out=buf[..., :n - 1, :, :], **common)
    _, lse_first = run(first)
    right = call.window_right if call.window_right >= 0 else None
    last = check_attention(call.q, call.k[..., head:, :], call.v[..., head:, :],
                           window=None if right is None else (None, right),
                           out=buf[..., n - 1, :, :], **common)
    _, lse_last = run(last)
    out, lse = merge_attention([buf[..., i, :, :] for i in range(n)],
                               [lse_first[..., i, :] for i in range(n - 1)] + [lse_last])
    if call.out is not None:
        call.out[...] = out
        out = call.out
    return out, lse
