"""One rank of one mode of ``gradsync bench compress``: train to the target, report.

    python3 -m gradsync.bench.compress_rank --settings FILE --mode MODE --result FILE

Started by the driver (``compress.py``) in its emulated host's namespace with torchrun's
variables (``netns.run``). Every mode joins the job's default group over gloo, which carries
the bench's own collectives (the barrier before each timed segment, the reduction of the
validation figures), and the modes over the gradsync backend add a group of their own
(``new_group(backend="gradsync")``) so that nothing of the bench's travels on it.

**A segment** is ``eval_every`` training steps (for ``gs-diloco`` and ``gs-streaming``,
rounded up to a multiple of H, and ``max_steps`` up to whole segments, so that every
evaluation sees a window's sync), and then as many more as it takes for no sync to be
running behind the steps (``gs-streaming``'s, ``gs-auto-local``'s with ``--local-overlap``;
at most ``EXTEND``, then waited for): a barrier, then the steps, timed on every rank and
counted at the slowest (a step is not done until the last rank is), so that the untimed
evaluation hides none of a sync's bytes and no mode waits for a sync its next steps would
hide; then each rank evaluates its share of the validation set with the clock stopped, and
one allreduce sums the figures. Every rank thus sees the same numbers and takes the same
decision: stop when the target is met (``reached``), at ``max_steps``, past ``minutes`` of
training time, or when the loss is no longer finite (``diverged``). The ``floor`` mode
trains with no exchange for ``floor_steps`` steps and evaluates nothing.

**Bytes.** The first rank of each host reads the host's ``eth0`` transmit counter
(``/proc/net/dev`` shows the namespace's own) around each segment's steps: what the host put
on the wire, every protocol's headers and the backends' own small messages included, and
nothing of the bench's (its collectives run outside the counted spans).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta

__all__ = ["main", "tx_bytes"]


def tx_bytes(dev: str = "eth0", table: str = "/proc/net/dev") -> int:
    """Bytes sent so far on ``dev`` of this process's network namespace."""
    with open(table) as f:
        for line in f:
            name, sep, fields = line.partition(":")
            if sep and name.strip() == dev:
                return int(fields.split()[8])  # receive has 8 fields, then transmit bytes
    raise RuntimeError(f"no interface {dev!r} in {table}")


