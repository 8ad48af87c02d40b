"""Lesson 08: where a data-parallel rank's memory goes, predicted and measured.

For a model of P parameters trained with Adam in fp32 on N ranks, each rank holds

=========  ==============  ==============  ================  ==================
stage      parameters      gradients       Adam state        total (fp32)
=========  ==============  ==============  ================  ==================
DDP        4P              4P              8P                16P
ZeRO-1     4P              4P              8P / N            8P + 8P/N
ZeRO-2     4P              4P / N          8P / N            4P + 12P/N
ZeRO-3     4P / N          4P / N          8P / N            16P / N   (= FSDP)
=========  ==============  ==============  ================  ==================

(Adam keeps two fp32 tensors per parameter, ``exp_avg`` and ``exp_avg_sq``, plus a scalar
``step`` per tensor.) The ZeRO paper counts mixed precision instead: 2 bytes of fp16
parameters, 2 of fp16 gradients and K = 12 of fp32 master weights and Adam state; pass
``param_bytes=2, grad_bytes=2, state_bytes=12`` for that.

:func:`measure_bytes` counts what a rank really allocated, so the prediction can be checked.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

STAGES = ("ddp", "zero1", "zero2", "zero3")
STAGE_LABELS = {"ddp": "DDP (replicated)", "zero1": "ZeRO-1: optimizer state sharded",
                "zero2": "ZeRO-2: + gradients sharded", "zero3": "ZeRO-3 / FSDP: + parameters"}


def predict_bytes(num_params: int, world_size: int, stage: str, param_bytes: int = 4,
                  grad_bytes: int = 4, state_bytes: int = 8) -> dict[str, float]:
    """Bytes one rank holds for parameters, gradients and optimizer state, and their total.

    ``stage`` is one of ``STAGES``; ``state_bytes`` is the optimizer state per parameter
    (8 for fp32 Adam, 4 for SGD with momentum, 0 for plain SGD). Ignores the few bytes of
    Adam's per-tensor ``step`` counters and the rounding of uneven shards.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of: {', '.join(STAGES)}")
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    # BEGIN SOLUTION 08.1: each stage divides one more of (state, grads, params) by world_size
    n = world_size
    sharded = STAGES.index(stage)  # 0: nothing, 1: state, 2: + grads, 3: + params
    params = num_params * param_bytes / (n if sharded >= 3 else 1)
    grads = num_params * grad_bytes / (n if sharded >= 2 else 1)
    state = num_params * state_bytes / (n if sharded >= 1 else 1)
    # END SOLUTION
    return {"params": params, "grads": grads, "optimizer": state,
            "total": params + grads + state}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank stores: a DTensor's local shard, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Sum of ``numel * element_size`` over the tensors (local shards for DTensors)."""
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, include_scalars: bool = False) -> int:
    """Bytes of the tensors in ``optimizer.state`` (a sharded optimizer's local one).

    Adam's ``step`` counters are 0-dim tensors; they are left out unless ``include_scalars``.
    """
    inner = getattr(optimizer, "local_optimizer", optimizer)
    if inner is None:  # a sharded optimizer on a rank that owns no parameter
        return 0
    tensors = [v for state in inner.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and (include_scalars or v.dim() > 0)]
    return tensor_bytes(tensors)


def measure_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank allocated for parameters, gradients and optimizer state."""
    params = list(model.parameters())
    measured = {"params": tensor_bytes(params),
                "grads": tensor_bytes(p.grad for p in params if p.grad is not None),
                "optimizer": optimizer_state_bytes(optimizer)}
    measured["total"] = sum(measured.values())
    return measured


def prediction_table(num_params: int, world_sizes: Iterable[int] = (1, 2, 4, 8),
                     **bytes_per_param) -> list[dict]:
    """One row per (stage, N): the predicted MB per rank, for plots and tables."""
    rows = []
    for stage in STAGES:
        for n in world_sizes:
            pred = predict_bytes(num_params, n, stage, **bytes_per_param)
            rows.append({"stage": stage, "world_size": n,
                         **{k: v / 2**20 for k, v in pred.items()}})
    return rows
