"""DiLoCo through the real front doors: the Horovod API and torch.distributed groups.

Run by tests/test_diloco_multiprocess.py (N = 2). Each rank trains a tiny model on its own
batch (so the ranks drift apart between syncs) with a ``DiLoCo`` wrapper:

- over the Horovod API (``comm="horovod"``: asynchronous collectives; int8 through the
  compressed allreduce), streaming (H=4, two fragments, landing a step after their start),
  and plain local SGD (H=2, outer lr 1, a float32 allreduce);
- over a gloo group and over a "gradsync" group (``TorchComm``), streaming with int8, and
  for a DDP model (over gloo, inner steps under ``no_sync()``) on a gloo group of its own.

After every landing the landed fragment's parameters must be equal, bit for bit, on every
rank, and the loss over all ranks' batches must fall; the same run done twice in the process
must end with the same bytes (fixed seeds: reproducible bit for bit). The script exits
non-zero at the first failure and prints ``count`` at its end.
"""

import contextlib
import warnings

import common  # noqa: F401  (deadline)
from checks import Checks
import tiny_net
from tiny_net import Net
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync.torch as hvd
from gradsync.compress import DiLoCo, Int8, TorchComm

warnings.simplefilter("ignore")
hvd.init()
R, N = hvd.rank(), hvd.size()
C = Checks(R)
fail = C.fail
STEPS = 12


def batch(rank: int = R):
    return tiny_net.batch(rank)


def whole_loss(model) -> float:
    return tiny_net.whole_loss(model, N)


digest = tiny_net.digest


def train(what: str, gather, ddp_group=None, **settings) -> str:
    torch.manual_seed(0)
    model = Net() if ddp_group is None else DDP(Net(), process_group=ddp_group)
    # A DDP model takes its inner steps under no_sync(): no gradient allreduce.
    quiet = contextlib.nullcontext if ddp_group is None else model.no_sync
    params = list(model.parameters())
    inner = torch.optim.SGD(params, lr=0.2)
    if "compressor" in settings:  # a new one per run: its residuals are the run's state
        settings = dict(settings, compressor=settings["compressor"]())
    outer = DiLoCo(model, inner, name=what.replace(" ", "_"), **settings)
    x, y = batch()
    first = whole_loss(model)
    seen = 0
    for _ in range(STEPS):
        outer.zero_grad()
        with quiet():
            F.cross_entropy(model(x), y).backward()
        outer.step()
        for t, fragment in outer.landed[seen:]:
            seen += 1
            if outer.pending:
                fail(f"{what}: a sync in flight at the landing step {t}")
            # Nothing in flight: the group is free for the check's own collective.
            digests = gather(digest([params[i] for i in outer.groups[fragment]]))
            C.count += 1
            if len(set(digests)) != 1:
                fail(f"{what}: fragment {fragment} differs between ranks after its landing "
                     f"at step {t}: {digests}")
    outer.finish()
    if seen < 2:
        fail(f"{what}: only {seen} landings in {STEPS} steps: {outer.landed}")
    last = whole_loss(model)
    C.count += 1
    if not last < first:
        fail(f"{what}: the loss over all batches did not fall: {first} -> {last}")
    return digest(params) + digest(outer.momenta)


def twice(what: str, gather, **settings) -> None:
    """Two runs with the same seeds end with the same bytes."""
    a = train(what, gather, **settings)
    b = train(what, gather, **settings)
    C.count += 1
    if a != b:
        fail(f"{what}: two runs with the same seeds differ: {a} {b}")


STREAMING = dict(sync_every=4, fragments=2, delay=1, outer_lr=0.7, outer_momentum=0.9)

# ----------------------------------------------------------------------------- Horovod API
hvd_gather = hvd.allgather_object
twice("horovod streaming int8", hvd_gather, compressor=lambda: Int8(block=64), comm="horovod",
      **STREAMING)
twice("horovod local sgd", hvd_gather, sync_every=2, outer_lr=1.0, outer_momentum=0.0,
      comm="horovod")

# ----------------------------------------------------------------------------- torch groups
dist.init_process_group("gradsync")
GLOO = dist.new_group(backend="gloo")
OWN = dist.new_group()  # the gradsync backend: DiLoCo's own group, the checks use the default


def all_digests(d):
    out = [None] * N
    dist.all_gather_object(out, d)
    return out


for label, group in (("gloo", GLOO), ("gradsync", OWN)):
    twice(f"{label} streaming int8", all_digests, compressor=lambda: Int8(block=64),
          comm=TorchComm(group), **STREAMING)
# A DDP user: the model wrapped by DDP over gloo (inner steps under no_sync()), DiLoCo on a
# gloo group of its own.
twice("ddp gloo streaming int8", all_digests, ddp_group=GLOO, compressor=lambda: Int8(block=64),
      comm=TorchComm(dist.new_group(backend="gloo")), **STREAMING)

dist.destroy_process_group()
hvd.shutdown()
print(f"rank {R}: count {C.count}")
