"""The suite's own setup under pytest-xdist (tests/conftest.py): each worker on its share of the CPUs."""

from __future__ import annotations

import os

import pytest
import torch

from kvforge.runners.cpus import usable_cpus


def test_an_xdist_worker_runs_on_its_share_of_the_cpus() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or count < 2:
        pytest.skip("not under pytest-xdist with two workers or more (the README's command runs -n 2)")
    at_most = -(-(os.cpu_count() or 1) // count)  # the machine's CPUs shared among the workers, rounded up
    assert 1 <= usable_cpus() <= at_most  # what onnxruntime's sessions are sized from
    assert torch.get_num_threads() == usable_cpus()
