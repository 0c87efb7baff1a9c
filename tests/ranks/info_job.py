"""What a job says at INFO, and that it says it once: ``info_job.py STEPS``.

Run with ``GRADSYNC_LOG_LEVEL=INFO`` (tests/test_logs.py). Every worker takes one step of each
kind first, so that everything the job decides has been decided (the World's peers, the
allreduce algorithm of both sizes, the Horovod API's fusion threshold, a parameter-server
push, a data-server epoch), prints ``STEPS-BEGIN`` to stderr, then takes STEPS more steps and
prints ``STEPS-END``. The test counts gradsync's INFO lines between the two marks: none, what
ever STEPS is. The job may have parameter servers and data servers (``--servers``,
``--data-servers``): a data server serves inside ``Loader`` and ends, a parameter server
runs ``python -m gradsync.ps``, not this script; a worker then pushes to
the servers and reads batches too.
"""

import common  # noqa: F401  (deadline)

import sys

import numpy as np
import torch

import gradsync as gs
import gradsync.data
import gradsync.ps
import gradsync.torch as hvd


class Numbers:
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"x": np.full(3, i, np.float32)}


def main():
    steps = int(sys.argv[1])
    loader = gradsync.data.Loader(Numbers(), batch_size=4) if "--data" in sys.argv else None
    hvd.init()
    model = torch.nn.Linear(3, 1)
    ps = gradsync.ps.ParameterClient(model, optimizer="sgd", lr=0.1) \
        if "--ps" in sys.argv else None

    def step(index):
        for count in (16, 1 << 14, 1 << 18):  # 64 B, 64 KiB, 1 MiB: three size classes
            gs.allreduce(np.ones(count, np.float32))
        hvd.allreduce(torch.ones(8), name="grad")
        if ps is not None:
            model(torch.ones(2, 3)).sum().backward()
            ps.step()
        if loader is not None and index == 0:
            for _ in loader:  # an epoch: the data server's work is the same every epoch
                pass

    step(0)
    print("STEPS-BEGIN", file=sys.stderr, flush=True)
    for index in range(steps):
        step(index + 1)
    gs.barrier()
    print("STEPS-END", file=sys.stderr, flush=True)
    if ps is not None:
        ps.close()
    hvd.shutdown()


if __name__ == "__main__":
    main()
