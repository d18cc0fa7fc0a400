"""The dispatch tables, without a GPU: which family and which instance serve a call."""
import ml_dtypes
import numpy as np
import pytest

from cuattn import _dispatch as d
from cuattn import _gate
from cuattn.families import mma_wide, sm90, sm90_3xf16, sm90_tf32
from cuattn.families._common import Request

F16, BF16, F32, F64 = (np.dtype(x) for x in (np.float16, ml_dtypes.bfloat16, np.float32,
                                             np.float64))
H200 = ((9, 0), 232448)
A100 = ((8, 0), 166912)
SM86 = ((8, 6), 101376)


def forward(dtype, head, *, gpu=H200, precision=None, forced=None, bias=None, mask=False):
    cc, smem = gpu
    if precision is None and dtype == F32:
        precision = "highest"
    return d._choose(dtype, head, head, bias, mask, True, cc, smem, forced, None, precision)


def hopper(dtype, head, *, bias=None, mask=False, aligned=True, limit=232448):
    """A family module's request on an H200 (head dims D = Dv)."""
    return Request(dtype, head, head, bias, mask, aligned, (9, 0), limit)


def backward(dtype, head, *, gpu=H200, grads=None, forced=None, tiles=None, precision=None,
             bias=None, has_mask=False):
    cc, smem = gpu
    grads = grads or (dtype, dtype)
    if precision is None and dtype == F32:
        precision = "highest"
    return d._choose_backward(dtype, head, head, bias, has_mask, grads, True, cc, smem, forced,
                              tiles, precision)


def test_forward_families_by_dtype_precision_and_head_dim():
    assert forward(F16, 64).family == "sm90"               # Hopper: wgmma
    assert forward(BF16, 128).family == "sm90"
    wide = forward(BF16, 256)                               # the piped sm90 instance ...
    assert wide.family == "sm90" and wide.tma and wide.fallback.family == "mma"
    assert d._choose(BF16, 256, 256, None, False, False, (9, 0), 232448, None, None,
                     None).family == "mma"                  # ... else beyond the per-block
    assert forward(F16, 64, gpu=A100).family == "mma"      # sm_90a code runs on sm_90 only
    assert forward(F16, 64, gpu=((10, 0), 232448)).family == "mma"
    assert forward(BF16, 512).family == "portable"        # beyond the mma head dims
    assert forward(F32, 128).family == "sm90_3xf16"       # "highest": the split on f16 wgmma
    assert forward(F32, 256).family == "portable"         # beyond sm90_3xf16
    assert forward(F32, 128, gpu=A100).family == "portable"  # "highest" elsewhere
    assert forward(F32, 128, precision="tf32").family == "sm90_tf32"  # Hopper: wgmma
    assert forward(F32, 256, precision="tf32").family == "mma_f32"    # beyond sm90_tf32
    assert forward(F32, 128, gpu=A100, precision="tf32").family == "mma_f32"
    assert forward(F32, 512, precision="tf32").family == "portable"
    assert forward(F64, 64).family == "mma_f64"            # FP64 tensor cores
    assert forward(F64, 64, gpu=A100).family == "mma_f64"
    assert forward(F64, 64, gpu=SM86).family == "portable"  # sm_86 has no FP64 tensor cores
    assert forward(F64, 256).family == "portable"           # beyond the mma_f64 head dims
    assert forward(F16, 64, gpu=((7, 5), 65536)).family == "portable"  # pre-Ampere
    # a forced family that does not serve the call gives no choice (NotImplementedError)
    assert forward(F32, 64, forced="mma_f32") is None     # precision "highest"
    assert forward(F64, 64, forced="mma") is None
    assert forward(F32, 64, forced="sm90", precision="tf32") is None


def test_sm90_tf32_instances_and_shared_memory():
    # float32 "tf32" on Hopper: head dims padded to 64; Q rows, two stages of K, the V
    # staging tile and V^T, all float
    choice = forward(F32, 100, precision="tf32")
    assert choice.family == "sm90_tf32"
    assert choice.name_expression == (
        "attention_fwd_sm90_tf32<cuattn::NoBias, false, 128, 128, 64, 2, true, 1>")
    assert choice.threads == 256 and choice.tiles.block_m == 128
    assert choice.shared_mem == 4 * (128 * 128 + 2 * 64 * 128 + 2 * 64 * 128)
    assert choice.shared_mem == sm90_tf32.sm90_tf32_smem_bytes(sm90.Sm90Tiles(128, 64), 128, 128)
    d64 = forward(F32, 64, precision="tf32")
    assert d64.name_expression.endswith("64, 64, 128, 2, true, 1>")
    assert d64.shared_mem == 4 * (128 * 64 + 2 * 128 * 64 + 2 * 128 * 64)
    assert forward(F32, 64, forced="sm90_tf32") is None  # "highest" is not served
    # the piped instance (K and V^T tile images, a producer warpgroup): three consumer
    # warpgroups (192 rows) and four slots of a 32-key K tile and V^T tile, two barriers each
    piped = choice.prepared
    assert piped.prepare and not choice.prepare and choice.prepare_from == sm90_tf32.PIPED_FROM_D128
    assert piped.name_expression == (
        "attention_fwd_sm90_tf32_piped<cuattn::NoBias, false, 128, 128, 32, 3, 4, false, true>")
    assert piped.threads == 512 and piped.tiles.block_m == 192 and piped.tiles.block_n == 32
    assert piped.shared_mem == 4 * (192 * 128 + 4 * 32 * (128 + 128)) + 16 * 4
    assert piped.shared_mem == sm90_tf32.sm90_piped_smem_bytes(sm90_tf32.PipedTiles(192, 32, 4),
                                                               128, 128)
    assert d64.prepared.name_expression.endswith("64, 64, 64, 3, 4, true, true>")


