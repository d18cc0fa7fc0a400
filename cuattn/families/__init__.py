"""Kernel families: one module per family of CUDA kernels.

A family module owns its kernels' template signatures (:class:`~._common.Kernel`, named
fields in the ``.cu`` file's order), its tile tables (candidates in order of preference,
each row with the measurement behind it), the shared-memory size of each tile and a
``forward(request, tiles=None)`` (and ``backward``) that returns the instance serving a
:class:`~._common.Request`. Which family serves a call is ``cuattn._dispatch``'s table.

- ``portable``: CUDA cores, every dtype and feature, head dims to 1024
- ``mma``: 16-bit inputs, mma.sync tensor cores (Ampere and newer), head dims to 256
- ``mma_wide``: float32 "tf32" and float64 on mma.sync tensor cores
- ``sm90``: 16-bit inputs, Hopper warpgroup MMA
- ``sm90_tf32``: float32 "tf32", Hopper warpgroup MMA, with a piped instance
- ``sm90_3xf16``: float32 "highest", Hopper float16 warpgroup MMA on split operands
"""
