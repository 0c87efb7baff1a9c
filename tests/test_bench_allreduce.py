"""``gradsync bench allreduce``: the table, the JSON rows, the gloo and Open MPI peers.

Three of the runs checked here were a job of their own each (``gradsync bench allreduce -np
N``: the command, ``gradsync run`` and N ranks, each importing torch), whose time was mostly
those start-ups. Now one job of three ranks, forked from one process that imported torch once
(tests/forked_jobs.py), runs the benchmark's module three times, each run a fresh job with its
own arguments and settings (tests/ranks/bench_runs.py), and each test reads its own run's rows
and output. What the shared job leaves out, the command line that starts the ranks, has a test
of its own that starts nothing; the run beside Open MPI, whose ranks mpirun must start, is
still a job of its own through the command.
"""

import json
import sys

import pytest

import forked_jobs
from harness import run_job

pytestmark = pytest.mark.multiprocess  # (the tests of the command line start nothing)

BENCH = [sys.executable, "-m", "gradsync", "bench", "allreduce"]
MODULE = "gradsync.bench.allreduce"
# A check of the benchmark's logic and output, not of its timing: few iterations.
SHORT = ["--seconds", "0.05", "--max-iters", "10", "--warmup", "1"]
TCP = {"GRADSYNC_TRANSPORT": "tcp", "GRADSYNC_CHUNK_BYTES": "256K"}
RUNS = [
    # gloo beside, two algorithms on plain and shared buffers
    {"name": "gloo", "args": ["--sizes", "4K:64K", "--factor", "16", "--algorithm", "ring,auto",
                              "--compare", "gloo", "--buffer", "plain,shared", *SHORT],
     "env": {}},
    # the ring's transfers alone over TCP; at 6 MiB the ring's segment trials run first
    {"name": "exchange", "args": ["--sizes", "3K:6M", "--factor", "2048", "--exchange", *SHORT],
     "env": TCP},
    # GRADSYNC_TUNE_SEGMENTS=0 at a size that would run the trials
    {"name": "tune-off", "args": ["--sizes", "4M:4M", *SHORT],
     "env": {**TCP, "GRADSYNC_TUNE_SEGMENTS": "0"}},
]
"""The runs of the shared job, in order, each with ``--json NAME.json``."""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The shared job of ``RUNS`` at 3 ranks on one host. Timeout: each run had a job of 120 s;
    together, forked, they took 35 s on the 2-core machine at a load of 13, where their three
    jobs had taken 80 s at a load of 14 (2026-11-29)."""
    folder = tmp_path_factory.mktemp("bench-allreduce")
    runs = [{**run, "module": MODULE, "args": [*run["args"], "--json",
                                                str(folder / f"{run['name']}.json")]}
            for run in RUNS]
    return forked_jobs.bench_runs(3, runs, folder, timeout=300)


def _rows(job, name: str) -> list:
    """Run ``name``'s JSON rows; fails its test unless the run returned on every rank."""
    assert job.ran(name), job
    return json.loads((job.folder / f"{name}.json").read_text())


def test_bench_allreduce_checks_results_and_measures_gloo_beside(job):
    rows = _rows(job, "gloo")
    out = job.stdout("gloo")
    assert [(r["size"], r["requested"], r["buffer"]) for r in rows] == [
        (size, alg, buf) for size in (4096, 65536) for buf in ("plain", "shared")
        for alg in ("ring", "auto")]
    assert "auto:shm+shared" in out
    for r in rows:
        assert r["gradsync"]["wrong"] == 0 and r["gloo"]["wrong"] == 0
        assert r["gradsync"]["time_us"] > 0 and r["ratio"] > 0
        assert r["algorithm"] == ("ring" if r["requested"] == "ring" else "shm")
    table = [line for line in out.splitlines() if line.startswith("  ")]
    assert len(table) == 1 + len(rows), out  # the column header, then a line per row
    assert not any(job.stdout("gloo", r) for r in (1, 2)), job  # only rank 0 prints


def test_bench_allreduce_times_the_ring_exchange_over_tcp(job):
    # --exchange: each of 3 ranks sends 2 (n - 1) / n of the vector to the next over plain
    # sockets, in segments; every byte must arrive from the previous rank (#wrong counts those
    # that did not). At 6 MiB the ring measures its segment size first (during the warm-up),
    # and the exchange cuts the chosen one.
    rows = _rows(job, "exchange")
    out = job.stdout("exchange")
    assert [r["size"] for r in rows] == [3072, 6 << 20]
    for r in rows:
        assert r["transport"] == "tcp" and r["gradsync"]["wrong"] == 0
        assert r["exchange"]["wrong"] == 0 and r["exchange"]["time_us"] > 0
    assert "exchange(us)" in out
    assert rows[0]["segment"] == 256 << 10  # below ring.TUNE_FROM_BYTES: chunk_bytes
    assert rows[1]["segment"] in (64 << 10, 256 << 10)
    assert (f"# ring over TCP: segments of {rows[1]['segment']} B chosen for allreduces of "
            f"{6 << 20} B") in out


