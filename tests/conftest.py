"""pytest's set-up for tests/: the per-file time budgets (tests/budgets.py, docs/testing.md)
and the groups that keep shared jobs in one worker on several workers (tests/parallel.py)."""

from budgets import (pytest_addoption, pytest_runtest_logreport,  # noqa: F401 (pytest's hooks)
                     pytest_runtest_makereport, pytest_sessionfinish, pytest_terminal_summary)
from parallel import pytest_collection_modifyitems, pytest_configure  # noqa: F401 (hooks)
