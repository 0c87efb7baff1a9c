"""What torch's own code asks of the "gradsync" backend (issue 37): the group answers for its
device and backend as a gloo group does, so FSDP2's full-state-dict load broadcast from rank 0
and DCP's ``async_save`` work; and the tests torch's backend-generic suite failed on gradsync
(``scripts/torch_suite.sh``): ``all_gather_coalesced``, a receive from any source, a sparse
``all_reduce``, a timeout worded as torch's. One 3-rank job (tests/ranks/pg_torch_contract.py)
runs every check; each test below reads its own check's line on every rank. Its ranks are
started as torchrun starts them, forked from one process that imported torch once
(tests/forked_jobs.py).
"""

import pytest

from forked_jobs import spawn

pytestmark = pytest.mark.multiprocess

CHECKS = ["devices", "fsdp2_full_state_dict_from_rank0", "async_save_on_the_default_group",
          "all_gather_coalesced", "recv_from_any_source", "sparse_all_reduce",
          "timeout_error_as_torch_words_it"]


@pytest.fixture(scope="module")
def ranks():
    # Two emulated hosts: shared memory between ranks 0 and 1, TCP to rank 2. No check here
    # is about lost ranks: a heartbeat that tolerates a starved rank (FSDP's and DCP's first
    # use import for seconds; CI's machine runs more ranks than it has cores).
    return spawn(3, "pg_torch_contract.py", timeout=300,
                 env={"GRADSYNC_HEARTBEAT_TIMEOUT": "30"},
                 per_rank_env=lambda r: {"GRADSYNC_HOSTNAME": f"host-{'aab'[r]}"})


@pytest.mark.parametrize("name", CHECKS)
def test_torch_contract(ranks, name):
    for r in ranks:
        assert f"rank {r.rank}: ok {name}\n" in r.output, \
            f"rank {r.rank} (exit {r.returncode}):\n{r.output[-6000:]}"


def test_torch_contract_job_ends_cleanly(ranks):
    for r in ranks:
        assert r.returncode == 0 and "torch contract done, 0 failed" in r.output, \
            f"rank {r.rank} (exit {r.returncode}):\n{r.output[-6000:]}"
