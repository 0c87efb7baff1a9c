"""Training throughput: gradsync.torch's DistributedOptimizer beside DDP (gloo), in one run.

Run as ``gradsync bench train -np N [--model mlp|cnn|both] [--compare ddp|fsdp]``; every rank runs
this module. Each rank trains on its own synthetic batch (random tensors made once, seeded by
rank) with SGD (momentum 0.9), one thread per rank. Every model is built once from a fixed
seed and copied, so all modes start from the same weights. The modes:

- ``single``: rank 0 trains alone (a plain optimizer) while the other ranks block on the
  rendezvous store, a socket read that takes no CPU. This is a one-rank job on this machine,
  the baseline of scaling efficiency: ``eff = job samples/s / (N x single)``. It is the honest
  baseline: the textbook definition, and what a user gains by adding ranks. Running N copies
  at once costs something even without communication (memory bandwidth, shared caches, the
  launcher and the other ranks' threads), and that loss counts against scaling here.
- ``local``: every rank trains its own copy at the same time, without communication. The
  same computation under the same load as the distributed modes, so ``comm = job samples/s /
  local`` isolates what communication costs (and ``local / (N x single)`` what the load does).
- ``gradsync``: ``gradsync.torch.DistributedOptimizer`` (its buckets are allreduced while
  backward runs; ``step()`` waits for the rest).
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel``, gloo, on the job's store
  (``--compare ddp``).
- ``ddp-gs``: the same DDP over the torch.distributed backend "gradsync" (a
  ``new_group(backend="gradsync")`` beside gloo's default group; ``--compare ddp``).
- ``gradsync-off`` (``--overhead``): ``gradsync`` again (a trainer of its own from the same
  weights, so that ``gradsync``'s parameters stay comparable with its peer's after the same
  steps), run with the flight recorder and the
  straggler watch off: the recorder keeps no record (as ``flight_recorder=0``), the pace
  meter counts nothing and its publisher makes no store request (as
  ``straggler_interval=0``; its thread still wakes once an interval, and finds it has
  nothing to do). ``gradsync`` runs them as the job is configured (the defaults: both on).
  Within each round the two take turns in alternating order, so that neither always runs
  right after the other modes; the table adds ``gs-off`` and ``on/off``: per round the
  ``gradsync`` rate over the ``gradsync-off`` rate, the median over the rounds (1 - it is
  the cost of observing the job, issue 41 item 5). ``--overhead-control`` runs the same two
  trainers with nothing turned off: the two are separate copies of the model (their own
  parameters, buckets and addresses), so its on/off is what the method reads when there is no
  cost to find, the yardstick for the real one.
- ``fsdp`` and ``fsdp-gs`` (``--compare fsdp``, instead of the two DDP modes):
  ``FullyShardedDataParallel`` (the whole model one unit, fully sharded: an allgather of the
  parameters in forward and in backward, a reduce-scatter of the gradients) over gloo and over
  the backend "gradsync". Their parameters are checksummed whole (``summon_full_params``).

Timing: each mode first runs ``--warmup`` steps. Then ``--windows`` rounds; in each round each
mode in turn runs ``--steps`` steps, started after a barrier and timed on every rank; a
window's time is the slowest rank's (the step is not done until the last rank is). The modes
take turns window by window, so that a slow spell of the machine hits them alike. Rates are
samples/s of the whole job (N x batch x steps / time; ``single``: one rank) and the table
shows their median over windows, with the interquartile range of the distributed modes in
percent of it. The step and window counts are rank 0's, broadcast.

After timing, every rank's parameters are checksummed (CRC32 of their bytes) and gathered:
gradsync and DDP must leave all ranks with identical parameters, bit for bit. The exit status
is 1 when they don't.

``--profile`` adds a pass that times each phase of a step on rank 0: forward (with
zero_grad), backward (for gradsync: its hooks copy gradients into buckets and launch their
allreduces; for DDP: its allreduces, which backward waits for), sync (gradsync's
``synchronize()``: launching what backward did not and waiting for the allreduces in
flight), update (the wrapped optimizer's step, inside ``skip_synchronize()``); and, in the
JSON rows only, ``compute`` (rank 0's forward + backward + update, median over the steps)
and ``compute_slowest`` (the same sum, per step the slowest rank's: the allreduces wait for
it; ``gradsync simulate`` predicts the step from it).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
import zlib

import numpy as np

from ..testbed.models import MODELS, build_model
from .allreduce import at_least

__all__ = ["parser", "run"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync bench train")
    p.add_argument("--model", choices=[*MODELS, "both"], default="both")
    p.add_argument("--batch-size", type=at_least(1), default=32, help="samples per rank per step")
    p.add_argument("--steps", type=at_least(1), default=20,
                   help="steps per timed window (default 20)")
    p.add_argument("--windows", type=at_least(1), default=5,
                   help="timed windows per mode (default 5)")
    p.add_argument("--warmup", type=at_least(0), default=5,
                   help="untimed steps per mode (default 5)")
    p.add_argument("--compare", choices=["ddp", "fsdp", "none"], default="none",
                   help="also measure DistributedDataParallel (ddp) or FullyShardedDataParallel "
                        "(fsdp), over gloo and over the backend 'gradsync', in the same run")
    p.add_argument("--bucket-view", action="store_true",
                   help="both DDP modes with gradient_as_bucket_view=True (gradients live in "
                        "DDP's buckets: one copy of every gradient less per step)")
    p.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none",
                   help="gradsync's gradient compression")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows to this file (rank 0)")
    p.add_argument("--profile", action="store_true",
                   help="time forward, backward, sync and update of each mode (rank 0)")
    p.add_argument("--overhead", action="store_true",
                   help="also run the gradsync mode with the flight recorder and the "
                        "straggler watch off, window for window beside it, and print the "
                        "ratio of the two (median over the windows)")
    p.add_argument("--overhead-control", action="store_true",
                   help="--overhead with the observers left on in gs-off's windows too: "
                        "the two trainers then differ only in being two copies, so on/off "
                        "shows what the method itself reads when nothing is turned off")
    return p


class _Observers:
    """The flight recorder and the straggler watch of the job, turned off for the windows of
    ``gradsync-off`` and back on (as the job was configured) for the others; ``seen`` counts
    what they recorded in the windows of each (records kept, steps measured), so that the
    JSON rows show the windows off observed nothing."""

    def __init__(self, recorder, meter, publisher, control: bool = False):
        self.recorder, self.meter, self.publisher = recorder, meter, publisher
        self.entries, self.metering = recorder.size, meter.on
        self.control = control
        """True (``--overhead-control``): nothing is turned off; gs-off's windows are observed
        as gradsync's are, so on/off measures the two copies' difference, not observing."""
        self.seen = {"on": {"records": 0, "steps": 0}, "off": {"records": 0, "steps": 0}}

    @classmethod
    def of_job(cls, control: bool = False) -> "_Observers":
        """The running job's recorder, meter and straggler publisher."""
        from .. import job
        from ..flight_recorder import recorder
        from ..liveness.pace import meter

        return cls(recorder, meter, job.current().pace, control)

    @contextlib.contextmanager
    def window(self, mode: str):
        """Runs a window of ``mode`` (``gradsync`` or ``gradsync_off``) and counts what was
        observed in it."""
        off = mode == "gradsync_off"
        if off and not self.control:
            self.turn(False)
        began, step = time.monotonic_ns(), self.meter.step  # the records' clock
        try:
            yield
        finally:
            seen = self.seen["off" if off else "on"]
            seen["records"] += sum(r.created_ns >= began for r in self.recorder.records())
            seen["steps"] += self.meter.step - step
            if off and not self.control:
                self.turn(True)

    def turn(self, on: bool) -> None:
        self.recorder.resize(self.entries if on else 0)
        self.meter.pause(on and self.metering)
        if self.publisher is not None:
            self.publisher.paused = not on


