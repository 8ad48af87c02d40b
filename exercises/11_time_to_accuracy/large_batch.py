# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 11: optimizers for large batches (LARS, LAMB), and their norms on sharded weights.

Linear scaling (lr_scaling.py) breaks down past some batch: with the lr that large, the
update of some layers is larger than their weights (the ratio ||w|| / ||g|| differs by
orders of magnitude from layer to layer) and training diverges, warmup or not. *Layer-wise
adaptive* optimizers give each tensor its own step size, proportional to its weight norm:

- **LARS** (You, Gitman, Ginsburg 2017, arXiv 1708.03888, Eq. 6), SGD with momentum and a
  *trust ratio* per tensor::

      trust = eta * ||w|| / (||g|| + wd * ||w|| + eps)      d = trust * (g + wd * w)
      buf = momentum * buf + d                                w -= lr * buf

  (torch-optimizer's convention: eta is the trust coefficient; a tensor of a group without
  weight decay, biases and norms as in SimCLR, or with a zero norm, takes plain g: d = g);
- **LAMB** (You et al. 2019, arXiv 1904.00962, Alg. 2), the same idea on Adam's direction::

      m = b1 m + (1 - b1) g        v = b2 v + (1 - b2) g^2
      r = m_hat / (sqrt(v_hat) + eps)    (m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t))
      u = r + wd * w                  trust = phi(||w||) / ||u||      w -= lr * trust * u

  phi clamps the weight norm at ``max_weight_norm`` when one is set (torch-optimizer clamps
  at 10); trust is 1 when either norm is 0. It trained BERT with batches of 32k-64k.

**Sharded weights.** When the optimizer state is sharded (ZeRO, FSDP), each rank updates
only its shard of each weight. Lesson 08's ZeRO optimizer gives each rank *whole* tensors, so
there a norm is local. DeepSpeed and FSDP cut each tensor into *element* shards (flattened,
padded to a multiple of N, chunk r on rank r; :func:`shard_of`), and then ||w|| is no
rank's business: it needs every rank's piece. Norms do not add, squares do::

      ||w||^2 = sum over ranks of ||w_r||^2        (||w|| != sum of ||w_r||)

so a rank sums the squares of its shard, one all-reduce adds them (all tensors' sums in one
vector: one message, not one per tensor), and the square root comes last. The same goes for
gradient clipping, whose total norm is over all tensors and all ranks.

Your tasks:

- 11.10 :meth:`LARS.step`;
- 11.11 :func:`lamb_direction` and :meth:`LAMB.step`;
- 11.12 :func:`shard_square_norms`: the norms of whole tensors from their shards;
- 11.13 :meth:`ShardedLAMB.step`: LAMB where each rank keeps and updates one element shard;
- 11.14 :func:`sharded_clip_grad_norm_`: ``torch.nn.utils.clip_grad_norm_`` on shards.

Given: :func:`shard_of` and :func:`unshard_into` (cut a tensor into element shards, gather
them back), the optimizers' constructors. The CLI trains the MLP a few steps with LAMB and
with ShardedLAMB on N ranks, and prints how far apart their weights end up::

    .venv/bin/python exercises/11_time_to_accuracy/large_batch.py --nproc 2
"""

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _check(name: str, value: float, low: float = 0.0, high: float = math.inf) -> None:
    if not low <= value < high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}), got {value}")


# --- 11.10 LARS -----------------------------------------------------------------------------

class LARS(torch.optim.Optimizer):
    """SGD with momentum and a layer-wise trust ratio (You et al. 2017; torch-optimizer's
    convention). Param-group options: ``lr``, ``momentum``, ``weight_decay``,
    ``trust_coefficient`` (eta), ``eps``. A group with ``weight_decay`` 0 is not scaled."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001,
                 eps: float = 1e-8):
        _check("lr", lr, low=1e-300)
        _check("momentum", momentum, high=1.0)
        for name, value in (("weight_decay", weight_decay), ("eps", eps),
                            ("trust_coefficient", trust_coefficient)):
            _check(name, value)
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        """One step on every parameter that has a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                raise NotImplementedError("Task 11.10: with weight decay and two nonzero norms, d is (g + wd w) times the trust ratio (its denominator has wd ||w|| and eps); else d is g. Momentum buffer (the first one is d itself), then w -= lr * buffer")
        return loss


# --- 11.11 LAMB ------------------------------------------------------------------------------

def lamb_direction(w: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
    """LAMB's direction ``u = r + wd * w`` for weights ``w`` and gradient ``g``, after
    updating the moments ``state["exp_avg"]`` and ``state["exp_avg_sq"]`` in place with the
    step number ``state["step"]`` (already counted: 1 at the first step). ``group``: the
    param group's options. :meth:`LAMB.step` and :meth:`ShardedLAMB.step` both use it."""
    raise NotImplementedError("Task 11.11: m and v are moving averages of g and g*g; divide them by 1 - beta^t when the group asks for bias correction; r = m / (sqrt(v) + eps); add wd * w (decoupled decay)")


