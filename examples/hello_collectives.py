"""Every gradsync collective once, on NumPy arrays and torch tensors.

    gradsync run -np 4 python examples/hello_collectives.py
"""

import time

import numpy as np
import torch

import gradsync as gs

gs.init()
rank, size = gs.rank(), gs.size()

x = np.full(1_000_000, rank, dtype=np.float32)
start = time.perf_counter()
y = gs.allreduce(x, op=gs.Sum)                 # a new array; x is untouched
elapsed = time.perf_counter() - start
gs.allreduce_(x, op=gs.Average)                # in place
h = gs.allreduce_async(x, name="grad.w")       # returns at once
z = gs.synchronize(h)

t = torch.arange(4.0) * (rank + 1)
gathered = gs.allgather(t.reshape(1, 4))       # one row per rank
root_value = gs.broadcast(torch.tensor([rank]), root_rank=0)
mine = gs.reducescatter(torch.ones(size * 2, 3), op=gs.Sum)
info = gs.allgather_object({"rank": rank, "local_rank": gs.local_rank()})

if rank == 0:
    print(f"{size} ranks; allreduce of 4 MB took {elapsed * 1e3:.2f} ms")
    print(f"sum of ranks = {y[0]:.0f} (expected {size * (size - 1) // 2}); average = {x[0]:.2f}")
    print(f"allgather rows: {gathered.shape[0]}; broadcast from 0: {root_value.item()}; "
          f"reducescatter block: {tuple(mine.shape)} of {mine[0, 0].item():.0f}s")
    print(f"objects: {info}")
gs.barrier()
gs.shutdown()
