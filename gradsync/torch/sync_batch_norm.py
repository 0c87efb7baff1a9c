"""SyncBatchNorm: batch normalization over the union of every rank's batch.

In training, the mean and variance of each channel are those of the concatenation of all
ranks' batches, so the output (and the running statistics) equal ``torch.nn.BatchNorm`` on the
full batch, whatever each rank's share of it (ranks may even hold no sample).

Forward. Each rank computes, per channel, its sample count n_r, its mean m_r and the sum of
squared deviations from that mean M2_r (not a sum of squares: E[x^2] - E[x]^2 cancels
catastrophically in float32 when the mean is large). One allgather of (n_r, m_r, M2_r), in
float64, gives every rank all of them, and Chan's parallel formula combines them:
n = sum n_r, mean = sum n_r m_r / n, M2 = sum (M2_r + n_r (m_r - mean)^2), var = M2 / n.
Worked example, one channel: rank 0 holds [1, 3] (n=2, m=2, M2=2), rank 1 holds [5] (n=1,
m=5, M2=0): mean = (4 + 5) / 3 = 3, M2 = 2 + 2 (2 - 3)^2 + 0 + 1 (5 - 3)^2 = 8, var = 8/3,
the variance of [1, 3, 5].

Backward. With x_hat = (x - mean) / std and y = w x_hat + b, the gradient of the sum of all
ranks' losses with respect to this rank's x is
    dx = w / std * (dy - sum(dy) / n - x_hat * sum(dy * x_hat) / n),
where the two sums run over every rank's samples: one allreduce (Sum) of the two per-channel
vectors. The weight and bias gradients are this rank's own sums; DistributedOptimizer reduces
them like any other gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .. import api as gs
from ..collectives.ops import Sum

__all__ = ["SyncBatchNorm"]


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                momentum: float, eps: float) -> torch.Tensor:
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        stat = torch.promote_types(x.dtype, torch.float32)
        xs = x.to(stat)
        count = x.numel() // channels
        local_mean = xs.mean(dims) if count else xs.new_zeros(channels)
        local_m2 = ((xs - _channel(local_mean, x.dim())) ** 2).sum(dims)
        row = torch.cat([torch.tensor([float(count)], dtype=torch.float64),
                         local_mean.double(), local_m2.double()])
        rows = gs.allgather(row.unsqueeze(0), name="sync_batch_norm.stats")
        counts, means, m2s = rows[:, :1], rows[:, 1:1 + channels], rows[:, 1 + channels:]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(f"SyncBatchNorm expects more than 1 value per channel when "
                             f"training, got {int(total)} across all ranks")
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        if running_mean is not None and running_var is not None:  # both, or neither
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((m2 / (total - 1)).to(running_var.dtype),
                                                    alpha=momentum)
        invstd = torch.rsqrt(m2 / total + eps).to(stat)
        x_hat = (xs - _channel(mean.to(stat), x.dim())) * _channel(invstd, x.dim())
        ctx.save_for_backward(x_hat, invstd, weight)
        ctx.total = total
        ctx.bias_dtype = None if bias is None else bias.dtype
        y = x_hat if weight is None else x_hat * _channel(weight.to(stat), x.dim())
        if bias is not None:
            y = y + _channel(bias.to(stat), x.dim())
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_hat, invstd, weight = ctx.saved_tensors
        dims = [0] + list(range(2, x_hat.dim()))
        dys = dy.to(x_hat.dtype)
        sum_dy = dys.sum(dims)
        sum_dy_xhat = (dys * x_hat).sum(dims)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            channels = x_hat.shape[1]
            both = gs.allreduce(torch.cat([sum_dy, sum_dy_xhat]), op=Sum,
                                name="sync_batch_norm.grad")
            mean_dy = _channel(both[:channels] / ctx.total, x_hat.dim())
            mean_dy_xhat = _channel(both[channels:] / ctx.total, x_hat.dim())
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_x = ((dys - mean_dy - x_hat * mean_dy_xhat) * _channel(scale, x_hat.dim()))
            grad_x = grad_x.to(dy.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xhat.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


def _channel(v: torch.Tensor, dim: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against an (N, C, ...) tensor."""
    return v.view((1, -1) + (1,) * (dim - 2))


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training statistics span every rank's batch.

    A drop-in for ``torch.nn.SyncBatchNorm`` (and Horovod's): the same arguments, for inputs
    of shape (N, C, ...). In eval mode it uses the running statistics, like BatchNorm.

    Args:
        num_features: C.
        eps: added to the variance for numerical stability.
        momentum: of the running statistics; None for a cumulative average.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running statistics (otherwise batch statistics are used in
            eval mode too, computed across ranks).
        process_group: torch.distributed's group; only None (every rank) is supported.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None):
        if process_group is not None:
            raise NotImplementedError("SyncBatchNorm(process_group=...): gradsync synchronizes "
                                      "statistics over every rank; leave process_group=None")
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            tracked = self.num_batches_tracked
            assert tracked is not None  # a buffer of every BatchNorm that tracks its stats
            tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(tracked)
        use_running = not self.training and self.track_running_stats
        if use_running or gs.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, not use_running, factor, self.eps)
        # Running statistics are updated only in training (as BatchNorm does).
        running = self.training and self.track_running_stats
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean if running else None,
            self.running_var if running else None, factor, self.eps)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group=None) -> torch.nn.Module:
        """Returns ``module`` with every BatchNorm*d layer replaced by a SyncBatchNorm."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
            if module.affine:
                converted.weight, converted.bias = module.weight, module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted
