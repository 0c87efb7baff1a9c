"""What one small ``dist.all_reduce`` costs a torch job, per backend (issue 37).

Run as ``gradsync run -np 2 python3 scripts/torch_small_call.py gradsync`` (or ``gloo``). The
default group on that backend; after 500 warm-up calls, five loops of 2,000 synchronous
``dist.all_reduce`` of the same 4 KiB float32 tensor, back to back, as a training loop's
metrics or loss averaging make them (Lightning's ``self.log(..., sync_dist=True)``); rank 0
prints the microseconds per call of each loop. Unlike ``gradsync bench backend``, whose
iterations each follow a barrier and are timed on the slower rank, this is the rate a loop
of such calls runs at.
"""

import sys
import time

import torch
import torch.distributed as dist

WARMUP, LOOPS, CALLS = 500, 5, 2000


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "gradsync"
    dist.init_process_group(backend)
    t = torch.ones(1024)
    for _ in range(WARMUP):
        dist.all_reduce(t)
    figures = []
    for _ in range(LOOPS):
        dist.barrier()
        began = time.perf_counter()
        for _ in range(CALLS):
            dist.all_reduce(t)
        figures.append((time.perf_counter() - began) / CALLS * 1e6)
    if dist.get_rank() == 0:
        print(f"{backend}: {' '.join(f'{f:.1f}' for f in figures)} us per all_reduce")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