def test_bench_allreduce_keeps_chunk_bytes_with_tune_segments_off(job):
    # GRADSYNC_TUNE_SEGMENTS=0 reaches the job's Comm: over TCP, at a size that would run the
    # trials, the ring cuts chunk_bytes and reports no choice.
    rows = _rows(job, "tune-off")
    assert rows[0]["segment"] == 256 << 10 and rows[0]["gradsync"]["wrong"] == 0
    assert not any("# ring over TCP: segments of" in job.stdout("tune-off", r)
                   for r in range(3))


def test_the_command_starts_the_ranks_through_gradsync_run(monkeypatch):
    """The part of ``gradsync bench allreduce -np N ARGS`` that the shared job does not run:
    the command checks ARGS, then starts ``gradsync run -np N python -m
    gradsync.bench.allreduce ARGS`` (and, for a bad argument, nothing)."""
    from gradsync.bench import allreduce
    from gradsync.run.cli import main

    started = []
    monkeypatch.setattr(allreduce.subprocess, "call", lambda cmd: started.append(cmd) or 0)
    args = ["--sizes", "4K:64K", "--compare", "gloo", "--exchange"]
    assert main(["bench", "allreduce", "-np", "3", *args]) == 0
    assert started == [[sys.executable, "-m", "gradsync", "run", "-np", "3",
                        sys.executable, "-m", MODULE, *args]]
    with pytest.raises(SystemExit) as error:
        main(["bench", "allreduce", "-np", "3", "--compare", "nccl"])
    assert error.value.code == 2 and len(started) == 1


def test_bench_allreduce_measures_open_mpi_beside(tmp_path):
    """Open MPI through mpi4py in the same ranks (started by mpirun); the bench extra and the
    system's Open MPI are needed: this fails with the command that installs them."""
    from gradsync.bench.allreduce import missing_mpi

    problem = missing_mpi()
    assert problem is None, problem
    out = tmp_path / "rows.json"
    proc = run_job(
        BENCH + ["-np", "2", "--sizes", "4K:64K", "--factor", "16", *SHORT,
                 "--compare", "mpi", "--json", str(out)], timeout=120)
    assert proc.returncode == 0, proc.stdout
    rows = json.loads(out.read_text())
    assert [r["size"] for r in rows] == [4096, 65536]
    for r in rows:
        assert r["peer"] == "mpi" and r["algorithm"] == "shm"
        assert r["gradsync"]["wrong"] == 0 and r["mpi"]["wrong"] == 0
        assert r["mpi"]["time_us"] > 0 and r["ratio"] > 0
    assert "mpi(us)" in proc.stdout


def test_bench_allreduce_compare_mpi_names_what_is_missing(monkeypatch, capsys):
    from gradsync.bench import allreduce

    monkeypatch.setattr(allreduce.shutil, "which", lambda name: None)
    monkeypatch.setattr(allreduce.importlib.util, "find_spec", lambda name: None)
    problem = allreduce.missing_mpi()
    assert "Open MPI's mpirun and mpi4py" in problem
    assert "apt-get install -y --no-install-recommends openmpi-bin" in problem and "pip install" in problem
    args = allreduce.parser().parse_args(["--compare", "mpi"])
    assert allreduce.drive(["gradsync-run"], args, ["--compare", "mpi"], 2, None) == 2
    assert "apt-get install -y --no-install-recommends openmpi-bin" in capsys.readouterr().err


def test_mpirun_command_adopts_ranks_as_root_and_oversubscribes(monkeypatch):
    from gradsync.bench.allreduce import mpirun_command

    monkeypatch.setenv("GRADSYNC_SHM_FAST", "0")
    cmd = mpirun_command(64, ["--compare", "mpi"], 12345)
    assert cmd[:3] == ["mpirun", "-np", "64"] and "--oversubscribe" in cmd
    assert cmd[cmd.index("GRADSYNC_SHM_FAST") - 1] == "-x"  # gradsync's settings reach the ranks
    assert "MASTER_ADDR=127.0.0.1" in cmd and "MASTER_PORT=12345" in cmd
    assert cmd[-4:] == ["-m", "gradsync.bench.allreduce", "--compare", "mpi"]
