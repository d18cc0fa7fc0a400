"""Emulate attention_backward_sm90_tf32.cu (the sm90_3xtf32 backward) in NumPy, no GPU: its
one-warpgroup forms (WARPGROUPS = 1; the two-warpgroup forms, written after this tool, were
checked on the GPU instead).

    PYTHONPATH=. python tools/emulate_sm90_f32_backward.py

Shared memory is a flat float array laid out as the kernels lay it out; tiles are written
with the kernels' Sw128 offsets, split (hi, lo; the streamed tiles stacked, lo rows after hi
rows) as they split them, and transposed with transpose_v's thread-to-element mapping. The
wgmma operands are read back the way the hardware reads a K-major 128-byte-swizzled operand
from a descriptor's byte address (rows 128 bytes apart in 1024-byte groups of eight, address
bits 4-6 XOR bits 7-9), which does not use Sw128, with TF32 truncation; register A operands
are rebuilt from the per-lane fragments that tf32_split_fragments makes (the m16n8k8 TF32 A
layout). The overlapped schedule's asynchronous reads happen as late as they may: after the
next tile's preparation, and raw tiles land as soon as they are requested. Every dK/dV and
dQ block of a small problem (no mask, no band) runs, and the gradients are compared with
reference.py's float64 ones: an error near float32 rounding means the kernels' offsets,
buffers, permutations and schedule agree with the hardware's reading; a wrong buffer, lo
offset or key permutation gives errors of the order of the gradients themselves.
"""
import numpy as np

from cuattn.reference import attention_backward_reference, attention_reference

LOG2E = np.log2(np.e)
THREADS = 128


def sw128(rows, row, col):
    """The kernels' Sw128<rows, 4>: float offset of (row, col)."""
    return (col >> 5) * rows * 32 + row * 32 + ((((col >> 2) & 7) ^ (row & 7)) << 2) + (col & 3)


def key_position(n):
    """tf32_key_position."""
    return (n & ~7) | ((n & 1) << 2) | ((n & 7) >> 1)


def split(x):
    """split_tf32: hi rounded to TF32 by add-and-mask, lo the exact remainder."""
    u = np.array([x], np.float32).view(np.uint32)[0]
    hi = np.array([(u + 0x1000) & 0xFFFFE000], np.uint32).view(np.float32)[0]
    return hi, np.float32(np.float32(x) - hi)


