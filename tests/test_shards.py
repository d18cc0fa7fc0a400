"""CUATTN_TEST_SHARD=i/n (tests/conftest.py): n runs that each keep one shard of the selected
tests run every test exactly once."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import _shard

ROOT = Path(__file__).resolve().parents[1]


def _collected(shard: str | None) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CUATTN_TEST_SHARD", None)
    if shard is not None:
        env["CUATTN_TEST_SHARD"] = shard
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--collect-only", "tests/test_reference.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_shards_partition_the_selection():
    every = _collected(None)
    shards = [_collected(f"{i}/3") for i in range(3)]
    assert all(shards) and sorted(sum(shards, [])) == sorted(every)


@pytest.mark.parametrize("value", ["3/3", "1", "a/2", "-1/2", "1/0"])
def test_a_bad_shard_is_a_usage_error(value):
    with pytest.raises(pytest.UsageError, match="CUATTN_TEST_SHARD"):
        _shard(value)