class LAMB(torch.optim.Optimizer):
    """Adam's direction with a layer-wise trust ratio (You et al. 2019, Algorithm 2).

    Param-group options: ``lr``, ``betas``, ``eps``, ``weight_decay`` (decoupled: added to
    the direction, as in AdamW), ``bias_correction`` (divide the moments by 1 - beta^t; off,
    torch-optimizer's ``debias=False``), ``max_weight_norm`` (phi: clamp ||w|| at it; None: no
    clamp). State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq``.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, bias_correction: bool = True,
                 max_weight_norm: float | None = None):
        _check("lr", lr, low=1e-300)
        _check("betas[0]", betas[0], high=1.0)
        _check("betas[1]", betas[1], high=1.0)
        _check("eps", eps)
        _check("weight_decay", weight_decay)
        if max_weight_norm is not None:
            _check("max_weight_norm", max_weight_norm, low=1e-300)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, bias_correction=bias_correction,
                                      max_weight_norm=max_weight_norm))

    @torch.no_grad()
    def step(self, closure=None):
        """One step on every parameter that has a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                raise NotImplementedError("Task 11.11: zero moments at the first step, count the step (from 1), u from lamb_direction; trust = phi(||w||) / ||u||, 1 if either norm is 0; w -= lr * trust * u")
        return loss


# --- element shards (given) ---------------------------------------------------------------------

