"""Compressors with error feedback (gradsync/compress/), on an in-memory group of threads.

The ranks are threads that meet at a barrier (``ThreadComm``): the compressors see only the
three collectives of ``gradsync/compress/comm.py``, so processes add nothing here. Each
collective is a barrier with a deadline, so a rank that issues a different collective (or
none) breaks the barrier instead of hanging. The front doors (DistributedOptimizer, the DDP
hook over gloo and gradsync) are tests/ranks/compress_train.py, run by
test_compress_multiprocess.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from gradsync.compress import BF16, FP8, Int4, Int8, PowerSGD, RandomK


class ThreadGroup:
    """``size`` ranks as threads; every collective is an exchange through shared slots."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list = [None] * size
        self.wire_bytes = [0] * size  # what each rank put on the wire (all collectives)
        self.wire_dtypes: set = set()


class ThreadComm:
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        g = self.group
        g.slots[self.rank] = t.clone()
        g.wire_dtypes.add(t.dtype)
        g.barrier.wait()
        got = list(g.slots)
        g.barrier.wait()
        return got

    def allreduce_sum_(self, t):
        got = self._exchange(t)
        self.group.wire_bytes[self.rank] += 2 * t.numel() * t.element_size()
        total = got[0].clone()
        for other in got[1:]:  # rank order: the same sum on every rank
            total += other
        t.copy_(total)

    def alltoall(self, send):
        got = self._exchange(send)
        self.group.wire_bytes[self.rank] += send.numel()
        block = send.numel() // self.size
        return torch.cat([got[s][self.rank * block:(self.rank + 1) * block]
                          for s in range(self.size)])

    def allgather(self, mine):
        got = self._exchange(mine)
        self.group.wire_bytes[self.rank] += mine.numel()
        return torch.cat(got)


def run_threads(size: int, body, abort) -> list:
    """Runs ``body(r)`` for r in range(size) on threads, one a rank; the first error calls
    ``abort()`` (so that the others' barriers break instead of waiting) and is raised here.
    Returns the results in rank order; a rank still running after 60 s fails the test."""
    results, errors = [None] * size, []

    def run(r):
        try:
            results[r] = body(r)
        except BaseException as exc:  # noqa: BLE001  (re-raised below)
            errors.append(exc)
            abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank is stuck"
    return results


def run_ranks(size: int, fn):
    """Runs ``fn(comm)`` on ``size`` threads; returns their results in rank order."""
    group = ThreadGroup(size)
    return run_threads(size, lambda r: fn(ThreadComm(group, r)), group.barrier.abort), group


def grads(rank: int, step: int, numel: int) -> torch.Tensor:
    """A gradient as training gives them: a steady direction (per rank) plus noise, so the
    sum over steps grows like the number of steps."""
    steady = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    noise = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + rank + 1))
    return steady + 0.5 * noise


COMPRESSORS = {
    "int8": lambda: Int8(block=16),
    "int4": lambda: Int4(block=15),  # odd: the last code of each block is half a byte
    "fp8": lambda: FP8(block=16),
    "bf16": lambda: BF16(block=16),
    "powersgd": lambda: PowerSGD(rank=2, min_compression_rate=1.0),
    "randomk": lambda: RandomK(0.1, seed=3),
}
SHAPES = [(12, 10), (10,), (7, 3, 2), (5,)]  # 120 + 10 + 42 + 5 = 177 elements
NUMEL = 177


# ----------------------------------------------------------------------------- error feedback
@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
def test_error_feedback_sum_of_sent_follows_sum_of_gradients(kind):
    """sum_t sent_t = sum_t g_t - residual_T exactly (telescoping), and the residual stays
    bounded, so the relative gap shrinks like 1/T (here from step 10 to step 60)."""
    size, steps = 3, 60

    def job(comm):
        c = COMPRESSORS[kind]()
        sent = torch.zeros(NUMEL, dtype=torch.float64)
        given = torch.zeros(NUMEL, dtype=torch.float64)
        gaps = []
        for step in range(steps):
            g = grads(comm.rank, step, NUMEL)
            given += g.double()
            sent += c.reduce(g, SHAPES, comm, "bucket0", average=False).double()
            if step + 1 in (10, steps):
                gaps.append(float((sent - given_all(step)).norm() / given_all(step).norm()))
        return sent, c, gaps

    def given_all(step):
        return sum(grads(r, s, NUMEL).double() for r in range(size) for s in range(step + 1))

    results, _ = run_ranks(size, job)
    total = given_all(steps - 1)
    sent = results[0][0]
    for other, _, _ in results[1:]:
        assert torch.equal(other, sent)  # the same result on every rank
    # What was not sent is exactly what the residuals hold.
    held = torch.zeros(NUMEL, dtype=torch.float64)
    for _, c, _ in results:
        for name, t in c.state.tensors["bucket0"].items():
            if name == "residual":
                if kind == "powersgd":  # residuals cover the compressed matrices only
                    held += _scatter_powersgd(c, t)
                else:
                    held += t.double()
            elif name.startswith("owner"):  # int8's owners' second rounding
                held += _scatter_owner(t, name, NUMEL)
    assert torch.allclose(sent + held, total, rtol=1e-4, atol=1e-3)
    early, late = results[0][2]
    assert late < early / 2 and late < 0.25, (early, late)


