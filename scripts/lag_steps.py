"""Steps to the compress bench's language-model target with and without one step of gradient
lag, in one process: no exchange, so what it shows is the optimiser's cost of a stale
gradient, not the link's (docs/benchmarks.md, "Gradient lag costs this model more steps").

    python3 scripts/lag_steps.py LAG [LR]      # LAG 0 or 1; LR AdamW's, default 3e-3

Each step computes the gradients of SIZE (4) ranks on their own batches (the bench's task,
``gradsync.bench.compress_tasks``, the same seeds), averages them, and applies the average at
once (LAG 0) or at the next step (LAG 1, as ``DistributedOptimizer(gradient_lag=1)`` does: the
first step applies nothing). Prints the validation loss (on rank 0's share of the validation
set, as the bench's rank 0 sees it) every 8 steps until it is at most 2.4
or 400 steps have run.
"""

import os
import sys

import torch

from gradsync.bench import compress_tasks as ct

SIZE, TARGET, MAX_STEPS, EVERY = 4, 2.4, 400, 8


def setup(lr: float = 3e-3):
    """The bench's language-model task for SIZE ranks in one process: (the ranks' tasks, the
    model, AdamW, each rank's batch generator, the parameters), the data prepared once."""
    folder = "/tmp/gs_lag_steps_data"
    if not os.path.exists(os.path.join(folder, "done")):
        os.makedirs(folder, exist_ok=True)
        ct.prepare("lm", folder)
        open(os.path.join(folder, "done"), "w").close()
    sizes = ct.Sizes()
    tasks = [ct.load("lm", folder, sizes, 8, r, SIZE) for r in range(SIZE)]
    torch.manual_seed(0)
    model = ct.build_model("lm", sizes)
    opt = torch.optim.AdamW(model.parameters(), lr)
    gens = [torch.Generator().manual_seed(r) for r in range(SIZE)]
    return tasks, model, opt, gens, list(model.parameters())


def reached(step: int, tasks, model) -> bool:
    """Every EVERY steps, prints the validation loss (rank 0's share) and says whether it is
    at most TARGET."""
    if step % EVERY:
        return False
    loss, count, _ = tasks[0].evaluate(model)
    print(step, round(loss / count, 4), flush=True)
    return loss / count <= TARGET


def main() -> None:
    lag = int(sys.argv[1])
    tasks, model, opt, gens, params = setup(float(sys.argv[2]) if len(sys.argv) > 2 else 3e-3)
    pending = None
    for step in range(1, MAX_STEPS + 1):
        grads = [torch.zeros_like(p) for p in params]
        for rank in range(SIZE):
            model.zero_grad()
            x, y = tasks[rank].batch(gens[rank])
            tasks[rank].loss(model, x, y).backward()
            for g, p in zip(grads, params):
                g += p.grad / SIZE
        apply, pending = (grads, None) if lag == 0 else (pending, grads)
        if apply is not None:
            for g, p in zip(apply, params):
                p.grad = g
            opt.step()
        if reached(step, tasks, model):
            break


if __name__ == "__main__":
    main()
