"""Horovod behaviours its own suite relies on (tests/ranks/hvd_behaviours.py), at 1 to 3 ranks:
the alltoall gradient of an equal split, DistributedOptimizer on a process set (members average,
other ranks step locally), sparse gradients, ``_parameter_names``, the step-after-synchronize
warning, the zero gradients of ``broadcast_optimizer_state``, process sets that add no store
clients and re-inits that leave no thread."""

import pytest

from harness import launch

pytestmark = pytest.mark.multiprocess

CHECKS = ("alltoall-grad", "set-optimizer", "sparse-grad", "parameter-names", "step-warning",
          "zero-grads", "store-clients", "shutdown")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_horovod_behaviours(n):
    result = launch(n, "hvd_behaviours.py", timeout=90)
    assert result.returncode == 0, result
    for check in CHECKS:
        assert result.output.count(f"ok {check} ") == n, (check, result.output[-3000:])
