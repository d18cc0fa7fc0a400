"""Kernel parameter blocks, defined once: by the C++ structs in the kernel sources.

A kernel takes one struct by value (``AttnParams``, ``AttnBwdParams``, ``FwdTmaParams``,
``Tf32Prep``, ``KvAppend``, ``MergeParams``).
:func:`block_dtype` reads the struct's declaration from the sources the loader uses
(``CUATTN_KERNEL_DIR`` included) and returns the NumPy structured dtype with the same
fields, offsets and size, so Python fills the block by field name and a field added or
moved in C++ is followed here without a second definition. The parser accepts what the
parameter structs use: ``long long``, ``int``, ``double``, ``float``, earlier structs and
``TensorMap`` (pipeline.cuh: 128 opaque bytes aligned to 64), several names per
declaration, comments; other structs in the same sources are read only when named.
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
                "AttnBwdParams": "common/common.cuh", "FwdTmaParams": "sm90/attention_sm90.cu",
                "Tf32Prep": "sm90/attention_sm90_tf32.cu",
                "KvAppend": "kv_cache.cu", "MergeParams": "merge.cu"}

_SCALARS = {"long long": np.int64, "int": np.int32, "double": np.float64, "float": np.float32,
            "unsigned long long": np.uint64}
#: opaque types the structs may hold: (dtype, alignment)
_OPAQUE = {"TensorMap": (np.dtype((np.uint8, 128)), 64)}
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_STRUCT = re.compile(r"\bstruct\s+(\w+)\s*\{([^{}]*)\}\s*;")


def _parse_structs(text: str) -> dict[str, str]:
    """{struct name: body} of every plain struct (no nested braces) in ``text``."""
    return dict(_STRUCT.findall(_COMMENT.sub("", text)))


def _fields(name: str, body: str) -> list[tuple[str, str]]:
    """[(C++ type, field name), ...] of a struct body."""
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
    return fields


@functools.lru_cache(maxsize=32)
def _dtype_in(directory: str, struct: str) -> np.dtype:
    text = (Path(directory) / STRUCT_FILES[struct]).read_text()
    if STRUCT_FILES[struct] != "common/common.cuh":  # it may nest the common structs
        text = (Path(directory) / "common/common.cuh").read_text() + text
    structs = _parse_structs(text)

    def dtype_of(name: str) -> tuple[np.dtype, int]:  # and its alignment
        if name in _OPAQUE:
            return _OPAQUE[name]
        if name not in structs:
            raise ValueError(f"struct {name} is not declared in {STRUCT_FILES[struct]}")
        names, formats, offsets, at, align = [], [], [], 0, 1
        for ctype, field in _fields(name, structs[name]):
            if ctype in _SCALARS:
                dtype = np.dtype(_SCALARS[ctype])
                field_align = dtype.itemsize
            else:
                dtype, field_align = dtype_of(ctype)
            at = -(-at // field_align) * field_align
            names.append(field), formats.append(dtype), offsets.append(at)
            at += dtype.itemsize
            align = max(align, field_align)
        return np.dtype({"names": names, "formats": formats, "offsets": offsets,
                         "itemsize": -(-at // align) * align}), align

    return dtype_of(struct)[0]


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
