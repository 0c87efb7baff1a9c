"""The torch.distributed backend "gradsync": collectives against gloo, DDP and FSDP against a
single-process reference, failures on every rank. Rank scripts: tests/ranks/pg_*.py, started
as torchrun starts ranks, with torchrun's variables and a store the test hosts, so every
rank's own status and message count: forked from one process that imported torch once
(``forked_jobs``: a rank started on its own spent most of its test's time importing torch),
``per_host`` ranks a host; one job goes through ``gradsync run``.

Two jobs run several scripts one after the other in the same ranks (``SHARED``), since each
script alone paid a job's start-up for seconds of checks.
"""

import re
import subprocess
import sys

import pytest

import forked_jobs
from harness import launch

pytestmark = pytest.mark.multiprocess

# Small chunks and shared-memory slots: 300-element tensors take the multi-chunk paths.
SMALL_CHUNKS = {"GRADSYNC_CHUNK_BYTES": "256", "GRADSYNC_SHM_SLOT_BYTES": "256"}
FAULTHANDLER = {"PYTHONFAULTHANDLER": "1"}  # a crash at exit shows every thread's stack

SHARED = {
    "aab": (3, 2, [{"name": "collectives", "module": "pg_collectives", "args": [],
                    "env": SMALL_CHUNKS},
                   {"name": "training", "module": "pg_training", "args": []},
                   {"name": "kill", "module": "pg_faults", "args": ["kill"]}]),
    "aa": (2, 2, [{"name": "training", "module": "pg_training", "args": []},
                  {"name": "mismatch", "module": "pg_faults", "args": ["mismatch"]}]),
}
"""The shared jobs by layout (a letter a rank's host): ranks, ranks a host, and the scripts
run in turn by tests/ranks/bench_runs.py, each as ``__main__`` with its arguments and
settings, in a process group of its own at a store of its own (the gloo groups the scripts
make put keys in the store that are numbered again from 0 after
``destroy_process_group``). Each script's stdout goes to its own file. A script that ends
its ranks (the kill: SIGKILL and exit 3; the mismatch: exit 3) comes last; a script that
fails ends its rank there, so its test and those of the scripts after it fail, never
pass."""


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """``shared(layout)``: the job of ``SHARED[layout]`` (``forked_jobs.BenchRuns``), run
    once per module; a deadline it missed fails every test that asks for it, once."""
    made: dict = {}

    def job(layout: str):
        if layout not in made:
            n, per_host, runs = SHARED[layout]
            try:
                made[layout] = forked_jobs.bench_runs(
                    n, runs, tmp_path_factory.mktemp(f"pg-{layout}"), timeout=300,
                    env=FAULTHANDLER, per_host=per_host), None
            except AssertionError as exc:
                made[layout] = None, exc
        done, error = made[layout]
        if error is not None:
            raise error
        return done
    return job


def _ok(ranks, marker):
    for r in ranks:
        assert r.returncode == 0 and marker in r.output, f"rank {r.rank}: exit {r.returncode}\n" \
                                                         f"{r.output[-5000:]}"


def _ran(job, name: str, marker: str) -> None:
    """Script ``name`` of a shared job returned on every rank (its exit status 0 alone) and
    printed ``marker`` on each."""
    assert job.ran(name), job
    for r in range(len(job.ranks)):
        assert marker in job.stdout(name, r), f"rank {r}:\n{job.stdout(name, r)[-5000:]}"


def test_registered_on_import_without_importing_torch():
    code = ("import sys, gradsync; assert 'torch' not in sys.modules; "
            "import torch.distributed as dist; assert 'GRADSYNC' in dist.Backend._plugins; "
            "assert dist.is_backend_available('gradsync')")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("np_,hosts", [(1, "a"), (3, "aab")])
def test_every_collective_and_dtype_against_gloo(np_, hosts, shared):
    if hosts in SHARED:
        _ran(shared(hosts), "collectives", "pg collectives ok")
    else:
        _ok(forked_jobs.spawn(np_, "pg_collectives.py", timeout=120, per_host=hosts.count("a"),
                              env={**SMALL_CHUNKS, **FAULTHANDLER}, lean=True),
            "pg collectives ok")


def test_every_collective_under_gradsync_run():
    # gradsync run exports torchrun's variables, so init_process_group() (env://) just works
    result = launch(2, "pg_collectives.py", timeout=120, env={**SMALL_CHUNKS, **FAULTHANDLER})
    assert result.returncode == 0, result
    assert result.output.count("pg collectives ok") == 2, result


@pytest.mark.parametrize("np_,hosts", [(2, "aa"), (3, "aab")])
def test_ddp_and_fsdp_train_like_one_process(np_, hosts, shared):
    _ran(shared(hosts), "training", "pg training ok: 14 checks")


@pytest.mark.parametrize("hosts", ["aaa", "aab"])
def test_rank_killed_mid_allreduce_under_ddp_fails_every_survivor(hosts, shared):
    if hosts in SHARED:  # the last script of its job: the ranks' ends are its
        job = shared(hosts)
        ranks, said = job.ranks, [job.stdout("kill", r) for r in range(3)]
    else:
        ranks = forked_jobs.spawn(3, "pg_faults.py", "kill", timeout=90, env=FAULTHANDLER,
                                  per_host=hosts.count("a"))
        said = [r.output for r in ranks]
    assert ranks[2].returncode == -9, ranks[2]  # killed itself
    for r in ranks[:2]:
        assert r.returncode == 3, f"rank {r.rank}: exit {r.returncode}\n{r.output[-4000:]}"
        out = said[r.rank]
        assert "caught RuntimeError" in out and "PeerLostBackendError" in out, out
        assert "rank 2" in out, out  # names the lost rank


@pytest.mark.parametrize("np_,first,second", [
    (2, "reduce_scatter_tensor", "barrier"), (3, "all_gather_into_tensor", "all_reduce")])
def test_mismatch_between_a_ring_and_the_shared_memory_group_fails_every_rank(np_, first,
                                                                              second):
    # The ring's ranks send frames that the group's rank never reads, and the group's rank
    # waits where the ring's never arrive: the group's wait looks at the frames waiting.
    # lean: the roads build no optimizer
    ranks = forked_jobs.spawn(np_, "pg_faults.py", "roads", first, second, timeout=60, lean=True)
    for r in ranks:
        assert r.returncode == 3, f"rank {r.rank}: exit {r.returncode}\n{r.output[-4000:]}"
        assert "caught MismatchBackendError" in r.output, r.output
        assert first in r.output and second in r.output, r.output  # what each rank issued
        seconds = float(re.search(r"raised after ([0-9.]+)s", r.output).group(1))
        assert seconds < 10, r.output


def test_shape_mismatch_under_ddp_fails_every_rank(shared):
    job = shared("aa")  # the last script of its job: the ranks' ends are its
    for r in job.ranks:
        out = job.stdout("mismatch", r.rank)
        assert r.returncode == 3, f"rank {r.rank}: exit {r.returncode}\n{r.output[-4000:]}"
        assert "caught MismatchBackendError" in out, out
        assert "ranks issued different collectives" in out, out
