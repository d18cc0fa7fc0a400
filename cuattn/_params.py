"""Kernel parameter blocks, defined once: by the C++ structs in the kernel sources.

A kernel takes one struct by value (``AttnParams``, ``AttnBwdParams``, ``Tf32Prep``,
``KvAppend``, ``MergeParams``).
:func:`block_dtype` reads the struct's declaration from the sources the loader uses
(``CUATTN_KERNEL_DIR`` included) and returns the NumPy structured dtype with the same
fields, offsets and size, so Python fills the block by field name and a field added or
moved in C++ is followed here without a second definition. The parser accepts what the
parameter structs use: ``long long``, ``int``, ``double``, ``float`` and earlier structs,
several names per declaration, comments.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np

from ._kernels import kernel_dir

__all__ = ["block_dtype", "new_block", "STRUCT_FILES"]

#: the source file that declares each parameter struct (with the structs it nests)
STRUCT_FILES = {"Strides": "common/common.cuh", "AttnParams": "common/common.cuh",
                "AttnBwdParams": "common/common.cuh", "Tf32Prep": "sm90/attention_sm90_tf32.cu",
                "KvAppend": "kv_cache.cu", "MergeParams": "merge.cu"}

_SCALARS = {"long long": np.int64, "int": np.int32, "double": np.float64, "float": np.float32,
            "unsigned long long": np.uint64}
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_STRUCT = re.compile(r"\bstruct\s+(\w+)\s*\{([^{}]*)\}\s*;")


def _parse_structs(text: str) -> dict[str, list[tuple[str, str]]]:
    """{struct name: [(C++ type, field name), ...]} of every plain struct in ``text``."""
    structs = {}
    for name, body in _STRUCT.findall(_COMMENT.sub("", text)):
        fields = []
        for decl in body.split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            match = re.fullmatch(r"((?:unsigned )?(?:long long|int|double|float)|\w+) (.+)", decl)
            if match is None:
                raise ValueError(f"struct {name}: cannot read the declaration {decl!r}")
            ctype, names = match.groups()
            fields += [(ctype, n.strip()) for n in names.split(",")]
        structs[name] = fields
    return structs


@functools.lru_cache(maxsize=32)
def _dtype_in(directory: str, struct: str) -> np.dtype:
    text = (Path(directory) / STRUCT_FILES[struct]).read_text()
    if STRUCT_FILES[struct] != "common/common.cuh":  # it may nest the common structs
        text = (Path(directory) / "common/common.cuh").read_text() + text
    structs = _parse_structs(text)

    def dtype_of(name: str) -> np.dtype:
        if name not in structs:
            raise ValueError(f"struct {name} is not declared in {STRUCT_FILES[struct]}")
        return np.dtype([(field, _SCALARS[ctype] if ctype in _SCALARS else dtype_of(ctype))
                         for ctype, field in structs[name]], align=True)

    return dtype_of(struct)


def block_dtype(struct: str) -> np.dtype:
    """The NumPy structured dtype of a parameter struct, read from the kernel sources."""
    return _dtype_in(str(kernel_dir()), struct)


def new_block(struct: str, **fields) -> np.ndarray:
    """A zeroed parameter block (a 0-d structured array) with ``fields`` set by name; a
    nested struct takes a tuple in field order (``q_s=(b0, b1, b2, row, col)``) or a dict
    by field name (``f={"q": ptr, ...}``)."""
    block = np.zeros((), block_dtype(struct))
    _fill(block, fields)
    return block


def _fill(block: np.ndarray, fields: dict) -> None:
    for name, value in fields.items():
        if isinstance(value, dict):  # a nested struct by field name
            _fill(block[name], value)
        else:
            block[name] = value
