"""DistributedOptimizer(gradient_lag=...)'s argument checks, which need no ranks (and
local_sgd=...'s, which compression="auto" takes; its choice: tests/test_compress_auto.py). The lag
itself (each step applies exactly the average of the previous step's gradients, the first
step applies nothing, each step's exchange still in flight when its step() returns; plain,
fp16 and int8 exchanges and LARC inside it) is checked against a reference worked by hand in
tests/ranks/lag_checks.py, run by tests/test_compress_multiprocess.py at 2 and 3 ranks."""

import pytest
import torch


@pytest.mark.parametrize("lag", [2, -1, True, 0.5])
def test_gradient_lag_is_zero_or_one(lag):
    import gradsync.torch as hvd

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="gradient_lag"):
        hvd.DistributedOptimizer(opt, gradient_lag=lag)


def test_local_sgd_comes_with_auto_only():
    import gradsync.torch as hvd

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    for compression, extra, match in [
            (hvd.Compression.int8, {}, "compression='auto'"),
            ("auto", {"op": hvd.Sum}, "op=Average"),
            ("auto", {"gradient_lag": 1}, "gradient_lag"),
            (hvd.Compression.auto(local_sgd=8), {}, "disagree")]:
        with pytest.raises(ValueError, match=match):
            hvd.DistributedOptimizer(opt, compression=compression, local_sgd=16, **extra)
