"""The wait of DDP inside torch's C++ reducer, measured around it from the backward pass.

DDP launches each bucket's allreduce from an autograd hook while backward runs: it calls this
backend's ``allreduce`` (from C++, on the thread that runs the backward pass: for CPU
tensors, the thread that called ``loss.backward()``), asks the Work for its Future, and at the
end of backward waits on those Futures in C++, in the reducer's *finalize*, an autograd
*final callback* it queues right after launching its last bucket. No Python code runs during
that wait, so ``Work.wait`` never sees it, and the pace meter (``pace.py``) would count the
whole step as compute: every rank alike, no straggler named.

What the autograd engine promises: final callbacks run once the backward pass has computed
its last gradient, one after another, in the order they were queued, on the thread that ran
it; a callback may queue another, which runs after every one queued before. So:

- at the first collective this backend is asked for inside a backward pass (the engine's
  ``torch._C._current_graph_task_id()`` names the pass; -1 outside one), ``issued`` queues
  *before*. DDP queues its finalize later (after its last bucket's allreduce, which is ours),
  so *before* runs first: the backward's own work is done, the reducer is about to wait.
- *before* reads the clock and queues *after*, which runs once DDP's finalize has returned.
- *after* reports the wait as blocked time, from *before* to the last completion of a
  collective of the backend (``Lane`` writes it), at most to *after* itself (the rest of the
  finalize copies the buckets into the gradients: the rank's own work), and marks a step
  of level ``BACKWARD``: a DDP job's steps are its backward passes, so its ranks are judged
  step by step without a call of the user's (a ``gradsync.mark_step`` of theirs wins).

Worked example: a rank's backward ends at t=100 ms; its last bucket's allreduce, waiting for a
slower peer, completes at 130 ms; the finalize returns at 131 ms. *before* runs at 100,
*after* at 131: blocked [100, 130], 30 ms; the slow peer's *before* runs at 130 and its
allreduce completes at once: blocked about 0 ms, so the rule of ``straggler_watch.py`` finds it
late by 30 ms.

Cost per collective: one call into torch's C++ (a thread-local read) and a compare; per
backward pass, two callbacks. FSDP's reduce-scatters also run in backward hooks, and its
backward passes mark steps the same way; it waits for them through ``Work.wait``, which the
meter sees already (the union of intervals counts a wait seen twice once).
"""

from __future__ import annotations

import time

import torch

from ...liveness.pace import BACKWARD, meter

__all__ = ["Backward", "backward"]


class Backward:
    """The process's watch over backward passes that issue collectives of the backend."""

    def __init__(self):
        self.task = -1  # the graph task whose *before* is queued
        self.done_ns = 0
        """When a collective of the backend last completed (monotonic ns; ``Lane`` writes it)."""
        self._began = 0
        self._engine = None

    def issued(self) -> None:
        """A collective is issued: inside a backward pass not yet watched, queue *before*."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task == self.task or not meter.on:
            return
        self.task = task
        try:
            self._queue(self._before)
        except RuntimeError:  # no final callbacks here (a thread without a graph task)
            self.task = -1

    def _queue(self, callback) -> None:
        if self._engine is None:
            self._engine = torch.autograd.Variable._execution_engine
        self._engine.queue_callback(callback)

    def _before(self) -> None:
        self._began = time.monotonic_ns()
        self._queue(self._after)

    def _after(self) -> None:
        now = time.monotonic_ns()
        began = self._began
        meter.blocked(began, max(began, min(now, self.done_ns)))
        self.task = -1
        meter.mark_step(BACKWARD)


backward = Backward()
"""The process's watch."""