def test_prepared_operands_from_enough_query_rows():
    # the preparation's fixed cost pays from enough query blocks per key tile; under a band
    # each key tile serves about half of them, so twice the rows
    choice = forward(F32, 128, precision="tf32")
    rows = sm90_tf32.PIPED_FROM_D128
    use = d.with_prepared_operands
    assert use(choice, rows, False) is choice.prepared
    assert use(choice, rows - 1, False) is choice
    assert use(choice, 2 * rows, True) is choice.prepared
    assert use(choice, 2 * rows - 2, True) is choice
    # a piped instance that does not fit is not offered
    tiles = sm90.Sm90Tiles(128, 64, prepare_from=1, piped=sm90_tf32.PipedTiles(192, 32, 4))
    assert sm90_tf32.forward(hopper(F32, 128), tiles).prepared
    assert sm90_tf32.forward(hopper(F32, 128, limit=200000), tiles).prepared is None


def test_sm90_3xf16_forward_instances_and_shared_memory():
    """float32 "highest" on Hopper by default: the split on float16 wgmma after a magnitudes
    kernel; Q (hi, lo) per warpgroup, the stacked split K and V tiles, two raw stages."""
    d64, d128 = forward(F32, 64), forward(F32, 128)
    assert d64.family == d128.family == "sm90_3xf16"
    assert d64.filename == "sm90/attention_sm90_3xf16.cu"
    assert d64.magnitudes == "attention_fwd_magnitudes" and d64.prepared is None
    assert d64.name_expression == (
        "attention_fwd_sm90_3xf16<cuattn::NoBias, false, 64, 64, 64, 2, true, 1>")
    assert d128.name_expression == (
        "attention_fwd_sm90_3xf16<cuattn::NoBias, false, 128, 128, 32, 2, true, 1>")
    assert d64.shared_mem == (2 * 2 * 64 * 64 + 2 * 64 * 128) * 2 + 2 * 64 * 128 * 4
    assert d128.shared_mem == (2 * 2 * 64 * 128 + 2 * 32 * 256) * 2 + 2 * 32 * 256 * 4
    assert forward(F32, 64, forced="sm90_3xf16", precision="tf32") is None
    assert forward(F32, 64, forced="sm90_3xf16", gpu=A100) is None
    assert forward(F32, 256, forced="sm90_3xf16") is None
    assert ("sm90/attention_sm90_3xf16.cu", "attention_fwd_magnitudes", True) in \
        _gate.forward_instances("sm_90")


def test_sm90_piped_instance_where_the_copy_engine_reads_the_inputs():
    """Aligned 16-bit inputs take the piped kernel (tensor maps, a producer warpgroup and
    two consumer warpgroups of 64 rows): Q of both, `stages` slots of a K and a V tile, and
    the barriers (Q's full, each slot's full and empty, Q's empty); its fallback is the
    per-block instance, and unaligned inputs take that one."""
    d128 = forward(BF16, 100)
    assert d128.tma and d128.family == "sm90" and d128.threads == 384
    assert d128.name_expression == (
        "attention_fwd_sm90_piped<__nv_bfloat16, cuattn::NoBias, false, 128, 128, 128, 2>")
    assert d128.tiles.block_m == 128 and d128.tiles.block_n == 128
    assert d128.shared_mem == 2 * (128 * 128 + 2 * 128 * 256) + 8 + 16 * 2 + 8
    assert d128.fallback.name_expression.startswith("attention_fwd_sm90<")
    assert d128.tma_from == sm90.PIPED_MIN_KEYS and forward(BF16, 256).tma_from == 0
    # to head dim 64, or with a bias, the per-block instance unless tiles force it
    for req in (hopper(F16, 64), hopper(F16, 96, bias=F16)):
        assert not sm90.forward(req).tma
    assert sm90.forward(hopper(F16, 128, mask=True)).tma  # where dispatch sees it staged
    assert sm90.forward(hopper(F16, 256, mask=True)).tma
    # a mask and bias staged in each slot: 128 rows of 144 (mask) and 528 bytes (float32
    # bias: 128 keys and a chunk for a misaligned start)
    staged = sm90.forward(hopper(F16, 64, mask=True, bias=np.float32),
                          sm90.Sm90PipedTiles(64, 2))
    assert staged.name_expression == (
        "attention_fwd_sm90_piped<__half, float, true, 64, 64, 64, 2>")
    assert staged.shared_mem == (2 * (128 * 64 + 2 * 64 * 128) + 2 * 128 * (80 + 272) + 8
                                 + 16 * 2 + 8)
    # where the staged tiles do not fit, the softmax reads them from global memory
    d64 = sm90.forward(hopper(F16, 64, mask=True, bias=np.float32), sm90.Sm90PipedTiles(128, 4))
    assert d64.name_expression == (
        "attention_fwd_sm90_piped<__half, float, true, 64, 64, 128, 4, false>")
    assert d64.shared_mem == 2 * (128 * 64 + 4 * 128 * 128) + 8 + 16 * 4 + 8
    wide = sm90.forward(hopper(F16, 256, bias=np.float32))
    assert wide.tma and wide.name_expression.endswith("256, 256, 64, 2, false>")
    assert sm90.forward(hopper(F16, 256, mask=True)).name_expression.endswith(
        "256, 256, 64, 2>")
    assert not sm90.forward(hopper(F16, 64, aligned=False)).tma
    assert sm90.forward(hopper(F16, 64), sm90.Sm90PipedTiles(64, 3)).name_expression.endswith(
        "64, 64, 64, 3>")
    with pytest.raises(NotImplementedError, match="tensor maps"):
        sm90.forward(hopper(F16, 64, aligned=False), sm90.Sm90PipedTiles(64, 3))
    # the table's next tiles where the first do not fit, else the per-block instance
    assert sm90.forward(hopper(F16, 128, limit=150000)).tiles.block_n == 64
    assert not sm90.forward(hopper(F16, 128, limit=90000)).tma


