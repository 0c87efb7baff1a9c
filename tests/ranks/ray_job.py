"""A Ray Train job: ``TorchTrainer`` with 2 CPU workers and ``TorchConfig(backend="gradsync")``.

``python ray_job.py``: starts a local Ray cluster, runs a DDP job with
``TorchConfig(backend="gradsync")`` and compares the final parameters the workers report with
one process training the same model on both workers' batches (``reference``). Ray's workers
are fresh processes that set up the process group before the training function runs, and
nothing here imports gradsync in them (no ``worker_process_setup_hook``): the backend is there
because torch's import loads gradsync's ``torch.backends`` entry point, as in a user's job with
gradsync installed. Prints ``ray train ok`` when the job ran on gradsync and agrees.

Until 2026-11-30 the job ran a second time with ``TorchConfig(backend="gloo")`` and the two
were compared: a second Ray Train job (its trainer and two workers, each importing torch) for a
result that the closed reference gives exactly, in this process.
"""

import os
import sys

import common  # noqa: F401  (deadline)
import torch

try:
    import ray
    import ray.train
    import ray.train.torch
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
except ImportError:
    sys.exit("this test needs Ray Train: pip install 'gradsync[ecosystem]' "
             "(or pip install 'ray[train]')")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


STEPS = 10


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g, dtype=torch.float64)
    return x, x.sum(1, keepdim=True).sin()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1)).double()


def train_loop(config):
    import torch.distributed as dist
    import torch.nn.functional as F

    net = ray.train.torch.prepare_model(model())
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    rank, size = dist.get_rank(), dist.get_world_size()
    x, y = data()
    for step in range(STEPS):
        lo = (step * 8 + rank * 4) % 64
        opt.zero_grad()
        F.mse_loss(net(x[lo:lo + 4]), y[lo:lo + 4]).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    if rank == 0:  # Ray Train keeps only checkpointed metrics: hand the result over a file
        torch.save({"backend": dist.get_backend(), "size": size, "params": flat},
                   config["out"])
    ray.train.report({"step": STEPS})


def reference() -> torch.Tensor:
    """The job in one process: each step's 8 samples, rank 0's 4 then rank 1's. DDP averages
    the two workers' gradients of their mean losses over 4 samples each: the gradient of the
    mean loss over the 8 (float64: equal up to the order of the sums)."""
    import torch.nn.functional as F

    net, (x, y) = model(), data()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        lo = step * 8 % 64
        opt.zero_grad()
        F.mse_loss(net(x[lo:lo + 8]), y[lo:lo + 8]).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


env = {"PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": env})  # no worker_process_setup_hook
backend = "gradsync"
out = f"/tmp/gradsync-ray/{backend}-{os.getpid()}.pt"
os.makedirs(os.path.dirname(out), exist_ok=True)
trainer = TorchTrainer(train_loop, train_loop_config={"out": out},
                       torch_config=TorchConfig(backend=backend),
                       scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                       run_config=ray.train.RunConfig(storage_path="/tmp/gradsync-ray",
                                                      name=f"job-{backend}-{os.getpid()}"))
result = trainer.fit()
if result.error is not None or not os.path.exists(out):
    sys.exit(f"{backend}: the job failed: {result.error!r}")
metrics = torch.load(out)
os.remove(out)
assert metrics["backend"] == backend and metrics["size"] == 2, metrics
print(f"{backend}: trained, {len(metrics['params'])} parameters", flush=True)
ray.shutdown()
want = reference()
if not torch.allclose(metrics["params"], want, rtol=1e-10, atol=1e-12):
    sys.exit(f"gradsync and one process differ by {(metrics['params'] - want).abs().max()}")
print("ray train ok", flush=True)