class _Trainer:
    """One mode's model, optimizer and step; ``timed_step`` adds the phase timers."""

    def __init__(self, mode: str, model, x, y, hvd, compression: str, group=None,
                 bucket_view: bool = False):
        import torch
        import torch.nn.functional as F

        self.mode, self.model, self.x, self.y, self.F = mode, model, x, y, F
        if mode in ("ddp", "ddp_gs"):  # ddp_gs: over the gradsync backend's group
            self.model = torch.nn.parallel.DistributedDataParallel(
                model, process_group=group, gradient_as_bucket_view=bucket_view)
        if mode in ("fsdp", "fsdp_gs"):
            from torch.distributed.fsdp import FullyShardedDataParallel

            self.model = FullyShardedDataParallel(model, process_group=group,
                                                  device_id=torch.device("cpu"),
                                                  use_orig_params=True)
        # (FSDP's parameters are its shards: the optimizer must take the wrapper's.)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        if mode == "gradsync":
            self.opt = hvd.DistributedOptimizer(self.opt, named_parameters=model.named_parameters(),
                                                compression=getattr(hvd.Compression, compression))
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(self.opt, root_rank=0)

    def step(self) -> None:
        self.opt.zero_grad()
        self.F.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()

    def timed_step(self) -> list[float]:
        """One step; returns the seconds of forward, backward, sync and update."""
        t0 = time.perf_counter()
        self.opt.zero_grad()
        loss = self.F.cross_entropy(self.model(self.x), self.y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if self.mode == "gradsync":
            self.opt.synchronize()
            t3 = time.perf_counter()
            with self.opt.skip_synchronize():
                self.opt.step()
        else:
            t3 = t2
            self.opt.step()
        t4 = time.perf_counter()
        return [t1 - t0, t2 - t1, t3 - t2, t4 - t3]

    def checksum(self) -> int:
        """CRC32 of the whole parameters (gathered, for FSDP: a collective)."""
        if self.mode in ("fsdp", "fsdp_gs"):
            from torch.distributed.fsdp import FullyShardedDataParallel

            with FullyShardedDataParallel.summon_full_params(self.model):
                return self._crc()
        return self._crc()

    def _crc(self) -> int:
        crc = 0
        for p in self.model.parameters():
            # A copy: a tensor seen through NumPy can no longer be resized, and FSDP frees
            # the storage of its gathered parameters by resizing it.
            crc = zlib.crc32(p.detach().clone().numpy().tobytes(), crc)
        return crc


def run(args) -> list[dict]:
    import torch
    import torch.distributed as dist

    import gradsync.torch as hvd
    from gradsync import job

    args.overhead = args.overhead or args.overhead_control
    hvd.init()
    torch.set_num_threads(1)
    world = job.world()
    rank, n = hvd.rank(), hvd.size()
    peer = None if args.compare == "none" else args.compare  # ddp or fsdp
    compare = peer is not None
    if compare:
        store = torch.distributed.PrefixStore("bench-train-ddp", world.store.base)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n)
        gs_group = dist.new_group(backend="gradsync")  # the backend "gradsync", for the _gs mode
    # Rank 0's counts, so that every rank issues the same collectives.
    steps, args.windows, args.warmup = hvd.broadcast_object(
        (args.steps, args.windows, args.warmup), 0, name="bench.train.counts")
    modes = ["single", "local", "gradsync"] + (["gradsync_off"] if args.overhead else []) \
        + ([peer, f"{peer}_gs"] if compare else [])
    observers = _Observers.of_job(args.overhead_control) if args.overhead else None
    rows = []
    for model_name in MODELS if args.model == "both" else [args.model]:
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        base, shape = build_model(model_name)
        gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own data
        x = torch.randn(args.batch_size, *shape, generator=gen)
        y = torch.randint(0, 10, (args.batch_size,), generator=gen)
        local = _Trainer("local", copy.deepcopy(base), x, y, hvd, args.compression)
        trainers = {"single": local, "local": local,
                    "gradsync": _Trainer("gradsync", copy.deepcopy(base), x, y, hvd,
                                         args.compression)}
        if args.overhead:
            trainers["gradsync_off"] = _Trainer("gradsync", copy.deepcopy(base), x, y, hvd,
                                                args.compression)
        if compare:
            trainers[peer] = _Trainer(peer, copy.deepcopy(base), x, y, hvd, args.compression,
                                      bucket_view=args.bucket_view)
            trainers[f"{peer}_gs"] = _Trainer(f"{peer}_gs", copy.deepcopy(base), x, y, hvd,
                                              args.compression, group=gs_group,
                                              bucket_view=args.bucket_view)
        for mode in modes:
            if mode != "single":  # ``local`` warms up the model ``single`` uses
                for _ in range(args.warmup):
                    trainers[mode].step()
        times = {mode: [] for mode in modes}
        for w in range(args.windows):
            for mode in _turns(modes, w):
                watched = observers is not None and mode in ("gradsync", "gradsync_off")
                with observers.window(mode) if watched else contextlib.nullcontext():
                    times[mode].append(_window(trainers[mode], steps, mode, rank, n, world,
                                               f"{model_name}.{w}"))
        row = _summarise(model_name, base, args, n, steps, times, world)
        if observers is not None:
            row["control"] = observers.control
            row["observed"] = copy.deepcopy(observers.seen)
            observers.seen = {k: {"records": 0, "steps": 0} for k in observers.seen}
        if args.profile:
            row["profile_ms"] = {mode: _profile(trainers[mode], steps * args.windows)
                                 for mode in modes if mode not in ("single", "gradsync_off")}
        sums = {mode: hvd.allgather_object(trainers[mode].checksum(), name=f"bench.crc.{mode}")
                for mode in modes if mode not in ("single", "local", "gradsync_off")}
        row["checksums"] = sums
        row["identical"] = all(len(set(v)) == 1 for v in sums.values())
        rows.append(row)
        if rank == 0:
            _print_row(row, header=len(rows) == 1, peer=peer)
    if rank == 0:
        _print_footer(rows, peer, args.profile)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    if compare:
        dist.destroy_process_group()
    hvd.shutdown()
    return rows


