"""A World over a subset of ranks runs beside the job's World without interleaving."""

import pytest

from harness import launch

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("np_,transport", [(1, "auto"), (3, "tcp"), (4, "auto")])
def test_subworlds_run_beside_the_job(np_, transport):
    result = launch(np_, "subworld.py", timeout=60, env={"GRADSYNC_TRANSPORT": transport})
    assert result.returncode == 0, result
    assert result.output.count("subworld ok") == np_, result
