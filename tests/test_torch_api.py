"""gradsync.torch's collectives through the real launcher at 1, 2 and 3 ranks (one job per size
shared with other scripts: tests/small_jobs.py).

The rank side is tests/ranks/torch_api.py: every collective and form (out-of-place, in place,
async, async in place, grouped) x dtype against a closed-form reference, Horovod's argument
conventions (average=, compression, prescale/postscale), the autograd gradients, the object
collectives, parameter and optimizer-state broadcast, SyncBatchNorm against BatchNorm on the
concatenated batch, join without an optimizer, and the errors raised for what gradsync cannot
honour. It exits non-zero at the first wrong value.
"""

import pytest

import small_jobs

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("n", [1, 2, 3])
def test_torch_api(n):
    # tests/ranks/torch_api.py, in the job it shares with other scripts (small_jobs.py)
    result = small_jobs.result(n)
    assert small_jobs.ran(result, "torch_api.py", n), result
    assert small_jobs.output(result, "torch_api.py").count("checks passed") == n, result
