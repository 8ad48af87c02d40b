"""Lesson 11: batch norm over the global batch: SyncBatchNorm, written by hand.

The one layer that breaks "N ranks of b samples = one process on N·b" is batch norm. In
training it normalises each channel c with the mean and the (biased) variance of *its batch*,
over every dimension but the channel one::

    μ_c = 1/n · Σ x_c        σ²_c = 1/n · Σ x_c² − μ_c²        y = γ_c (x − μ_c) / √(σ²_c + ε) + β_c

(n: the values per channel, batch × height × width). Under DDP each rank's ``BatchNorm``
sees only its own b samples: its μ and σ² are noisier than the global batch's, and differ
from rank to rank, so DDP trains a different model than one process would (and at b = 2 or 4
per GPU, a worse one). **SyncBatchNorm** computes the statistics of the global batch instead:
each rank sums Σx, Σx² and its n, one all-reduce adds them over the ranks, and every rank
divides by the global n. Sums, not means: with uneven shares (the last batch of an epoch) the
mean of the ranks' means is not the mean.

Two more things make it the same as one process:

- **gradients**: μ and σ² depend on every rank's inputs, so the gradient of rank r's loss
  reaches the other ranks' inputs through them. The all-reduce must be part of autograd: its
  backward is an all-reduce of the gradients too (:func:`all_reduce_sum`, given). A plain
  ``dist.all_reduce`` is invisible to autograd, and each rank's input gradients miss the
  others' share;
- **running statistics** (used in eval): ``running = (1 − m)·running + m·batch`` with momentum
  m (``momentum=None``: the cumulative average, m = 1/batches seen), where the variance kept is
  the *unbiased* σ²·n/(n − 1), with the global n: with 2 samples on a rank that factor is 2,
  with 10 in the global batch it is 1.11.

Your tasks:

- 11.3 :func:`global_moments`: the global batch's mean, biased variance and count per channel,
  with one all-reduce;
- 11.4 :meth:`SyncBatchNormByHand.forward`: normalise with them in training (and update the
  running statistics), with the running statistics in eval;
- 11.5 :func:`convert_sync_by_hand`: put a :class:`SyncBatchNormByHand` in place of every batch
  norm of a model, keeping its weights and statistics (as torch's
  ``nn.SyncBatchNorm.convert_sync_batchnorm`` does).

Given: :func:`all_reduce_sum` (an all-reduce that autograd sees through), and the CLI: on
``--nproc`` ranks with uneven shares of one batch it compares per-rank ``BatchNorm`` and the
hand SyncBN with one process on the whole batch, then trains ``dpt.models.ConvNet`` a few
steps under DDP both ways. (torch's own ``nn.SyncBatchNorm`` runs only on GPUs; the course
compares the two in ``tests/gpu``.)::

    .venv/bin/python solutions/11_time_to_accuracy/sync_bn.py --nproc 3
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

# --- given: an all-reduce autograd sees through -------------------------------------------------


class _AllReduceSum(torch.autograd.Function):
    """y = Σ_r x_r on every rank. Each y_s depends on every x_r with derivative 1, so the
    gradient of x_r is Σ_s (the gradient of y_s): an all-reduce sum of the gradients."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of ``tensor`` over the ranks of ``group`` (None: every rank), a new tensor,
    differentiable: its backward all-reduces the gradient (``_AllReduceSum``). Outside a
    process group: ``tensor`` itself, as a group of one would give. (torch's
    ``torch.distributed.nn.functional.all_reduce`` does this too, but warns as deprecated.)"""
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    return _AllReduceSum.apply(tensor, group)


# --- 11.3 the statistics of the global batch ----------------------------------------------------

def global_moments(x: torch.Tensor, group=None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per channel (dim 1), the mean and the biased variance of ``x`` over every rank of
    ``group``, and the global count n, from ONE :func:`all_reduce_sum`.

    ``x`` is this rank's ``(b, C, ...)`` input, b any size (ranks may hold different numbers of
    samples). Returns ``(mean, var, count)``: two tensors of shape ``(C,)`` in ``x``'s dtype,
    differentiable with respect to ``x`` on every rank, and a 0-d tensor: the values per
    channel on all ranks together. ``var = Σx²/n − mean²`` (divided by n, not n − 1), never
    below 0.
    """
    # BEGIN SOLUTION 11.3: sum x and x² over every dim but 1, with this rank's count n, in one tensor; one all_reduce_sum of it; divide by the global n (var = Σx²/n − mean², biased)
    dims = [d for d in range(x.dim()) if d != 1]
    n = torch.full((1,), x.numel() // x.shape[1], dtype=x.dtype, device=x.device)
    sums = all_reduce_sum(torch.cat([x.sum(dims), (x * x).sum(dims), n]), group)
    c = x.shape[1]
    count = sums[2 * c]
    mean = sums[:c] / count
    var = (sums[c:2 * c] / count - mean * mean).clamp_min(0)
    return mean, var, count
    # END SOLUTION


# --- 11.4 the layer ------------------------------------------------------------------------------

class SyncBatchNormByHand(_BatchNorm):
    """Batch norm over the global batch of ``group``'s ranks, for inputs ``(b, C)`` or
    ``(b, C, ...)`` (``BatchNorm1d``, ``2d`` and ``3d`` alike). Its parameters and buffers are
    those of any torch batch norm (``weight``, ``bias``, ``running_mean``, ``running_var``,
    ``num_batches_tracked``), so a state dict moves between the two."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, group=None,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.group = group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected an input (batch, {self.num_features}, ...) of 2 or "
                             f"more dimensions, got shape {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Training (or no running statistics kept): normalise with :func:`global_moments`;
        when the running statistics are kept, also count the batch in
        ``num_batches_tracked`` and move ``running_mean`` and ``running_var`` towards the
        batch's mean and *unbiased* variance (var·n/(n − 1), n the global count) by
        ``momentum`` (None: by 1/num_batches_tracked), without autograd. Eval: normalise with
        the running statistics. Then ``weight`` and ``bias`` when ``affine``."""
        self._check_input_dim(x)
        if x.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels in dim 1, got shape "
                             f"{tuple(x.shape)}")
        # BEGIN SOLUTION 11.4: in training, normalise with global_moments and update the running stats without autograd (momentum; var·n/(n−1) with the global n); in eval use the running stats; then weight and bias
        shape = [1, -1] + [1] * (x.dim() - 2)
        if self.training or self.running_mean is None:
            mean, var, count = global_moments(x, self.group)
            if self.training and self.running_mean is not None:
                with torch.no_grad():
                    self.num_batches_tracked.add_(1)
                    m = (self.momentum if self.momentum is not None
                         else 1.0 / float(self.num_batches_tracked))
                    self.running_mean.mul_(1 - m).add_(m * mean)
                    self.running_var.mul_(1 - m).add_(m * var * count / (count - 1))
        else:
            mean, var = self.running_mean, self.running_var
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out
        # END SOLUTION


