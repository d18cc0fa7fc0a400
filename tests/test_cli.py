"""The command line runs on a machine without a GPU."""
import subprocess
import sys


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
