"""The NVRTC resource gate (``python -m pytest -m gate``; it needs the ``gate`` extra): every
kernel instance dispatch can pick, for every head dim from 1 to 256 and every feature flag,
compiles without a GPU; the fast ones go through ptxas for sm_80, sm_86 and sm_90 and do not
spill, use no stack frame and keep their warpgroup MMAs unserialized."""
import functools

import pytest

from cuattn._gate import compile_instance, compile_instances, gate_plan

PLAN = gate_plan()


@functools.cache
def _compiled(selected: tuple) -> dict:
    """The instances this run selected, compiled once, one process per core."""
    return dict(zip(selected, compile_instances([(f, e, a, p) for a, f, e, p in selected])))


@pytest.fixture
def resources(request):
    """The compile result of each selected instance (a Resources, or the compile error)."""
    return _compiled(request.config.cuattn_gate_selected)


@pytest.mark.gate
@pytest.mark.parametrize(
    "inst", PLAN, ids=[f"{a}-{'ptx' if p else 'sass'}-{e}" for a, _, e, p in PLAN])
def test_instance_compiles(inst, resources):
    arch, filename, expr, ptx_only = inst
    res = resources[inst]
    if isinstance(res, Exception):
        raise res
    if not ptx_only:  # a fast instance
        assert res.registers > 0
        assert not res.spills, f"{expr} spills on {arch}:\n{res.log}"
        assert res.stack_frame == 0, f"{expr} uses a stack frame on {arch}:\n{res.log}"
        assert not res.wgmma_serialized, f"{expr}: ptxas serialized its wgmma:\n{res.log}"


def test_the_gate_covers_every_head_dim():
    """Every D = Dv from 1 to 256 is among the gate's calls, for every family, so a tile
    class that cannot compile is caught without a GPU."""
    from cuattn._gate import GATE_HEAD_DIMS
    assert set(range(1, 257)) <= set(GATE_HEAD_DIMS)
    exprs = {e for _, _, e, _ in PLAN}
    # the padded classes of the mma family's 16-bit forward, 129-192 among them
    for hd in (64, 128, 192, 256):
        assert any(e.startswith("attention_fwd_mma<__half") and f", {hd}, {hd}, " in e
                   for e in exprs), hd


@pytest.mark.gate
def test_a_compile_error_names_the_file(tmp_path, monkeypatch):
    import shutil

    from cuattn._kernels import kernel_dir
    shutil.copytree(kernel_dir(), tmp_path, dirs_exist_ok=True)
    (tmp_path / "vector_add.cu").write_text((tmp_path / "vector_add.cu").read_text()
                                            + "\nthis is not C++;\n")
    monkeypatch.setenv("CUATTN_KERNEL_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="vector_add.cu"):
        compile_instance("vector_add.cu", "vector_add<float, 4>", "sm_90")
    with pytest.raises(RuntimeError, match="vector_add.cu"):
        compile_instance("vector_add.cu", "vector_add<float, 4>", "sm_90", ptx_only=True)


def test_wgmma_wrappers_match_their_generator(capsys):
    """cuda/sm90/wgmma.cuh is generated (tools/gen_wgmma.py): a hand edit or a stale copy fails."""
    import importlib.util
    from pathlib import Path

    from cuattn._kernels import kernel_dir
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gen_wgmma", root / "tools" / "gen_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.main()
    assert capsys.readouterr().out == (kernel_dir() / "sm90/wgmma.cuh").read_text()


@pytest.mark.gate
def test_parameter_block_layouts_are_the_compilers(tmp_path, monkeypatch):
    """NVRTC agrees with the parameter blocks read from the C++ structs: a kernel copies
    every field of each struct, in order, to out[i] and its size to the last slot; the PTX
    shows at which parameter offset each field is loaded (NVRTC has no offsetof)."""
    import re
    import shutil

    from cuda.bindings import nvrtc

    from cuattn._gate import CUPY_APPENDS, cuda_include_dir
    from cuattn._kernels import kernel_dir, read_source
    from cuattn._params import STRUCT_FILES, block_dtype

    def leaves(dtype, prefix=""):
        for name in dtype.names:
            field, offset = dtype.fields[name][:2]
            if field.names:
                yield from ((p, o + offset, flt) for p, o, flt in leaves(field, f"{prefix}{name}."))
            elif field.subdtype is not None:  # an opaque array (TensorMap): its first word
                yield f"{prefix}{name}.opaque[0]", offset, False
            else:
                yield f"{prefix}{name}", offset, field.kind == "f"

    shutil.copytree(kernel_dir(), tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("CUATTN_KERNEL_DIR", str(tmp_path))
    for struct in STRUCT_FILES:
        dtype = block_dtype(struct)
        fields = list(leaves(dtype))
        body = "".join(f"    out[{i}] = {'__double_as_longlong' if flt else '(long long)'}"
                       f"(p.{name});\n" for i, (name, _, flt) in enumerate(fields))
        source = (read_source(STRUCT_FILES[struct]) + "using namespace cuattn;\n"
                  f'extern "C" __global__ void layout_check(const {struct} p, long long* out) '
                  f"{{\n{body}    out[{len(fields)}] = sizeof({struct});\n}}\n")
        err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"layout_check.cu", 0, [], [])
        opts = [b"-std=c++17", b"-arch=compute_90", *(o.encode() for o in CUPY_APPENDS)]
        if cuda_include_dir():
            opts.append(f"--include-path={cuda_include_dir()}".encode())
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        ptx = b" " * size
        nvrtc.nvrtcGetPTX(prog, ptx)
        nvrtc.nvrtcDestroyProgram(prog)
        assert result == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode()
        ptx = ptx.decode()
        # scalar loads, and vector loads (a 64-byte aligned block has them): register ->
        # offset, each element of a vector 8 (or its size) bytes after the one before
        loads = {}
        for size, regs, at in re.findall(
                r"ld\.param(?:\.v\d)?\.[a-z](\d+)\s+\{?([%\w, ]+)\}?, "
                r"\[layout_check_param_0\+?(\d*)\]", ptx):
            for j, reg in enumerate(r.strip() for r in regs.split(",")):
                loads[reg] = int(at or 0) + j * int(size) // 8
        stores = re.findall(r"st\.global\.\w+\s+\[%\w+\+?(\d*)\], (%?\w+);", ptx)
        consts = dict(re.findall(r"mov\.[us]64\s+(%\w+), (\d+);", ptx))
        seen = {int(at or 0) // 8: value for at, value in stores}
        assert int(consts.get(seen[len(fields)], seen[len(fields)])) == dtype.itemsize, struct
        for i, (name, offset, _) in enumerate(fields):
            assert loads[seen[i]] == offset, f"{struct}.{name}"
