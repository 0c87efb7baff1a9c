"""DistributedOptimizer: bucket planning (no processes), then training parity at 2 and 3 ranks.

The multi-process side is tests/ranks/torch_parity.py: N ranks with batch B against one
process with batch N*B: SGD, Adam, float32 and float64, op=Sum, predivide, two backward passes
per step, synchronize/clip/skip_synchronize, step(closure), unused parameters and SyncBatchNorm,
each with a tiny and with the default fusion threshold; then explicit groups, compression, bf16
autocast with GradScaler, bucket launches during backward, argument checks, errors for
gradients changed before synchronize(), add_param_group, sparse gradients, and join with
uneven data.
"""

import pytest
import torch

from gradsync.torch import Compression
from gradsync.torch.buckets import assign_buckets, plan_buckets, split_evenly
from gradsync.torch.optimizer import _check_groups, _parameter_names
from harness import launch
import small_jobs


def test_plan_buckets_worked_example():
    # buckets.py's example: threshold 1 KiB, registration order w1 (2 KiB), b1 (64 B),
    # w2 (768 B), b2 (16 B); planned in reverse: [b2, w2, b1] and [w1].
    sizes, dtypes = [16, 768, 64, 2048], ["f32"] * 4
    assert plan_buckets(sizes, dtypes, 1024) == [[0, 1, 2], [3]]


def test_plan_buckets_per_dtype_and_caps():
    sizes = [8, 8, 8, 8, 8]
    assert plan_buckets(sizes, ["a", "b", "a", "b", "a"], 16) == [[0, 2], [1, 3], [4]]
    assert plan_buckets(sizes, ["a"] * 5, 0) == [[i] for i in range(5)]
    assert plan_buckets([100, 1, 1], ["a"] * 3, 10) == [[0], [1, 2]]
    assert plan_buckets([], [], 10) == []


def test_choose_shared_takes_the_largest_buckets_above_the_limit():
    from gradsync.torch.buckets import choose_shared

    assert choose_shared([10, 50, 40, 50, 5], above=8, most=2) == {1, 3}  # ties: lower index
    assert choose_shared([10, 50, 40, 50, 5], above=8, most=9) == {0, 1, 2, 3}
    assert choose_shared([10, 50], above=50) == set() and choose_shared([], above=0) == set()


def test_split_evenly():
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_evenly([1, 2], 4) == [[1], [2]]


def test_explicit_groups_become_buckets_in_backward_order():
    params = [torch.zeros(2), torch.zeros(3), torch.zeros(4, dtype=torch.float64), torch.zeros(5)]
    # Two groups of consecutive parameters, [0, 1] and [2, 3]; the second is split by dtype.
    # A bucket is complete when its first-registered member's gradient arrives, and backward
    # goes last layer first: [3], then [2], then [0, 1].
    assert assign_buckets(params, 2) == [[3], [2], [0, 1]]
    # A listed group with two dtypes is one bucket per dtype; unlisted ones stand alone. The
    # group's float32 part waits for parameter 0, so it goes last.
    assert assign_buckets(params, [[params[0], params[2], params[3]]]) == [[2], [1], [0, 3]]


def test_named_parameters_validation():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    groups = [{"params": [a, b]}]
    assert _parameter_names(groups, [("a", a), ("b", b)]) == {id(a): "a", id(b): "b"}
    assert _parameter_names(groups, None) == {id(a): "allreduce.noname.0.0",
                                              id(b): "allreduce.noname.0.1"}
    extra = torch.nn.Parameter(torch.zeros(1))  # named but not optimized: allowed, as in Horovod
    assert _parameter_names(groups, [("a", a), ("b", b), ("c", extra)])[id(b)] == "b"
    for bad, message in (([("a", a)], "not named"), ([("a", a), ("a", b)], "duplicates: a"),
                         ([a, b], "tuples"), ([("a", a), ("b", b), ("c", a)], "appears again")):
        with pytest.raises(ValueError, match=message):
            _parameter_names(groups, bad)
    with pytest.raises(ValueError, match="only appear once"):
        _check_groups([[a], [a]], groups)
    with pytest.raises(ValueError, match="not a parameter"):
        _check_groups([[extra]], groups)
    with pytest.raises(ValueError, match="positive integer"):
        _check_groups(-1, groups)


@pytest.mark.parametrize("compressor, wire", [(Compression.none, torch.float32),
                                              (Compression.fp16, torch.float16),
                                              (Compression.bf16, torch.bfloat16)])
def test_compression_round_trip(compressor, wire):
    x = torch.linspace(-3, 3, 11)
    sent, ctx = compressor.compress(x)
    assert sent.dtype == wire
    back = compressor.decompress(sent, ctx)
    assert back.dtype == torch.float32 and torch.allclose(back, x, rtol=1e-2, atol=1e-2)
    ints = torch.arange(5)  # only floating-point tensors are cast
    assert compressor.compress(ints)[0].dtype == torch.int64
    assert torch.equal(compressor.decompress(*compressor.compress(ints)), ints)


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_training_parity(n):
    # tests/ranks/torch_parity.py, in the job it shares with other scripts (small_jobs.py)
    result = small_jobs.result(n)
    assert small_jobs.ran(result, "torch_parity.py", n), result
    assert small_jobs.output(result, "torch_parity.py").count("all passed") == n, result


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.slow), 2, 3])
def test_gradients_are_bucket_views(n):
    # The default zero_grad(): grads inside the fusion buffers, nothing staged, closed-form
    # averages with 1 and 2 backward passes; set_to_none=True/False as torch.optim's.
    if n == 1:  # the slow tier's
        result = launch(n, "torch_bucket_views.py", timeout=90)
        assert result.returncode == 0, result
        output = result.output
    else:  # in the job it shares with other scripts (small_jobs.py)
        result = small_jobs.result(n)
        assert small_jobs.ran(result, "torch_bucket_views.py", n), result
        output = small_jobs.output(result, "torch_bucket_views.py")
    assert output.count("bucket views ok") == n, result
