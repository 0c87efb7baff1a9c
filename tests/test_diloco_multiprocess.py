"""DiLoCo through the real front doors at 2 ranks: tests/ranks/diloco_train.py (the Horovod
API's asynchronous collectives, int8 included; TorchComm over a gloo group and over a
"gradsync" group; a DDP model under no_sync()). One job runs them all, its ranks forked from
one process that imported torch once (tests/forked_jobs.py)."""

import pytest

import forked_jobs


@pytest.mark.multiprocess
def test_diloco_on_both_front_doors():
    result = forked_jobs.job(2, "diloco_train.py", timeout=150)
    assert result.returncode == 0, result
    assert result.output.count("count 67") == 2, result
