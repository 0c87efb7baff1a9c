"""A Ray Train job: ``TorchTrainer`` with 2 CPU workers and ``TorchConfig(backend=...)``.

``python ray_job.py``: starts a local Ray cluster, runs the same DDP job with
``TorchConfig(backend="gloo")`` and with ``TorchConfig(backend="gradsync")`` and compares the
final parameters the workers report. Ray's workers are fresh processes that set up the
process group before the training function runs, and nothing here imports gradsync in them
(no ``worker_process_setup_hook``): the backend is there because torch's import loads
gradsync's ``torch.backends`` entry point, as in a user's job with gradsync installed.
Prints ``ray train ok`` when both jobs ran on their backend and agree.
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


def train_loop(config):
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rank, size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g, dtype=torch.float64)
    y = x.sum(1, keepdim=True).sin()
    for step in range(10):
        lo = (step * 8 + rank * 4) % 64
        opt.zero_grad()
        F.mse_loss(model(x[lo:lo + 4]), y[lo:lo + 4]).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if rank == 0:  # Ray Train keeps only checkpointed metrics: hand the result over a file
        torch.save({"backend": dist.get_backend(), "size": size, "params": flat},
                   config["out"])
    ray.train.report({"step": 10})


env = {"PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": env})  # no worker_process_setup_hook
results = {}
for backend in ("gloo", "gradsync"):
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
    results[backend] = metrics["params"]
    print(f"{backend}: trained, {len(metrics['params'])} parameters", flush=True)
ray.shutdown()
if not torch.allclose(results["gloo"], results["gradsync"], rtol=1e-10, atol=1e-12):
    sys.exit(f"gloo and gradsync differ by {(results['gloo'] - results['gradsync']).abs().max()}")
print("ray train ok", flush=True)
