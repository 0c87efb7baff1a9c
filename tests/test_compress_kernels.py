"""The quantizers' compiled kernels (gradsync/compress/_quantfast.c) against torch's operations.

int8, int4 and bf16 run their per-block arithmetic compiled where the module loads
(``quantized.COMPILED``); their torch operations are the reference. Both paths run the same
reductions here, threads as ranks (``test_compress``'s in-memory group) over 1-4 ranks, and
must agree bit for bit: the results, each rank's residual and each owner's, over steps that
feed the residuals back, for element counts 0, 1, small, uneven and of many blocks, blocks of
1, odd sizes and the default, Sum and Average. A gradient that overflowed (inf, NaN) leaves
every residual finite on both paths and non-finite results in the same places.
"""

from __future__ import annotations

import pytest
import torch

from gradsync import _native
from gradsync.compress import quantized
from gradsync.compress.quantized import BF16, FP8, Int4, Int8
from test_compress import ThreadComm, ThreadGroup, run_threads

KINDS = [Int8, Int4, BF16]


@pytest.fixture(autouse=True)
def compiled():
    """The kernels must be there (a compiler is part of the set-up: scripts/setup.sh)."""
    module = _native.load("_quantfast")
    assert module is not None, ("the compiled quantizers did not build: install a C compiler "
                                "and Python's headers (apt-get install gcc python3-dev), then "
                                "`pip install -e .` or `gradsync build-native`")
    return module


def reduce_steps(kind, size: int, n: int, block: int, average: bool, on: bool,
                 grads=None, steps: int = 2):
    """``steps`` reductions of each rank's gradient through ``kind`` on ``size`` thread ranks,
    the compiled kernels ``on`` or off: every rank's results and its state afterwards."""
    group = ThreadGroup(size)
    comms = [ThreadComm(group, r) for r in range(size)]
    compressors = [kind(block=block) for _ in range(size)]

    def body(r):
        outs = []
        for step in range(steps):
            g = (grads[r].clone() if grads is not None else
                 torch.randn(n, generator=torch.Generator().manual_seed(100 * step + r))
                 * (10.0 ** (r - 2)))
            outs.append(compressors[r].reduce(g, [(n,)], comms[r], "b", average))
        state = compressors[r].state.tensors.get("b", {})
        return outs, {k: v.clone() for k, v in state.items()}

    previous = quantized.COMPILED
    quantized.COMPILED = on
    try:
        return run_threads(size, body, group.barrier.abort)
    finally:
        quantized.COMPILED = previous


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits (NaN where NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("n,block", [(0, 1024), (1, 1024), (5, 3), (4099, 1024),
                                     (20000, 1023), (3001, 1), (70001, 64)])
def test_the_kernels_give_torchs_bits(kind, size, n, block):
    for average in (True, False):
        torch_path = reduce_steps(kind, size, n, block, average, on=False)
        kernels = reduce_steps(kind, size, n, block, average, on=True)
        for r in range(size):
            (outs_t, state_t), (outs_k, state_k) = torch_path[r], kernels[r]
            for step, (t, k) in enumerate(zip(outs_t, outs_k)):
                assert same(t, k), (r, step, (t - k).abs().max())
            assert state_t.keys() == state_k.keys()
            for part in state_t:
                assert same(state_t[part].reshape(-1), state_k[part].reshape(-1)), (r, part)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_an_overflowed_gradient_leaves_finite_residuals_on_both_paths(kind):
    n, size = 5000, 3
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(size)]
    grads[1][10] = float("nan")
    grads[2][3000] = float("inf")
    grads[0][4999] = float("-inf")
    results = {}
    for on in (False, True):
        results[on] = reduce_steps(kind, size, n, 1024, True, on, grads=grads, steps=1)
        for outs, state in results[on]:
            assert all(bool(torch.isfinite(v).all()) for v in state.values()), on
    for (outs_t, _), (outs_k, _) in zip(results[False], results[True]):
        assert torch.equal(torch.isfinite(outs_t[0]), torch.isfinite(outs_k[0]))
        finite = torch.isfinite(outs_t[0])
        assert torch.equal(outs_t[0][finite], outs_k[0][finite])


def test_the_kernels_run_where_they_load_and_fp8_stays_torch(compiled, monkeypatch):
    calls = []
    monkeypatch.setattr(quantized, "_kernels", lambda: (calls.append(1), compiled)[1])
    reduce_steps(Int4, 2, 3000, 1024, True, on=True, steps=1)
    assert calls  # int4 asked for the kernels
    calls.clear()
    reduce_steps(FP8, 2, 3000, 1024, True, on=True, steps=1)
    assert not calls and FP8.KIND is None  # fp8 has no compiled encoding
    for kind in KINDS:
        assert kind.KIND is not None


def test_the_kernels_refuse_what_they_cannot_do(compiled):
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="kind"):
        compiled.quantize(7, 1, 4, x.data_ptr(), x.data_ptr(), x.data_ptr(), None)
    with pytest.raises(ValueError, match="block"):
        compiled.quantize(0, 1, 0, x.data_ptr(), x.data_ptr(), x.data_ptr(), None)
    with pytest.raises(ValueError, match="exactly one"):
        compiled.dequantize(0, 1, 4, x.data_ptr(), x.data_ptr(), None, None)
    with pytest.raises(TypeError):
        compiled.quantize(0, 1, 4)