def _scatter_powersgd(c, residual):
    out = torch.zeros(NUMEL, dtype=torch.float64)
    offset = start = 0
    for shape, p in zip(SHAPES, c.plan(SHAPES)):
        n = torch.Size(shape).numel()
        if p is not None:
            out[start:start + n] = residual[offset:offset + n].double()
            offset += n
        start += n
    return out


def _scatter_owner(t, name, numel):
    rank, size = (int(v) for v in name.removeprefix("owner").split("of"))
    chunk = t.numel()
    out = torch.zeros(numel, dtype=torch.float64)
    piece = t.reshape(-1)[:max(0, min(chunk, numel - rank * chunk))]
    out[rank * chunk:rank * chunk + piece.numel()] = piece.double()
    return out


# ----------------------------------------------------------------------------- int8
ADVERSARIAL = {
    "all_at_max": lambda r, n: torch.full((n,), 3.0e38),
    "mixed_signs": lambda r, n: torch.where(torch.arange(n) % 2 == r % 2, 1e30, -1e30)
    * torch.ones(n),
    "huge_range": lambda r, n: torch.logspace(-30, 30, n) * (-1) ** r if n else torch.zeros(0),
    "zeros": lambda r, n: torch.zeros(n),
    "int8_extremes": lambda r, n: torch.full((n,), 127.0),
}


@pytest.mark.parametrize("codec", [Int8, Int4, FP8, BF16])
@pytest.mark.parametrize("values", sorted(ADVERSARIAL))
@pytest.mark.parametrize("size, numel", [(2, 0), (3, 1), (3, 2), (2, 7), (3, 100), (3, 1000)])
def test_quantized_sums_cannot_overflow(codec, values, size, numel):
    """Every result is finite and within the quantization's error of the true average,
    whatever the values: no integer sum is ever taken."""
    make = ADVERSARIAL[values]

    def job(comm):
        return codec(block=32).reduce(make(comm.rank, numel), [(numel,)], comm, None,
                                      average=True)

    results, group = run_ranks(size, job)
    exact = sum(make(r, numel).double() for r in range(size)) / size
    for out in results:
        assert out.shape == (numel,) and torch.equal(out, results[0])
        assert torch.isfinite(out).all()
        # Two roundings, each at most half a step of the block's scale (int8: 1/254 of the
        # block's largest magnitude, int4: 1/14; fp8 e4m3: 1/16 relative to the value, or of
        # the scale; bf16: 1/512 relative to the value).
        peak = max(float(make(r, numel).abs().max()) if numel else 0.0 for r in range(size))
        bound = {Int8: 2.0 / 127, Int4: 2.0 / 7, FP8: 0.14, BF16: 0.01}[codec] * peak
        err = float((out.double() - exact).abs().max()) if numel else 0.0
        assert err <= bound, (err, bound)
    if numel:
        assert group.wire_dtypes == {torch.uint8}  # nothing but bytes crossed


def test_int8_wire_is_one_byte_per_element():
    size, numel, block = 3, 3 * 4096, 1024

    def job(comm):
        return Int8(block=block).reduce(torch.randn(numel), [(numel,)], comm, "k", False)

    _, group = run_ranks(size, job)
    # Each rank puts its whole alltoall send block (one chunk per rank) and its chunk for the
    # all-gather on the wire: 1 byte per element plus 4 bytes per block of scales.
    per_rank = numel + 4 * numel // block + (numel // size + 4 * numel // size // block)
    assert group.wire_bytes == [per_rank] * size
    assert per_rank < 1.4 * numel  # against 8 bytes per element for float32 (both phases)


