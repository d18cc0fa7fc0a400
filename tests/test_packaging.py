"""The loader finds and inlines the kernel sources; the wheel ships them."""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cuattn._kernels import kernel_dir, read_source

ROOT = Path(__file__).resolve().parents[1]


def test_sources_found_and_headers_inlined():
    assert (kernel_dir() / "common/common.cuh").is_file()
    text = read_source("portable/attention_portable.cu")
    assert '#include "common/common.cuh"' not in text and "struct AttnParams" in text
    assert text.count("struct AttnParams {") == 1  # each header once


def test_kernel_dir_override(tmp_path, monkeypatch):
    (tmp_path / "common").mkdir()
    (tmp_path / "common/common.cuh").write_text("#pragma once\n// edited header\n")
    (tmp_path / "vector_add.cu").write_text('#include "common/common.cuh"\n// edited kernel\n')
    monkeypatch.setenv("CUATTN_KERNEL_DIR", str(tmp_path))
    assert kernel_dir() == tmp_path
    assert "edited header" in read_source("vector_add.cu")
    monkeypatch.setenv("CUATTN_KERNEL_DIR", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="CUATTN_KERNEL_DIR"):
        kernel_dir()


def test_params_blocks_have_the_sizes_of_their_structs():
    # every field of the parameter structs is 8 bytes wide: no padding rule can differ
    from cuattn._params import block_dtype
    assert block_dtype("Strides").itemsize == 5 * 8
    assert block_dtype("AttnParams").itemsize == 8 * 21 + 8 * 5 * 9 + 8 * 10
    assert block_dtype("AttnBwdParams").itemsize == block_dtype("AttnParams").itemsize + 8 * 7 \
        + 5 * 5 * 8
    assert block_dtype("Tf32Prep").itemsize == 9 * 8 + 5 * 8


@pytest.mark.skipif(not (ROOT / "setup.py").is_file(), reason="not a source checkout")
def test_wheel_contains_kernel_sources(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path),
                    str(ROOT)], check=True)
    wheel = next(tmp_path.glob("cuattn-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (ROOT / "cuda").rglob("*.cu*"):
        assert f"cuattn/cuda/{path.relative_to(ROOT / 'cuda').as_posix()}" in names
    for path in (ROOT / "cuattn").rglob("*.py"):  # every module, subpackages too
        assert path.relative_to(ROOT).as_posix() in names
