"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): a rank-r power step per matrix.

Vocabulary. Each gradient of two or more dimensions is a *matrix* M (rows = its first
dimension, columns = the rest) that is *compressed* when rank r saves at least
``min_compression_rate`` (rows * cols >= rate * (rows + cols) * r); the others (biases,
norms, matrices too small to gain) are *plain* and travel uncompressed, as in the paper.

One step, for a bucket, on every rank w:

1. M_w = gradient + residual_w; P_w = M_w Q, with Q the same on every rank (warm start: the
   previous step's reduced Q, or a seeded Gaussian at the first step);
2. one allreduce of [plain tensors, every P_w] (the plain part rides with the P factors, so
   a bucket costs two allreduces, not three);
3. P = orthonormal basis of sum_w P_w (``torch.linalg.qr``: Householder, cheap for an
   rows x r matrix on a CPU, and stable on a rank-deficient P, where Gram-Schmidt divides
   by zero);
4. Q_w = M_w^T P; residual_w = M_w - P Q_w^T: what the projection onto P left out of this
   rank's matrix, kept for the next step (error feedback);
5. one allreduce of every Q_w; the result is P (sum_w Q_w)^T = sum_w P Q_w^T: exactly the
   sum of what each rank sent (its projection). Q = sum_w Q_w / n warm-starts the next step.

A matrix of rank at most r is reproduced exactly (up to rounding): P spans its columns, so
the projection loses nothing and the residual is zero.

**Plain first steps** (``plain_steps=k``, torch's hook's ``start_powerSGD_iter``): the first k
reductions of each bucket are plain float32 allreduces of the whole bucket, with no residual
kept; the power steps begin at the (k + 1)-th, from a zero residual. The count is each
bucket's step counter in the state (``state.py``), so a restored run goes on where it was.
On the language model of ``gradsync bench compress`` at 100 Mbit/s, two plain steps took
rank 4 to the target in 152 steps instead of 160, as many as torch's hook, which
``gradsync bench compress`` runs with ``start_powerSGD_iter=2`` (docs/benchmarks.md).

Every rank orthonormalises the same summed P itself, and the results agree bit for bit only
if its QR does the same arithmetic everywhere (the same torch and LAPACK; for these thin
matrices LAPACK takes its unblocked, single-threaded path). torch's PowerSGD hook relies on
the same; ranks on different builds would drift apart by rounding.

Bytes per step: r (rows + cols) floats per compressed matrix, plus the plain tensors, over
two allreduces (2 (n-1)/n each on a ring), against rows * cols for the uncompressed matrix.
The state per bucket: the residual (every compressed element) and each matrix's Q.
"""

from __future__ import annotations

import torch

from .base import ReducingCompressor, seed_for

__all__ = ["PowerSGD"]


class PowerSGD(ReducingCompressor):
    """Rank-``rank`` PowerSGD with error feedback and a warm-started Q (module docstring).

    Args:
        rank: the rank r of each compressed matrix's approximation (capped at its size).
        min_compression_rate: compress a matrix only if it shrinks at least this much.
        seed: seeds the first Q of each matrix (the same on every rank).
        tiers: ``"slowest"`` (default): on several hosts, each host's sum is reduced in
            float32 onto its first rank, and only those ranks run PowerSGD (``tiers.py``);
            ``"all"``: every rank runs it.
        plain_steps: reduce each bucket's first ``plain_steps`` times uncompressed (module
            docstring, "Plain first steps"); a reduction without a key (no state) is never
            one of them.
    """

    shardable = False  # each matrix must stay whole: tiers.py reduces onto a host's leader

    def __init__(self, rank: int = 4, min_compression_rate: float = 2.0, seed: int = 0,
                 tiers: str = "slowest", plain_steps: int = 0):
        super().__init__(seed, tiers)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        if min_compression_rate < 1:
            raise ValueError(f"min_compression_rate must be at least 1, got "
                             f"{min_compression_rate}")
        if isinstance(plain_steps, bool) or not isinstance(plain_steps, int) or plain_steps < 0:
            raise ValueError(f"plain_steps must be an int of 0 or more, got {plain_steps!r}")
        self.rank, self.min_compression_rate = rank, float(min_compression_rate)
        self.plain_steps = plain_steps

    def _describe(self) -> str:
        plain = f", plain_steps={self.plain_steps}" if self.plain_steps else ""
        return (f"powersgd(rank={self.rank}, min_compression_rate={self.min_compression_rate}"
                f"{plain})")

    def plan(self, shapes: list[tuple]) -> list[tuple[int, int, int] | None]:
        """Per tensor: (rows, cols, r) if it is compressed, else None (plain)."""
        out: list[tuple[int, int, int] | None] = []
        for shape in shapes:
            if len(shape) < 2:
                out.append(None)
                continue
            rows = int(shape[0])
            cols = 1
            for d in shape[1:]:
                cols *= int(d)
            r = min(self.rank, rows, cols)
            saves = rows * cols >= self.min_compression_rate * (rows + cols) * r
            out.append((rows, cols, r) if r and saves else None)
        return out

    def _reduce(self, x, shapes, comm, key, average):
        n = comm.size
        step = self.state.step(key) if key is not None else self.plain_steps
        if step < self.plain_steps:
            since = self.state.begin()
            comm.allreduce_sum_(x)
            self.state.set_step(key, step + 1, since)  # once the allreduce returned
            if average:
                x /= n
            return x
        plan = self.plan(shapes)
        pieces = list(x.split([_numel(s) for s in shapes]))
        matrices = [(i, rows, cols, r) for i, (p, shape) in enumerate(zip(plan, shapes))
                    if p is not None for rows, cols, r in [p]]
        plain = [i for i, p in enumerate(plan) if p is None]
        compressed = sum(rows * cols for _, rows, cols, _ in matrices)
        since = self.state.begin()
        residual = self._residual(key, "residual", compressed)
        left = torch.empty_like(residual)  # its successor, put once both allreduces returned
        ms, qs, offset = [], [], 0
        for i, rows, cols, r in matrices:
            m = pieces[i].view(rows, cols)
            m += residual[offset:offset + rows * cols].view(rows, cols)
            offset += rows * cols
            ms.append(m)
            qs.append(self._q(key, i, cols, r))
        # Allreduce 1: the plain tensors and every P.
        ps = [m @ q for m, q in zip(ms, qs)]
        first = torch.cat([pieces[i] for i in plain] + [p.reshape(-1) for p in ps])
        comm.allreduce_sum_(first)
        parts = first.split([pieces[i].numel() for i in plain] + [p.numel() for p in ps])
        for i, part in zip(plain, parts):
            pieces[i].copy_(part)
        bases = [torch.linalg.qr(part.view(p.shape)).Q for part, p in zip(parts[len(plain):], ps)]
        # Each rank's Q and what its projection left out.
        local_qs, offset = [], 0
        for m, basis in zip(ms, bases):
            q = m.t() @ basis
            local_qs.append(q)
            left[offset:offset + m.numel()].copy_((m - basis @ q.t()).reshape(-1))
            offset += m.numel()
        # Allreduce 2: every Q.
        if local_qs:
            second = torch.cat([q.reshape(-1) for q in local_qs])
            comm.allreduce_sum_(second)
            summed = second.split([q.numel() for q in local_qs])
            for (i, rows, cols, r), basis, q in zip(matrices, bases, summed):
                q = q.view(cols, r)
                pieces[i].view(rows, cols).copy_(basis @ q.t())
                if key is not None:
                    self.state.put(key, f"q{i}", q / n, since)
        if key is not None:
            self.state.put(key, "residual", left, since)
        if average:
            x /= n
        return x

    def _q(self, key: str | None, i: int, cols: int, r: int) -> torch.Tensor:
        def first() -> torch.Tensor:
            g = torch.Generator().manual_seed(seed_for(self.seed, f"{key}/q{i}"))
            return torch.randn(cols, r, generator=g)

        if key is None:
            return first()
        return self.state.tensor(key, f"q{i}", (cols, r), first)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
