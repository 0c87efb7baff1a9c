"""A World over a subset of ranks runs beside the job's World without interleaving."""

import pytest

import small_jobs

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("np_,transport", [(1, "auto"), (3, "tcp"), (4, "auto")])
def test_subworlds_run_beside_the_job(np_, transport):
    # tests/ranks/subworld.py, in the job it shares with other scripts (small_jobs.py)
    entry = "subworld.py" + (":tcp" if transport == "tcp" else "")
    result = small_jobs.result(np_)
    assert small_jobs.ran(result, entry, np_), result
    assert small_jobs.output(result, entry).count("subworld ok") == np_, result
