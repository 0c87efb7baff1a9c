"""``gradsync bench allreduce`` end to end: the table, the JSON rows, the gloo and Open MPI peers."""

import json
import os
import sys

import pytest

from harness import run_job

pytestmark = pytest.mark.multiprocess  # (the last two tests start nothing)

BENCH = [sys.executable, "-m", "gradsync", "bench", "allreduce"]
# This process's environment without its gradsync settings, as the harness gives a job.
ENV = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}


def test_bench_allreduce_checks_results_and_measures_gloo_beside(tmp_path):
    out = tmp_path / "rows.json"
    proc = run_job(
        BENCH + ["-np", "2", "--sizes", "4K:64K", "--factor", "16", "--seconds", "0.05",
                 "--algorithm", "ring,auto", "--compare", "gloo", "--buffer", "plain,shared",
                 "--json", str(out)], timeout=120)
    assert proc.returncode == 0, proc.stdout
    rows = json.loads(out.read_text())
    assert [(r["size"], r["requested"], r["buffer"]) for r in rows] == [
        (size, alg, buf) for size in (4096, 65536) for buf in ("plain", "shared")
        for alg in ("ring", "auto")]
    assert "auto:shm+shared" in proc.stdout
    for r in rows:
        assert r["gradsync"]["wrong"] == 0 and r["gloo"]["wrong"] == 0
        assert r["gradsync"]["time_us"] > 0 and r["ratio"] > 0
        assert r["algorithm"] == ("ring" if r["requested"] == "ring" else "shm")
    table = [line for line in proc.stdout.splitlines() if line.startswith("[0]<stdout>:  ")]
    assert len(table) == 1 + len(rows)  # the column header, then a line per row


def test_bench_allreduce_times_the_ring_exchange_over_tcp(tmp_path):
    # --exchange: each of 3 ranks sends 2 (n - 1) / n of the vector to the next over plain
    # sockets, in segments; every byte must arrive from the previous rank (#wrong counts those
    # that did not). At 6 MiB the ring measures its segment size first (during the warm-up),
    # and the exchange cuts the chosen one.
    out = tmp_path / "rows.json"
    proc = run_job(
        BENCH + ["-np", "3", "--sizes", "3K:6M", "--factor", "2048", "--seconds", "0.05",
                 "--exchange", "--json", str(out)], timeout=120,
        env={**ENV, "GRADSYNC_TRANSPORT": "tcp", "GRADSYNC_CHUNK_BYTES": "256K"})
    assert proc.returncode == 0, proc.stdout
    rows = json.loads(out.read_text())
    assert [r["size"] for r in rows] == [3072, 6 << 20]
    for r in rows:
        assert r["transport"] == "tcp" and r["gradsync"]["wrong"] == 0
        assert r["exchange"]["wrong"] == 0 and r["exchange"]["time_us"] > 0
    assert "exchange(us)" in proc.stdout
    assert rows[0]["segment"] == 256 << 10  # below ring.TUNE_FROM_BYTES: chunk_bytes
    assert rows[1]["segment"] in (64 << 10, 256 << 10)
    assert (f"# ring over TCP: segments of {rows[1]['segment']} B chosen for allreduces of "
            f"{6 << 20} B") in proc.stdout


def test_bench_allreduce_keeps_chunk_bytes_with_tune_segments_off(tmp_path):
    # GRADSYNC_TUNE_SEGMENTS=0 reaches the job's Comm: over TCP, at a size that would run the
    # trials, the ring cuts chunk_bytes and reports no choice.
    out = tmp_path / "rows.json"
    proc = run_job(
        BENCH + ["-np", "2", "--sizes", "4M:4M", "--seconds", "0.05", "--json", str(out)],
        timeout=120,
        env={**ENV, "GRADSYNC_TRANSPORT": "tcp", "GRADSYNC_CHUNK_BYTES": "256K",
             "GRADSYNC_TUNE_SEGMENTS": "0"})
    assert proc.returncode == 0, proc.stdout
    rows = json.loads(out.read_text())
    assert rows[0]["segment"] == 256 << 10 and rows[0]["gradsync"]["wrong"] == 0
    assert "# ring over TCP: segments of" not in proc.stdout


def test_bench_allreduce_measures_open_mpi_beside(tmp_path):
    """Open MPI through mpi4py in the same ranks (started by mpirun); the bench extra and the
    system's Open MPI are needed: this fails with the command that installs them."""
    from gradsync.bench.allreduce import missing_mpi

    problem = missing_mpi()
    assert problem is None, problem
    out = tmp_path / "rows.json"
    proc = run_job(
        BENCH + ["-np", "2", "--sizes", "4K:64K", "--factor", "16", "--seconds", "0.05",
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
