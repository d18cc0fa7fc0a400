"""GPU tests carry ``@pytest.mark.gpu``: skipped where no GPU is present, and failed
instead when ``CUATTN_REQUIRE_GPU=1``, so that a GPU run can never be green by skipping."""
import os

import pytest


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


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    """The NVRTC gate compiles the instances this run selected in one parallel batch."""
    config.cuattn_gate_selected = tuple(
        item.callspec.params["inst"] for item in items
        if getattr(item, "originalname", None) == "test_instance_compiles")
