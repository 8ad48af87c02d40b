"""Rank functions for lesson 12's memory calculator tests (test_memory_calc.py).

What lessons 08 and 09's SOLUTION code really holds and sends, counted on ``N`` = 2 gloo
ranks: one training step after a warm-up step (Adam's state exists from the first one), for

- ``ddp``: torch's DDP with Adam (its buckets go through the default all-reduce comm hook, a
  Python ``dist.all_reduce``, so they are counted like any other call);
- ``zero1``: DDP + lesson 08's ``ShardedOptimizer`` (Adam);
- ``zero2``: lesson 08's ``ShardedOptimizer`` with ``reduce_gradients()`` instead of DDP;
- ``fsdp``, ``fsdp_bf16``: lesson 09's ``FSDP`` by hand (Adam), fp32 and bf16 compute.

The collectives are counted by wrapping ``torch.distributed``'s functions in the rank (the
lessons call them through the module, ``dist.broadcast(...)``): each call records its op and
the bytes of its *logical* buffer, the whole tensor the operation is about (an all-reduce's
or a broadcast's tensor, an all-gather's output, a reduce-scatter's input). Only the
outermost call counts: ``reduce_scatter_tensor`` calls ``reduce_scatter_single`` inside, and
gloo, which has no reduce-scatter of its own, carries one out as an all-reduce in C++; what is
counted is the operation the lesson's code means, never how a backend emulates it. The test
turns those buffers into what one rank sends with the ring factors.

The lesson code comes from ``solutions/`` (lessons 08 and 09's reference answers, whatever
tree is under test): these checks are about lesson 12's calculator, not those lessons.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.helpers import rank_part
from tests.lessons import REPO

N = 2
SOLUTIONS = REPO / "solutions"
# lesson 08's ShardedOptimizer gives each rank whole tensors: 4 equal layers split 2 + 2
MLP_WIDTH = 32
MLP_LAYERS = 4
# lesson 09's FSDP pads each unit to a multiple of N: an odd vocab makes the root unit odd
TINY = {"vocab": 33, "dim": 16, "heads": 2, "layers": 2, "seq_len": 8}
BATCH = 4

# name -> (argument index, keyword) of the logical buffer, and whether it is a list of tensors
LOGICAL = {
    "all_reduce": (0, "tensor", False),
    "broadcast": (0, "tensor", False),
    "reduce": (0, "tensor", False),
    "all_gather_into_tensor": (0, "output_tensor", False),
    "all_gather_single": (0, "output_tensor", False),
    "_all_gather_base": (0, "output_tensor", False),
    "reduce_scatter_tensor": (1, "input", False),
    "reduce_scatter_single": (1, "input", False),
    "_reduce_scatter_base": (1, "input", False),
    "all_gather": (0, "tensor_list", True),
    "reduce_scatter": (1, "input_list", True),
}
# the logical operation each call is, in the calculator's words
KIND = {"all_reduce": "all_reduce", "broadcast": "broadcast", "reduce": "reduce",
        "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
        "_all_gather_base": "all_gather", "all_gather": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
        "_reduce_scatter_base": "reduce_scatter", "reduce_scatter": "reduce_scatter"}


class Counter:
    """Records each outermost collective call while ``on``: ``(kind, dtype, numel, bytes)``."""

    def __init__(self):
        self.calls: list[dict] = []
        self.on = False
        self.depth = 0

    def install(self) -> None:
        for name in LOGICAL:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        index, keyword, is_list = LOGICAL[name]

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self.on and self.depth == 0:
                buf = args[index] if len(args) > index else kwargs[keyword]
                tensors = list(buf) if is_list else [buf]
                self.calls.append({
                    "kind": KIND[name], "dtype": str(tensors[0].dtype).replace("torch.", ""),
                    "numel": sum(t.numel() for t in tensors),
                    "bytes": sum(t.numel() * t.element_size() for t in tensors)})
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return counted


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_bytes(optimizer) -> int:
    """The optimizer's state tensors (Adam's exp_avg and exp_avg_sq; its 0-dim ``step``
    counters are left out, as the calculator leaves them out)."""
    inner = getattr(optimizer, "local_optimizer", optimizer)
    if inner is None:
        return 0
    return _bytes(v for state in inner.state.values() for v in state.values()
                  if torch.is_tensor(v) and v.dim() > 0)


def _held(params, optimizer) -> dict:
    params = list(params)
    return {"params": _bytes(params),
            "grads": _bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _state_bytes(optimizer),
            "param_dtypes": sorted({str(p.dtype) for p in params})}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(MLP_WIDTH, MLP_WIDTH) for _ in range(MLP_LAYERS)])


def _run(counter: Counter, step, params, optimizer) -> dict:
    """A warm-up step, then one counted step; what the rank holds after it."""
    step()
    counter.calls, counter.on = [], True
    try:
        step()
    finally:
        counter.on = False
    return {"calls": counter.calls, **_held(params, optimizer)}


def _mlp_strategy(counter: Counter, strategy: str, rank: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpt.lessons import load

    model = _mlp()
    num_params = sum(p.numel() for p in model.parameters())
    after_backward = None
    if strategy in ("ddp", "zero1"):
        model = DDP(model)
        # the default hook, registered explicitly: DDP's all-reduce goes through Python
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    if strategy == "ddp":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        zero = load("08_sharding", "zero_optimizer", SOLUTIONS)
        optimizer = zero.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
        if strategy == "zero2":
            after_backward = optimizer.reduce_gradients
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(BATCH, MLP_WIDTH, generator=g), torch.randn(BATCH, MLP_WIDTH, generator=g)

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()

    return {"num_params": num_params, **_run(counter, step, model.parameters(), optimizer)}


def _fsdp(counter: Counter, compute_dtype, rank: int) -> dict:
    from dpt.lessons import load
    from dpt.models import TinyTransformer, token_batch

    fsdp_by_hand = load("09_fsdp", "fsdp_by_hand", SOLUTIONS)
    torch.manual_seed(0)
    model = TinyTransformer(**TINY)
    fsdp = fsdp_by_hand.FSDP(model, compute_dtype=compute_dtype)
    units = {unit.name: unit.numel for unit in fsdp.all_units}
    optimizer = torch.optim.Adam(fsdp.parameters(), lr=1e-3)
    inputs, targets = token_batch(BATCH, TINY["seq_len"], TINY["vocab"], seed=200 + rank)

    def step():
        optimizer.zero_grad(set_to_none=True)
        fsdp_by_hand.loss_fn(fsdp(inputs), targets).backward()
        fsdp.finish_grad_sync()
        optimizer.step()

    return {"units": units, **_run(counter, step, fsdp.parameters(), optimizer)}


def counted_steps(rank: int, world_size: int) -> dict:
    """Every strategy on this rank, each part on its own (``rank_part``)."""
    counter = Counter()
    counter.install()
    out = {"rank": rank, "world_size": world_size}
    for strategy in ("ddp", "zero1", "zero2"):
        out[strategy] = rank_part(_mlp_strategy, counter, strategy, rank)
    out["fsdp"] = rank_part(_fsdp, counter, None, rank)
    out["fsdp_bf16"] = rank_part(_fsdp, counter, torch.bfloat16, rank)
    return out
