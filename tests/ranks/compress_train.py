"""Each compressor of gradsync/compress/ through both front doors, training a tiny model.

Run by tests/test_compress_multiprocess.py (N = 2, 3). Front door 1: the Horovod API
(``hvd.DistributedOptimizer(compression=...)`` on several fused buckets, ``hvd.allreduce``
and ``hvd.grouped_allreduce`` with ``compression=``). Front door 2: the DDP communication
hook, over the "gradsync" backend and over gloo, with buckets so small that every layer is a
bucket of its own (DDP calls the hook several times per step: the ranks must issue the
hook's collectives in the same order, or gloo fails). Each run overfits one fixed batch per
rank for a few SGD steps: the loss over all ranks' batches must fall (by at least 0.3 of
what uncompressed steps achieve), and the parameters must be equal, bit for bit,
on every rank. Then DistributedOptimizer(gradient_lag=1) and LARC (``lag_checks.py``). The
script exits non-zero at the first failure and prints ``count`` at its end.
"""

import warnings

import common  # noqa: F401  (deadline)
from checks import Checks
from lag_checks import check_gradient_lag
import tiny_net
from tiny_net import Net
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync
import gradsync.torch as hvd
from gradsync.compress import (FP8, Auto, HookState, Int4, Int8, PowerSGD, RandomK, TorchComm,
                               compressed_hook)

warnings.simplefilter("ignore")
hvd.init()
R, N = hvd.rank(), hvd.size()
C = Checks(R)
fail = C.fail
STEPS = 8


def compressors():
    return {"int8": Int8(block=64), "int4": Int4(block=63), "fp8": FP8(block=64),
            "powersgd": PowerSGD(rank=2, min_compression_rate=1.0),
            "randomk": RandomK(0.5, seed=5)}


def batch(rank: int = R):
    return tiny_net.batch(rank)


def whole_loss(model) -> float:
    return tiny_net.whole_loss(model, N)


def digest(model) -> str:
    return tiny_net.digest(model.parameters())


def reference_fall() -> float:
    """How far the whole loss falls in STEPS uncompressed steps (one process, every batch)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    first = whole_loss(model)
    for _ in range(STEPS):
        opt.zero_grad()
        (sum(F.cross_entropy(model(x), y) for x, y in map(batch, range(N))) / N).backward()
        opt.step()
    return first - whole_loss(model)


FALL = reference_fall()


def train(model, optimizer, what: str, gather, auto=None) -> None:
    """STEPS steps, and with ``auto`` (local SGD allowed) on to the end of the window in
    force, whose sync makes the ranks' parameters equal."""
    x, y = batch()
    losses = [whole_loss(model)]
    for step in range(STEPS + 4):
        if step >= STEPS and (auto is None or auto.period == 1
                              or auto.phase == auto.period - 1):
            break  # every step exchanged, or the window's sync just ran
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        losses.append(whole_loss(model))
    C.count += 1
    # Compressed steps make less progress than exact ones (random-k sends half, PowerSGD a
    # rank-2 part), but error feedback keeps them going the same way.
    if not losses[0] - losses[-1] > 0.3 * FALL:
        fail(f"{what}: the loss fell by less than 0.3 x {FALL:.4f} (uncompressed): {losses}")
    digests = gather(digest(model))
    C.count += 1
    if len(set(digests)) != 1:
        fail(f"{what}: parameters differ between ranks: {digests}")


def several_buckets(compressor, what: str) -> None:
    C.count += 1
    if len(compressor.state.tensors) < 2:
        fail(f"{what}: expected several buckets, the state has {list(compressor.state.tensors)}")


# ----------------------------------------------------------------------------- Horovod API
world = gradsync.job.world()
world.config = world.config.replace(fusion_threshold=1024)  # several buckets
for name, compressor in compressors().items():
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   compression=compressor)
    train(model, opt, f"DistributedOptimizer {name}", lambda d: hvd.allgather_object(d))
    several_buckets(compressor, f"DistributedOptimizer {name}")
# The class (its defaults) works as Horovod's compressors do.
torch.manual_seed(0)
model = Net()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                               named_parameters=model.named_parameters(),
                               compression=hvd.Compression.int8)
train(model, opt, "DistributedOptimizer Compression.int8", lambda d: hvd.allgather_object(d))