@pytest.mark.parametrize("seqlen_k, causal, piped", [(1024, False, False), (2048, False, True),
                                                     (2048, True, False), (4096, True, True)])
def test_sm90_piped_instance_from_enough_keys(seqlen_k, causal, piped):
    """Up to head dim 128 a call takes the piped instance from PIPED_MIN_KEYS keys (a band
    from twice as many), else its per-block fallback; past 128 at any length."""
    from _hostdev import on_device

    from cuattn._checks import check_attention
    rng = np.random.default_rng(0)
    for head, want in ((128, piped), (256, True)):
        q = on_device(rng.standard_normal((1, 2, 8, head)).astype(np.float16))
        k, v = (on_device(rng.standard_normal((1, 2, seqlen_k, head)).astype(np.float16))
                for _ in range(2))
        choice = d.forward_kernel(check_attention(q, k, v, causal=causal), *H200)
        assert choice.tma == want and choice.family == "sm90"


def test_sm90_instances_and_shared_memory():
    # one warpgroup (128 threads) per 64 query rows; head dims padded to 64; every tile in
    # the 128-byte-swizzle layout: Q rows, `stages` stages of K and V (two by default)
    choice = forward(BF16, 100).fallback
    assert choice.name_expression == (
        "attention_fwd_sm90<__nv_bfloat16, cuattn::NoBias, false, 128, 128, 64, 1, 2, true, 1>")
    assert choice.threads == 128 and choice.tiles.block_m == 64
    assert choice.shared_mem == 2 * (64 * 128 + 2 * 64 * 128 + 2 * 64 * 128)
    two = sm90.forward(hopper(F16, 64, mask=True, aligned=False), sm90.Sm90Tiles(128, 128))
    assert two.name_expression == (
        "attention_fwd_sm90<__half, cuattn::NoBias, true, 64, 64, 128, 2, 2, false, 1>")
    # with a mask, each stage also holds its 128 x 128 mask tile, rows 144 bytes apart (the
    # chunks of 128 keys and one more for a start off a 16-byte boundary)
    assert two.threads == 256 and two.shared_mem == 2 * (128 * 64 + 2 * 128 * 128) + 2 * 128 * 144
    biased = sm90.forward(hopper(F16, 64, bias=np.float32, mask=True), sm90.Sm90Tiles(64, 64))
    assert biased.shared_mem == 2 * (64 * 64 + 2 * 64 * 128) + 2 * 64 * (80 + 272)
    three = sm90.forward(hopper(F16, 64), sm90.Sm90Tiles(64, 64, 3, 4))
    assert three.name_expression.endswith("64, 64, 64, 1, 4, true, 3>")
    assert three.shared_mem == 2 * (64 * 64 + 4 * 64 * 128)
    # the loader builds this file for sm_90a (wgmma), whatever the gate's target
    from cuattn._kernels import nvrtc_options
    assert "-arch=sm_90a" in nvrtc_options("sm_90", "sm90/attention_sm90.cu")
    assert "-arch=sm_90" in nvrtc_options("sm_90", "mma/attention_mma.cu")


def test_mma_f32_instance_pads_head_dims_to_32_and_fits_every_gate_target():
    choice = forward(F32, 40, forced="mma_f32", precision="tf32")
    assert ("attention_fwd_mma_wide<float, cuattn::NoBias, false, 64, 64,"
            in choice.name_expression)
    for gpu in (H200, A100, SM86):
        for head in (32, 64, 128, 256):
            choice = forward(F32, head, gpu=gpu, forced="mma_f32", precision="tf32")
            assert choice.family == "mma_f32" and choice.shared_mem <= gpu[1]
    # the H200's D64 row: 128 rows as 4 warps x 2 row tiles; shared memory is the kernel's
    # Q pair rows (pitch 2 HEAD_DIM + 16 floats) and two stages of K and V
    choice = forward(F32, 64, forced="mma_f32", precision="tf32")
    assert choice.name_expression.endswith(", 64, 64, 64, 4, 2, 1, true>")
    assert choice.threads == 128 and choice.tiles.block_m == 128
    assert choice.shared_mem == 4 * (64 * (2 * 64 + 16) + 2 * 64 * (64 + 8) + 2 * 64 * (64 + 4))
    # the sm_86 row cannot hold those 109 KB and takes the next candidate
    assert forward(F32, 64, gpu=SM86, precision="tf32").tiles.block_m == 64


def test_parameter_blocks_are_filled_by_field_name():
    """A parameter block's dtype is the C++ struct's (read from the sources): fields by
    name, nested strides as tuples, the forward's pointers one run of 8-byte fields."""
    from cuattn._gpu_backward import BACKWARD_SLOTS
    from cuattn._gpu_plan import FORWARD_SLOTS
    from cuattn._launch import _run_of_fields
    from cuattn._params import block_dtype, new_block

    block = new_block("AttnParams", q=1, bias=7, seqlen_q=70, window_right=0, scale=0.125,
                      softcap=30.0, k_s=(1, 2, 3, 4, 5), magnitudes=9)
    assert block.dtype.names[:9] == FORWARD_SLOTS
    assert block.dtype.names[-10:] == ("magnitudes", "packed", "num_packed", "k_lengths_size",
                                       "k_lengths_from", "k_lengths_step", "page_size",
                                       "num_pages", "k_page", "v_page")
    assert int(block["q"]) == 1 and int(block["bias"]) == 7 and int(block["seqlen_q"]) == 70
    assert float(block["scale"]) == 0.125 and float(block["softcap"]) == 30.0
    assert [int(block["k_s"][f]) for f in ("b0", "b1", "b2", "row", "col")] == [1, 2, 3, 4, 5]
    assert int(block["magnitudes"]) == 9 and int(block["v"]) == 0  # the rest zero
    run, offset = _run_of_fields(block.dtype, FORWARD_SLOTS)
    assert (run.size, offset) == (72, 0)
    bwd = new_block("AttnBwdParams", f={"seqlen_k": 5, "q": 3}, dq=11, num_col_tiles=2)
    assert int(bwd["f"]["seqlen_k"]) == 5 and int(bwd["f"]["q"]) == 3 and int(bwd["dq"]) == 11
    assert block_dtype("AttnBwdParams").names[1:6] == BACKWARD_SLOTS
    with pytest.raises(ValueError, match="consecutive"):
        _run_of_fields(block.dtype, ("q", "seqlen_q"))
    with pytest.raises(ValueError):
        new_block("AttnParams", no_such_field=1)