@pytest.mark.parametrize("codec", [Int8, Int4, FP8, BF16])
def test_quantized_on_one_rank_with_an_odd_chunk(codec):
    """One rank (a process set of one, auto's one-rank timing of the arithmetic): the wire's
    rows are one row whose stride (4 bytes of scale + 67 codes) is no multiple of 4."""
    x = torch.linspace(-1.0, 1.0, 67)
    (out,), _ = run_ranks(1, lambda comm: codec(block=1024).reduce(x, [(67,)], comm, "k",
                                                                    average=True))
    bound = 2.0 / 7 if codec is Int4 else 0.14  # two roundings of a step of 1/7
    assert out.shape == (67,) and float((out - x).abs().max()) <= bound


def test_bf16_wire_is_two_bytes_per_element():
    size, numel, block = 3, 3 * 4096, 1024

    def job(comm):
        return BF16(block=block).reduce(torch.randn(numel), [(numel,)], comm, "k", False)

    _, group = run_ranks(size, job)
    per_rank = 2 * numel + 4 * numel // block + (2 * numel // size + 4 * numel // size // block)
    assert group.wire_bytes == [per_rank] * size
    assert group.wire_dtypes == {torch.uint8}


def test_int4_wire_is_half_a_byte_per_element():
    size, numel, block = 3, 3 * 4096, 1024

    def job(comm):
        return Int4(block=block).reduce(torch.randn(numel), [(numel,)], comm, "k", False)

    _, group = run_ranks(size, job)
    per_rank = numel // 2 + 4 * numel // block + (numel // 2 // size + 4 * numel // size // block)
    assert group.wire_bytes == [per_rank] * size
    assert group.wire_dtypes == {torch.uint8}


@pytest.mark.parametrize("block", [16, 15])
def test_int4_exact_on_representable_values(block):
    """Integers in [-7, 7] in blocks whose maximum is 7 are quantized without loss, every
    code at both ends of a byte (and a block of an odd count, half a byte of padding)."""
    pattern = torch.tensor([7.0, -7.0, 0.0, 3.0, -1.0, 5.0, -6.0, 2.0, 1.0, -3.0, 4.0, -5.0,
                            6.0, -2.0, -4.0, 7.0])[:block]
    x = pattern.repeat(6)

    def job(comm):
        return Int4(block=block).reduce(x, [(x.numel(),)], comm, None, average=False)

    results, _ = run_ranks(2, job)
    assert torch.equal(results[0], 2 * x) and torch.equal(results[1], 2 * x)


def test_int8_exact_on_representable_values():
    """Integers in [-127, 127] in blocks whose maximum is 127 are quantized without loss, and
    so is their sum (scale: the number of ranks)."""
    x = torch.stack([torch.full((255,), 127.0), torch.arange(-127.0, 128.0)], 1).reshape(-1)

    def job(comm):
        return Int8(block=16).reduce(x, [(510,)], comm, None, average=False)

    for size in (2, 3):
        results, _ = run_ranks(size, job)
        assert torch.equal(results[0], size * x)


# ----------------------------------------------------------------------------- PowerSGD
@pytest.mark.parametrize("true_rank, rank", [(1, 1), (2, 2), (2, 4)])
def test_powersgd_reconstructs_low_rank_matrices(true_rank, rank):
    rows, cols = 40, 30

    def matrix(r):
        g = torch.Generator().manual_seed(7 + r)
        return torch.randn(rows, true_rank, generator=g) @ torch.randn(true_rank, cols,
                                                                        generator=g)

    def job(comm):
        c = PowerSGD(rank=rank, min_compression_rate=1.0)
        m = matrix(0)  # the same matrix on every rank: the sum has the same rank
        out = c.reduce(m.reshape(-1), [(rows, cols)], comm, "b", average=True)
        return out.view(rows, cols), c.state.tensors["b"]["residual"]

    results, _ = run_ranks(2, job)
    for out, residual in results:
        assert torch.allclose(out, matrix(0), atol=1e-4)
        assert float(residual.abs().max()) < 1e-4


def test_powersgd_residual_is_what_was_left():
    rows, cols = 16, 12

    def job(comm):
        c = PowerSGD(rank=1, min_compression_rate=1.0)
        g = grads(comm.rank, 0, rows * cols + 5)
        out = c.reduce(g, [(rows, cols), (5,)], comm, "b", average=False)
        return g, out, c.state.tensors["b"]["residual"]

    results, _ = run_ranks(2, job)
    sent_plus_left = results[0][1].clone()
    for g, _, residual in results:
        sent_plus_left[:rows * cols] += residual
    total = results[0][0] + results[1][0]
    assert torch.allclose(sent_plus_left, total, atol=1e-5)
    # The plain vector travelled whole; the matrix was cut to rank 1 (it had more).
    assert torch.allclose(results[0][1][rows * cols:], total[rows * cols:])
    approx = results[0][1][:rows * cols].view(rows, cols)
    assert torch.linalg.matrix_rank(approx) == 1