def same_auto_choice(auto, what: str, reasons: tuple, gather) -> None:
    """compression="auto" decided (for one of ``reasons``: a drift check on a loaded
    machine may have decided again, or undone a change its steps did not bear out) and every
    rank holds the same choice."""
    C.count += 1
    d = auto.decision
    if d is None or not d.reason.startswith(reasons):
        fail(f"{what}: expected a decision for {reasons}, got {d and d.summary()}")
    if R == 0:
        print(f"{what}: {d.summary()}", flush=True)
    choices = gather((d.step, sorted(d.choices.items())))
    if len(set(map(repr, choices))) != 1:
        fail(f"{what}: the ranks chose differently: {choices}")


def quick_auto():
    # tiers="all": on one host auto would be off; this measures the ranks' own links.
    # Decided at step 2 on the probe of step 1 where that reads a slow link, else at step 4
    # (warm-up 1, the probe, calibration 2); checked again at steps 4 and 6.
    return Auto(tiers="all", warmup=1, calibrate=2, check_every=2)


# compression="auto": off on one host (none at once), and measured (tiers="all").
for what, compression in (("auto", "auto"), ("Auto(tiers='all')", quick_auto())):
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    train(model, opt, f"DistributedOptimizer {what}", lambda d: hvd.allgather_object(d))
    same_auto_choice(opt._gs_reducer, f"DistributedOptimizer {what}",
                     ("one host",) if compression == "auto" else
                     ("calibrated", "drift", "measured"),
                     lambda d: hvd.allgather_object(d))

# compression="auto" allowed local SGD (H at most 4), decided at step 3 (no drift check in
# these 8 steps; early=1: after both float32 calibration steps, not on the probe of step 1,
# which the tiny net's short step may read as a slow link), and where that changed an
# option, its trial checked TRIAL steps later, which a loaded machine may undo ("measured":
# CI's stop 64): whatever H and sync option it chose (H 1, 2 or 4, from step 3; float32 or
# a quantizer: the loopback link decides), training goes on to the end of the window in
# force, so the parameters must end equal on every rank, through DistributedOptimizer's
# attach and after_step and the Horovod API's DiLoCo reducer.
torch.manual_seed(0)
model = Net()
auto = Auto(tiers="all", warmup=1, calibrate=2, check_every=100, margin=0.0,
            local_steps=0.0, local_sgd=4, early=1.0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                               named_parameters=model.named_parameters(), compression=auto)
train(model, opt, "DistributedOptimizer auto, local_sgd=4", lambda d: hvd.allgather_object(d),
      auto)
same_auto_choice(auto, "DistributedOptimizer auto, local_sgd=4", ("calibrated", "measured"),
                 lambda d: hvd.allgather_object(d))
C.count += 1
if len(set(hvd.allgather_object((auto.decision.period, auto.period, auto.phase)))) != 1:
    fail(f"auto, local_sgd=4: the ranks hold different windows: {auto.decision.summary()}")
# The same with the probe step (early's default) and momentum: the warm-up and probe steps
# are a local window (DistributedOptimizer gives itself as the optimizer), and where every
# step is exchanged after it (the loopback link: calibration in float32; local SGD never
# paying beyond a tolerance of 500%), the momenta are averaged on the controller's thread, where
# the compressor runs (a Horovod-API collective waited for there would never run), so the
# ranks' momenta and parameters end equal.
torch.manual_seed(0)
model = Net()
auto = Auto(tiers="all", warmup=1, calibrate=2, check_every=100, margin=0.0,
            local_steps=0.0, local_sgd=4, tolerance=5.0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5),
                               named_parameters=model.named_parameters(), compression=auto)
train(model, opt, "DistributedOptimizer auto, local_sgd=4, warm window",
      lambda d: hvd.allgather_object(d), auto)
C.count += 1
momenta = hvd.allgather_object(tiny_net.digest(
    [opt.state[p]["momentum_buffer"] for p in model.parameters()]))
if len(set(momenta)) != 1 or auto.period != 1:
    fail(f"auto, local_sgd=4, warm window: expected every step exchanged at the end (H "
         f"{auto.period}: {auto.decision.summary()}) and the momenta equal on every rank: "
         f"{momenta}")
# Where local SGD hands back to every step exchanged, the optimizer's state is averaged
# over the ranks (auto_local.py's align_optimizer, over the Horovod API here: the optimizer
# is DistributedOptimizer itself): momenta that differ per rank come out as their mean.
C.count += 1
for p in model.parameters():
    opt.state[p]["momentum_buffer"] = torch.full_like(p, float(R))
auto._local.align_optimizer(0)
if any(not torch.equal(opt.state[p]["momentum_buffer"], torch.full_like(p, (N - 1) / 2))
       for p in model.parameters()):
    fail("auto, local_sgd=4: the optimizer's state was not averaged over the ranks")