# --- 11.5 converting a model -----------------------------------------------------------------------

def convert_sync_by_hand(module: nn.Module, group=None) -> nn.Module:
    """``module`` with every batch norm in it (any ``_BatchNorm``, at any depth) replaced by a
    :class:`SyncBatchNormByHand` over ``group``; returns the new module when ``module`` itself
    is one, else ``module``, changed in place.

    A replacement keeps everything of the one it replaces: ``num_features``, ``eps``,
    ``momentum``, ``affine``, ``track_running_stats``, the very ``weight`` and ``bias``
    parameters (an optimizer built before keeps stepping them), ``running_mean``,
    ``running_var``, ``num_batches_tracked``, and train or eval mode.
    """
    # BEGIN SOLUTION 11.5: a _BatchNorm becomes a SyncBatchNormByHand with the same settings, parameters, running stats, num_batches_tracked and mode; recurse into every child
    out = module
    if isinstance(module, _BatchNorm):
        out = SyncBatchNormByHand(module.num_features, module.eps, module.momentum,
                                  module.affine, module.track_running_stats, group=group)
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        if module.track_running_stats:
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_sync_by_hand(child, group))
    return out
    # END SOLUTION


# --- given: the CLI -------------------------------------------------------------------------------

def shares(total: int, world_size: int) -> list[int]:
    """Uneven shares of ``total`` samples: rank r gets about (r + 1) parts, every rank >= 2."""
    weights = list(range(1, world_size + 1))
    sizes = [max(2, total * w // sum(weights)) for w in weights]
    sizes[-1] = total - sum(sizes[:-1])
    if sizes[-1] < 2:
        raise ValueError(f"a batch of {total} is too small for {world_size} ranks of 2 or more")
    return sizes


def my_rows(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    sizes = shares(len(x), world_size)
    start = sum(sizes[:rank])
    return x[start:start + sizes[rank]]


def batch(total: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 3 + 2 * torch.randn(total, 3, 8, 8, generator=g)


def images(steps: int, per_rank: int, world_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = per_rank * world_size
    return [(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))
            for _ in range(steps)]


def train(model: nn.Module, data, rank: int, world_size: int, lr: float = 0.1
          ) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in data:
        per_rank = len(x) // world_size
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
    return [t.detach().cpu().clone() for t in model.state_dict().values()
            if t.is_floating_point()]


def compare_worker(rank: int, world_size: int, total: int = 24, steps: int = 5,
                   per_rank: int = 4) -> dict:
    """Rank ``rank``: one batch norm forward on its uneven share of a batch, per-rank and
    synchronised; then ``steps`` DDP steps of a ConvNet, per-rank BN and hand SyncBN."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpt.models import ConvNet

    x = my_rows(batch(total), rank, world_size)
    torch.manual_seed(0)
    local = nn.BatchNorm2d(3)
    synced = convert_sync_by_hand(nn.BatchNorm2d(3))
    out = {"local": local(x).detach(), "synced": synced(x).detach(),
           "local_running_var": local.running_var.clone(),
           "synced_running_var": synced.running_var.clone()}
    data = images(steps, per_rank, world_size)
    for name, convert in (("per_rank_bn", False), ("sync_bn", True)):
        torch.manual_seed(0)
        model = ConvNet(batch_norm=True)
        out[name] = train(DDP(convert_sync_by_hand(model) if convert else model), data, rank,
                          world_size)
    return out


def largest(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=3, help="ranks (gloo on the CPU)")
    ap.add_argument("--batch", type=int, default=24, help="the global batch of the BN forward, "
                    "shared unevenly between the ranks")
    ap.add_argument("--steps", type=int, default=3, help="DDP steps of the ConvNet")
    ap.add_argument("--per-rank", type=int, default=4, help="ConvNet batch per rank")
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args(argv)
    try:
        if args.nproc < 2:
            raise ValueError(f"--nproc must be at least 2 (one rank has nothing to "
                             f"synchronise), got {args.nproc}")
        if args.steps < 1 or args.per_rank < 2:
            raise ValueError("--steps must be at least 1 and --per-rank at least 2")
        sizes = shares(args.batch, args.nproc)
        from dpt.ranks import run_distributed

        t0 = time.perf_counter()
        ranks = run_distributed(compare_worker, world_size=args.nproc, timeout=args.timeout,
                                backend="gloo", echo=False,
                                kwargs={"total": args.batch, "steps": args.steps,
                                        "per_rank": args.per_rank})
    except (ValueError, RuntimeError, OSError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    from dpt.models import ConvNet

    whole = nn.BatchNorm2d(3)
    want = whole(batch(args.batch)).detach()
    local = torch.cat([r["local"] for r in ranks])
    synced = torch.cat([r["synced"] for r in ranks])
    print(f"BatchNorm2d on {args.nproc} ranks holding {'/'.join(map(str, sizes))} of "
          f"{args.batch} samples, against one process on all of them "
          f"({time.perf_counter() - t0:.1f} s):")
    print(f"  per-rank BatchNorm: outputs differ by up to {(local - want).abs().max():.2e}, "
          f"running_var by up to {max(largest([r['local_running_var']], [whole.running_var]) for r in ranks):.2e}")
    print(f"  SyncBatchNormByHand: outputs differ by up to {(synced - want).abs().max():.2e}, "
          f"running_var by up to {max(largest([r['synced_running_var']], [whole.running_var]) for r in ranks):.2e}")
    torch.manual_seed(0)
    reference = train(ConvNet(batch_norm=True),
                      images(args.steps, args.per_rank, args.nproc), 0, 1)
    print(f"ConvNet, {args.steps} SGD steps of {args.per_rank} images per rank under DDP, "
          f"against one process on {args.per_rank * args.nproc}: largest difference in the "
          f"weights and running statistics")
    print(f"  per-rank BatchNorm: {largest(ranks[0]['per_rank_bn'], reference):.2e}")
    print(f"  SyncBatchNormByHand: {largest(ranks[0]['sync_bn'], reference):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
