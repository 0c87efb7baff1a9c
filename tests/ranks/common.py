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


def elastic_job(hvd, features: int, samples: int, target, optimizer, batch_size: int,
                seed: int, **fields):
    """The toy regression that the elastic rank scripts train.

    ``samples`` points of ``features`` inputs spread evenly over [-1, 1], labelled by
    ``target`` (``torch.sin``, ``torch.cos``) of their sum weighted 1, 2, ... ``features``.
    The model is a tanh network with ``2 * features`` hidden units, trained by ``optimizer``
    (a function of the parameters, e.g. ``lambda p: torch.optim.SGD(p, lr=0.05)``) wrapped by
    ``hvd.DistributedOptimizer``, through an ``ElasticSampler`` of ``batch_size`` samples per
    batch, shuffled with ``seed``.

    Returns (dataset, model, optimizer, state): ``state`` is a ``TorchState`` of the model,
    the optimizer, the sampler and ``fields``.
    """
    import torch

    x = torch.linspace(-1, 1, samples * features).reshape(samples, features)
    y = target(x @ torch.arange(1.0, features + 1.0).unsqueeze(1))
    dataset = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.Sequential(torch.nn.Linear(features, 2 * features), torch.nn.Tanh(),
                                torch.nn.Linear(2 * features, 1))
    wrapped = hvd.DistributedOptimizer(optimizer(model.parameters()),
                                       named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, batch_size=batch_size, seed=seed)
    state = hvd.elastic.TorchState(model, wrapped, sampler=sampler, **fields)
    return dataset, model, wrapped, state


def digest(model) -> str:
    """A short hash of the model's parameters and buffers: equal on ranks that agree."""
    import hashlib

    import torch

    flat = torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()])
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16]


# --- waiting for another process, instead of sleeping for it ------------------------------

def lifeline(directory: str, survivors: int, cap: float = 30.0) -> None:
    """Arranges this process's SIGKILL for when it has stopped itself (SIGSTOP), which it
    cannot end on its own: once ``survivors`` files are in ``directory`` (each rank that has
    checked what it must leaves one: ``reported``), or after ``cap`` seconds if one never does.

    Not sooner: a stopped rank's closed sockets would tell the others what only its silence
    (the heartbeat) must. And not a fixed delay: that one is paid in full by every test, even
    when the survivors are done in 2 s. The shell ignores SIGTERM, so a launcher's stop, which
    SIGTERMs the group and SIGKILLs it after its grace, leaves it there to kill the stopped
    rank as soon as the survivors reported, not at the end of the grace."""
    import subprocess

    pid = os.getpid()
    script = (f"trap '' TERM; i=0; while [ \"$(ls {directory} | wc -l)\" -lt {survivors} ] && "
              f"[ $i -lt {int(cap * 10)} ] && kill -0 {pid}; do sleep 0.1; i=$((i + 1)); "
              f"done; kill -9 {pid}")
    subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)


def reported(directory: str, rank: int) -> None:
    """Leaves rank ``rank``'s file in ``directory``: it has what it came for (``lifeline``)."""
    open(os.path.join(directory, f"reported.{rank}"), "w").close()


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie its parent has not reaped counts: its
    sockets are closed and its port refuses)."""
    from gradsync.testbed.procfs import gone as ended

    return ended(pid)


def until(condition, what: str, timeout: float = 60.0, every: float = 0.01) -> None:
    """Polls ``condition()`` every ``every`` seconds until it holds; exits the rank naming
    ``what`` after ``timeout`` seconds (far beyond any step of a test on a loaded machine)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"pid {os.getpid()}: {what}: not within {timeout:.0f}s")
        time.sleep(every)
