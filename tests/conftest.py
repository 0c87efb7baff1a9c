"""pytest's set-up for tests/: the per-file time budgets (tests/budgets.py, docs/testing.md)."""

from budgets import (pytest_addoption, pytest_runtest_logreport,  # noqa: F401 (pytest's hooks)
                     pytest_runtest_logstart, pytest_sessionfinish, pytest_terminal_summary)
