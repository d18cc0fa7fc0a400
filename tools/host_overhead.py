"""Host time per call on tiny shapes (the target: <= 25 us of Python per attention call).

    PYTHONPATH=. python tools/host_overhead.py            # microseconds per call
    PYTHONPATH=. python tools/host_overhead.py --profile [WORD]  # and a cProfile of a row

Calls are issued back to back without synchronisation, so a row measures the host side
where its GPU work is shorter (a few microseconds for the attention rows; the decode,
packed, key-length and layer rows print the larger of the two).
"""
import cProfile
import pstats
import sys
import time

import cupy as cp
import numpy as np

import cuattn


def per_call_us(fn, n=2000):
    fn()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    cp.cuda.Device().synchronize()
    return (t1 - t0) / n * 1e6


def main():
    q = cp.random.standard_normal((1, 2, 16, 64), dtype=cp.float32).astype(cp.float16)
    x = cp.random.standard_normal((16, 64), dtype=cp.float32)
    mask = cp.ones((16, 16), bool)
    out = cp.empty_like(x)
    # decoding: one query row per head against 2048 keys, split in two key chunks; with
    # four query groups per key head, folded into rows first
    dq = cp.random.standard_normal((1, 32, 1, 1, 64), dtype=cp.float32).astype(cp.float16)
    dk = cp.random.standard_normal((1, 32, 1, 2048, 64), dtype=cp.float32).astype(cp.float16)
    gq = dq.reshape(1, 8, 4, 1, 64)
    gk = dk[:, :8]
    # the ViT-B/16 self-attention layer at batch 1 (x (1, 197, 768), 12 heads, biases)
    lx = cp.random.standard_normal((1, 197, 768), dtype=cp.float32).astype(cp.float16)
    lw = [cp.random.standard_normal((768, 768), dtype=cp.float32).astype(cp.float16) / 28
          for _ in range(4)]
    lb = [cp.zeros(768, cp.float16) for _ in range(4)]
    # 16 packed sequences of 16 rows each; a decoding batch of 16 entries with 16 distinct
    # key lengths (16 dense parts each, run side by side)
    pq = cp.random.standard_normal((1, 2, 256, 64), dtype=cp.float32).astype(cp.float16)
    offsets = np.arange(0, 257, 16)
    kq = cp.random.standard_normal((16, 8, 1, 64), dtype=cp.float32).astype(cp.float16)
    kc = cp.random.standard_normal((16, 8, 512, 64), dtype=cp.float32).astype(cp.float16)
    lengths = np.arange(100, 500, 25)[:, None]
    # the same lengths kept on the device, and a paged cache of 128-row pages read in place
    dlen = cp.asarray(lengths.astype(np.int32))
    pool = cp.ascontiguousarray(kc.reshape(16, 8, 4, 128, 64).transpose(0, 2, 1, 3, 4))
    pool = pool.reshape(64, 8, 128, 64)
    table = cp.arange(64, dtype=cp.int32).reshape(16, 4)
    rows = {
        "attention fp16 (1, 2, 16, 64)": lambda: cuattn.attention(q, q, q),
        "attention fp16 causal + mask": lambda: cuattn.attention(q, q, q, causal=True, mask=mask),
        "attention fp32 (16, 64) portable": lambda: cuattn.attention(x, x, x),
        "decode fp16 H32 Sk2048 (2 chunks)": lambda: cuattn.attention(dq, dk, dk),
        "decode fp16 Hq32 Hk8 Sk2048 (folded)": lambda: cuattn.attention(gq, gk, gk),
        "multi_head_attention fp16 B1 N197 E768": lambda: cuattn.multi_head_attention(
            lx, *lw, num_heads=12, b_q=lb[0], b_k=lb[1], b_v=lb[2], b_o=lb[3]),
        "packed fp16 16 sequences of 16 rows": lambda: cuattn.attention(
            pq, pq, pq, q_offsets=offsets, k_offsets=offsets),
        "k_lengths fp16 B16, 16 distinct lengths": lambda: cuattn.attention(
            kq, kc, kc, k_lengths=lengths),
        "k_lengths fp16 B16, device lengths": lambda: cuattn.attention(
            kq, kc, kc, k_lengths=dlen),
        "paged fp16 B16, device table and lengths": lambda: cuattn.attention(
            kq, pool, pool, k_lengths=dlen, block_table=table),
        "vector_add fp32 1024, out=": lambda: cuattn.vector_add(x, x, out=out),
        "cupy.add fp32 1024, out= (reference)": lambda: cp.add(x, x, out=out),
    }
    from cuattn._checks import check_attention
    parts = {
        "  of which check_attention": lambda: check_attention(q, q, q),
        "  of which one output allocation": lambda: cp.ndarray((1, 2, 16, 64), cp.float16),
    }
    try:  # the peer's host time on the same call, for scale
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        tq = torch.from_dlpack(q)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa(tq, tq, tq)
            torch.cuda.synchronize()
            flash_us = per_call_us(lambda: sdpa(tq, tq, tq))
        peers = {"torch flash (1, 2, 16, 64), no context": flash_us}
    except Exception as exc:  # noqa: BLE001 - no torch: no peer row
        peers = {f"torch flash: {type(exc).__name__}": float("nan")}
    for name, fn in {**rows, **parts}.items():
        print(f"{name:40s} {per_call_us(fn):7.1f} us per call (host, launch included)")
    for name, us in peers.items():
        print(f"{name:40s} {us:7.1f} us per call (host, launch included)")
    if "--profile" in sys.argv:  # --profile [WORD]: the first row whose name has WORD
        at = sys.argv.index("--profile") + 1
        word = sys.argv[at] if at < len(sys.argv) else "attention"
        name = next(n for n in rows if word in n)
        print(f"cProfile of {name}")
        prof = cProfile.Profile()
        prof.enable()
        per_call_us(rows[name])
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
