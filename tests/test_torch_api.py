"""gradsync.torch's collectives through the real launcher at 1, 2 and 3 ranks.

The rank side is tests/ranks/torch_api.py: every collective and form (out-of-place, in place,
async, async in place, grouped) x dtype against a closed-form reference, Horovod's argument
conventions (average=, compression, prescale/postscale), the autograd gradients, the object
collectives, parameter and optimizer-state broadcast, SyncBatchNorm against BatchNorm on the
concatenated batch, join without an optimizer, and the errors raised for what gradsync cannot
honour. It exits non-zero at the first wrong value.
"""

import pytest

from harness import launch

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("n", [1, 2, 3])
def test_torch_api(n):
    result = launch(n, "torch_api.py", timeout=120)
    assert result.returncode == 0, result
    assert result.output.count("checks passed") == n, result
