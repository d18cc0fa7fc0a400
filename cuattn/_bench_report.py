"""The benchmark's report: the Markdown tables printed after a run, the plot, the
performance page (``--report``) and the README's short table (``--readme``)."""
from __future__ import annotations

import platform
import sys
import time

import numpy as np

from ._bench_core import Result


def format_tables(results: list[Result]) -> str:
    lines = []
    for suite in dict.fromkeys(r.case.suite for r in results):
        group = [r for r in results if r.case.suite == suite]
        unit = group[0].case.unit
        peers = list(dict.fromkeys(row.impl for r in group for row in r.rows))
        lines.append(f"\n### suite {suite} ({unit}; ratio = peer time / cuattn time, >1 means "
                     f"cuattn is faster; extra MB = peak extra device memory)")
        header = ["case"] + [f"{p}" for p in peers] + ["cuattn extra MB"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for r in group:
            by = {row.impl: row for row in r.rows}
            ours = by.get("cuattn")
            cells = [r.case.label]
            for p in peers:
                row = by.get(p)
                if row is None or row.ms is None:
                    cells.append("—")
                elif p == "cuattn" or ours is None or ours.ms is None:
                    cells.append(f"{row.rate:.1f}")
                else:
                    cells.append(f"{row.rate:.1f} ({row.ms / ours.ms:.2f}x)")
            cells.append("—" if ours is None or ours.extra_mb is None else f"{ours.extra_mb:.1f}")
            lines.append("| " + " | ".join(cells) + " |")
            if ours is not None and ours.note:
                lines.append(f"|   ↳ cuattn: {ours.note} |" + " |" * (len(header) - 1))
    return "\n".join(lines)


def _plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [r.case.label for r in results]
    impls = list(dict.fromkeys(row.impl for r in results for row in r.rows))
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 5))
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        vals = [next((row.rate or 0 for row in r.rows if row.impl == impl), 0) for r in results]
        ax.bar(np.arange(len(labels)) + i * width, vals, width, label=impl)
    ax.set_xticks(np.arange(len(labels)) + 0.4)
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s (attention) or GB/s (vector_add, decode)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def environment(cupy) -> dict:
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    torch = sys.modules.get("torch")
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": props["name"].decode(),
            "compute_capability": dev.compute_capability,
            "driver": cupy.cuda.runtime.driverGetVersion(),
            "cupy": cupy.__version__, "numpy": np.__version__,
            "torch": getattr(torch, "__version__", None),
            "python": platform.python_version(),
            "command": " ".join(["python -m cuattn" if sys.argv[0].endswith("__main__.py")
                                 else sys.argv[0], *sys.argv[1:]])}