def test_a_struct_edited_in_the_sources_is_followed(tmp_path, monkeypatch):
    """The block layout has one definition, the C++ struct: a copy of the sources with a
    field added (CUATTN_KERNEL_DIR) gives blocks with that field at its place."""
    import shutil

    from cuattn._kernels import kernel_dir
    from cuattn._params import block_dtype
    shutil.copytree(kernel_dir(), tmp_path, dirs_exist_ok=True)
    common = (tmp_path / "common/common.cuh").read_text()
    edited = common.replace("    double scale;", "    long long extra;  // a new field\n"
                                                "    double scale;", 1)
    assert edited != common
    (tmp_path / "common/common.cuh").write_text(edited)
    before = block_dtype("AttnParams")
    monkeypatch.setenv("CUATTN_KERNEL_DIR", str(tmp_path))
    after = block_dtype("AttnParams")
    assert after.itemsize == before.itemsize + 8
    assert after.fields["extra"][1] == before.fields["scale"][1]
    assert block_dtype("AttnBwdParams").fields["dout"][1] == after.itemsize


def test_portable_pipeline_and_16_byte_copies():
    def expr(dtype, head, aligned, gpu=H200):
        cc, smem = gpu
        precision = "highest" if dtype == F32 else None
        return d._choose(dtype, head, head, None, False, aligned, cc, smem, "portable", None,
                         precision).name_expression
    # float32/float64 with the head dim in one chunk: cp.async pipeline, 16-byte copies when
    # the rows are aligned, element copies otherwise
    assert expr(F32, 128, True).endswith(", 1, true, true>")
    assert expr(F32, 128, False).endswith(", 1, true, false>")
    assert expr(F64, 128, True).endswith(", true, true>")
    # float64 to head dim 64 on sm_80+: the warp-tiled form with 64-key tiles in lockstep,
    # 16-byte copies when aligned
    assert expr(F64, 64, True) == \
        "attention_fwd_portable_warps<double, cuattn::NoBias, false, 64, 64, 64, true, true>"
    assert expr(F64, 59, False).endswith("64, 64, 64, false, true>")
    assert expr(F64, 32, True).endswith("32, 32, 64, true, true>")
    # where its 198 KB do not fit but 187 KB do: 32-key tiles in two groups of warps
    assert expr(F64, 64, True, gpu=((9, 0), 195 * 1024)).endswith("64, 64, 32, true, false>")
    assert expr(F64, 64, True, gpu=((7, 5), 65536)).startswith("attention_fwd_portable<")
    # 16-bit inputs convert on load, and Q beyond one chunk is not pipelined
    assert expr(F16, 128, True).endswith(", false, false>")
    assert expr(F32, 512, True).endswith(", false, false, true>")  # four chunks: CHUNKED
    # before sm_80 there is no cp.async
    assert expr(F32, 64, True, gpu=((7, 5), 65536)).endswith(", false, false>")
    # the H200 gets the swept 128x64 (D128) and 128x128 (D64) float32 tiles
    assert "attention_fwd_portable<float, cuattn::NoBias, false, 128, 64, 128, 128," in \
        expr(F32, 128, True)
    assert "attention_fwd_portable<float, cuattn::NoBias, false, 128, 128, 64, 64," in \
        expr(F32, 64, True)


def test_families_serve_their_compute_capabilities():
    f64 = next(f for f in d.FAMILIES if f.name == "mma_f64")
    assert f64.serves((8, 0)) and f64.serves((9, 0)) and f64.serves((10, 0))
    assert not f64.serves((8, 6)) and not f64.serves((8, 9)) and not f64.serves((12, 0))
    mma = next(f for f in d.FAMILIES if f.name == "mma")
    assert mma.serves((8, 6)) and mma.serves((12, 0)) and not mma.serves((7, 5))


def test_mma_f64_instances_fit_the_gpus_with_fp64_tensor_cores():
    choice = forward(F64, 40)
    assert ("attention_fwd_mma_wide<double, cuattn::NoBias, false, 64, 64,"
            in choice.name_expression)
    for gpu in (H200, A100):
        for head in (32, 64, 96, 128):
            choice = forward(F64, head, gpu=gpu)
            assert choice.family == "mma_f64" and choice.shared_mem <= gpu[1]
            # the kernel's pitches: Q pair rows (two rows interleaved) 2 HEAD_DIM + 2, K rows
            # HEAD_DIM + 8, V rows HEAD_DIM_V + 2 doubles
            t = choice.tiles
            assert choice.shared_mem == 8 * (t.block_m // 2 * (2 * t.d_tile + 2) + 2 * t.block_n * (
                t.d_tile + 8) + 2 * t.block_n * (t.dv_tile + 2))