def _turns(modes: list[str], window: int) -> list[str]:
    """The modes in the order of round ``window``: ``gradsync`` and ``gradsync_off`` swap
    places every other round, so that neither always follows the same mode."""
    if window % 2 == 0 or "gradsync_off" not in modes:
        return modes
    turned = list(modes)
    on, off = turned.index("gradsync"), turned.index("gradsync_off")
    turned[on], turned[off] = "gradsync_off", "gradsync"
    return turned


def _window(trainer: _Trainer, steps: int, mode: str, rank: int, n: int, world,
            key: str) -> float:
    """Times ``steps`` steps of ``trainer``; returns this rank's seconds (0 when idle)."""
    import gradsync as gs

    gs.barrier()
    if mode == "single":
        elapsed = 0.0
        if rank == 0:
            start = time.perf_counter()
            for _ in range(steps):
                trainer.step()
            elapsed = time.perf_counter() - start
        # The others wait in a blocking read of the store, leaving the machine to rank 0.
        world.store.barrier(f"bench.train.single.{key}", n, world.store.timeout)
        return elapsed
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step()
    return time.perf_counter() - start


def _summarise(model_name, base, args, n, steps, times, world) -> dict:
    import gradsync as gs

    row = {"model": model_name, "params": sum(p.numel() for p in base.parameters()),
           "batch": args.batch_size, "ranks": n, "steps": steps, "windows": args.windows,
           "compression": args.compression, "bucket_view": args.bucket_view,
           "fusion_threshold": world.config.fusion_threshold}
    slowest_of = {}
    for mode, samples in times.items():
        slowest = slowest_of[mode] = gs.allreduce(np.array(samples), op=gs.Max,
                                                  name=f"bench.train.{mode}")
        ranks = 1 if mode == "single" else n
        rates = ranks * args.batch_size * steps / slowest
        q75, q25 = np.percentile(rates, [75, 25])
        median = statistics.median(rates.tolist())
        row[mode] = {"samples_per_s": median, "iqr_pct": 100 * (q75 - q25) / median,
                     "step_ms": statistics.median(slowest.tolist()) / steps * 1e3}
    if "gradsync_off" in times:
        # Per round the rate observed over the rate unobserved (= the unobserved window's
        # time over the observed one's): rounds pair windows run close together in time.
        ratios = slowest_of["gradsync_off"] / slowest_of["gradsync"]
        row["observed_ratio"] = statistics.median(ratios.tolist())
        row["observed_ratios"] = ratios.tolist()
    single = row["single"]["samples_per_s"]
    for mode in times:
        if mode != "single":
            row[mode]["eff"] = row[mode]["samples_per_s"] / (n * single)
            row[mode]["comm"] = row[mode]["samples_per_s"] / row["local"]["samples_per_s"]
    for peer in ("ddp", "fsdp"):
        if peer in row:
            rate, gs_rate = row[peer]["samples_per_s"], row[f"{peer}_gs"]["samples_per_s"]
            row["ratio"] = row["gradsync"]["samples_per_s"] / rate
            row[f"ratio_{peer}_gs"] = gs_rate / rate
            row[f"ratio_{peer}_gs_gradsync"] = gs_rate / row["gradsync"]["samples_per_s"]
    return row


