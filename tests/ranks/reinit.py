"""init / collectives / shutdown three times in one process: each init is a fresh job."""

import common  # noqa: F401  (deadline)
import numpy as np

import gradsync as gs

for i in range(3):
    gs.init()
    assert gs.is_initialized()
    y = gs.allreduce(np.ones(1000) * (gs.rank() + i), op=gs.Sum)
    assert y[0] == sum(range(gs.size())) + i * gs.size(), y[0]
    gs.barrier()
    gs.shutdown()
    assert not gs.is_initialized()
print("reinit ok", flush=True)