def test_backward_families_and_tiles():
    assert backward(BF16, 64).family == "sm90"             # Hopper: wgmma
    d128 = backward(BF16, 128)                               # 64-query dK/dV tiles at D128
    assert d128.family == "sm90" and ", 128, 128, 64, true, 1, false, true>" in d128.dkdv
    assert backward(BF16, 256).family == "mma"             # beyond the sm90 backward's head dims
    assert backward(F16, 64, gpu=A100).family == "mma"
    choice = backward(BF16, 64, forced="mma")
    assert choice.family == "mma" and choice.filename == "mma/attention_backward_mma.cu"
    assert choice.delta == "attention_bwd_delta<__nv_bfloat16>"
    # the H200 row caps both kernels at 3 blocks per SM; the sm_8x row does not cap dK/dV
    assert choice.dkdv.endswith(", 32, 4, true, 3>") and choice.dq.endswith(", 32, 4, true, 3>")
    assert backward(BF16, 64, gpu=A100).dkdv.endswith(", 32, 4, true, 2>")
    assert backward(F16, 128, gpu=SM86).smem_dkdv <= SM86[1]
    assert backward(F32, 64).family == "sm90_3xf16"       # "highest": the split on f16 wgmma
    assert backward(F32, 128).family == "sm90_3xf16"
    assert backward(F32, 256).family == "portable"         # beyond its head dims
    assert backward(F32, 64, gpu=A100).family == "portable"  # "highest" elsewhere
    assert backward(F32, 128, precision="tf32").family == "mma_f32"
    assert backward(F32, 128, gpu=A100, precision="tf32").family == "mma_f32"
    assert backward(F32, 256, precision="tf32").family == "portable"
    assert backward(F64, 1024).family == "portable"
    assert backward(F16, 512).family == "portable"


def test_portable_backward_rounds_as_a_tf32_forward():
    """A "tf32" call that a TF32 family served forward (to D 256 on sm_80+) has its scores
    recomputed by the portable backward from TF32 operands, so that P = exp(s - lse)
    matches the forward's lse; past D 256, or below sm_80, the portable forward served it
    in float32, and so does the backward."""
    def tf32(head, gpu=H200):
        return d.tf32_forward(F32, head, head, None, False, True, gpu[0], gpu[1])

    assert tf32(64) and tf32(256) and tf32(200, gpu=A100)
    assert not tf32(257) and not tf32(512) and not tf32(64, gpu=((7, 5), 65536))
    assert not d.tf32_forward(F32, 64, 64, None, False, True, (9, 0), H200[1], "portable")
    rounded = d._choose_backward(F32, 200, 200, None, False, (F32, F32), True, *H200, None,
                                 None, "tf32", True)
    assert rounded.family == "portable"
    assert rounded.dkdv.endswith(", true>") and rounded.dq.endswith(", true>")
    plain = backward(F32, 200, precision="tf32")
    assert not plain.dkdv.endswith(", true>") and "TF32" not in plain.dkdv


def test_forced_backward_takes_the_forward_of_dispatch(monkeypatch):
    """A backward forced by kernel= (the tests' default forward, then one family's
    backward) rounds as dispatch's TF32 forward did; CUATTN_KERNEL forces both, so the
    portable forward's float32 scores are recomputed unrounded."""
    from _hostdev import on_device

    from cuattn._checks import check_attention
    rng = np.random.default_rng(0)
    q, k, v = (on_device(rng.standard_normal((1, 2, 64, 200)).astype(np.float32))
               for _ in range(3))
    call = check_attention(q, k, v, precision="tf32")
    grads = (F32, F32)
    monkeypatch.delenv("CUATTN_KERNEL", raising=False)
    forced = d.backward_kernels(call, *H200, grads, q, kernel="portable")
    assert forced.family == "portable" and forced.dkdv.endswith(", true>")
    monkeypatch.setenv("CUATTN_KERNEL", "portable")
    both = d.backward_kernels(call, *H200, grads, q)
    assert both.family == "portable" and not both.dkdv.endswith(", true>")


def test_sm90_3xf16_backward_instances_and_shared_memory():
    """The split on float16 wgmma serves float32 "highest" to head dim 128 on sm_90, after a
    magnitudes kernel; at 128 the two warpgroups of a 64-key block compute dV and dK."""
    choice = backward(F32, 64, forced="sm90_3xf16")
    assert choice.family == "sm90_3xf16"
    assert choice.filename == "sm90/attention_backward_sm90_3xf16.cu"
    assert choice.magnitudes == "attention_bwd_magnitudes"
    assert choice.delta == "attention_bwd_delta<float>"
    flags = "cuattn::NoBias, false, 64, 64"
    # the second warpgroup's score products staggered behind the first's (true, last)
    assert choice.dkdv == f"attention_bwd_dkdv_sm90_3xf16<{flags}, 32, true, 1, true, 2, 1, true>"
    assert choice.dq == f"attention_bwd_dq_sm90_3xf16<{flags}, 64, true, 1, true, 2, true>"
    assert (choice.dkdv_rows, choice.dq_rows, choice.dkdv_roles) == (128, 128, 1)
    assert (choice.threads_dkdv, choice.threads_dq) == (256, 256)
    # the .cu header: K, V (hi, lo: float16) of both warpgroups, two raw float stages of the
    # streamed tiles, two buffers of their stacked split tiles, lse and delta
    assert (choice.smem_dkdv, choice.smem_dq) == (
        2 * 2 * 64 * 128 * 2 + 2 * 32 * 128 * 4 + 2 * 2 * 32 * 128 * 2 + 2 * 2 * 32 * 4,
        2 * 2 * 64 * 128 * 2 + 2 * 64 * 128 * 4 + 2 * 2 * 64 * 128 * 2)
    wide = backward(F32, 128, forced="sm90_3xf16")
    flags = "cuattn::NoBias, false, 128, 128"
    assert wide.dkdv == f"attention_bwd_dkdv_sm90_3xf16<{flags}, 32, true, 1, true, 2, 3, true>"
    assert (wide.dkdv_roles, wide.dkdv_rows, wide.col_tile) == (1, 64, 128)
    # one 64-key set of K and V (hi, lo), two raw stages and two split buffers of Q and dO,
    # lse and delta, and the P^T that warpgroup 0 hands to warpgroup 1 (64 keys x 32 queries)
    assert wide.smem_dkdv == (2 * 64 * 256 * 2 + 2 * 32 * 256 * 4 + 2 * 2 * 32 * 256 * 2
                              + 2 * 2 * 32 * 4 + 64 * 32 * 4)
    roles = backward(F32, 128, forced="sm90_3xf16",
                     tiles=sm90_3xf16.Sm90F16SplitBwdTiles(32, 32, dkdv_warpgroups=2, dkdv_roles=2))
    assert (roles.dkdv_roles, roles.dkdv_rows) == (2, 128)
    assert max(wide.smem_dkdv, wide.smem_dq) <= H200[1]
    assert backward(F32, 64, forced="sm90_3xf16", precision="tf32") is None
    assert backward(F32, 256, forced="sm90_3xf16") is None
    assert backward(F32, 64, forced="sm90_3xf16", gpu=A100) is None
    instances = [e for f, e, _ in _gate.backward_instances("sm_90")
                 if f == "sm90/attention_backward_sm90_3xf16.cu"]
    assert "attention_bwd_magnitudes" in instances