def _rst_table(rows: list[list[str]]) -> list[str]:
    """A reStructuredText grid-free "simple table" of string cells (first row: header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    rule = "  ".join("=" * w for w in widths)
    fmt = [("  ".join(c.ljust(w) for c, w in zip(r, widths))).rstrip() for r in rows]
    return [rule, fmt[0], rule, *fmt[1:], rule]


def write_report(results: list[Result], directory, env: dict | None = None) -> str:
    """Write ``performance.rst`` into ``directory`` from one run's results: the environment
    (date, GPU, driver, versions, command), one table per suite (cuattn's rate, each peer's
    with the ratio peer time / cuattn time, cuattn's peak extra memory) and a plot for each
    of the first four suites. Returns the page's path."""
    import os

    os.makedirs(directory, exist_ok=True)
    if env is None:
        from ._kernels import require_cupy
        env = environment(require_cupy())
    lines = ["Performance", "===========", "",
             "One run of ``python -m cuattn bench`` on one GPU, every implementation timed in "
             "the same process on the same inputs (CUDA-event medians after warm-up). "
             "Attention rates are TFLOP/s by FlashAttention's count (forward 4·B·H·Sq·Sk·D, "
             "halved under causal masking; backward 2.5 times that), vector_add's GB/s, and "
             "decode rates GB/s of K and V read. "
             "A ratio is the peer's time over cuattn's: above 1, cuattn is faster. This page "
             "is generated; to regenerate it on a GPU machine run the command below.", "",
             f"- date: {env['date']}", f"- GPU: {env['gpu']} (compute capability "
             f"{env['compute_capability']}), driver {env['driver']}",
             f"- CuPy {env['cupy']}, NumPy {env['numpy']}, PyTorch {env.get('torch') or '-'}, "
             f"Python {env['python']}", f"- command: ``{env['command']}``", ""]
    suites = list(dict.fromkeys(r.case.suite for r in results))
    for i, suite in enumerate(suites):
        group = [r for r in results if r.case.suite == suite]
        unit = group[0].case.unit
        peers = [p for p in dict.fromkeys(row.impl for r in group for row in r.rows)
                 if p != "cuattn"]
        table = [["case", f"cuattn {unit}", *peers, "cuattn extra MB"]]
        for r in group:
            by = {row.impl: row for row in r.rows}
            ours = by.get("cuattn")
            ok = ours is not None and ours.ms is not None
            cells = [r.case.label, f"{ours.rate:.1f}" if ok else "failed"]
            for p in peers:
                row = by.get(p)
                cells.append("-" if row is None or row.ms is None else
                             f"{row.rate:.1f} ({row.ms / ours.ms:.2f}x)" if ok else
                             f"{row.rate:.1f}")
            cells.append(f"{ours.extra_mb:.1f}" if ok and ours.extra_mb is not None else "-")
            table.append(cells)
        title = f"Suite ``{suite}``"
        lines += [title, "-" * len(title), "", *_rst_table(table), ""]
        if i < 4:
            try:
                name = f"performance-{suite}.png"
                _plot(group, os.path.join(directory, name))
                lines += [f".. image:: {name}", f"   :alt: {suite} suite, {unit}", ""]
            except ImportError:
                pass
    path = os.path.join(directory, "performance.rst")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


#: the README's generated block: the lines between these two are rewritten by --readme
README_BEGIN = "<!-- performance table: generated -->"
README_END = "<!-- end of the generated performance table -->"
#: the peers a README row compares with, best first where several ran
_README_PEERS = ("torch flash", "torch cudnn", "torch flash nested", "torch cudnn nested")


def readme_table(results: list[Result], env: dict) -> list[str]:
    """The README's short table (Markdown): per suite its first forward and first
    backward case, cuattn's rate and its ratio to PyTorch's flash and cuDNN backends
    where they ran (peer time / cuattn time), under the run's date, GPU and command."""
    rows = [["suite", "case", "cuattn", "vs torch flash", "vs torch cuDNN"]]
    for suite in dict.fromkeys(r.case.suite for r in results):
        group = [r for r in results if r.case.suite == suite]
        unit = group[0].case.unit
        picked = {}
        for r in group:
            picked.setdefault(r.case.direction, r)
        for r in picked.values():
            by = {row.impl: row for row in r.rows}
            ours = by.get("cuattn")
            if ours is None or ours.ms is None:
                continue
            cells = [suite, r.case.label, f"{ours.rate:.1f} {unit}"]
            for kind in ("flash", "cudnn"):
                peer = next((by[p] for p in _README_PEERS if kind in p and p in by
                             and by[p].ms is not None), None)
                cells.append("-" if peer is None else f"{peer.ms / ours.ms:.2f}x")
            rows.append(cells)
    return [f"{env['gpu']}, driver {env['driver']}, {env['date'][:10]}; ratio = peer time / "
            f"cuattn time (above 1: cuattn is faster); from `{env['command']}`:", "",
            "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
            *("| " + " | ".join(r) + " |" for r in rows[1:])]


def write_readme(results: list[Result], path, env: dict | None = None) -> None:
    """Rewrite the block of the README at ``path`` between README_BEGIN and README_END
    with :func:`readme_table` (the page must hold both markers, in order)."""
    if env is None:
        from ._kernels import require_cupy
        env = environment(require_cupy())
    with open(path) as f:
        text = f.read()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"{path} has no block between {README_BEGIN!r} and {README_END!r}")
    head = text[:begin + len(README_BEGIN)]
    with open(path, "w") as f:
        f.write("\n".join([head, *readme_table(results, env), text[end:]]))