def shard_of(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s element shard of ``t``: flattened, zero-padded to a multiple of
    ``world_size``, chunk ``rank`` (a new tensor, ``ceil(numel / world_size)`` elements).
    The padding zeros add nothing to a sum of squares, and LAMB leaves them at zero."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    flat = t.detach().reshape(-1)
    size = -(-flat.numel() // world_size)
    padded = F.pad(flat, (0, size * world_size - flat.numel()))
    return padded[rank * size:(rank + 1) * size].clone()


def unshard_into(param: torch.Tensor, shard: torch.Tensor, group=None) -> None:
    """Gather every rank's ``shard`` of ``param`` (from :func:`shard_of`) into ``param``."""
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, shard.contiguous(), group=group)
    with torch.no_grad():
        param.copy_(torch.cat(pieces)[:param.numel()].view_as(param))


# --- 11.12 norms of sharded tensors -------------------------------------------------------------

def shard_square_norms(shards: list[torch.Tensor], group=None) -> torch.Tensor:
    """The norms of the whole tensors whose shards (this rank's) are ``shards``.

    A 1-D tensor, one norm per shard, equal on every rank. Exactly one all-reduce, whatever
    the number of tensors. An empty list: an empty tensor and no all-reduce.
    """
    if not shards:
        return torch.zeros(0)
    raise NotImplementedError("Task 11.12: each shard's sum of squares into one vector; one all-reduce (SUM) of it adds the ranks' pieces; square roots last")


# --- 11.13 LAMB on element shards ----------------------------------------------------------------

class ShardedLAMB(LAMB):
    """LAMB where each rank keeps the moments of, and updates, its element shard of each
    parameter only (1/N of LAMB's state), then gathers the updated shards into the params.

    Every rank holds the same full parameters and the same full (already averaged) gradient,
    DDP's; a rank reads its shard of both with :func:`shard_of`. Options as :class:`LAMB`,
    plus ``group`` (the process group; None: every rank). State per parameter: ``step``, and
    ``exp_avg`` and ``exp_avg_sq`` of the shard's size. The trust ratio is the whole tensor's:
    its norms come from :func:`shard_square_norms`.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, bias_correction: bool = True,
                 max_weight_norm: float | None = None, group=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, max_weight_norm=max_weight_norm)
        self.process_group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    @torch.no_grad()
    def step(self, closure=None):
        """One step; returns ``closure()``'s loss. Every rank must call it (collectives)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rank, world, pg = self.rank, self.world_size, self.process_group
        raise NotImplementedError("Task 11.13: per parameter, this rank's shards of w and g, the moments of the shard and u; the norms of all ws and us from one shard_square_norms call; each shard's update with the whole tensor's trust ratio; gather the shards back into the parameters")
        return loss


# --- 11.14 gradient clipping on shards ---------------------------------------------------------

@torch.no_grad()
def sharded_clip_grad_norm_(grad_shards: list[torch.Tensor], max_norm: float,
                            group=None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients held as element shards.

    ``grad_shards``: this rank's shard of each gradient, scaled in place. Returns the total
    norm (a 0-d tensor, equal on every rank) of all the whole gradients, as torch's does, and
    scales by ``min(1, max_norm / (total + 1e-6))``: never up.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    if not grad_shards:
        return torch.tensor(0.0)
    raise NotImplementedError("Task 11.14: one all-reduced sum of squares over every shard of every tensor; its square root is the total norm; the coefficient is capped at 1")


# --- the command line ---------------------------------------------------------------------------

def compare_worker(rank: int, world_size: int, steps: int, batch: int, seed: int) -> dict:
    """On each rank: the MLP trained ``steps`` steps with :class:`ShardedLAMB`; rank 0 also
    trains a copy with :class:`LAMB` and measures the largest weight difference."""
    import copy

    from dpt.dist import rank_device
    from dpt.models import MLP

    device = rank_device()
    torch.manual_seed(seed)
    model = MLP().to(device)
    twin = copy.deepcopy(model)

    def groups(m):
        return [{"params": [p for p in m.parameters() if p.dim() > 1], "weight_decay": 0.01},
                {"params": [p for p in m.parameters() if p.dim() <= 1], "weight_decay": 0.0}]

    opts = dict(lr=0.01, max_weight_norm=10.0)
    sharded = ShardedLAMB(groups(model), **opts)
    plain = LAMB(groups(twin), **opts) if rank == 0 else None
    gen = torch.Generator().manual_seed(seed + 1)  # the same batches on every rank
    for _ in range(steps):
        x = torch.randn(batch, 1, 28, 28, generator=gen).to(device)
        y = torch.randint(0, 10, (batch,), generator=gen).to(device)
        for m, opt in ((model, sharded), (twin, plain)):
            if opt is None:
                continue
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    state = sum(t.numel() for s in sharded.state.values() for t in s.values()
                if torch.is_tensor(t))
    out = {"state_elements": state}
    if rank == 0:
        out["full_state_elements"] = sum(t.numel() for s in plain.state.values()
                                         for t in s.values() if torch.is_tensor(t))
        out["max_diff"] = max((a - b).abs().max().item()
                              for a, b in zip(model.parameters(), twin.parameters()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args(argv)
    try:
        if args.nproc < 1 or args.steps < 1 or args.batch_size < 1:
            raise ValueError("--nproc, --steps and --batch-size must be at least 1")
        from dpt.ranks import run_distributed

        ranks = run_distributed(compare_worker, world_size=args.nproc, timeout=args.timeout,
                                args=(args.steps, args.batch_size, args.seed), echo=False)
    except (ValueError, RuntimeError, OSError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    r0 = ranks[0]
    print(f"LAMB vs ShardedLAMB on {args.nproc} rank(s), MLP, {args.steps} steps: largest "
          f"weight difference {r0['max_diff']:.2e}")
    print(f"optimizer state per rank: {max(r['state_elements'] for r in ranks):,} elements "
          f"(unsharded LAMB: {r0['full_state_elements']:,})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
