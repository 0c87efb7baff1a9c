"""Adasum over the job's real pairs (shm or tcp): every dtype and buffer layout against the
NumPy reference of tests/test_adasum.py. Run by tests/test_adasum_multiprocess.py.

    adasum_check.py shm|tcp

The transport is ``init()``'s keyword argument (not GRADSYNC_TRANSPORT), so that both run in
one job of tests/small_jobs.py, one after the other.
"""

import common  # noqa: F401  (deadline)

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gradsync as gs  # noqa: E402
from gradsync import job  # noqa: E402
from gradsync.collectives import adasum  # noqa: E402
from test_adasum import DTYPE_IDS, DTYPES, EPS, random_inputs, reference, widen  # noqa: E402

TRANSPORT = sys.argv[1]
gs.init(transport=TRANSPORT)
world, R, N = job.world(), gs.rank(), gs.size()
LAYOUTS = [[0], [1], [3 * N + 1], [5, 0, 1, 17, 2 * N + 3, 40], [20000, 3, 70001]]
checked = 0
for dtype, dtype_id in zip(DTYPES, DTYPE_IDS):
    for counts in LAYOUTS:
        inputs = random_inputs(N, sum(counts), dtype, seed=len(counts) + N)
        flat = inputs[R].copy()
        world.comm.begin(f"adasum {dtype_id} {counts}")
        adasum.allreduce(world.comm, flat, dtype, counts)
        want = reference(inputs, counts, dtype)
        scale = max(1.0, float(np.abs(want).max(initial=0.0)))
        bad = np.flatnonzero(np.abs(widen(flat, dtype) - want) > 8 * EPS[dtype] * scale)
        if bad.size:
            sys.exit(f"rank {R}: adasum {dtype_id} {counts}: wrong at {bad[:5].tolist()}: got "
                     f"{widen(flat, dtype)[bad[:5]]} want {want[bad[:5]]}")
        # Every rank must hold the same bits: compare a digest through a Sum allreduce.
        digest = np.frombuffer(flat.tobytes(), dtype=np.uint8).astype(np.int64).sum()
        total = gs.allreduce(np.array([digest], dtype=np.int64), op=gs.Sum, name="digest")
        if total[0] != digest * N:
            sys.exit(f"rank {R}: adasum {dtype_id} {counts}: ranks hold different bits")
        checked += 1
print(f"rank {R}: {checked} adasum checks passed over {world.config.transport}")
gs.shutdown()