# Collectives: int8 of values it represents exactly sums exactly: integers in [-127, 127],
# every other one 127, so that every block's scale is 1 (and the sum's is N).
x = torch.stack([torch.full((255,), 127.0), torch.arange(-127.0, 128.0)], dim=1).reshape(-1)
got = hvd.allreduce(x, name="int8.exact", op=hvd.Sum, compression=hvd.Compression.int8)
C.count += 1
if not torch.equal(got, N * x):
    fail(f"allreduce int8: got {got[:5]}.. want {(N * x)[:5]}..")
# PowerSGD of a rank-1 matrix (the same on every rank) reconstructs it.
m = torch.outer(torch.arange(1.0, 9.0), torch.arange(1.0, 7.0))
v = torch.arange(float(R), R + 3.0)
got_m, got_v = hvd.grouped_allreduce([m, v], name="psgd", op=hvd.Average,
                                     compression=hvd.Compression.powersgd(rank=1))
C.count += 1
if not (torch.allclose(got_m, m, atol=1e-4)
        and torch.allclose(got_v, torch.arange(3.0) + (N - 1) / 2)):
    fail(f"grouped_allreduce powersgd: got {got_m} {got_v}")

# Gradient lag and LARC (tests/ranks/lag_checks.py), in this job rather than one of their own.
check_gradient_lag(C)

# ----------------------------------------------------------------------------- DDP hook
dist.init_process_group("gradsync")
GLOO = dist.new_group(backend="gloo")


for label, group in (("gradsync", None), ("gloo", GLOO)):
    for name, compressor in compressors().items():
        torch.manual_seed(0)
        model = DDP(Net(), process_group=group, bucket_cap_mb=0.0005)
        model.register_comm_hook(HookState(compressor, group), compressed_hook)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        train(model, opt, f"DDP hook over {label}, {name}",
              lambda d, group=group: tiny_net.all_digests(d, group))
        several_buckets(compressor, f"DDP hook over {label}, {name}")

for label, group, state in (("gradsync", None, HookState(quick_auto())),
                            ("gloo", GLOO, HookState("auto", GLOO))):
    torch.manual_seed(0)
    model = DDP(Net(), process_group=group, bucket_cap_mb=0.0005)
    model.register_comm_hook(state, compressed_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    train(model, opt, f"DDP hook over {label}, auto",
          lambda d, group=group: tiny_net.all_digests(d, group))
    same_auto_choice(state.compressor, f"DDP hook over {label}, auto",
                     ("calibrated", "drift", "measured") if label == "gradsync" else
                     ("one host",),
                     lambda d, group=group: tiny_net.all_digests(d, group))



# The same local SGD through the DDP hook, as docs/slow-links.md's DDP loop: the script
# attaches the parameters (the syncs on a gloo group of their own) and calls after_step
# after each step. DDP rebuilds its buckets after step 0, so auto counts (and decides) a
# step later than above: the loop goes on until the window in flight has ended.
torch.manual_seed(0)
model = DDP(Net(), bucket_cap_mb=0.0005)
auto = Auto(tiers="all", warmup=1, calibrate=2, check_every=100, margin=0.0,
            local_steps=0.0, local_sgd=4)
model.register_comm_hook(HookState(auto), compressed_hook)
opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5)
# With the optimizer, the warm-up and probe steps are a local window (auto.py, 2); where
# every step is exchanged after a window, the momenta are averaged too.
auto.attach(list(model.parameters()), comm=TorchComm(dist.new_group(backend="gloo")),
            optimizer=opt)
x, y = batch()
held = []  # H in force for each step's buckets
for step in range(STEPS + 4):
    if step >= STEPS and (auto.period == 1 or auto.phase == auto.period - 1):
        break  # every step exchanged, or the window's sync just ran
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    held.append(auto.period)
    opt.step()
    auto.after_step()
C.count += 1
digests = tiny_net.all_digests(digest(model), None)
if len(set(digests)) != 1:
    fail(f"DDP hook, auto, local_sgd=4: parameters differ after step {step}: {digests}")
C.count += 1
if held[0] == 1:
    fail(f"DDP hook, auto, local_sgd=4: the warm-up exchanged (H per step {held})")
same_auto_choice(auto, "DDP hook over gradsync, auto, local_sgd=4",
                 ("calibrated", "measured"),
                 lambda d: tiny_net.all_digests(d, None))

dist.destroy_process_group()
hvd.shutdown()
print(f"rank {R}: count {C.count}")
