"""Shared-memory layouts, defined once for Python and CUDA.

A :class:`Layout` lists a kernel's shared-memory buffers in order, each with its element
type and its element count as an expression over the kernel's template parameters
(Python syntax: ``+ - * //``, ``a if c else b``, comparisons, ``max``, ``min`` and the
:data:`BUILTINS`; ``T_SIZE`` is the size in bytes of a type parameter ``T``). Python
evaluates it (:meth:`Layout.bytes`) for dispatch; ``tools/gen_layouts.py`` writes the same
description as C++ (``cuda/common/layouts.cuh``: a struct per layout whose enum holds each
buffer's byte offset and the total ``BYTES``), which the kernel carves its
``extern __shared__`` memory from. A test regenerates the header, so the two cannot
disagree.
"""
from __future__ import annotations

import ast
import functools
from dataclasses import dataclass

#: fixed-size element types a layout may name (type parameters are sized by the caller)
TYPE_SIZES = {"float": 4, "double": 8, "__half": 2, "unsigned char": 1, "float4": 16}

#: functions the expressions may call, each defined once as an expression of its arguments
BUILTINS = {
    # row pitch in bytes of a staged mask or bias tile of `cols` elements of `size` bytes:
    # its 16-byte chunks, one more for a misaligned start
    "side_pitch": (("size", "cols"), "16 * (cols * size // 16 + 1)"),
}


@dataclass(frozen=True)
class Layout:
    """A kernel's shared memory: ``name`` of the C++ struct, its template parameters
    (``"typename T, int HEAD_DIM, bool OVERLAP"``) and its ``buffers`` as (name, element
    type, element count expression), laid out one after the other from byte 0."""
    name: str
    params: str
    buffers: tuple[tuple[str, str, str], ...]

    def _param_names(self) -> list[tuple[str, str]]:
        return [tuple(p.split()) for p in self.params.split(",")]

    def bytes(self, **values) -> int:
        """The layout's size in bytes; ``values`` gives every template parameter (a type
        parameter by its size in bytes)."""
        return self.offsets(**values)["BYTES"]

    def offsets(self, **values) -> dict[str, int]:
        """Each buffer's byte offset and the total, ``BYTES``."""
        return dict(_offsets(self, tuple(sorted((k, int(v)) for k, v in values.items()))))

    def _offsets(self, values: dict) -> list[tuple[str, int]]:
        names = {n for _, n in self._param_names()}
        if set(values) != names:
            raise TypeError(f"{self.name}: expected {sorted(names)}, got {sorted(values)}")
        types = {n for kind, n in self._param_names() if kind == "typename"}
        env = dict(values)
        env.update({f"{t}_SIZE": env[t] for t in types})
        at, out = 0, {}
        for buf, elem, count in self.buffers:
            out[buf] = at
            size = env[elem] if elem in types else TYPE_SIZES[elem]
            at += size * _evaluate(count, env)
        out["BYTES"] = at
        return list(out.items())

    def cpp(self) -> str:
        """The C++ struct: an enum of byte offsets (an enum, not static data members, which
        NVRTC would emit as unused globals)."""
        types = {n for kind, n in self._param_names() if kind == "typename"}
        lines = [f"template <{self.params}>", f"struct {self.name} {{", "    enum : long long {"]
        prev = None
        for buf, elem, count in self.buffers + (("BYTES", None, None),):
            if prev is None:
                lines.append(f"        {buf} = 0,")
            else:
                pbuf, pelem, pcount = prev
                size = f"sizeof({pelem})" if pelem in types else str(TYPE_SIZES[pelem])
                lines.append(f"        {buf} = {pbuf} + (long long){size} * "
                             f"{to_cpp(pcount, types)},")
            prev = (buf, elem, count)
        lines += ["    };", "};"]
        return "\n".join(lines)


_ALLOWED = (ast.Expression, ast.Constant, ast.Name, ast.Load, ast.BinOp, ast.Add, ast.Sub,
            ast.Mult, ast.FloorDiv, ast.IfExp, ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.Gt,
            ast.LtE, ast.GtE, ast.BoolOp, ast.And, ast.Or, ast.Call)


@functools.cache
def _compiled(expr: str):
    """``expr`` checked against the layout language (what :func:`to_cpp` can write) and
    compiled once."""
    tree = ast.parse(expr, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED) or (
                isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and (
                    node.func.id in ("max", "min") or node.func.id in BUILTINS))) or (
                isinstance(node, ast.Constant) and not isinstance(node.value, int)):
            raise ValueError(f"{expr}: unsupported expression {ast.dump(node)}")
    return compile(tree, f"<layout {expr}>", "eval")


def _builtin(name: str):
    params, body = BUILTINS[name]
    return lambda *args: _evaluate(body, dict(zip(params, args)))


_FUNCTIONS = {"__builtins__": {}, "max": max, "min": min,
              **{name: _builtin(name) for name in BUILTINS}}


def _evaluate(expr: str, env: dict) -> int:
    return int(eval(_compiled(expr), _FUNCTIONS, env))  # noqa: S307 - our own checked text


def to_cpp(expr: str, types=()) -> str:
    """The C++ text of a layout expression (``types``: the type parameters, whose
    ``X_SIZE`` is ``sizeof(X)``)."""
    def cpp(node):
        if isinstance(node, ast.Expression):
            return cpp(node.body)
        if isinstance(node, ast.Constant):
            return str(int(node.value))
        if isinstance(node, ast.Name):
            if node.id.endswith("_SIZE") and node.id[:-5] in types:
                return f"(int)sizeof({node.id[:-5]})"
            return node.id
        if isinstance(node, ast.BinOp):
            op = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "/"}[type(node.op)]
            return f"({cpp(node.left)} {op} {cpp(node.right)})"
        if isinstance(node, ast.IfExp):
            return f"({cpp(node.test)} ? {cpp(node.body)} : {cpp(node.orelse)})"
        if isinstance(node, ast.Compare):
            op = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.Gt: ">", ast.LtE: "<=",
                  ast.GtE: ">="}[type(node.ops[0])]
            return f"({cpp(node.left)} {op} {cpp(node.comparators[0])})"
        if isinstance(node, ast.BoolOp):
            op = " && " if isinstance(node.op, ast.And) else " || "
            return "(" + op.join(cpp(v) for v in node.values) + ")"
        if isinstance(node, ast.Call):
            args = [cpp(a) for a in node.args]
            if node.func.id in ("max", "min"):
                a, b = args
                return f"({a} {'>' if node.func.id == 'max' else '<'} {b} ? {a} : {b})"
            return f"{node.func.id}_bytes({', '.join(args)})"
        raise ValueError(f"{expr}: unsupported expression")
    return cpp(ast.parse(expr, mode="eval"))


def builtins_cpp() -> str:
    """The BUILTINS as constexpr C++ functions (``side_pitch_bytes`` ...)."""
    out = []
    for name, (params, body) in BUILTINS.items():
        args = ", ".join(f"int {p}" for p in params)
        out.append(f"constexpr int {name}_bytes({args}) {{ return {to_cpp(body)}; }}")
    return "\n".join(out)


@functools.lru_cache(maxsize=4096)
def _offsets(layout: Layout, values: tuple) -> tuple:
    return tuple(layout._offsets(dict(values)))
