"""Horovod behaviours its own suite relies on (tests/ranks/hvd_behaviours.py), at 1 to 3 ranks:
the alltoall gradient of an equal split, DistributedOptimizer on a process set (members average,
other ranks step locally), sparse gradients, ``_parameter_names``, the step-after-synchronize
warning, the zero gradients of ``broadcast_optimizer_state``, process sets that add no store
clients and re-inits that leave no thread."""

import pytest

import small_jobs

pytestmark = pytest.mark.multiprocess

CHECKS = ("alltoall-grad", "set-optimizer", "sparse-grad", "parameter-names", "step-warning",
          "zero-grads", "store-clients", "shutdown")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_horovod_behaviours(n):
    # tests/ranks/hvd_behaviours.py, in the job it shares with other scripts (small_jobs.py)
    result = small_jobs.result(n)
    assert small_jobs.ran(result, "hvd_behaviours.py", n), result
    output = small_jobs.output(result, "hvd_behaviours.py")
    for check in CHECKS:
        assert output.count(f"ok {check} ") == n, (check, output[-3000:])
