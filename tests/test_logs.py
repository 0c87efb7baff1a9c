"""GRADSYNC_LOG_LEVEL shows what it names: gradsync.logs.configure."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest

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
