"""``FP8FLOW_TEST_SHARD=i/N`` (test/conftest.py): N runs of the suite, one slice each, run every test once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import _test_shard, shard_members

TEST_DIR = Path(__file__).parent


@pytest.mark.parametrize("count", [1, 2, 7, 1768])
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_slices_partition_the_tests_in_order(count, n):
    slices = [shard_members(count, i, n) for i in range(1, n + 1)]
    owners = [[i for i in range(n) if slices[i][k]] for k in range(count)]
    assert all(len(o) == 1 for o in owners), "each test in exactly one slice"
    assert [o[0] for o in owners] == sorted(o[0] for o in owners), "consecutive slices, in collection order"
    sizes = [sum(s) for s in slices]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("spec", "want"), [(None, None), ("2/3", (2, 3)), ("1/1", (1, 1))])
def test_shard_spec(monkeypatch, spec, want):
    if spec is None:
        monkeypatch.delenv("FP8FLOW_TEST_SHARD", raising=False)
    else:
        monkeypatch.setenv("FP8FLOW_TEST_SHARD", spec)
    assert _test_shard() == want


@pytest.mark.parametrize("spec", ["0/2", "3/2", "2", "a/b"])
def test_bad_shard_spec(monkeypatch, spec):
    monkeypatch.setenv("FP8FLOW_TEST_SHARD", spec)
    with pytest.raises(pytest.UsageError, match="must be i/N"):
        _test_shard()


def _collect(shard: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FP8FLOW_TEST_SHARD=shard)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "test_pad_group_offsets.py"],
        cwd=TEST_DIR, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_pytest_runs_one_slice_and_stops_on_a_bad_spec():
    """End to end: pytest keeps the slice (and says how many it deselected); a bad value stops before collecting."""
    done = _collect("2/3")
    tests = [line for line in done.stdout.splitlines() if "::" in line]
    total = len(tests) + int(done.stdout.split("(")[1].split()[0])  # "k/n tests collected (m deselected)"
    assert done.returncode == 0 and tests and len(tests) == sum(shard_members(total, 2, 3))
    bad = _collect("4/3")
    assert bad.returncode == pytest.ExitCode.USAGE_ERROR and "::" not in bad.stdout
