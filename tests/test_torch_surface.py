"""The Horovod surface added for issue 10, through the real launcher at 1 to 4 ranks.

The rank side is tests/ranks/torch_surface.py: the build queries (gradsync's true answers),
op=Adasum in every allreduce and grouped_allreduce form against the NumPy reference of
tests/test_adasum.py and closed forms, grouped_allgather and grouped_reducescatter (sync,
async, gradients), sparse_allreduce_async, and DistributedOptimizer(op=Adasum) with SGD,
momentum, Adam, accumulation and a parameter only one rank uses, against closed forms.
"""

import pytest

from harness import launch
import small_jobs

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("n", [1, 2, 3])
def test_torch_surface(n):
    # tests/ranks/torch_surface.py, in the job it shares with other scripts (small_jobs.py)
    result = small_jobs.result(n)
    assert small_jobs.ran(result, "torch_surface.py", n), result
    assert small_jobs.output(result, "torch_surface.py").count("surface checks passed") == n, \
        result


@pytest.mark.slow
def test_torch_surface_at_4_ranks():
    result = launch(4, "torch_surface.py", timeout=150)
    assert result.returncode == 0, result
    assert result.output.count("surface checks passed") == 4, result