def _torch_bf16_hook(state, bucket):
    """torch's ``bf16_compress_hook``, unchanged, under another name.

    ``DistributedDataParallel.register_comm_hook`` refuses a hook *named*
    ``bf16_compress_hook`` unless CUDA with NCCL 2.10+ (or XPU) is there (torch 2.13,
    ``nn/parallel/distributed.py``), although the hook only casts the bucket to bfloat16 and
    allreduces it on the given group, which gloo does on CPU tensors. No return annotation:
    DDP compares it with the object ``Future[Tensor]``, and this module's annotations are
    strings."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(state, bucket)


class _Trainer:
    """One mode's model and step: ``step(x, y)``; ``model`` is what evaluation runs."""

    def __init__(self, mode: str, model, task, s: dict):
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.task, self.model, self.outer, self.auto = task, model, None, None
        self.group = None  # the gradsync group, in the modes that have one
        lr = s["lr"]
        if mode == "floor":
            self.net, self.opt = model, torch.optim.AdamW(model.parameters(), lr)
            self.choice = "none (no exchange)"
            return
        if mode in ("gs-int8-lag", "gs-powersgd-lag"):
            self._lagged(mode, model, s)
            return
        group = None
        if mode.startswith("gs-"):
            import gradsync  # noqa: F401  (registers the backend "gradsync")

            group = self.group = dist.new_group(backend="gradsync")
        if mode in ("gs-diloco", "gs-streaming"):
            from gradsync.compress import BF16, DiLoCo, Int4, Int8, TorchComm

            inner = torch.optim.AdamW(model.parameters(), lr)
            sync = s["diloco_sync"]
            kind = {"int8": Int8, "int4": Int4, "bf16": BF16}.get(sync)
            streaming = mode == "gs-streaming"
            fragments, delay = ((s["streaming_fragments"], s["streaming_delay"]) if streaming
                                else (1, 0))
            self.outer = DiLoCo(model, inner, sync_every=s["diloco_h"], outer_lr=s["outer_lr"],
                                outer_momentum=s["outer_momentum"], fragments=fragments,
                                delay=delay,
                                carry=streaming and s.get("streaming_carry", True),
                                compressor=None if kind is None else kind(seed=s["seed"]),
                                comm=TorchComm(group))
            self.net, self.opt = model, self.outer
            overlap = (f", {fragments} fragments" if fragments > 1 else "") + (
                f", each landing {delay} steps later" if streaming else "") + (
                ", overwriting the steps in flight" if streaming
                and not s.get("streaming_carry", True) else "")
            self.choice = (f"H={s['diloco_h']}, outer lr {s['outer_lr']} momentum "
                           f"{s['outer_momentum']}, {sync}{overlap}")
            return
        # One bucket for torch's PowerSGD hook: with DDP's default buckets its second
        # allreduce, issued from a future's callback, can reach gloo in a different order on
        # different ranks, and gloo fails (issue 38). A bucket_cap_mb given by the caller
        # also caps the first bucket (DDP's 1 MiB first bucket is for the default only);
        # --bucket-cap-mb sets it for every other mode.
        cap = s.get("bucket_cap_mb")
        extra = ({"bucket_cap_mb": 1 << 12} if mode == "gloo-powersgd"
                 else {} if cap is None else {"bucket_cap_mb": cap})
        self.net = DDP(model, process_group=group, broadcast_buffers=False, **extra)
        self.opt = torch.optim.AdamW(model.parameters(), lr)
        r = s["powersgd_rank"]
        if mode in ("gloo-fp32", "gs-fp32"):
            self.choice = "fp32"
        elif mode == "gloo-bf16":
            self.net.register_comm_hook(None, _torch_bf16_hook)
            self.choice = "bf16 (torch's hook)"
        elif mode == "gloo-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            # start_powerSGD_iter=2: torch's smallest with error feedback (its first steps
            # are plain allreduces, while DDP rebuilds its buckets).
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                       start_powerSGD_iter=2, random_seed=s["seed"])
            self.net.register_comm_hook(state, psgd.powerSGD_hook)
            self.choice = f"rank {r}, one bucket"
        elif mode in ("gs-auto", "gs-auto-local"):
            from gradsync.compress import Auto, HookState, TorchComm, compressed_hook

            local = s.get("local_sgd") if mode == "gs-auto-local" else None
            self.auto = Auto(seed=s["seed"], local_sgd=local,
                             local_overlap=s.get("local_overlap", 0) if local else 0)
            self.net.register_comm_hook(HookState(self.auto, group, overlap=s.get("overlap", True)),
                                        compressed_hook)
            if local:  # as a DDP script does (docs/slow-links.md): the syncs on a group of
                # their own, after_step after each optimizer step (``step``)
                self.auto.attach(list(model.parameters()),
                                 comm=TorchComm(dist.new_group(backend="gradsync")),
                                 optimizer=self.opt)
            self.choice = "auto (not decided yet)"  # replaced by its decision at the end
        elif mode in ("gs-int8", "gs-int4", "gs-powersgd"):
            from gradsync.compress import HookState, Int4, Int8, PowerSGD, compressed_hook

            # PowerSGD's first two reductions of each bucket plain, as torch's hook's in
            # gloo-powersgd (start_powerSGD_iter=2): the two are compared like for like.
            compressor = Int8(seed=s["seed"]) if mode == "gs-int8" else \
                Int4(seed=s["seed"]) if mode == "gs-int4" else \
                PowerSGD(rank=r, seed=s["seed"], plain_steps=2)
            self.net.register_comm_hook(
                HookState(compressor, group, overlap=s.get("overlap", True)), compressed_hook)
            self.choice = compressor.describe()
        else:
            raise ValueError(f"unknown mode {mode!r}")

    def _lagged(self, mode: str, model, s: dict) -> None:
        """The Horovod API's ``DistributedOptimizer`` with a compressor and
        ``gradient_lag=1`` (docs/slow-links.md, "Gradient lag") on a World of its own: its
        store on the port after the default group's (rank 0 hosts both; every emulated host
        has its own ports)."""
        import torch

        import gradsync.torch as hvd
        from gradsync.compress import Int8, PowerSGD

        os.environ["GRADSYNC_STORE_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
        hvd.init()
        compressor = Int8(seed=s["seed"]) if mode == "gs-int8-lag" else \
            PowerSGD(rank=s["powersgd_rank"], seed=s["seed"])
        self.net = model
        self.opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), s["lr"]),
                                            named_parameters=model.named_parameters(),
                                            compression=compressor, gradient_lag=1)
        self.choice = f"{compressor.describe()}, gradient lag 1"

    def step(self, x, y) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.task.loss(self.net, x, y).backward()
        self.opt.step()
        if self.auto is not None:
            self.auto.after_step()  # local SGD's syncs (nothing unless attached)


