"""Adasum (collectives/adasum.py), ranks as threads over in-memory pairs, against a NumPy
reference of the recursive formula, plus the properties that hold whatever the inputs.

The reference below is the formula written plainly: the binary tree of pairwise combinations
in the order the algorithm defines (extras folded into their partners first, then neighbours,
then pairs of pairs), each combination computed in float64 from whole vectors and rounded once
to the dtype. The algorithm splits every dot product across ranks and sums the pieces in
another order, so results agree to a few units in the last place, not bit for bit; the
properties (orthogonal, identical, scaled inputs) are exact.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from gradsync.collectives import adasum
from gradsync.collectives.ops import BFLOAT16
from test_algorithms import cast, run_ok, run_ranks, storage

SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
DTYPES = [np.float16, BFLOAT16, np.float32, np.float64]
DTYPE_IDS = ["float16", "bfloat16", "float32", "float64"]
EPS = {np.float16: 2.0 ** -10, BFLOAT16: 2.0 ** -7, np.float32: 2.0 ** -23, np.float64: 2.0 ** -52}


# --- the reference ------------------------------------------------------------------------

def widen(x: np.ndarray, dtype) -> np.ndarray:
    if dtype == BFLOAT16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).double().numpy()
    return x.astype(np.float64)


def pair(a: np.ndarray, b: np.ndarray, counts: list[int], dtype) -> np.ndarray:
    """Adasum(a, b) per tensor, in float64, rounded to ``dtype`` (both are float64 arrays)."""
    out = np.empty_like(a)
    start = 0
    for count in counts:
        x, y = a[start:start + count], b[start:start + count]
        dot, xx, yy = x @ y, x @ x, y @ y
        tiny = np.sqrt(sys.float_info.min)  # a smaller squared norm counts as a zero vector
        cx = 1 - dot / (2 * xx) if xx >= tiny else 1.0
        cy = 1 - dot / (2 * yy) if yy >= tiny else 1.0
        out[start:start + count] = cx * x + cy * y
        start += count
    return widen(cast(out, dtype), dtype)


def reference(inputs: list[np.ndarray], counts: list[int], dtype) -> np.ndarray:
    vectors = [widen(x, dtype) for x in inputs]
    p = 1 << (len(vectors).bit_length() - 1)
    leaves = vectors[:p]
    for extra in range(p, len(vectors)):  # extra e folds into its partner e - p first
        leaves[extra - p] = pair(leaves[extra - p], vectors[extra], counts, dtype)
    while len(leaves) > 1:  # then neighbours, then pairs of pairs, ...
        leaves = [pair(leaves[i], leaves[i + 1], counts, dtype) for i in range(0, len(leaves), 2)]
    return leaves[0]


def test_reference_pins_the_formula():
    # The worked pair of the module's comment, and the tree for 3 ranks, by hand.
    a, b, c = np.array([1.0, 0.0]), np.array([1.0, 1.0]), np.array([0.0, 2.0])
    np.testing.assert_array_equal(reference([a, b], [2], np.float64), [1.25, 0.75])
    ac = a + c  # a and c are orthogonal, so they sum; then (1, 2) with b: dot 3, norms 5, 2
    want = (1 - 3 / 10) * ac + (1 - 3 / 4) * b
    np.testing.assert_allclose(reference([a, b, c], [2], np.float64), want, rtol=1e-15)


# --- running the algorithm ----------------------------------------------------------------

def run_adasum(inputs: list[np.ndarray], dtype, counts=None) -> list[np.ndarray]:
    def rank_fn(comm):
        data = inputs[comm.rank].copy()
        adasum.allreduce(comm, data, dtype, counts)
        return data

    return run_ok(len(inputs), rank_fn)


def random_inputs(n: int, total: int, dtype, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [cast(rng.standard_normal(total), dtype) for _ in range(n)]


def check_against_reference(inputs, counts, dtype) -> None:
    results = run_adasum(inputs, dtype, counts)
    for rank, got in enumerate(results):
        assert got.dtype == storage(dtype)
        assert got.tobytes() == results[0].tobytes(), f"rank {rank} differs from rank 0"
    want = reference(inputs, counts, dtype)
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    np.testing.assert_allclose(widen(results[0], dtype), want, rtol=0, atol=8 * EPS[dtype] * scale)


def layouts(n: int) -> dict[str, list[int]]:
    """Tensor counts packed in one buffer: empty, single elements, uneven, many tensors."""
    return {
        "zero": [0], "one": [1], "fewer": [max(n - 1, 1)], "uneven": [3 * n + 1],
        "multi": [5, 0, 1, 17, 2 * n + 3, 40],
        "few": [1, 2, 3] * 5,
        "many": [1, 2, 0, 3] * 20,
    }


@pytest.mark.parametrize("layout", ["zero", "one", "fewer", "uneven", "multi", "few", "many"])
@pytest.mark.parametrize("n", SIZES)
def test_against_reference_float64(n, layout):
    counts = layouts(n)[layout]
    check_against_reference(random_inputs(n, sum(counts), np.float64, seed=n), counts,
                            np.float64)


@pytest.mark.parametrize("chunk", [None, 7], ids=["chunk-default", "chunk-7"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("layout", ["multi", "many"])
def test_against_reference_dtypes(n, dtype, layout, chunk, monkeypatch):
    if chunk:  # the arithmetic's passes then cut tensors anywhere, many passes per window
        monkeypatch.setattr(adasum, "_CHUNK", chunk)
    counts = layouts(n)[layout]
    check_against_reference(random_inputs(n, sum(counts), dtype, seed=10 + n), counts, dtype)


def test_per_tensor_not_per_buffer():
    # Two tensors in one buffer: rank 0's parts are (1, 0) and (1, 1); rank 1's (0, 1) and
    # (1, 1). Per tensor: the first pair is orthogonal (sum), the second identical (itself).
    # One dot product over the whole buffer would give other numbers.
    inputs = [np.array([1.0, 0.0, 1.0, 1.0]), np.array([0.0, 1.0, 1.0, 1.0])]
    np.testing.assert_array_equal(run_adasum(inputs, np.float64, [2, 2])[0], [1, 1, 1, 1])
    whole = run_adasum(inputs, np.float64)[0]
    assert not np.array_equal(whole, [1, 1, 1, 1])


# --- properties ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", SIZES)
def test_orthogonal_gradients_sum(n, dtype):
    # Rank r holds (r + 1) at coordinates r, r + n, r + 2n, ... of each tensor: pairwise
    # orthogonal, so every combination is a plain sum, exactly.
    counts = [3 * n, 2 * n + 1]
    inputs = []
    for r in range(n):
        x = np.zeros(sum(counts))
        for start, count in zip(np.cumsum([0] + counts[:-1]), counts):
            x[start + r:start + count:n] = r + 1
        inputs.append(cast(x, dtype))
    want = widen(cast(sum(widen(x, dtype) for x in inputs), dtype), dtype)
    for got in run_adasum(inputs, dtype, counts):
        np.testing.assert_array_equal(widen(got, dtype), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", SIZES)
def test_identical_gradients_give_the_gradient(n, dtype):
    g = random_inputs(1, 4 * n + 3, dtype, seed=n)[0]
    for got in run_adasum([g] * n, dtype, [n, 3 * n + 3]):
        assert got.tobytes() == g.tobytes()


@pytest.mark.parametrize("n", SIZES)
def test_scale_invariance(n):
    inputs = random_inputs(n, 7 * n + 2, np.float32, seed=3 * n)
    base = run_adasum(inputs, np.float32)[0]
    # A power of two scales every product and norm exactly: the same coefficients, exactly.
    quadrupled = run_adasum([x * 4 for x in inputs], np.float32)[0]
    np.testing.assert_array_equal(quadrupled, base * 4)
    tripled = run_adasum([x * 3 for x in inputs], np.float32)[0]
    np.testing.assert_allclose(tripled, base * 3, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_parallel_gradients_average_on_powers_of_two(n):
    # g_r = (r + 1) v: every pair averages, and a balanced tree averages all.
    v = np.random.default_rng(n).standard_normal(5 * n + 1)
    got = run_adasum([(r + 1) * v for r in range(n)], np.float64)[0]
    np.testing.assert_allclose(got, (n + 1) / 2 * v, rtol=1e-12)


def test_parallel_gradients_on_three_ranks_weigh_the_folded_ones_less():
    # Rank 2 folds into rank 0 first: ((g0 + g2) / 2 + g1) / 2, as docs/torch.md says.
    v = np.random.default_rng(0).standard_normal(11)
    got = run_adasum([1 * v, 2 * v, 4 * v], np.float64)[0]
    np.testing.assert_allclose(got, (0.25 * 1 + 0.5 * 2 + 0.25 * 4) * v, rtol=1e-12)


def test_zero_gradient_is_neutral():
    g = np.array([3.0, -1.0, 2.0])
    for n in (2, 3, 4):
        inputs = [np.zeros(3)] * (n - 1) + [g]
        np.testing.assert_array_equal(run_adasum(inputs, np.float64)[0], g)
    np.testing.assert_array_equal(run_adasum([np.zeros(3)] * 3, np.float64)[0], np.zeros(3))


# --- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_])
def test_integer_dtypes_raise(dtype):
    _, errors = run_ranks(2, lambda comm: adasum.allreduce(comm, np.zeros(4, dtype), dtype))
    assert all(isinstance(e, TypeError) and np.dtype(dtype).name in str(e) for e in errors), errors


def test_counts_must_cut_the_buffer():
    results, errors = run_ranks(2, lambda comm: adasum.allreduce(
        comm, np.zeros(5), np.float64, [2, 2]))
    assert all(isinstance(e, ValueError) and "[2, 2]" in str(e) for e in errors), errors