@pytest.mark.parametrize("head,cols,tiles", [(64, 64, 1), (128, 128, 1), (192, 64, 3),
                                             (256, 128, 2)])
def test_mma_backward_column_tiles_divide_the_padded_head_dim(head, cols, tiles):
    choice = backward(F16, head, forced="mma")
    assert choice.col_tile == cols and -(-head // choice.col_tile) == tiles
    assert f", {cols}, " in choice.dkdv


def test_broadcast_gradients_are_written_in_the_accumulator_type():
    choice = backward(F16, 64, grads=(F32, F16), forced="mma")
    assert choice.dkdv.startswith("attention_bwd_dkdv_mma<__half, float,")
    assert choice.dq.startswith("attention_bwd_dq_mma<__half, __half,")
    choice = backward(F16, 64, grads=(F32, F16))
    assert choice.dkdv.startswith("attention_bwd_dkdv_sm90<__half, float,")
    assert choice.dq.startswith("attention_bwd_dq_sm90<__half, __half,")
    choice = backward(F64, 64, grads=(F64, F64))
    assert choice.dkdv.startswith("attention_bwd_dkdv<double, double,")


def test_every_backward_candidate_fits_its_gpu():
    for gpu in (H200, A100, SM86):
        for dtype, precision in ((F16, None), (BF16, None), (F32, "highest"), (F32, "tf32"),
                                 (F64, None)):
            for head in (32, 64, 128, 256, 1024):
                choice = backward(dtype, head, gpu=gpu, precision=precision)
                assert max(choice.smem_dkdv, choice.smem_dq) <= gpu[1]


def test_mma_f32_backward_instances_and_shared_memory():
    # "tf32" at D64: one block computes dK and dV; K and V in fragment order, two stages of
    # Q, dO (pitch D + 4), each rounded to TF32 once in place, lse and delta
    choice = backward(F32, 40, precision="tf32", gpu=A100)
    assert choice.family == "mma_f32" and choice.filename == "mma/attention_backward_mma_f32.cu"
    assert choice.dkdv == ("attention_bwd_dkdv_mma_f32<cuattn::NoBias, false, 64, 64, 32, 4, "
                           "true, true, 2>")
    assert choice.dq == ("attention_bwd_dq_mma_f32<cuattn::NoBias, false, 64, 64, 32, 4, true, "
                         "true, 3>")
    assert choice.delta == "attention_bwd_delta<float>" and choice.dkdv_roles == 1
    assert choice.smem_dkdv == (64 * 128 + 2 * 32 * (128 + 8) + 2 * 2 * 32) * 4
    assert choice.smem_dq == (64 * 128 + 2 * 32 * (128 + 8)) * 4
    # D128: 16-query and 16-key tiles, rounded in place
    choice = backward(F32, 128, precision="tf32")
    assert choice.dkdv_roles == 1 and ", 16, 4, true, true, 2>" in choice.dkdv
    assert choice.smem_dq == (64 * 256 + 2 * 16 * (256 + 8)) * 4
    # the fallback tiles read the streamed tiles as stored and round them per use
    choice = backward(F32, 64, precision="tf32", tiles=mma_wide.MmaF32BwdTiles(4, 16, 4, 16, 2, 3))
    assert choice.dkdv.endswith(", 16, 4, false, true, 2>")


def test_sm90_backward_instances_and_shared_memory():
    # the table's two kernels: one warpgroup of 64 keys (dK/dV) or 64 query rows (dQ), all
    # columns in one block (64-query tiles in dK/dV; at D64 dK/dV capped at 2 blocks per SM,
    # dQ at 3, both overlapped: three stages of the streamed tiles; dK/dV loads lse and delta
    # a request ahead)
    choice = backward(BF16, 40)
    assert choice.dkdv == ("attention_bwd_dkdv_sm90<__nv_bfloat16, __nv_bfloat16, "
                           "cuattn::NoBias, false, 64, 64, 64, true, 2, true, true>")
    assert choice.dq == ("attention_bwd_dq_sm90<__nv_bfloat16, __nv_bfloat16, "
                         "cuattn::NoBias, false, 64, 64, 64, true, 3, true>")
    assert choice.threads_dkdv == choice.threads_dq == 128
    assert choice.dkdv_rows == choice.dq_rows == 64 and choice.col_tile == 64
    assert choice.smem_dkdv == (64 * 128 + 3 * 64 * 128) * 2 + 3 * 2 * 64 * 4
    assert choice.smem_dq == (64 + 3 * 64) * 128 * 2
    # without the overlap: two stages
    choice = backward(BF16, 40, tiles=sm90.Sm90BwdTiles(64, 64, 2, 3))
    assert choice.dkdv.endswith(", 64, true, 2, false>") and choice.dq.endswith(", 3, false>")
    assert choice.smem_dkdv == (64 * 128 + 2 * 64 * 128) * 2 + 2 * 2 * 64 * 4
    assert choice.smem_dq == (64 + 2 * 64) * 128 * 2
    # lse and delta loaded when used (explicit tiles): the name keeps the template's default,
    # the shared memory is the same
    plain = backward(BF16, 64, tiles=sm90.Sm90BwdTiles(64, 64, 2, 3, dkdv_overlap=True,
                                                    dq_overlap=True))
    assert plain.dkdv.endswith(", 64, 64, 64, true, 2, true>")
    assert plain.dq.endswith(", 64, true, 3, true>")
    assert plain.smem_dkdv == (64 * 128 + 3 * 64 * 128) * 2 + 3 * 2 * 64 * 4
    assert backward(BF16, 64).dkdv.endswith(", 64, 64, 64, true, 2, true, true>")
    assert backward(BF16, 128).dkdv.endswith(", 128, 128, 64, true, 1, false, true>")
    # ... without a mask and a bias only (the table's; explicit tiles are taken as given)
    assert backward(BF16, 64, has_mask=True).dkdv.endswith(", 64, true, 2, true>")
    assert backward(BF16, 128, bias=BF16).dkdv.endswith(", 64, true, 1, false>")
    assert backward(BF16, 64, has_mask=True, tiles=sm90.Sm90BwdTiles(
        64, 64, 2, 3, dkdv_overlap=True, dq_overlap=True,
        dkdv_stats_ahead=True)).dkdv.endswith(", 2, true, true>")
    from cuattn._kernels import nvrtc_options
    assert "-arch=sm_90a" in nvrtc_options("sm_90", "sm90/attention_backward_sm90.cu")


def _cpp_signatures() -> dict:
    """Template parameter names of every __global__ template in cuda/, by kernel name."""
    import re

    from cuattn._kernels import kernel_dir
    pattern = re.compile(r"template\s*<([^<>]*)>\s*__global__\s+void\s+"
                         r"(?:__launch_bounds__\([^()]*(?:\([^()]*\))?[^()]*\)\s*)?(\w+)\s*\(")
    found = {}
    for path in kernel_dir().rglob("*.cu*"):
        for params, name in pattern.findall(path.read_text()):
            names = tuple(p.split("=")[0].split()[-1] for p in params.split(","))
            defaults = tuple(p.split("=")[0].split()[-1] for p in params.split(",") if "=" in p)
            found[name] = (names, defaults)
    return found


def test_template_signatures_name_the_cpp_parameters():
    """Each family's Kernel lists the C++ template's parameters by name, in order: a
    reordered or renamed parameter in a .cu file fails here, not at run time."""
    import importlib
    import pkgutil

    import cuattn.families
    from cuattn.families._common import Kernel
    cpp = _cpp_signatures()
    kernels = {}
    for info in pkgutil.iter_modules(cuattn.families.__path__):
        module = importlib.import_module(f"cuattn.families.{info.name}")
        kernels.update({k.name: k for k in vars(module).values() if isinstance(k, Kernel)})
    # every attention template is named; the utility kernels build their names in
    # cuattn/elementwise.py, cuattn/cache.py and cuattn/merge.py
    assert set(cpp) - set(kernels) == {"vector_add", "kv_cache_append", "merge_parts"}
    for name, kernel in kernels.items():
        assert name in cpp, f"{name}: no such __global__ template in cuda/"
        params, defaults = cpp[name]
        assert kernel.params == params, name
        assert set(kernel.defaults) <= set(defaults), name


def test_a_template_signature_takes_every_parameter_by_name():
    from cuattn.families._common import Kernel
    k = Kernel("f", "T HAS_MASK N LAST", defaults={"LAST": False})
    assert k(T=F16, HAS_MASK=True, N=64, LAST=False) == "f<__half, true, 64>"
    assert k(T=BF16, HAS_MASK=False, N=8, LAST=True) == "f<__nv_bfloat16, false, 8, true>"
    with pytest.raises(TypeError, match="missing"):
        k(T=F16, HAS_MASK=True, N=64)
    with pytest.raises(TypeError, match="unknown"):
        k(T=F16, HAS_MASK=True, N=64, LAST=True, EXTRA=1)


def test_shared_memory_layouts_header_is_generated_from_the_families(capsys):
    """cuda/common/layouts.cuh is written by tools/gen_layouts.py from the Layout descriptions that
    dispatch sizes shared memory with: a hand edit or a stale copy fails here."""
    import importlib.util
    from pathlib import Path

    from cuattn._kernels import kernel_dir
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gen_layouts", root / "tools" / "gen_layouts.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.main()
    assert capsys.readouterr().out == (kernel_dir() / "common/layouts.cuh").read_text()


def test_a_layout_is_evaluated_as_its_cpp_text_reads():
    from cuattn.families._layout import Layout, to_cpp
    layout = Layout("L", "typename T, int N, bool TWO", (
        ("a", "T", "N * 2 if TWO else N"),
        ("b", "float", "max(N, 3) + side_pitch(2, N) // 16"),
    ))
    assert layout.offsets(T=8, N=5, TWO=True) == {"a": 0, "b": 80, "BYTES": 80 + 4 * (5 + 1)}
    assert layout.bytes(T=2, N=1, TWO=False) == 2 + 4 * (3 + 1)
    assert to_cpp("N * 2 if TWO else N // T_SIZE", ("T",)) == \
        "(TWO ? (N * 2) : (N / (int)sizeof(T)))"
    assert "b = a + (long long)sizeof(T) * (TWO ? (N * 2) : N)," in layout.cpp()
    with pytest.raises(TypeError):
        layout.bytes(T=2, N=1)


def test_piped_plan_encodes_tensor_maps_on_host_memory(monkeypatch):
    """The piped kernel's plan, through a CuPy stand-in on host memory: q, k and v become
    rank-5 tensor maps (head dim, sequence, batch axes 2, 1, 0; a broadcast axis has extent
    1) in the parameter block, encoded again only for new addresses; where the driver
    refuses a map, the plan takes the per-block instance. Both equal the reference."""
    from _accuracy import assert_accurate
    from _hostdev import fake_gpu

    import cuattn
    from cuattn.reference import attention_reference, naive_attention

    arrays, launches = [], []
    device = fake_gpu(monkeypatch, arrays, launches, np.float16)
    rng = np.random.default_rng(5)

    def inputs(sk=2048):
        host = [rng.standard_normal(shape).astype(np.float16)
                for shape in ((2, 3, 100, 128), (2, 1, sk, 128), (2, 1, sk, 128))]
        dev = [x.copy().view(device) for x in host]
        arrays.extend(dev)
        return host, dev

    def run(host, dev):
        launches.clear()
        out = cuattn.attention(*dev)
        assert_accurate(out, attention_reference(*host)[0], naive_attention(*host))
        return [fn for fn, *_ in launches]

    host, dev = inputs()
    assert run(host, dev) == [
        "attention_fwd_sm90_piped<__half, cuattn::NoBias, false, 128, 128, 128, 2>"]
    q, k, v = dev
    # batch axes (2, 3): k broadcasts along the second, so the kernel keeps both
    assert device.maps == [
        (q.data.ptr, (128, 100, 3, 2, 1), (256, 100 * 256, 3 * 100 * 256, 16), (64, 64, 1, 1, 1)),
        (k.data.ptr, (128, 2048, 1, 2, 1), (256, 16, 2048 * 256, 16), (64, 128, 1, 1, 1)),
        (v.data.ptr, (128, 2048, 1, 2, 1), (256, 16, 2048 * 256, 16), (64, 128, 1, 1, 1))]
    run(host, dev)  # the same addresses: the block still holds their maps
    assert len(device.maps) == 3
    host, dev = inputs()
    run(host, dev)
    assert [m[0] for m in device.maps[3:]] == [x.data.ptr for x in dev]
    new_q = rng.standard_normal((2, 3, 100, 128)).astype(np.float16)  # a new q only
    dev[0] = new_q.copy().view(device)
    arrays.append(dev[0])
    run([new_q] + host[1:], dev)
    assert [m[0] for m in device.maps[6:]] == [dev[0].data.ptr]
    device.map_result = 1  # CUDA_ERROR_INVALID_VALUE: a new signature takes the fallback
    host, dev = inputs(sk=2100)
    assert run(host, dev) == [
        "attention_fwd_sm90<__half, cuattn::NoBias, false, 128, 128, 64, 1, 2, true, 1>"]


def test_persistent_piped_plan_takes_a_block_per_sm(monkeypatch):
    """Persistent piped tiles name the PERSISTENT instance, which launches a block per SM
    (8 in the stand-in) at most and reads the call's work units (128-row query blocks x
    batch entries) from its parameter block; the result equals the reference, as the
    per-unit grid's does."""
    from _accuracy import assert_accurate
    from _hostdev import Memory, emulate_forward, fake_gpu

    from cuattn.attention import _attention
    from cuattn.reference import attention_reference, naive_attention

    arrays, launches, seen = [], [], []
    forward = emulate_forward(Memory(arrays), np.float16)

    def record(block, pointers, grid):
        seen.append((grid[0], int(block["units"])))
        forward(block, pointers, grid)

    device = fake_gpu(monkeypatch, arrays, launches, np.float16,
                      {"attention_fwd_sm90_piped": record})
    rng = np.random.default_rng(6)
    host = [rng.standard_normal(shape).astype(np.float16)
            for shape in ((2, 3, 300, 128), (2, 3, 500, 128), (2, 3, 500, 128))]
    dev = [x.copy().view(device) for x in host]
    arrays.extend(dev)
    want = attention_reference(*host, causal=True)[0]
    for persistent, grid in ((True, 8), (False, 18)):
        tiles = sm90.Sm90PipedTiles(128, 2, persistent=persistent)
        out = _attention(*dev, causal=True, tiles=tiles)
        assert_accurate(out, want, naive_attention(*host, causal=True))
        assert seen.pop() == (grid, 3 * 6)  # ceil(300 / 128) query blocks x 6 entries
        assert launches[-1][0] == ("attention_fwd_sm90_piped<__half, cuattn::NoBias, false, "
                                   f"128, 128, 128, 2{', true, false, true' * persistent}>")
    assert sm90.forward(hopper(F16, 64), sm90.Sm90PipedTiles(
        128, 4, overlap=True, persistent=True)).name_expression.endswith(
        "64, 64, 128, 4, true, true, true>")


def test_piped_instance_takes_a_mask_it_stages():
    """Past head dim 64, from PIPED_MIN_KEYS keys, a masked call takes the piped instance
    where its producer stages the mask's tiles: rows 16 bytes apart, or one row for every
    query. A mask read from global memory (other strides), a bias, or head dim 64 takes the
    per-block instance."""
    from _hostdev import on_device

    from cuattn._checks import check_attention

    def choice(head, mask, keys=2048, **kw):  # arrays with the .data.ptr dispatch reads
        q, k = (on_device(np.zeros((1, 2, n, head), np.float16)) for n in (64, keys))
        return d.forward_kernel(check_attention(q, k, k, mask=mask, **kw), (9, 0), 232448)

    full = np.ones((1, 1, 64, 2048), bool)
    assert choice(128, full).tma and not choice(128, full, causal=True).tma  # a band: 4096
    assert choice(128, np.ones(2048, bool)).tma  # one row for every query
    assert not choice(128, np.ones((1, 1, 64, 2049), bool)[..., :2048]).tma  # 2049 apart
    assert not choice(128, np.ones((2048, 64), bool).T).tma  # column stride 64
    assert not choice(128, np.ones((64, 1), bool)).tma  # one column for every key
    assert not choice(128, full, bias=np.zeros((64, 2048), np.float16)).tma
    assert not choice(64, full).tma
    assert not choice(128, full[..., :1024], keys=1024).tma
