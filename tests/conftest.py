"""GPU tests carry ``@pytest.mark.gpu``: skipped where no GPU is present, and failed
instead when ``CUATTN_REQUIRE_GPU=1``, so that a GPU run can never be green by skipping.

``CUATTN_TEST_SHARD=i/n`` keeps the i-th of n disjoint shards of the selected tests (by a
hash of each test's id, the same in every process): n runs with i = 0 .. n - 1 run every
test once, for machines that hold a run for a limited time."""
import os
import zlib

# a pytest-xdist worker's share of the cores for BLAS (the float64 references): without it
# each of n workers starts a BLAS thread per core, and those spin against each other (the
# variables are read when NumPy loads, which in a worker comes after this file)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "").isdigit():
    _share = str(max(1, (os.cpu_count() or 1) // max(1, int(
        os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
    for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, _share)

import pytest  # noqa: E402 - after the BLAS threads are set


def _gpu_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy, no driver or no device: no GPU
        return 0


HAVE_GPU = _gpu_count() > 0
REQUIRE_GPU = os.environ.get("CUATTN_REQUIRE_GPU") == "1"


def pytest_runtest_setup(item):
    if "gpu" in item.keywords and not HAVE_GPU:
        if REQUIRE_GPU:
            pytest.fail("CUATTN_REQUIRE_GPU=1 but no GPU is available", pytrace=False)
        pytest.skip("no GPU (set CUATTN_REQUIRE_GPU=1 to make this a failure)")


def shard_of(nodeid: str, count: int) -> int:
    """The shard (0 .. count - 1) of the test ``nodeid``."""
    return zlib.crc32(nodeid.encode()) % count


def _shard(value: str) -> tuple[int, int]:
    index, _, count = value.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise pytest.UsageError(f"CUATTN_TEST_SHARD must be i/n with 0 <= i < n, got {value!r}")
    return int(index), int(count)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    """With CUATTN_TEST_SHARD=i/n, only the tests of shard i; then the NVRTC gate compiles
    the instances this run selected in one parallel batch."""
    value = os.environ.get("CUATTN_TEST_SHARD")
    if value:
        index, count = _shard(value)
        shards = [shard_of(item.nodeid, count) for item in items]
        config.hook.pytest_deselected(
            items=[item for item, s in zip(items, shards) if s != index])
        items[:] = [item for item, s in zip(items, shards) if s == index]
    config.cuattn_gate_selected = tuple(
        item.callspec.params["inst"] for item in items
        if getattr(item, "originalname", None) == "test_instance_compiles")
