"""A CPU SyncBatchNorm for the tests: torch's layer is CUDA-only.

``CPUSyncBatchNorm`` does what ``torch.nn.SyncBatchNorm`` does, with the same
collectives on the wire: in forward an all-gather of ``[mean, invstd, count]``
(``2C + 1`` elements; a rank with an empty batch sends zeros and a count of 0,
which the combination ignores), in backward an all-reduce of ``[sum_dy,
sum_dy_xmu]`` (``2C``) when the input needs a gradient. It normalises over the
union of the ranks' batches and updates the running statistics with that
union's mean and unbiased variance, so every rank's running statistics stay
equal. It declares ``join_forward_collectives = True``: a joined rank keeps
the buffer update of its replay (it is the global one). Input ``(N, C)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                running_mean: torch.Tensor, running_var: torch.Tensor, eps: float,
                momentum: float, group: Any) -> torch.Tensor:
        channels = x.shape[1]
        world = dist.get_world_size(group)
        if x.numel() > 0:
            mean = x.mean(0)
            invstd = torch.rsqrt(x.var(0, unbiased=False) + eps)
            count = torch.full((1,), float(x.shape[0]), dtype=x.dtype)
            combined = torch.cat([mean, invstd, count])
        else:
            combined = torch.zeros(2 * channels + 1, dtype=x.dtype)
        gathered = [torch.empty_like(combined) for _ in range(world)]
        dist.all_gather(gathered, combined, group=group)
        stacked = torch.stack(gathered)
        means, invstds, counts = stacked[:, :channels], stacked[:, channels:-1], stacked[:, -1:]
        keep = counts.squeeze(-1) >= 1
        means, invstds, counts = means[keep], invstds[keep], counts[keep]
        total = counts.sum()
        mean = (means * counts).sum(0) / total
        variances = invstds.pow(-2) - eps
        var = ((variances + (means - mean).pow(2)) * counts).sum(0) / total
        invstd = torch.rsqrt(var + eps)
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(momentum * mean)
            running_var.mul_(1 - momentum).add_(momentum * var * total / (total - 1))
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = total
        ctx.group = group
        return (x - mean) * invstd * weight + bias

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, weight, mean, invstd = ctx.saved_tensors
        xmu = x - mean
        sum_dy = dy.sum(0)
        sum_dy_xmu = (dy * xmu).sum(0)
        grad_weight = sum_dy_xmu * invstd
        grad_bias = sum_dy
        grad_x = None
        if ctx.needs_input_grad[0]:
            combined = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(combined, group=ctx.group)
            sum_dy, sum_dy_xmu = combined.split(x.shape[1])
            total = ctx.total
            grad_x = weight * invstd / total * (
                total * dy - sum_dy - xmu * invstd.pow(2) * sum_dy_xmu)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class CPUSyncBatchNorm(nn.BatchNorm1d):
    """``torch.nn.SyncBatchNorm``'s behaviour and collectives, on the CPU (module doc)."""

    join_forward_collectives = True

    def __init__(self, channels: int, group: Any = None) -> None:
        super().__init__(channels)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        return _SyncBatchNorm.apply(x, self.weight, self.bias, self.running_mean,
                                    self.running_var, self.eps, self.momentum, self.group)
