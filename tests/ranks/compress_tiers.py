"""Compression on the slow tier only, through both front doors, on emulated hosts.

Run by tests/test_compress_tiers_multiprocess.py with 4 ranks on two emulated hosts
(GRADSYNC_HOSTNAME: ranks 0, 1 on host-a, 2, 3 on host-b; shared memory inside a host, TCP
between them). Each rank knows every rank's input, so it checks the result against the
reference of the tiered schedule: each host's float32 sum, quantized once per host, within
the rounding of the host sums, where quantizing every rank would miss by the size of the
part that cancels inside each host. Then the DistributedOptimizer and the DDP hook (over
gloo) train the tiny classifier: the loss falls, the parameters agree bit for bit, and the
error feedback sits under tiered keys on the ranks that compress. Prints ``count`` at the end.
"""

import warnings

import common  # noqa: F401  (deadline)
from checks import Checks
import tiny_net
from tiny_net import Net
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync
import gradsync.torch as hvd
from gradsync.compress import HookState, Int8, PowerSGD, compressed_hook

warnings.simplefilter("ignore")
hvd.init()
R, N = hvd.rank(), hvd.size()
C = Checks(R)
fail = C.fail
HOSTS = [[0, 1], [2, 3]]
NUMEL = 333


def inputs(rank: int) -> torch.Tensor:
    """Small values, plus +-1000 v cancelling between the two ranks of a host."""
    g = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
    v = torch.randn(NUMEL, generator=torch.Generator().manual_seed(50 + rank // 2))
    return g + (1000.0 if rank % 2 == 0 else -1000.0) * v


def check_tiered(got: torch.Tensor, what: str) -> None:
    sums = [inputs(a) + inputs(b) for a, b in HOSTS]
    exact = (sums[0].double() + sums[1].double())
    first = sum(float(s.abs().max()) for s in sums) / 254
    bound = first + (float(exact.abs().max()) + first) / 254
    err = float((got.double() - exact).abs().max())
    C.count += 1
    if not err <= bound + 1e-3:
        fail(f"{what}: off the host sums by {err}, beyond one rounding per host ({bound})")


def tiered_keys(compressor, what: str) -> None:
    keys = list(compressor.state.tensors)
    C.count += 1
    if not keys or not all("@" in k for k in keys):
        fail(f"{what}: expected residuals under tiered keys, the state has {keys}")


def train(model, optimizer, what: str, gather) -> None:
    x, y = tiny_net.batch(R)
    first = tiny_net.whole_loss(model, N)
    for _ in range(8):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    last = tiny_net.whole_loss(model, N)
    C.count += 2
    if not last < first - 0.05:
        fail(f"{what}: the loss went from {first:.4f} to {last:.4f}")
    digests = gather(tiny_net.digest(model.parameters()))
    if len(set(digests)) != 1:
        fail(f"{what}: parameters differ between ranks: {digests}")


# ----------------------------------------------------------------------------- Horovod API
world = gradsync.job.world()
C.count += 1
if world.topology.host_of != (0, 0, 1, 1):
    fail(f"expected two emulated hosts, the topology says {world.topology.host_of}")
c = Int8(block=16)
got = hvd.allreduce(inputs(R), name="tiers.int8", op=hvd.Sum, compression=c)
check_tiered(got, "hvd.allreduce int8")
C.count += 1
if len(set(hvd.allgather_object(tiny_net.digest([got])))) != 1:
    fail("hvd.allreduce int8: the result differs between ranks")

world.config = world.config.replace(fusion_threshold=1024)  # several buckets
for name, make in (("int8", lambda: Int8(block=64)),
                   ("powersgd", lambda: PowerSGD(rank=2, min_compression_rate=1.0))):
    compressor = make()
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   compression=compressor)
    train(model, opt, f"DistributedOptimizer {name}", hvd.allgather_object)
    if name == "int8" or R in (0, 2):  # PowerSGD's residuals: on the hosts' first ranks
        tiered_keys(compressor, f"DistributedOptimizer {name}")
    else:
        C.count += 1
        if compressor.state.tensors:
            fail(f"DistributedOptimizer powersgd: rank {R} leads no host but holds state "
                 f"{list(compressor.state.tensors)}")

# ----------------------------------------------------------------------------- DDP hook
dist.init_process_group("gradsync")
GLOO = dist.new_group(backend="gloo")


for label, group in (("gloo", GLOO), ("gradsync", None)):
    state = HookState(Int8(block=16), group)
    got = state.compressor.reduce(inputs(R), [(NUMEL,)], state.comm(), None, average=False)
    check_tiered(got, f"hook comm over {label}")
    torch.manual_seed(0)
    model = DDP(Net(), process_group=group, bucket_cap_mb=0.0005)
    state = HookState(Int8(block=64), group)
    model.register_comm_hook(state, compressed_hook)
    train(model, torch.optim.SGD(model.parameters(), lr=1.0), f"DDP hook over {label}",
          lambda d, group=group: tiny_net.all_digests(d, group))
    tiered_keys(state.compressor, f"DDP hook over {label}")

dist.destroy_process_group()
hvd.shutdown()
print(f"rank {R}: count {C.count}")
