"""The command line runs on a machine without a GPU."""
import subprocess
import sys

import pytest


def _run(*args):
    return subprocess.run([sys.executable, "-m", "cuattn", *args], capture_output=True,
                          text=True, timeout=600)


def test_info():
    res = _run("info")
    assert res.returncode == 0, res.stderr
    assert "cuattn" in res.stdout and "kernel sources" in res.stdout


def test_demo_checks_against_float64():
    res = _run("demo")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "197 tokens" in res.stdout and " ok" in res.stdout


@pytest.mark.gate  # needs the gate extra (NVRTC's Python bindings)
def test_check_gate_compiles_without_a_gpu():
    res = _run("check", "--gate", "--arch", "sm_90", "--match", "attention_bwd_delta<__half>",
               "--match", "sm90/attention_backward_sm90.cu")
    assert res.returncode == 0, res.stdout + res.stderr
    line = next(x for x in res.stdout.splitlines() if "attention_bwd_delta<__half>" in x)
    regs, stack = (int(v) for v in line.split()[:2])
    assert regs > 0 and stack == 0 and "yes" in line and "FAIL" not in line
    assert "1 instances, 0 fast ones not clean" in res.stdout
    res = _run("check", "--gate", "--arch", "sm_75")
    assert res.returncode == 2 and "unknown architecture" in res.stdout


def test_check_gate_without_nvrtc_bindings_says_what_to_install():
    # hide cuda.bindings, as on a machine with only the base install
    code = ("import sys; sys.modules['cuda.bindings'] = None; "
            "from cuattn.__main__ import main; "
            "sys.exit(main(['check', '--gate', '--arch', 'sm_90']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert 'pip install "cuattn[gate]"' in res.stdout
    assert "Traceback" not in res.stderr