def _profile(trainer: _Trainer, steps: int) -> dict:
    """Median seconds of each phase over ``steps`` steps, as milliseconds."""
    import gradsync as gs

    gs.barrier()
    phases = np.array([trainer.timed_step() for _ in range(steps)])
    med = np.median(phases, axis=0) * 1e3
    # Per step, the slowest rank's compute: the allreduces wait for it (gradsync simulate
    # predicts the step from it). Exchanged after the timed steps, so it times none of them.
    compute = phases[:, 0] + phases[:, 1] + phases[:, 3]
    slowest = gs.allreduce(compute, op=gs.Max, name=f"bench.train.profile.{trainer.mode}")
    return {"forward": med[0], "backward": med[1], "sync": med[2], "update": med[3],
            "total": float(np.median(phases.sum(axis=1)) * 1e3),
            "compute": float(np.median(compute) * 1e3),
            "compute_slowest": float(np.median(slowest) * 1e3)}


#: The ratio columns' short names: the peer's mode over the backend "gradsync".
_SHORT = {"ddp": "dgs", "fsdp": "fgs"}
_WHAT = {"ddp": "DDP", "fsdp": "FSDP (the whole model one fully sharded unit)"}


def _print_row(row: dict, header: bool, peer: "str | None") -> None:
    if header:
        fusion = row["fusion_threshold"]
        fusion = f"{fusion >> 20}M" if fusion % (1 << 20) == 0 else f"{fusion}B"
        short = _SHORT.get(peer)
        view = f" (gradient_as_bucket_view={row['bucket_view']})" if peer == "ddp" else ""
        for line in (
                f"training throughput, {row['ranks']} ranks x 1 thread, synthetic data, SGD, "
                f"batch {row['batch']} per rank, {row['windows']} windows x {row['steps']} "
                f"steps after warm-up; gradsync compression={row['compression']}, "
                f"fusion_threshold={fusion}",
                "samples/s of the whole job, median over windows of the slowest rank; "
                "iqr = interquartile range, % of the median",
                "single = rank 0 alone, the others blocked on the store (the 1-rank baseline); "
                "local = every rank at once, no communication",
                "eff = rate / (N x single): scaling efficiency; comm = rate / local: "
                "what communication costs",
                *(["gs-off = gradsync with the flight recorder and the straggler watch off; "
                   "on/off = gradsync's rate over gs-off's, per round, median over the "
                   f"{row['windows']} rounds (1 - on/off: the cost of observing the job)"]
                  if "gradsync_off" in row and not row.get("control") else []),
                *(["control (--overhead-control): gs-off = a second gradsync trainer, "
                   "observed like the first; on/off = their rates' ratio, per round, median "
                   f"over the {row['windows']} rounds: what the method reads with no cost to "
                   "find"] if row.get("control") else []),
                *([f"{peer} = {_WHAT[peer]} over gloo; {peer}-gs = the same over the "
                   f"torch.distributed backend 'gradsync'{view}; {short}/{peer} and "
                   f"{short}/gs: {peer}-gs's rate over {peer}'s and gradsync's"]
                  if peer else [])):
            print(f"# {line}", flush=True)
        cols = f"{'model':>5} {'params':>7} {'batch':>5} | {'single':>8} {'local':>8} | " \
               f"{'gradsync':>9} {'iqr%':>5} {'eff':>5} {'comm':>5}"
        if "gradsync_off" in row:
            cols += f" | {'gs-off':>9} {'iqr%':>5} {'on/off':>6}"
        if peer:
            cols += f" | {peer:>9} {'iqr%':>5} {'eff':>5} {'comm':>5}" \
                    f" | {peer + '-gs':>9} {'iqr%':>5} {'eff':>5} {'comm':>5}" \
                    f" | {'gs/' + peer:>6} {short + '/' + peer:>7} {short + '/gs':>6}"
        print(cols, flush=True)
    g = row["gradsync"]
    line = f"{row['model']:>5} {row['params'] / 1e6:>6.2f}M {row['batch']:>5} | " \
           f"{row['single']['samples_per_s']:>8.1f} {row['local']['samples_per_s']:>8.1f} | " \
           f"{g['samples_per_s']:>9.1f} {g['iqr_pct']:>5.1f} {g['eff']:>5.2f} {g['comm']:>5.2f}"
    if "gradsync_off" in row:
        off = row["gradsync_off"]
        line += f" | {off['samples_per_s']:>9.1f} {off['iqr_pct']:>5.1f} " \
                f"{row['observed_ratio']:>6.3f}"
    if peer:
        for mode in (peer, f"{peer}_gs"):
            d = row[mode]
            line += f" | {d['samples_per_s']:>9.1f} {d['iqr_pct']:>5.1f} {d['eff']:>5.2f} " \
                    f"{d['comm']:>5.2f}"
        line += f" | {row['ratio']:>6.2f} {row[f'ratio_{peer}_gs']:>7.2f} " \
                f"{row[f'ratio_{peer}_gs_gradsync']:>6.2f}"
    print(line, flush=True)


