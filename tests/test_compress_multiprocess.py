"""The compressors through both front doors at 2 and 3 ranks: tests/ranks/compress_train.py
(the Horovod API's DistributedOptimizer and collectives; the DDP hook over the "gradsync"
backend and over gloo, several buckets each), then gradient lag and LARC against a reference
worked by hand (tests/ranks/lag_checks.py). One job per world size runs them all, its ranks
forked from one process that imported torch once (tests/forked_jobs.py: what is checked is
inside the ranks, and the launcher's start-up added an interpreter and torch's import per
rank); the 3-rank job is in the slow tier (each job took 20-30 s on a loaded machine under
``gradsync run``)."""

import pytest

import forked_jobs


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_compressors_train_on_both_front_doors(n):
    result = forked_jobs.job(n, "compress_train.py", timeout=150)
    assert result.returncode == 0, result
    assert result.output.count("count 120") == n, result
