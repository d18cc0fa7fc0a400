"""The NVRTC resource gate: every kernel instance that dispatch can pick compiles for sm_80
and sm_90 without a GPU, and the fast ones do not spill, use no stack frame and keep their
warpgroup MMAs unserialized."""
import functools

import pytest

from cuattn._dispatch import GATE_TARGETS
from cuattn._gate import compile_instance, compile_instances, gate_instances

INSTANCES = [(arch, *inst) for arch in GATE_TARGETS for inst in gate_instances(arch)]


@functools.cache
def _compiled(selected: tuple) -> dict:
    """The instances this run selected, compiled once, one process per core (CI has two:
    one at a time took most of CI's time)."""
    return dict(zip(selected, compile_instances([(f, e, a) for a, f, e, _ in selected])))


@pytest.fixture
def resources(request):
    """The compile result of each selected instance (a Resources, or the compile error)."""
    selected = tuple(item.callspec.params.get("inst") for item in request.session.items
                     if item.originalname == "test_instance_compiles_without_spills")
    return _compiled(selected)


@pytest.mark.parametrize("inst", INSTANCES, ids=[f"{a}-{e}" for a, _, e, _ in INSTANCES])
def test_instance_compiles_without_spills(inst, resources):
    arch, filename, expr, fast = inst
    res = resources[inst]
    if isinstance(res, Exception):
        raise res
    assert res.registers > 0
    if fast:
        assert not res.spills, f"{expr} spills on {arch}:\n{res.log}"
        assert res.stack_frame == 0, f"{expr} uses a stack frame on {arch}:\n{res.log}"
        assert not res.wgmma_serialized, f"{expr}: ptxas serialized its wgmma:\n{res.log}"


def test_a_compile_error_names_the_file(tmp_path, monkeypatch):
    import shutil

    from cuattn._kernels import kernel_dir
    for f in kernel_dir().iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "vector_add.cu").write_text((tmp_path / "vector_add.cu").read_text()
                                            + "\nthis is not C++;\n")
    monkeypatch.setenv("CUATTN_KERNEL_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="vector_add.cu"):
        compile_instance("vector_add.cu", "vector_add<float, 4>", "sm_90")


def test_wgmma_wrappers_match_their_generator(capsys):
    """cuda/wgmma.cuh is generated (tools/gen_wgmma.py): a hand edit or a stale copy fails."""
    import importlib.util
    from pathlib import Path

    from cuattn._kernels import kernel_dir
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gen_wgmma", root / "tools" / "gen_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.main()
    assert capsys.readouterr().out == (kernel_dir() / "wgmma.cuh").read_text()
