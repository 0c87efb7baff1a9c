"""The argument checks both APIs share (``gradsync/pipeline/arguments.py``): the rules themselves,
then both APIs held to them through the launcher (``tests/ranks/arguments.py``)."""

import numpy as np
import pytest
import torch

from gradsync.collectives.ops import Adasum, Sum
from gradsync.pipeline import arguments
from gradsync.pipeline.tensors import wrap
import small_jobs


@pytest.mark.parametrize("splits", [[1.0, 1.0], [1, 1.0], np.ones(2), torch.ones(2),
                                    torch.ones(2, dtype=torch.float64), [np.float32(1), 1]])
def test_float_splits_are_rejected_not_rounded(splits):
    with pytest.raises(ValueError, match="must hold integers"):
        arguments.send_counts(splits, 2, 2)


@pytest.mark.parametrize("splits", [[1, 1], (1, 1), np.ones(2, np.int32), torch.ones(2,
                         dtype=torch.int64), [np.int64(1), torch.tensor(1)]])
def test_integer_splits_of_any_kind(splits):
    assert arguments.send_counts(splits, 2, 2) == [1, 1]


@pytest.mark.parametrize("splits", [[2], [3, -1], [1, 2], [1, 1, 0]])
def test_splits_must_cover_the_rows_once_per_rank(splits):
    with pytest.raises(ValueError, match="one non-negative entry per rank"):
        arguments.send_counts(splits, 2, 2)


def test_equal_split_needs_divisible_rows():
    assert arguments.send_counts(None, 6, 3) == [2, 2, 2]
    with pytest.raises(ValueError, match=r"divisible by the number of ranks \(4\)"):
        arguments.send_counts(None, 6, 4)


def test_root_is_a_member():
    assert arguments.root_index(2, range(4)) == 2
    assert arguments.root_index(5, [1, 3, 5], "the odd set") == 2
    for root in (4, -1, 0.5):
        with pytest.raises(ValueError, match=f"root_rank {root} is outside 0..3"):
            arguments.root_index(root, range(4))
    with pytest.raises(ValueError, match=r"not a rank of the odd set \(ranks \[1, 3, 5\]\)"):
        arguments.root_index(2, [1, 3, 5], "the odd set")


def test_reduce_op():
    assert arguments.reduce_op(Sum) is Sum
    with pytest.raises(TypeError, match="op must be one of"):
        arguments.reduce_op("sum")
    with pytest.raises(ValueError, match="allreduce only"):
        arguments.reduce_op(Adasum)
    with pytest.raises(TypeError, match="floating-point"):
        arguments.reduce_op(Adasum, np.int32)
    assert arguments.reduce_op(Adasum, np.float16) is Adasum


def test_rows_needs_a_dimension():
    assert arguments.rows(wrap(np.zeros((3, 2))), "allgather") == 3
    with pytest.raises(ValueError, match="allgather needs a tensor of at least one dimension"):
        arguments.rows(wrap(np.array(1.0)), "allgather")


@pytest.mark.parametrize("inplace", [True, False])
def test_result_in_place_or_new(inplace):
    tensor = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: wrap works on a copy
    buf = wrap(tensor, writable=inplace)
    target = arguments.target(buf, inplace)
    target *= 2
    out = arguments.result(buf, target, tensor, inplace)
    expected = torch.arange(6.0).reshape(2, 3).t() * 2
    assert torch.equal(out, expected)
    assert (out is tensor) == inplace
    assert torch.equal(tensor, expected if inplace else expected / 2)


def test_row_result_keeps_the_row_shape():
    buf = wrap(torch.zeros(4, 2, 3, dtype=torch.float64))
    out = arguments.row_result(buf, np.arange(6.0), 1)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 2, 3)
    assert out.dtype == torch.float64 and out.flatten().tolist() == list(range(6))


def test_received_splits_follow_the_tensor_kind():
    assert isinstance(arguments.received_splits([1, 2], np.zeros(1)), np.ndarray)
    counts = arguments.received_splits([1, 2], torch.zeros(1))
    assert counts.dtype == torch.int32 and counts.tolist() == [1, 2]


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [1, 3])
def test_both_apis_reject_alike(n):
    # tests/ranks/arguments.py, in the job it shares with other scripts (small_jobs.py)
    result = small_jobs.result(n)
    assert small_jobs.ran(result, "arguments.py", n), result
    assert small_jobs.output(result, "arguments.py").count("arguments ok") == n, result
