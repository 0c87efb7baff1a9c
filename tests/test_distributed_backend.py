"""The torch.distributed backend "gradsync": collectives against gloo, DDP and FSDP against a
single-process reference, failures on every rank. Rank scripts: tests/ranks/pg_*.py, started
as torchrun starts ranks, with torchrun's variables and a store the test hosts, so every
rank's own status and message count: forked from one process that imported torch once
(``forked_jobs.spawn``: a rank started on its own spent most of its test's time importing
torch), ``per_host`` ranks a host; one job goes through ``gradsync run``.
"""

import re
import subprocess
import sys

import pytest

import forked_jobs
from harness import launch

pytestmark = pytest.mark.multiprocess

# Small chunks and shared-memory slots: 300-element tensors take the multi-chunk paths.
SMALL_CHUNKS = {"GRADSYNC_CHUNK_BYTES": "256", "GRADSYNC_SHM_SLOT_BYTES": "256",
                "PYTHONFAULTHANDLER": "1"}  # a crash at exit shows every thread's stack


def _ok(ranks, marker):
    for r in ranks:
        assert r.returncode == 0 and marker in r.output, f"rank {r.rank}: exit {r.returncode}\n" \
                                                         f"{r.output[-5000:]}"


def test_registered_on_import_without_importing_torch():
    code = ("import sys, gradsync; assert 'torch' not in sys.modules; "
            "import torch.distributed as dist; assert 'GRADSYNC' in dist.Backend._plugins; "
            "assert dist.is_backend_available('gradsync')")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("np_,hosts", [(1, "a"), (3, "aab")])
def test_every_collective_and_dtype_against_gloo(np_, hosts):
    ranks = forked_jobs.spawn(np_, "pg_collectives.py", timeout=120, env=SMALL_CHUNKS,
                              per_host=hosts.count("a"))
    _ok(ranks, "pg collectives ok")


def test_every_collective_under_gradsync_run():
    # gradsync run exports torchrun's variables, so init_process_group() (env://) just works
    result = launch(2, "pg_collectives.py", timeout=120, env=SMALL_CHUNKS)
    assert result.returncode == 0, result
    assert result.output.count("pg collectives ok") == 2, result


@pytest.mark.parametrize("np_,hosts", [(2, "aa"), (3, "aab")])
def test_ddp_and_fsdp_train_like_one_process(np_, hosts):
    ranks = forked_jobs.spawn(np_, "pg_training.py", timeout=150, per_host=hosts.count("a"))
    _ok(ranks, "pg training ok: 11 checks")


@pytest.mark.parametrize("hosts", ["aaa", "aab"])
def test_rank_killed_mid_allreduce_under_ddp_fails_every_survivor(hosts):
    ranks = forked_jobs.spawn(3, "pg_faults.py", "kill", timeout=90, per_host=hosts.count("a"))
    assert ranks[2].returncode == -9, ranks[2]  # killed itself
    for r in ranks[:2]:
        assert r.returncode == 3, f"rank {r.rank}: exit {r.returncode}\n{r.output[-4000:]}"
        assert "caught RuntimeError" in r.output and "PeerLostBackendError" in r.output, r.output
        assert "rank 2" in r.output, r.output  # names the lost rank


@pytest.mark.parametrize("np_,first,second", [
    (2, "reduce_scatter_tensor", "barrier"), (3, "all_gather_into_tensor", "all_reduce")])
def test_mismatch_between_a_ring_and_the_shared_memory_group_fails_every_rank(np_, first,
                                                                              second):
    # The ring's ranks send frames that the group's rank never reads, and the group's rank
    # waits where the ring's never arrive: the group's wait looks at the frames waiting.
    ranks = forked_jobs.spawn(np_, "pg_faults.py", "roads", first, second, timeout=60)
    for r in ranks:
        assert r.returncode == 3, f"rank {r.rank}: exit {r.returncode}\n{r.output[-4000:]}"
        assert "caught MismatchBackendError" in r.output, r.output
        assert first in r.output and second in r.output, r.output  # what each rank issued
        seconds = float(re.search(r"raised after ([0-9.]+)s", r.output).group(1))
        assert seconds < 10, r.output


def test_shape_mismatch_under_ddp_fails_every_rank():
    ranks = forked_jobs.spawn(2, "pg_faults.py", "mismatch", timeout=90)
    for r in ranks:
        assert r.returncode == 3, f"rank {r.rank}: exit {r.returncode}\n{r.output[-4000:]}"
        assert "caught MismatchBackendError" in r.output, r.output
        assert "ranks issued different collectives" in r.output, r.output
