# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 02: DataParallel by hand.

``nn.DataParallel`` does four things on every forward::

                  +-> chunk 0 -> replica 0 -> out 0 -+
    batch -scatter+-> chunk 1 -> replica 1 -> out 1 -+-gather-> output, on the root device
                  +-> chunk 2 -> replica 2 -> out 2 -+
                      (each replica: a fresh copy of the root's weights)

1. **scatter** the batch into N chunks along dimension 0 (the last chunk may be smaller);
2. **replicate** the model: N copies whose weights are *copies of the root's*, made afresh on
   every forward;
3. **parallel apply**: run replica k on chunk k, all at once;
4. **gather** the N outputs back on the root device, in order.

In backward, gradients flow back through the gather to each replica, and from each replica's
weight copies back to the root's weights, where the N contributions are **summed**. Summing is
right: with a loss averaged over the whole gathered batch, replica k's gradient is already
its chunk's share of the full-batch gradient.

On CUDA each step is torch's own primitive from ``torch.nn.parallel`` (given below). On the
CPU there is one "device" per replica: replicas run in Python threads (torch releases the GIL
inside its kernels), each with ``cores // N`` intra-op threads so that N replicas do not
oversubscribe the cores. That CPU path is what you write.

Honest limits of the CPU path: the autograd engine runs the CPU part of backward on one
thread, so only the forward is parallel; on GPUs each device has its own backward thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from dpt.dist import cpu_budget


def _cuda_devices(devices) -> list[int] | None:
    """CUDA device indices when ``devices`` names CUDA devices, else None (the CPU path)."""
    if not devices:
        return None
    out = []
    for d in devices:
        d = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
        if d.type != "cuda":
            return None
        out.append(d.index if d.index is not None else torch.cuda.current_device())
    return out


# ------------------------------------------------------------------------------ 1. scatter


def scatter(x: torch.Tensor, n: int, devices: Sequence | None = None) -> list[torch.Tensor]:
    """Split ``x`` along dimension 0 into at most ``n`` chunks, in order, dropping no sample.

    Chunks have ``ceil(B / n)`` rows except the last, which may be smaller (``torch.chunk``'s
    rule, the same as ``nn.DataParallel``). With ``B < n`` there are only ``B`` chunks.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    cuda = _cuda_devices(devices)
    if cuda is not None:
        return list(torch.nn.parallel.comm.scatter(x, cuda[:n], dim=0))
    raise NotImplementedError("Task 02.1: split x along dim 0 into chunks of ceil(B / n) rows, keeping the short last chunk")


# ---------------------------------------------------------------------------- 2. replicate


class Broadcast(torch.autograd.Function):
    """Copy k tensors to n replicas; in backward, sum the n gradients of each tensor.

    ``Broadcast.apply(n, t1, ..., tk)`` returns ``n * k`` tensors, replica by replica:
    ``(t1 for replica 0, ..., tk for replica 0, t1 for replica 1, ...)``.
    This is torch's ``nn.parallel._functions.Broadcast`` without the devices: its backward is
    ``ReduceAddCoalesced``, a sum.
    """

    @staticmethod
    def forward(ctx, n: int, *tensors: torch.Tensor):
        ctx.n, ctx.k = n, len(tensors)
        return tuple(t.detach().clone() for _ in range(n) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        raise NotImplementedError("Task 02.3: one gradient per input of forward: None for n, then each tensor's gradient summed over the replicas")


def _copy_tree(module: nn.Module) -> tuple[nn.Module, list[tuple[nn.Module, nn.Module]]]:
    """A structural copy of ``module``: new module objects with their own ``_parameters``,
    ``_buffers`` and ``_modules`` dicts (still pointing at the originals' tensors).

    Returns the new root and the pairs ``(original submodule, its copy)``. A submodule used
    twice is copied once, so shared (tied) submodules stay shared.
    """
    copies: dict[int, nn.Module] = {}
    pairs = []
    for m in module.modules():  # each distinct module once
        c = m.__new__(type(m))
        c.__dict__ = m.__dict__.copy()
        c._parameters = dict(m._parameters)
        c._buffers = dict(m._buffers)
        c._modules = dict(m._modules)
        copies[id(m)] = c
        pairs.append((m, c))
    for m, c in pairs:
        for name, child in m._modules.items():
            c._modules[name] = None if child is None else copies[id(child)]
    return copies[id(module)], pairs


def replicate(module: nn.Module, n: int, devices: Sequence | None = None) -> list[nn.Module]:
    """``n`` replicas of ``module`` whose gradients flow back (summed) to ``module``'s own.

    - every parameter of replica r is the r-th ``Broadcast`` copy of the root's parameter
      (one ``Broadcast.apply`` over all parameters; a tied parameter maps to one copy);
    - replica 0 shares the root's buffers (the same tensor objects), so in-place buffer
      updates on replica 0 (batch-norm running statistics) reach the root; replicas 1..n-1
      get clones of the buffers, whose updates are lost. ``nn.DataParallel`` does exactly this.
    """
    cuda = _cuda_devices(devices)
    if cuda is not None:
        return torch.nn.parallel.replicate(module, cuda[:n], detach=not torch.is_grad_enabled())
    raise NotImplementedError("Task 02.2: give each replica its own module tree, wired to that replica's Broadcast copies of the parameters")


# ----------------------------------------------------------------------- 3. parallel apply


@contextlib.contextmanager
def intra_op_threads(n: int):
    """Set torch's intra-op threads to ``n`` inside the block (new threads inherit it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[torch.Tensor],
                   devices: Sequence | None = None) -> list[torch.Tensor]:
    """Run ``replicas[k](inputs[k])`` for every k at the same time; outputs in input order.

    On the CPU, one Python thread per replica. Grad mode is per thread in torch, so the
    caller's mode (``torch.no_grad()`` or not) is carried into each thread. An exception in
    any replica is raised here.
    """
    if len(replicas) != len(inputs):
        raise ValueError(f"{len(replicas)} replicas but {len(inputs)} inputs")
    cuda = _cuda_devices(devices)
    if cuda is not None:
        return torch.nn.parallel.parallel_apply(list(replicas), [(x,) for x in inputs],
                                                devices=cuda[:len(replicas)])
    raise NotImplementedError("Task 02.4: run each replica on its input in its own thread, in the caller's grad mode; outputs in order")


# --------------------------------------------------------------------------------- 4. gather


def gather(outputs: Sequence[torch.Tensor], device: torch.device | str | int | None = None
           ) -> torch.Tensor:
    """Concatenate the replicas' outputs along dimension 0, in order, on ``device`` (the root).

    Differentiable: in backward each replica receives the slice of the gradient that belongs
    to its own chunk.
    """
    if device is not None and torch.device(device).type == "cuda":
        return torch.nn.parallel.gather(list(outputs), torch.device(device), dim=0)
    raise NotImplementedError("Task 02.5: concatenate the outputs along dim 0, on the root device when one is given")


# ---------------------------------------------------------------------------- all together


class DataParallelByHand(nn.Module):
    """``nn.DataParallel``'s forward, written out: scatter, replicate, parallel apply, gather.

    ``DataParallelByHand(model, n_replicas=N)`` runs on the CPU with N replicas in threads and
    ``threads_per_replica`` intra-op threads each (default ``cores // N``, at least 1).
    ``DataParallelByHand(model, device_ids=[0, 1])`` uses CUDA devices and torch's primitives;
    the model must already be on ``device_ids[0]``, the root.

    As with ``nn.DataParallel``, the wrapped model is ``.module``: save ``.module.state_dict()``
    and the checkpoint loads into a plain model.
    """

    def __init__(self, module: nn.Module, n_replicas: int | None = None,
                 device_ids: Sequence[int] | None = None, threads_per_replica: int | None = None):
        super().__init__()
        self.module = module
        self.device_ids = list(device_ids) if device_ids else None
        if self.device_ids:
            self.devices = [torch.device("cuda", i) for i in self.device_ids]
            self.n = len(self.devices)
        else:
            self.devices = None
            self.n = int(n_replicas or 1)
            if self.n < 1:
                raise ValueError(f"n_replicas must be at least 1, got {n_replicas}")
        self.threads_per_replica = threads_per_replica or max(1, cpu_budget() // self.n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        root = self.devices[0] if self.devices else None
        raise NotImplementedError("Task 02.6: chain scatter, replicate, parallel_apply and gather (CPU: threads_per_replica threads each)")