def test_powersgd_plain_first_steps_are_exact_sums_then_the_power_steps_begin():
    rows, cols = 16, 12

    def job(comm):
        c = PowerSGD(rank=1, min_compression_rate=1.0, plain_steps=2)
        outs = []
        for step in range(3):
            g = grads(comm.rank, step, rows * cols)
            outs.append((g.clone(), c.reduce(g, [(rows, cols)], comm, "b", average=False)))
            if step == 1:  # a restored copy goes on from the same count
                restored = PowerSGD(rank=1, min_compression_rate=1.0, plain_steps=2)
                restored.load_state_dict(c.state_dict())
                assert restored.state.step("b") == 2 and "b" not in restored.state.tensors
        return outs, c.state.tensors["b"]["residual"]

    results, _ = run_ranks(2, job)
    for step in range(3):
        total = results[0][0][step][0] + results[1][0][step][0]
        out = results[0][0][step][1]
        if step < 2:  # whole, and no residual kept
            assert torch.allclose(out, total, atol=1e-6), step
        else:  # cut to rank 1; the residuals are what it left
            assert torch.linalg.matrix_rank(out.view(rows, cols)) == 1
            left = results[0][1] + results[1][1]
            assert torch.allclose(out + left, total, atol=1e-5)
    with pytest.raises(ValueError, match="plain_steps"):
        PowerSGD(plain_steps=-1)
    assert "plain_steps=2" in PowerSGD(plain_steps=2).describe()
    assert "plain_steps" not in PowerSGD().describe()


def test_powersgd_keeps_small_and_flat_tensors_plain():
    c = PowerSGD(rank=4)  # default rate 2: a 4x4 matrix would not shrink
    assert c.plan([(10,), (4, 4), (64, 32), (8, 2, 2, 2)]) == [None, None, (64, 32, 4), None]


# ----------------------------------------------------------------------------- random-k
def test_randomk_sends_the_same_k_positions_everywhere():
    numel = 1000

    def job(comm):
        c = RandomK(0.05, seed=11)
        g = torch.full((numel,), float(comm.rank + 1))
        return c.reduce(g, [(numel,)], comm, "b", average=False), c.state.tensors["b"]

    results, group = run_ranks(3, job)
    out = results[0][0]
    assert int((out != 0).sum()) == 50 and torch.equal(out[out != 0], torch.full((50,), 6.0))
    for other, state in results:
        assert torch.equal(other, out)
        # What was sent left the residual; the rest stayed.
        assert torch.equal(state["residual"] == 0, out != 0)
    assert group.wire_bytes == [2 * 50 * 4] * 3  # k float32 values, no indices


# ----------------------------------------------------------------------------- state
@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
def test_state_dict_round_trip_continues_bit_for_bit(kind):
    """Steps 0..9 straight, against steps 0..4, a state_dict, a fresh compressor loading it,
    then steps 5..9: every result equal, bit for bit."""
    size = 2

    def straight(comm):
        c = COMPRESSORS[kind]()
        return [c.reduce(grads(comm.rank, s, NUMEL), SHAPES, comm, "b", False)
                for s in range(10)]

    def resumed(comm):
        c = COMPRESSORS[kind]()
        out = [c.reduce(grads(comm.rank, s, NUMEL), SHAPES, comm, "b", False)
               for s in range(5)]
        saved = c.state_dict()
        fresh = COMPRESSORS[kind]()
        fresh.load_state_dict(saved)
        return out + [fresh.reduce(grads(comm.rank, s, NUMEL), SHAPES, comm, "b", False)
                      for s in range(5, 10)]

    a, _ = run_ranks(size, straight)
    b, _ = run_ranks(size, resumed)
    for ra, rb in zip(a, b):
        for x, y in zip(ra, rb):
            assert torch.equal(x, y)


def test_load_state_dict_refuses_another_compressor():
    with pytest.raises(ValueError, match="cannot be loaded"):
        PowerSGD(rank=2).load_state_dict(PowerSGD(rank=4).state_dict())
    with pytest.raises(TypeError, match="floating-point"):
        Int8().reduce(torch.zeros(3, dtype=torch.int32), [(3,)], None, None, False)
