"""Packaging for cuattn. The kernel sources in cuda/ ship inside the wheel as cuattn/cuda/,
where cuattn._kernels finds them; a source checkout (PYTHONPATH=.) and an editable install
read cuda/ in place."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithKernels(build_py):
    """Copy the .cu and .cuh files of cuda/ (and its folders) into the built package as
    cuattn/cuda/."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "cuattn" / "cuda"
        for source in sorted((HERE / "cuda").rglob("*.cu*")):
            dest = target / source.relative_to(HERE / "cuda")
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.copy_file(str(source), str(dest))


setup(
    name="cuattn",
    version="0.1.0",
    description="Exact, fast attention for CuPy and NumPy, on cuattn's own CUDA kernels",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=["cuattn", "cuattn.families"],
    cmdclass={"build_py": BuildPyWithKernels},
    install_requires=["numpy>=1.24", "ml_dtypes>=0.4"],
    extras_require={
        # CuPy with the CUDA toolkit wheels it needs at run time (NVRTC, headers, cuBLAS),
        # so that a machine with only a driver works
        "cuda13": ["cupy-cuda13x[ctk]>=14.2,<15"],
        "cuda12": ["cupy-cuda12x[ctk]>=14.2,<15"],
        # Dask arrays in, Dask arrays out; distributed for clusters (one worker per GPU)
        "dask": ["dask[array,distributed]>=2024.1"],
        "test": ["pytest>=7", "hypothesis>=6", "scipy>=1.10",
                 "dask[array,distributed]>=2024.1"],
        # the NVRTC resource gate (pytest -m gate) compiles with the NVRTC minor version of
        # the GPU machines (13.0), so that its register and spill counts are theirs; install
        # it apart from the cuda13 extra, whose toolkit wheels are newer
        "gate": ["pytest>=7", "hypothesis>=6", "scipy>=1.10", "cuda-bindings>=13.0,<13.1",
                 "nvidia-cuda-nvrtc==13.0.*", "nvidia-cuda-runtime==13.0.*"],
        "docs": ["sphinx>=7", "numpydoc>=1.6"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": ["cuattn=cuattn.__main__:main"]},
)
