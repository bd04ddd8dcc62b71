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


def _collect(shard: str | None) -> tuple[int, list[str]]:
    """Exit code and test ids of ``pytest --collect-only -k kernel_matches`` over one file (``FP8FLOW_TEST_SHARD``
    set to ``shard``, or unset)."""
    env = {k: v for k, v in os.environ.items() if k != "FP8FLOW_TEST_SHARD"} | (
        {"FP8FLOW_TEST_SHARD": shard} if shard else {}
    )
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", "test_pad_group_offsets.py", "-k", "kernel_matches"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *args], cwd=TEST_DIR, env=env, capture_output=True, text=True, check=False
    )
    return done.returncode, [line for line in done.stdout.splitlines() if "::" in line]


def test_pytest_runs_one_slice_of_the_selected_tests_and_stops_on_a_bad_spec():
    """End to end: the slices split the tests ``-k`` selected, not every test of the file; a bad value stops pytest
    before it collects anything."""
    _, selected = _collect(None)
    code, middle = _collect("2/3")
    assert code == 0 and len(selected) > len(middle) > 0
    assert middle == [t for t, keep in zip(selected, shard_members(len(selected), 2, 3), strict=True) if keep]
    code, tests = _collect("4/3")
    assert code == pytest.ExitCode.USAGE_ERROR and not tests