def _evaluated(trainer: _Trainer):
    """The model a segment's evaluation runs: the trainer's, or under local SGD mid-window
    (``gs-auto-local`` with H > 1; ``gs-streaming``, whose ranks differ by the steps
    carried) a copy holding the ranks' average, as the window's sync will make it (averaged
    over the bench's own group, outside the timed steps)."""
    import copy

    import torch.distributed as dist

    if trainer.outer is not None:
        outer = trainer.outer
        if not outer.carry and outer.fragments == 1 and not outer.pending:
            return trainer.model  # a window's end: every rank holds the synced model
    elif trainer.auto is None or trainer.auto.period <= 1:
        return trainer.model
    average = copy.deepcopy(trainer.model)
    for p in average.parameters():
        dist.all_reduce(p.data)
        p.data /= dist.get_world_size()
    return average


EXTEND = 32
"""The most steps a segment runs past ``eval_every`` for a sync behind the steps to land."""


def _in_flight(trainer: _Trainer) -> bool:
    """Whether a sync runs behind the steps: ``gs-streaming``'s, or ``gs-auto-local``'s
    with ``--local-overlap``."""
    if trainer.outer is not None:
        return bool(trainer.outer.pending)
    return trainer.auto is not None and trainer.auto.in_flight()


def _meets(s: dict, loss: float, accuracy: float) -> bool:
    if s["task"] == "cnn":
        return accuracy >= s["target_accuracy"]
    return loss <= s["target_loss"]


