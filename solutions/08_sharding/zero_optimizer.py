"""Lesson 08: a ZeRO-1 sharded optimizer, written by hand.

:class:`ShardedOptimizer` is a drop-in ``torch.optim.Optimizer``, built the way torch's
``ZeroRedundancyOptimizer`` is::

    model = DDP(model)                                   # gradients still all-reduced
    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3, weight_decay=0.01)
    opt.zero_grad(); loss.backward(); opt.step()         # as usual

- every rank sees the same list of parameters and the same assignment of each parameter to
  an *owner* rank (:func:`partition_params`, balanced by size);
- each rank builds the real (inner) optimizer only for the parameters it owns, so it keeps
  only 1/N of the optimizer state (Adam: 8 bytes per parameter become 8/N);
- after its local step each owner broadcasts its updated parameters, so all ranks again
  hold identical full weights for the next forward.

ZeRO-2 also shards the gradients: :meth:`ShardedOptimizer.reduce_gradients` (used *instead*
of DDP) reduces each gradient to its owner only and frees it on the other ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def partition_params(sizes: Sequence[int], world_size: int) -> list[int]:
    """The owner rank of each parameter, given the parameters' sizes (numel).

    Balanced by size: no rank's total may exceed another's by more than the largest single
    parameter. Deterministic (same input, same answer), since every rank computes it alone.
    """
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    # BEGIN SOLUTION 08.2: biggest parameter first, each to the rank with the least so far
    owners = [0] * len(sizes)
    loads = [0] * world_size
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += sizes[i]
    # END SOLUTION
    return owners


class ShardedOptimizer(torch.optim.Optimizer):
    """Optimizer state sharded over the ranks of ``process_group`` (ZeRO stage 1).

    ``ShardedOptimizer(params, optimizer_class, process_group=None, **optimizer_kwargs)``.
    ``params`` may be parameter groups (dicts), as for any torch optimizer; per-group
    options (``lr``, ``weight_decay``...) are kept, and changes to ``param_groups`` (an LR
    scheduler) reach the inner optimizer at the next :meth:`step`.
    """

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer],
                 process_group: dist.ProcessGroup | None = None, **optimizer_kwargs):
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        # The base class turns params into self.param_groups and fills in the defaults.
        super().__init__(params, optimizer_kwargs)
        self.optimizer_class = optimizer_class
        self.all_params = [p for group in self.param_groups for p in group["params"]]
        owners = partition_params([p.numel() for p in self.all_params], self.world_size)
        self.owner = dict(zip(map(id, self.all_params), owners))
        # params_of[r]: the parameters rank r owns, in a fixed order every rank agrees on.
        self.params_of = [[p for p in self.all_params if self.owner[id(p)] == r]
                          for r in range(self.world_size)]
        # One inner group per outer group (maybe empty), so their options stay aligned.
        local_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [p for p in g["params"] if self.owner[id(p)] == self.rank]}
                        for g in self.param_groups]
        self.local_optimizer = (optimizer_class(local_groups, **optimizer_kwargs)
                                if self.params_of[self.rank] else None)

    def _global_rank(self, group_rank: int) -> int:
        if self.process_group is None:
            return group_rank
        return dist.get_global_rank(self.process_group, group_rank)

    def _sync_options(self) -> None:
        """Copy the outer groups' options (e.g. a scheduler's new lr) to the inner groups."""
        for outer, inner in zip(self.param_groups, self.local_optimizer.param_groups):
            for key, value in outer.items():
                if key != "params":
                    inner[key] = value

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """ZeRO-2 without DDP: average each gradient onto its owner, free it elsewhere.

        Collective: every rank calls it, and all enter the same reduces. A parameter with a
        gradient on some ranks only (a branch that only some ranks' data takes) counts as a
        zero gradient where it has none, as in DDP; one with no gradient anywhere keeps none.
        """
        # Which parameters have a gradient on ANY rank. Deciding from this rank's gradients
        # alone, a rank could skip a reduce that the others enter, and they would wait forever.
        has_grad = torch.tensor([p.grad is not None for p in self.all_params], dtype=torch.int32,
                                device=self.all_params[0].device)
        dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=self.process_group)
        anywhere = {id(p) for p, flag in zip(self.all_params, has_grad.tolist()) if flag}
        for r, params in enumerate(self.params_of):
            with_grad = [p for p in params if id(p) in anywhere]
            if not with_grad:
                continue
            for p in with_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in with_grad])
            dist.reduce(flat, dst=self._global_rank(r), group=self.process_group)
            if r == self.rank:
                flat /= self.world_size
                offset = 0
                for p in with_grad:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
            else:
                for p in with_grad:
                    p.grad = None
            del flat  # freed before the next owner's buffer is built: one at a time

    def step(self, closure=None):
        """Step the parameters this rank owns, then share every owner's updated ones."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # BEGIN SOLUTION 08.3: step what this rank owns, then share the updated parameters with every rank
        if self.local_optimizer is not None:
            self._sync_options()
            self.local_optimizer.step()
        with torch.no_grad():
            for r, params in enumerate(self.params_of):
                if not params:
                    continue
                # One flat buffer per owner: N broadcasts per step, not one per tensor.
                flat = torch.cat([p.detach().reshape(-1) for p in params])
                dist.broadcast(flat, src=self._global_rank(r), group=self.process_group)
                if r != self.rank:
                    offset = 0
                    for p in params:
                        p.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
                del flat  # one owner's buffer at a time
        # END SOLUTION
        return loss

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (each rank saves its own)."""
        return {"rank": self.rank, "world_size": self.world_size,
                "local": None if self.local_optimizer is None
                else self.local_optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict["world_size"] != self.world_size or state_dict["rank"] != self.rank:
            raise ValueError("this shard was saved by rank {rank} of {world_size}".format(
                **state_dict))
        if self.local_optimizer is not None:
            self.local_optimizer.load_state_dict(state_dict["local"])
            self._sync_options()


def owned_fraction(optimizer: ShardedOptimizer) -> float:
    """The share of all parameter elements this rank owns (about 1/N when balanced)."""
    total = sum(p.numel() for p in optimizer.all_params)
    return sum(p.numel() for p in optimizer.params_of[optimizer.rank]) / max(1, total)


def demo_worker(rank: int, world_size: int, steps: int = 5, seed: int = 0) -> dict:
    """For the notebook: DDP + Adam against DDP + ShardedOptimizer(Adam), same data.

    Returns the largest parameter difference after ``steps`` and each one's Adam state bytes.
    """
    import copy

    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from zero_accounting import optimizer_state_bytes

    from dpt.dist import rank_device
    from dpt.models import ConvNet

    device = rank_device()  # the CPU under gloo, this rank's GPU under NCCL
    ids = [device.index] if device.type == "cuda" else None
    torch.manual_seed(seed)
    base = ConvNet().to(device)
    plain_model = DDP(copy.deepcopy(base), device_ids=ids)
    sharded_model = DDP(copy.deepcopy(base), device_ids=ids)
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-3, weight_decay=0.01)
    sharded = ShardedOptimizer(sharded_model.parameters(), torch.optim.Adam, lr=1e-3,
                               weight_decay=0.01)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    for _ in range(steps):
        x, y = torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)
        x, y = x.to(device), y.to(device)
        for model, opt in ((plain_model, plain), (sharded_model, sharded)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    diff = max((p - q).abs().max().item()
               for p, q in zip(plain_model.parameters(), sharded_model.parameters()))
    return {"rank": rank, "max_diff": diff, "plain_state": optimizer_state_bytes(plain),
            "sharded_state": optimizer_state_bytes(sharded), "owned": owned_fraction(sharded)}
