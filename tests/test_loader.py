"""The kernel loader without a GPU: get_kernels compiles the instances a first call needs
side by side, each instance once, on the caller's device (a CuPy stand-in and a stand-in
for the compile)."""
import threading
import types

import pytest

from cuattn import _kernels


@pytest.fixture
def loader(monkeypatch):
    """A CuPy stand-in on device 1 and a compile that records (instance, device of its
    thread) and waits at ``loader.barrier`` (set by the test) before it returns."""
    local = threading.local()

    class Device:
        def __init__(self, device_id):
            self.id = device_id

        def __enter__(self):
            self.previous, local.device = getattr(local, "device", 0), self.id

        def __exit__(self, *exc):
            local.device = self.previous

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=Device, runtime=types.SimpleNamespace(getDevice=lambda: 1)))
    state = types.SimpleNamespace(compiled=[], barrier=None)

    def compile_one(device_id, directory, filename, expr, options):
        state.compiled.append((expr, getattr(local, "device", 0)))
        if state.barrier is not None:
            state.barrier.wait()
        return f"kernel {expr}"

    monkeypatch.setattr(_kernels, "require_cupy", lambda: cupy)
    monkeypatch.setattr(_kernels, "_module", compile_one)
    monkeypatch.setattr(_kernels, "_ready", {})
    monkeypatch.setattr(_kernels, "_locks", {})
    return state


def test_instances_compile_side_by_side_on_the_callers_device(loader):
    # each compile returns only once all three are running: they run side by side
    loader.barrier = threading.Barrier(3, timeout=10)
    got = _kernels.get_kernels("f.cu", [("a", 0), ("b", 0), ("c", 0)])
    assert got == ["kernel a", "kernel b", "kernel c"]
    assert sorted(loader.compiled) == [("a", 1), ("b", 1), ("c", 1)]
    loader.barrier = None
    assert _kernels.get_kernels("f.cu", [("a", 0), ("c", 0)]) == ["kernel a", "kernel c"]
    assert _kernels.get_kernel("f.cu", "b") == "kernel b"
    assert len(loader.compiled) == 3  # kept: nothing compiles twice


def test_an_instance_compiles_once_when_threads_race(loader):
    loader.barrier = threading.Barrier(2, timeout=10)  # "a" and "b" together; "a" once
    got = _kernels.get_kernels("f.cu", [("a", 0), ("b", 0), ("a", 0)])
    assert got == ["kernel a", "kernel b", "kernel a"]
    assert sorted(e for e, _ in loader.compiled) == ["a", "b"]


def test_a_failing_compile_reaches_the_caller(loader, monkeypatch):
    def fail(device_id, directory, filename, expr, options):
        raise _kernels.KernelCompileError(f"compiling {expr} failed")
    monkeypatch.setattr(_kernels, "_module", fail)
    with pytest.raises(_kernels.KernelCompileError, match="compiling b failed"):
        _kernels.get_kernels("f.cu", [("b", 0), ("c", 0)])