def _train(trainer: _Trainer, task, gen, s: dict, floor: bool, measure: bool) -> dict:
    import torch
    import torch.distributed as dist

    segment = s["eval_every"]
    max_steps = s["floor_steps"] if floor else s["max_steps"]
    if trainer.outer is not None:  # whole windows only: evaluate the synced model
        h = s["diloco_h"]
        segment = -(-segment // h) * h
        max_steps = -(-max_steps // segment) * segment
    steps, clock, sent, evals = 0, 0.0, 0.0, []
    reached, stop = None, None
    while stop is None:
        count = min(segment, max_steps - steps)
        dist.barrier()
        before = tx_bytes() if measure else 0
        start = time.perf_counter()
        for _ in range(count):
            x, y = task.batch(gen)
            trainer.step(x, y)
        # The segment ends where no sync runs behind the steps (the same step on every
        # rank: the schedule is), a few steps more on the clock: the untimed evaluation
        # hides none of a sync's bytes, and no mode waits for one its next steps hide.
        while _in_flight(trainer) and count < segment + EXTEND:
            x, y = task.batch(gen)
            trainer.step(x, y)
            count += 1
        for outer in (trainer.outer, trainer.auto):
            if outer is not None:
                outer.settle()  # (past EXTEND steps: waited for on the clock)
        elapsed = time.perf_counter() - start
        wire = tx_bytes() - before if measure else 0
        steps += count
        figures = (0.0, 0, 0) if floor else task.evaluate(_evaluated(trainer))
        sums = torch.tensor([*figures, wire], dtype=torch.float64)
        dist.all_reduce(sums)
        slowest = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        clock += float(slowest)
        sent += float(sums[3])
        if not floor:
            loss, accuracy = float(sums[0] / sums[1]), float(sums[2] / sums[1])
            evals.append({"step": steps, "seconds": round(clock, 4), "loss": loss,
                          "accuracy": accuracy})
            if not math.isfinite(loss):
                stop = "diverged"
            elif _meets(s, loss, accuracy):
                reached, stop = (steps, clock), "reached"
        if stop is None and steps >= max_steps:
            stop = "max steps"
        if stop is None and clock >= s["minutes"] * 60:
            stop = "time budget"
    return {"steps": steps, "seconds": clock, "sent": sent, "evals": evals, "stop": stop,
            "eval_every": segment, "reached": reached is not None,
            "steps_to_target": reached[0] if reached else None,
            "time_to_target": reached[1] if reached else None,
            "final": evals[-1] if evals else {}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m gradsync.bench.compress_rank")
    p.add_argument("--settings", required=True, help="the driver's settings (JSON)")
    p.add_argument("--mode", required=True)
    p.add_argument("--result", required=True, help="rank 0 writes its row here (JSON)")
    args = p.parse_args(argv)
    with open(args.settings) as f:
        s = json.load(f)

    import torch
    import torch.distributed as dist

    from .compress_tasks import Sizes, build_model, load

    torch.set_num_threads(1)  # several ranks share the cores, as under torchrun
    dist.init_process_group("gloo", timeout=timedelta(seconds=s["collective_timeout"]))
    rank, size = dist.get_rank(), dist.get_world_size()
    sizes = Sizes(**s["sizes"])
    task = load(s["task"], s["data"], sizes, s["batch"], rank, size, s["val_items"])
    torch.manual_seed(s["seed"])  # the same weights on every rank, in every mode
    model = build_model(s["task"], sizes)
    trainer = _Trainer(args.mode, model, task, s)
    gen = torch.Generator().manual_seed(s["seed"] * 1000 + rank)  # the same batches per mode
    measure = int(os.environ.get("LOCAL_RANK", "0")) == 0
    row = _train(trainer, task, gen, s, args.mode == "floor", measure)
    hosts = size // s["ranks_per_host"]
    if trainer.auto is not None and trainer.auto.decision is not None:
        # The decision in force at the end (each change was logged at INFO on rank 0).
        decision = trainer.auto.decision
        trainer.choice = decision.short()
        row["decision"] = decision.summary()
        row["decisions"] = [f"step {d.step} ({d.reason}): {d.short()}"
                            for d in trainer.auto.history]
    if trainer.group is not None:
        # What the gradsync group's allreduces ran, by size (the planner's close calls
        # measured: collectives/planner.py).
        row["allreduce"] = trainer.group._get_backend(torch.device("cpu")).world.plans.kept()
    row.update(mode=args.mode, choice=trainer.choice,
               params=sum(p.numel() for p in model.parameters()),
               bytes_per_step=row.pop("sent") / hosts / row["steps"])
    if trainer.outer is not None:
        trainer.outer.finish()
    dist.barrier()
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # The rank ends here, without the interpreter's finalization: DDP keeps its process group
    # (gloo's, or gradsync's) alive past destroy_process_group, so the group's threads are
    # still running while the interpreter is torn down, and one that takes the GIL then is
    # ended by Python in a C++ frame that may not unwind: "terminate called without an active
    # exception", SIGABRT, as the rank ends (its last output line; once in about 150 gloo-fp32
    # runs here, once in CI). What the bench reports is written by now; flushed here.
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