def _print_footer(rows: list[dict], peer: "str | None", profile: bool) -> None:
    for row in rows:
        n = row["ranks"]
        parts = []
        for mode, sums in row["checksums"].items():
            same = len(set(sums)) == 1
            crcs = f"{sums[0]:08x}" if same else ", ".join(f"{s:08x}" for s in sums)
            parts.append(f"{mode} {'yes' if same else 'NO'} (crc32 {crcs})")
        agree = ""
        if peer and row["identical"]:
            same = row["checksums"]["gradsync"][0] == row["checksums"][peer][0]
            agree = f"; gradsync and {peer} {'agree' if same else 'differ'}"
            same = row["checksums"][f"{peer}_gs"][0] == row["checksums"][peer][0]
            agree += f"; {peer}_gs and {peer} {'agree' if same else 'differ'}"
        print(f"# {row['model']}: parameters identical on all {n} ranks after training: "
              + ", ".join(parts) + agree, flush=True)
    if profile:
        print("# profile, rank 0, median ms per step: forward (with zero_grad), backward, "
              "sync (gradsync's synchronize()), update (optimizer step)", flush=True)
        print(f"{'model':>5} {'mode':>8} {'forward':>8} {'backward':>8} {'sync':>8} "
              f"{'update':>8} {'total':>8}", flush=True)
        for row in rows:
            for mode, ph in row["profile_ms"].items():
                print(f"{row['model']:>5} {mode:>8} {ph['forward']:>8.2f} {ph['backward']:>8.2f} "
                      f"{ph['sync']:>8.2f} {ph['update']:>8.2f} {ph['total']:>8.2f}", flush=True)


if __name__ == "__main__":
    results = run(parser().parse_args(sys.argv[1:]))
    sys.exit(0 if all(row["identical"] for row in results) else 1)
