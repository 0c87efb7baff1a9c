"""Runs ``gradsync probe`` as one rank (for tests that start ranks without the launcher)."""

import sys

import common  # noqa: F401  (deadline)

from gradsync.bench import probe

sys.exit(probe.main(sys.argv[1:]))
