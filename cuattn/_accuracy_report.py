"""The accuracy comparison's report: Markdown tables of a :func:`cuattn.accuracy.run`
result."""
from __future__ import annotations

from ._accuracy_grid import QUANTITIES


def _max_error(entry: dict, name: str, quantity: str) -> float | None:
    errors = entry["errors"].get(name)
    if errors is None or errors[quantity] is None:
        return None
    return errors[quantity]["max"]


def _cell(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def _short(peer: str) -> str:
    return peer.removeprefix("torch ")


def _unavailable(section: dict) -> list[str]:
    """One line per peer that could not run some cases: how many, and the first reasons."""
    lines = []
    for name in ["cuattn", *section["peers"]]:
        notes = [c["notes"][name] for c in section["cases"] if name in c["notes"]]
        if notes:
            reasons = "; ".join(list(dict.fromkeys(notes))[:3])
            lines.append(f"- {name}: no result or non-finite on {len(notes)} of "
                         f"{len(section['cases'])} cases ({reasons})")
    return lines + ([""] if lines else [])


def _error_section(section: dict, within: float) -> list[str]:
    peers = section["peers"]
    header = ["case"]
    for q in QUANTITIES:
        header += [f"{q} cuattn", *(f"{q} {_short(p)}" for p in peers), f"{q} ratio"]
    rows = []
    for c in section["cases"]:
        row = [c["label"]]
        for q in QUANTITIES:
            row += [_cell(_max_error(c, name, q), ".2e") for name in ["cuattn", *peers]]
            row.append(_cell(c["ratios"][q], ".2f"))
        rows.append(row)
    lines = [f"### {section['title']}: max |error| against float64", "",
             "ratio = cuattn's error / the best peer's error on the same inputs", "",
             *_table(header, rows), *_unavailable(section)]
    summary = section["summary"]
    if "note" in summary:
        lines += [f"Ratios: {summary['note']}.", ""]
    if any(summary[q]["count"] for q in QUANTITIES):
        stats = []
        for q in QUANTITIES:
            s = summary[q]
            stats.append([q, str(s["count"]), *(_cell(s.get(k), ".2f") for k in
                                                ("median", "p90", "max")),
                          _cell(s.get("within"), ".0%")])
        lines += _table(["quantity", "cases", "median ratio", "p90", "max",
                         f"ratio <= {within}"], stats)
    return lines


def _ulp_section(section: dict, ulps: int) -> list[str]:
    rows = []
    for c in section["cases"]:
        for name, ratios in c["ulp_ratios"].items():
            rows.append([c["label"], name, *(
                f"{_cell(ratios[q], '.2f')} ({_cell(_max_error(c, name, q), '.1e')})"
                for q in QUANTITIES)])
    stats = [[name, *(f"{_cell(s[q].get('max'), '.2f')} ({_cell(s[q].get('within'), '.0%')})"
                      for q in QUANTITIES)] for name, s in section["summary"].items()]
    return [f"### {section['title']}: max |error| / ({ulps} eps max|ref|), eps = 2^-52", "",
            "at most 1: within four units in the last place of the largest reference "
            "magnitude (max |error| in brackets)", "",
            *_table(["case", "implementation", *QUANTITIES], rows), *_unavailable(section),
            "Largest ratio per implementation (fraction of cases at most 1 in brackets):", "",
            *_table(["implementation", *QUANTITIES], stats)]


def _one_key_section(entries: list) -> list[str]:
    rows = []
    for e in entries:
        if "error" in e:
            cells = ["error: " + e["error"], "—", "—", "—"]
        else:
            cells = [str(e["out_exact"]), str(e["dk_zero"]), str(e["dq_zero"]),
                     _cell(e["dk_max"], ".1e")]
        rows.append([e["dtype"], e["case"], *cells])
    return ["### One allowed key: probabilities exactly 1", "",
            *_table(["dtype", "case", "out equals v", "dk exactly 0", "dq exactly 0",
                     "max abs dk"], rows)]


def format_report(result: dict) -> str:
    """The markdown tables of a :func:`run` result.

    Per section: each case's max errors (cuattn and each peer) and ratios, the peers that
    could not run some cases and why, and the summary of the ratios; the float64 errors
    over their 4-ulp bound; the one-allowed-key checks.

    Examples
    --------
    >>> import numpy as np
    >>> from cuattn import accuracy
    >>> result = accuracy.run(quick=True, xp=np, progress=lambda line: None)
    >>> print(accuracy.format_report(result).splitlines()[0])
    ## Accuracy against float64 attention
    """
    env = result["environment"]
    device = (f"{env['gpu']} (compute capability {env['compute_capability']}), CuPy "
              f"{env['cupy']}" if env["backend"] != "numpy" else "CPU (cuattn's NumPy backend)")
    lines = ["## Accuracy against float64 attention", "",
             f"- {device}; PyTorch {env['torch'] or 'not available (no peers)'}; "
             f"NumPy {env['numpy']}; {env['date']}",
             "- reference: float64 attention from the same inputs, on the same device; "
             "dout standard normal",
             "- causal is bottom-right aligned; for Sq != Sk the peers get PyTorch's "
             "causal_lower_right", ""]
    for key in ("half", "float32"):
        lines += _error_section(result[key], result["within"])
    lines += _ulp_section(result["float64"], result["ulps"])
    lines += _one_key_section(result["one_key"])
    return "\n".join(lines).rstrip() + "\n"
