"""Shared set-up of rank scripts: a deadline that dumps every thread's stack, then exits."""

import faulthandler
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_deadline = float(os.environ.get("GS_TEST_DEADLINE", "0"))
if _deadline > 0:
    faulthandler.dump_traceback_later(_deadline, exit=True)


def inputs(kind: str, rank: int, count: int):
    """Closed-form inputs: small integers, so every dtype and reduction order is exact."""
    import numpy as np

    i = np.arange(count)
    if kind in ("sum", "average"):
        return rank + 1 + (i % 5)
    if kind in ("min", "max"):
        return (rank * 7 + i) % 11
    return 1 + ((rank + i) % 2)  # product: at most 2 ** size
