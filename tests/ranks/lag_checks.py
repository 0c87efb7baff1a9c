"""DistributedOptimizer(gradient_lag=1) against a hand-computed reference.

Called by tests/ranks/compress_train.py (so its job, at 2 and 3 ranks, pays for start-up
once). Rank r's loss at step t is linear in the parameters, sum(p * c(p, r, t)), so its
gradient is exactly c(p, r, t): a closed form. With a lag of one step, step t applies the
average over ranks of step t - 1's gradients and the first step applies nothing, so a plain
torch SGD (with momentum) that is handed those averages, and does not step at t = 0, must end
every step with the same parameters. Several buckets (a tiny fusion threshold); plain,
fp16-cast and int8 exchanges, and LARC inside the DistributedOptimizer (its norms are those
of the averaged gradients, as the reference's). Adds 48 to the checks' count.
"""

import torch

import gradsync
import gradsync.torch as hvd

SHAPES = {"w": (5,), "m": (3, 4), "b": (3,)}
STEPS = 4


def coefficient(name: str, rank: int, step: int) -> torch.Tensor:
    """Small integers: their sums are exact in float32 and in fp16."""
    n = torch.Size(SHAPES[name]).numel()
    return ((rank + 1) * (step + 1) + torch.arange(n) % 7 - 3).float().view(SHAPES[name])


def params():
    torch.manual_seed(0)
    return {name: torch.nn.Parameter(torch.randn(shape)) for name, shape in SHAPES.items()}


def sgd(ps):
    return torch.optim.SGD(ps.values(), lr=0.1, momentum=0.5)


def larc(ps):
    inner = torch.optim.SGD(ps.values(), lr=0.1, momentum=0.5, weight_decay=0.01)
    return hvd.LARS(inner, trust=0.05, clip=True)


def check_gradient_lag(C) -> None:
    R, N = hvd.rank(), hvd.size()
    fail = C.fail

    def average(name: str, step: int) -> torch.Tensor:
        return sum(coefficient(name, r, step) for r in range(N)) / N

    world = gradsync.job.world()
    threshold = world.config.fusion_threshold
    world.config = world.config.replace(fusion_threshold=16)  # one bucket per parameter
    for label, compression, tolerance, make in (("plain", hvd.Compression.none, 1e-6, sgd),
                                                ("fp16", hvd.Compression.fp16, 2e-3, sgd),
                                                ("int8", hvd.Compression.int8, 0.05, sgd),
                                                ("larc", hvd.Compression.none, 1e-5, larc)):
        mine, ref = params(), params()
        opt = hvd.DistributedOptimizer(make(mine), named_parameters=list(mine.items()),
                                       compression=compression, gradient_lag=1)
        ref_opt = make(ref)
        C.count += 1
        if len(opt._gs_buckets) != 3:
            fail(f"{label}: expected 3 buckets, got {len(opt._gs_buckets)}")
        for step in range(STEPS):
            opt.zero_grad()
            sum((p * coefficient(name, R, step)).sum() for name, p in mine.items()).backward()
            opt.step()
            if step == 0:  # documented: the first step applies nothing, the gradients are zero
                C.count += 1
                if any(p.grad is None or p.grad.abs().sum() != 0 for p in mine.values()):
                    fail(f"{label}: after the first step the gradients should be zeros, got "
                         f"{[p.grad for p in mine.values()]}")
            else:
                ref_opt.zero_grad()
                for name, p in ref.items():
                    p.grad = average(name, step - 1)
                ref_opt.step()
            C.count += 1
            for name in SHAPES:
                if not torch.allclose(mine[name], ref[name], rtol=tolerance, atol=tolerance):
                    fail(f"{label} step {step}: '{name}' is {mine[name].data}, the reference "
                         f"(the average of step {step - 1}'s gradients) gives {ref[name].data}")
            # This step's exchange is still in flight: waited for by the next step() only.
            C.count += 1
            if any(len(lag.flights) != 1 for lag in opt._gs_lag.values()):
                fail(f"{label} step {step}: expected one round in flight per bucket, got "
                     f"{[len(lag.flights) for lag in opt._gs_lag.values()]}")
        digests = hvd.allgather_object([p.detach().clone() for p in mine.values()])
        C.count += 1
        if not all(all(torch.equal(a, b) for a, b in zip(d, digests[0])) for d in digests):
            fail(f"{label}: parameters differ between ranks")
        opt.load_state_dict(opt.state_dict())  # waits for the round in flight and drops it
        C.count += 1
        if any(lag.flights for lag in opt._gs_lag.values()):
            fail(f"{label}: load_state_dict left rounds in flight")

    world.config = world.config.replace(fusion_threshold=threshold)
