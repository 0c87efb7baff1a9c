"""Where the ``gradsync`` logger's records go: ``GRADSYNC_LOG_LEVEL`` made visible.

Python's logging shows nothing below WARNING until a handler is installed, so setting the
``gradsync`` logger to DEBUG alone prints nothing. ``configure(level)``, called when the
configuration is built (``config.load_config``, at ``init()``), sets the level and, unless the
program has configured logging itself, gives the ``gradsync`` logger (and only it) one stderr
handler whose lines name the rank::

    gradsync[1] DEBUG gradsync: connected to 3 peers in 0.02s

A program that has configured logging (a handler on the root logger or on ``gradsync``) keeps
its own output; only the level is set. The default level, WARNING, changes nothing: warnings
already reach stderr through Python's last-resort handler. Nothing happens at import (STYLE.md:
no logging configuration at import); calling ``configure`` again only changes the level.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["configure", "LOGGER"]

LOGGER = "gradsync"
"""The logger every gradsync module logs under (as ``gradsync`` or ``gradsync.<part>``)."""

_RANK_VARIABLES = ("GRADSYNC_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def _rank() -> str:
    """This process's rank: the job's once ``init()`` has run, else the launcher's variable."""
    api = sys.modules.get("gradsync.api")  # never imported from here: no cycle, no cost
    if api is not None and api.is_initialized():
        try:
            return str(api.rank())
        except Exception:  # a world being torn down: fall back to the launcher's word
            pass
    return next((os.environ[v] for v in _RANK_VARIABLES if v in os.environ), "?")


class _RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.gradsync_rank = _rank()
        return super().format(record)


class _Handler(logging.StreamHandler):
    """gradsync's own stderr handler: recognised, so that it is installed once. It writes to
    ``sys.stderr`` as it is at each record, not as it was when installed (a test or a
    notebook may replace it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass  # always sys.stderr


def configure(level: str) -> None:
    """Sets the ``gradsync`` logger to ``level`` and makes its records visible on stderr.

    Idempotent. Adds the handler only when neither the root logger nor ``gradsync`` has one
    (the program did not configure logging); at WARNING, the default, does nothing unless
    the level was changed earlier.

    Args:
        level: a logging level name (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``, ``CRITICAL``).
    """
    logger = logging.getLogger(LOGGER)
    if level == "WARNING" and logger.level == logging.NOTSET:
        return  # the default: Python's last-resort handler already prints warnings
    logger.setLevel(level)
    if any(isinstance(h, _Handler) for h in logger.handlers):
        return
    if logger.handlers or logging.getLogger().handlers:
        return  # the program configured logging: its handlers take the records
    handler = _Handler()
    handler.setFormatter(_RankFormatter(
        "gradsync[%(gradsync_rank)s] %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
