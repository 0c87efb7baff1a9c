"""GRADSYNC_LOG_LEVEL shows what it names: gradsync.logs.configure; and what a job says at
INFO (tests/ranks/info_job.py): once per job, never per step."""

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

import harness
from gradsync import logs

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def clean_logger():
    logger, root = logging.getLogger("gradsync"), logging.getLogger()
    saved = (logger.level, list(logger.handlers), list(root.handlers))
    logger.setLevel(logging.NOTSET)
    logger.handlers[:] = []
    root.handlers[:] = []
    yield logger
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    root.handlers[:] = saved[2]


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh process (pytest's own logging handlers would hide ours)."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env},
                          timeout=60)


def test_debug_records_reach_stderr_with_the_rank_once():
    proc = run("import logging; from gradsync import logs; logs.configure('DEBUG'); "
               "logs.configure('DEBUG'); lg = logging.getLogger('gradsync'); "
               "assert len(lg.handlers) == 1, lg.handlers; "
               "logging.getLogger('gradsync.transport.tcp').debug('connected to %d peers', 2); "
               "logging.getLogger('other').warning('not ours')", GRADSYNC_RANK="3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ("gradsync[3] DEBUG gradsync.transport.tcp: connected to 2 peers\n"
                           "not ours\n")  # other loggers: Python's last resort, as before


def test_the_default_level_changes_nothing(clean_logger):
    logs.configure("WARNING")
    assert (clean_logger.level, clean_logger.handlers) == (logging.NOTSET, [])


def test_a_program_that_configured_logging_keeps_its_handlers(clean_logger):
    logging.getLogger().addHandler(logging.NullHandler())
    logs.configure("INFO")
    assert clean_logger.level == logging.INFO and clean_logger.handlers == []


def test_the_level_follows_the_variable_at_init():
    # A fresh process: nothing at import, the handler once the config is built.
    proc = run("import logging, gradsync; lg = logging.getLogger('gradsync'); "
               "assert lg.handlers == [] and lg.level == 0; "
               "from gradsync.config import load_config; load_config(); "
               "lg.info('hello')", GRADSYNC_LOG_LEVEL="info")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "gradsync[?] INFO gradsync: hello\n"


# ---------------------------------------------------------------- what a job says at INFO
def _info(lines: list[str], rank: int) -> list[str]:
    """Rank ``rank``'s gradsync INFO records, without the launcher's prefix and the logger's."""
    tag = f"[{rank}]<stderr>:gradsync[{rank}] INFO "
    return [line[len(tag):].split(": ", 1)[1] for line in lines if line.startswith(tag)]


@pytest.mark.multiprocess
def test_an_info_job_says_once_who_is_who_and_what_was_chosen_and_nothing_per_step():
    # Two workers over TCP (so that three sizes take three algorithms), a parameter server
    # and a data server; 20 steps of every kind after the first (tests/ranks/info_job.py).
    r = harness.launch(2, "info_job.py", "20", "--ps", "--data", timeout=180,
                       env={"GRADSYNC_LOG_LEVEL": "INFO", "GRADSYNC_TRANSPORT": "tcp"},
                       launcher_args=("--servers", "1", "--data-servers", "1"))
    assert r.returncode == 0, r
    lines = r.output.splitlines()
    # The launcher: which process each rank is (a parameter server: the entry point it runs).
    started = {int(m[0]): (m[1], int(m[2])) for m in re.findall(
        r"^gradsync run: rank (\d) \(([a-z ]+ ?\d?)\) on host localhost: pid (\d+)"
        r"(?:, \S+ -m gradsync\.ps)?$", r.output, re.M)}
    assert {k: v[0] for k, v in started.items()} == {
        0: "worker", 1: "worker", 2: "parameter server 0", 3: "data server 0"}, r
    # ... and the one process of the job that is no rank: the store's keeper.
    assert re.search(r"^gradsync run: the job's store: port \d+, kept by pid \d+ \(the store "
                     r"keeper\)$", r.output, re.M), r
    # Each rank: who it is (the pid the launcher named), its role, its peers.
    for rank in (0, 1):
        pid = started[rank][1]
        assert f"rank {rank} of 2 on host localhost (pid {pid}, local rank {rank} of 2): " \
               "worker; peers: 0 over shared memory, 1 over tcp (connected on first use)" \
               in _info(lines, rank), r
    assert _info(lines, 2) == [f"rank 2 of 3 on host localhost (pid {started[2][1]}, local "
                               "rank 2): parameter server 0 of 1 (each shard on 1 of them), "
                               "serving 2 workers"], r
    assert _info(lines, 3) == [f"rank 3 on host localhost (pid {started[3][1]}): data server "
                               "0 of 1, serving 2 workers"], r
    # Rank 0: the fusion threshold, and each algorithm once, at the first size that chose it.
    chosen = [line for line in _info(lines, 0) if line.startswith("allreduce over 2 ranks")]
    assert sorted(line.split(",")[0].split(": ")[1] for line in chosen) == \
        ["doubling", "halving_doubling", "ring"], r
    assert "Horovod API (global, 2 ranks): fusion threshold 67108864 bytes (64 MiB)" in \
        _info(lines, 0), r
    assert _info(lines, 1)[1:] == [], r  # job-wide facts: rank 0 says them
    # Nothing per step: no record between the marks, whatever the number of steps.
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[{rank}]<stderr>:")]
        begin, end = mine.index(f"[{rank}]<stderr>:STEPS-BEGIN"), \
            mine.index(f"[{rank}]<stderr>:STEPS-END")
        assert _info(mine[begin:end], rank) == [], r