def tf32(x):
    """The instruction's reading of float32 data: the low 13 bits ignored."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


class Smem:
    def __init__(self, floats):
        self.m = np.full(floats, np.nan, np.float32)

    def operand(self, start, rows):
        """rows x 8 floats of a K-major 128-byte-swizzled operand at byte address start."""
        out = np.empty((rows, 8), np.float64)
        for r in range(rows):
            for j in range(8):
                a = start + (r // 8) * 1024 + (r % 8) * 128 + j * 4
                a ^= ((a >> 7) & 7) << 4
                out[r, j] = tf32(self.m[a // 4])
        return out

    def load(self, base, rows, cols, src):  # load_tile: zeros past the tensor
        for r in range(rows):
            for c in range(cols):
                ok = r < src.shape[0] and c < src.shape[1]
                self.m[base + sw128(rows, r, c)] = src[r, c] if ok else 0.0

    def split_own(self, tile, rows, cols, lo):  # round_own_tf32 with SPLIT: lo `lo` floats on
        for r in range(rows):
            for c in range(cols):
                o = sw128(rows, r, c)
                self.m[tile + o], self.m[tile + o + lo] = split(self.m[tile + o])

    def split_stacked(self, dst, raw, rows, cols):  # split_stacked: hi rows, then lo rows
        for r in range(rows):
            for c in range(cols):
                self.m[dst + sw128(2 * rows, r, c)], self.m[dst + sw128(2 * rows, rows + r, c)] = \
                    split(self.m[raw + sw128(rows, r, c)])

    def transpose(self, vt, vs, rows, cols):  # transpose_v<rows, cols, THREADS, true>
        warps, kb, cg = THREADS // 32, rows // 16, cols // 8
        wide = warps >= kb
        cs, kstep = (warps // kb, 0) if wide else (1, warps)
        na, nb = cg // cs, 1 if wide else kb // warps
        for tid in range(THREADS):
            warp, lane = tid // 32, tid % 32
            n = (warp % kb) * 16 + lane % 16
            c = (warp // kb if wide else 0) * 8 + 4 * (lane // 16)
            rd, wr = sw128(rows, n, c), [sw128(cols, c + e, key_position(n)) for e in range(4)]
            for a in range(na):
                for b in range(nb):
                    col, row = 8 * cs * a, 16 * kstep * b
                    at_rd = (rd ^ (((col % 32) // 4) << 2)) + (col // 32) * rows * 32 + row * 32
                    for e in range(4):
                        at = wr[e] + col * 32 + (row // 32) * cols * 32
                        self.m[vt + at], self.m[vt + cols * rows + at] = split(
                            self.m[vs + at_rd + e])

    def product_ss(self, acc, a_tile, b_tile, accumulate, b_rows=None):
        """product_ss<N, CONTRACT, float, B_ROWS>: B the first N rows of a B_ROWS-row tile."""
        n = acc.shape[1]
        b_rows = b_rows or n
        if not accumulate:
            acc[:] = 0
        for kk in range(64 // 8):  # CONTRACT = the padded head dim, 64
            col = (kk % 4) * 32
            acc += (self.operand(a_tile + (kk // 4) * 64 * 128 + col, 64)
                    @ self.operand(b_tile + (kk // 4) * b_rows * 128 + col, n).T)

    def product_rs(self, acc, a, z_tile, accumulate):  # product_rs_tf32<N, CONTRACT>
        n = acc.shape[1]
        if not accumulate:
            acc[:] = 0
        for kk in range(a.shape[1] // 8):
            acc += a[:, 8 * kk:8 * kk + 8] @ self.operand(
                z_tile + (kk // 4) * n * 128 + (kk % 4) * 32, n).T

    def stacked_ss(self, acc, a, a_lo, b):  # stacked_product_ss, then stacked_sum
        n = acc.shape[1]
        wide, y = np.zeros((64, 2 * n)), np.zeros(acc.shape)
        self.product_ss(wide, a, b, False)
        self.product_ss(y, a + a_lo, b, False, b_rows=2 * n)
        acc[:] = wide[:, :n] + (wide[:, n:] + y)

    def split_rs(self, acc, frags, z, z_lo):
        hi, lo = frags
        self.product_rs(acc, hi, z + z_lo, False)
        self.product_rs(acc, lo, z, True)
        self.product_rs(acc, hi, z, True)


def fragments(x):
    """tf32_split_fragments of a 64 x K accumulator tile, each part rebuilt as the 64 x K A
    operand the instruction sees: lane (g, t) of warp w holds register e = element FROM[e] of
    its m16n8 accumulators (rows g, g + 8; columns 2t, 2t + 1) and the A layout puts it at
    row g + 8 (e % 2), k = t + 4 (e // 2)."""
    parts = [np.zeros(x.shape), np.zeros(x.shape)]
    from_ = (0, 2, 1, 3)
    for w in range(4):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for kk in range(x.shape[1] // 8):
                for e in range(4):
                    f = from_[e]
                    value = x[16 * w + g + 8 * (f // 2), 8 * kk + 2 * t + f % 2]
                    for part, v in zip(parts, split(value)):
                        part[16 * w + g + 8 * (e % 2), 8 * kk + t + 4 * (e // 2)] = tf32(v)
    return parts


def p_and_ds(s, dp, lse_log2, delta, allowed, scale):
    """p_and_ds_tile without mask, bias or softcap, in float32."""
    prob = np.where(allowed, np.exp2(s.astype(np.float32) * np.float32(scale * LOG2E)
                                     - lse_log2), 0).astype(np.float32)
    return prob, np.where(allowed, prob * (dp.astype(np.float32) - delta), 0).astype(np.float32)


def dkdv_block(q, k, v, dout, lse, delta, n0, scale, overlap, bm=32, hd=64):
    """attention_bwd_dkdv_sm90_3xtf32 for the 64 keys from n0."""
    sq, sk = q.shape[0], k.shape[0]
    ke, qe, tb = 64 * hd, bm * hd, 2 if overlap else 1
    k_s = 0
    v_s = k_s + 2 * ke
    q_raw = v_s + 2 * ke
    do_raw = q_raw + 2 * qe
    q_s = do_raw + 2 * qe
    do_s = q_s + 2 * qe
    qt_s = do_s + 2 * qe
    dot_s = qt_s + tb * 2 * qe
    lse_s = dot_s + tb * 2 * qe
    delta_s = lse_s + 2 * bm
    sm = Smem(delta_s + 2 * bm)
    tiles = -(-sq // bm)
    sm.load(k_s, 64, hd, k[n0:n0 + 64])
    sm.load(v_s, 64, hd, v[n0:n0 + 64])

    def request(t):
        m0, st = t * bm, t & 1
        sm.load(q_raw + st * qe, bm, hd, q[m0:m0 + bm])
        sm.load(do_raw + st * qe, bm, hd, dout[m0:m0 + bm])
        rows = np.arange(m0, m0 + bm)
        inside = rows < sq
        sm.m[lse_s + st * bm:lse_s + (st + 1) * bm] = np.where(
            inside, lse[np.minimum(rows, sq - 1)] * LOG2E, -np.inf)
        sm.m[delta_s + st * bm:delta_s + (st + 1) * bm] = np.where(
            inside, delta[np.minimum(rows, sq - 1)], 0)

    def prepare(t):
        st, buf = t & 1, t & 1 if overlap else 0
        if t + 1 < tiles:
            request(t + 1)
        sm.split_stacked(q_s, q_raw + st * qe, bm, hd)
        sm.split_stacked(do_s, do_raw + st * qe, bm, hd)
        sm.transpose(qt_s + buf * 2 * qe, q_raw + st * qe, bm, hd)
        sm.transpose(dot_s + buf * 2 * qe, do_raw + st * qe, bm, hd)

    request(0)
    sm.split_own(k_s, 64, hd, ke)
    sm.split_own(v_s, 64, hd, ke)
    dk, dv = np.zeros((64, hd)), np.zeros((64, hd))
    prepare(0)
    for t in range(tiles):
        st, buf = t & 1, t & 1 if overlap else 0
        s, dp = np.zeros((64, bm)), np.zeros((64, bm))
        sm.stacked_ss(s, 4 * k_s, 4 * ke, 4 * q_s)
        sm.stacked_ss(dp, 4 * v_s, 4 * ke, 4 * do_s)
        lse_t = sm.m[lse_s + st * bm:lse_s + (st + 1) * bm]
        allowed = ((n0 + np.arange(64))[:, None] < sk) & np.isfinite(lse_t)[None, :]
        p, ds = p_and_ds(s, dp, lse_t[None, :], sm.m[delta_s + st * bm:delta_s + (st + 1) * bm],
                         allowed, scale)
        frag_p, frag_ds = fragments(p), fragments(ds)
        dv_t, dk_t = np.zeros((64, hd)), np.zeros((64, hd))

        def gradient_products(buf=buf, frag_p=frag_p, frag_ds=frag_ds, dv_t=dv_t, dk_t=dk_t):
            sm.split_rs(dv_t, frag_p, 4 * (dot_s + buf * 2 * qe), 4 * qe)
            sm.split_rs(dk_t, frag_ds, 4 * (qt_s + buf * 2 * qe), 4 * qe)

        if not overlap:
            gradient_products()
        if t + 1 < tiles:
            prepare(t + 1)
        if overlap:  # the tensor cores read at the wait, after the next tile's preparation
            gradient_products()
        dv += dv_t
        dk += dk_t
    return dk * scale, dv


def dq_block(q, k, v, dout, lse, delta, m0, scale, overlap, bn, hd=64):
    """attention_bwd_dq_sm90_3xtf32 for the 64 query rows from m0."""
    sq, sk = q.shape[0], k.shape[0]
    qe, ke, tb = 64 * hd, bn * hd, 2 if overlap else 1
    q_s = 0
    do_s = q_s + 2 * qe
    k_raw = do_s + 2 * qe
    v_raw = k_raw + 2 * ke
    k_s = v_raw + 2 * ke
    v_s = k_s + 2 * ke
    kt_s = v_s + 2 * ke
    sm = Smem(kt_s + tb * 2 * ke)
    tiles = -(-sk // bn)
    sm.load(q_s, 64, hd, q[m0:m0 + 64])
    sm.load(do_s, 64, hd, dout[m0:m0 + 64])

    def request(t):
        sm.load(k_raw + (t & 1) * ke, bn, hd, k[t * bn:(t + 1) * bn])
        sm.load(v_raw + (t & 1) * ke, bn, hd, v[t * bn:(t + 1) * bn])

    def prepare(t):
        st, buf = t & 1, t & 1 if overlap else 0
        if t + 1 < tiles:
            request(t + 1)
        sm.split_stacked(k_s, k_raw + st * ke, bn, hd)
        sm.split_stacked(v_s, v_raw + st * ke, bn, hd)
        sm.transpose(kt_s + buf * 2 * ke, k_raw + st * ke, bn, hd)

    request(0)
    sm.split_own(q_s, 64, hd, qe)
    sm.split_own(do_s, 64, hd, qe)
    rows = m0 + np.arange(64)
    lse_log2 = np.where(rows < sq, lse[np.minimum(rows, sq - 1)] * LOG2E, -np.inf)[:, None]
    delta_r = np.where(rows < sq, delta[np.minimum(rows, sq - 1)], 0)[:, None]
    dq = np.zeros((64, hd))
    prepare(0)
    for t in range(tiles):
        buf = t & 1 if overlap else 0
        s, dp = np.zeros((64, bn)), np.zeros((64, bn))
        sm.stacked_ss(s, 4 * q_s, 4 * qe, 4 * k_s)
        sm.stacked_ss(dp, 4 * do_s, 4 * qe, 4 * v_s)
        allowed = (rows < sq)[:, None] & ((t * bn + np.arange(bn)) < sk)[None, :]
        _, ds = p_and_ds(s, dp, lse_log2, delta_r, allowed, scale)
        frag_ds = fragments(ds)
        dq_t = np.zeros((64, hd))

        def gradient_products(buf=buf, frag_ds=frag_ds, dq_t=dq_t):
            sm.split_rs(dq_t, frag_ds, 4 * (kt_s + buf * 2 * ke), 4 * ke)

        if not overlap:
            gradient_products()
        if t + 1 < tiles:
            prepare(t + 1)
        if overlap:
            gradient_products()
        dq += dq_t
    return dq * scale


def main():
    rng = np.random.default_rng(0)
    d = 64
    scale = 1 / np.sqrt(d)
    for sq, sk in ((100, 90), (130, 200)):
        q, k, v, dout = (rng.standard_normal((n, d)).astype(np.float32)
                         for n in (sq, sk, sk, sq))
        out, lse = attention_reference(q, k, v)
        delta = (dout.astype(np.float64) * out).sum(-1)
        want = attention_backward_reference(dout, q, k, v)
        for overlap, bn in ((False, 64), (False, 32), (True, 32)):
            blocks = [dkdv_block(q, k, v, dout, lse, delta, n0, scale, overlap)
                      for n0 in range(0, sk, 64)]
            dk = np.concatenate([b[0] for b in blocks])[:sk]
            dv = np.concatenate([b[1] for b in blocks])[:sk]
            dq = np.concatenate([dq_block(q, k, v, dout, lse, delta, m0, scale, overlap, bn)
                                 for m0 in range(0, sq, 64)])[:sq]
            errs = "  ".join(f"{n} {np.abs(g - w).max():.1e} (of {np.abs(w).max():.2f})"
                             for n, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want))
            print(f"Sq {sq} Sk {sk} overlap={overlap!s:5s} dQ key tile {bn}: max error {errs}",
                  flush=True)


if __name__ == "__main__":
    main()
