"""Rank functions for lesson 10's communication-hook tests (run by dpt.ranks.run_distributed).

Each loads the lesson module inside the rank (``tests.lessons.load``). Where a test grades one
task, the others it would lean on are replaced here by references (``reference_attach``,
``ReferenceCounter``), so a task is graded on its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from dpt.dist import rank_device
from dpt.models import MLP
from tests.lessons import load

LESSON = "10_inside_a_step"


def hooks():
    return load(LESSON, "comm_hooks")


def torch_bf16(process_group, bucket):
    """torch's bf16 hook under another name: DDP refuses to register the original on a torch
    built without CUDA, though gloo reduces bf16."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def allreduce_hook(process_group, bucket):
    return default_hooks.allreduce_hook(process_group, bucket)


def reference_attach(ddp, name, **opts):
    """What task 10.9 does, for the tests of the other tasks."""
    if name == "none":
        return None
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=opts.get("rank", 1),
            start_powerSGD_iter=opts.get("start_iter", 10),
            use_error_feedback=opts.get("error_feedback", True))
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": torch_bf16,
            "allreduce": allreduce_hook, "bf16_by_hand": hooks().bf16_hook_by_hand}[name]
    ddp.register_comm_hook(None, hook)
    return None


class ReferenceCounter:
    """What task 10.10 does, for the tests of the other tasks: bytes per dist.all_reduce."""

    def __enter__(self):
        self.bytes, self.calls, real = 0, 0, dist.all_reduce
        self._real = real

        def counting(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            self.calls += 1
            return real(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real


class FakeBucket:
    """The part of ``dist.GradBucket`` a compression hook uses: one flat buffer."""

    def __init__(self, buffer: torch.Tensor):
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer]


def bucket_values(rank: int, n: int = 4096) -> torch.Tensor:
    """Rank ``rank``'s gradients: a spread of magnitudes (1e-6 .. 1e3), both signs."""
    g = torch.Generator().manual_seed(1234 + rank)
    return torch.randn(n, generator=g) * torch.logspace(-6, 3, n)[torch.randperm(n, generator=g)]


def hook_on_a_bucket(rank, world_size, hook="by_hand"):
    """Call a hook on a fake bucket holding :func:`bucket_values`; what its Future gives."""
    device = rank_device()
    fn = hooks().bf16_hook_by_hand if hook == "by_hand" else default_hooks.bf16_compress_hook
    buffer = bucket_values(rank).to(device)
    bucket = FakeBucket(buffer)
    calls = []
    real = dist.all_reduce

    def watching(tensor, *args, **kwargs):
        async_op = kwargs.get("async_op", args[2] if len(args) > 2 else False)
        calls.append({"dtype": str(tensor.dtype), "numel": tensor.numel(),
                      "async_op": bool(async_op)})
        return real(tensor, *args, **kwargs)

    dist.all_reduce = watching
    try:
        future = fn(None, bucket)
    finally:
        dist.all_reduce = real
    is_future = isinstance(future, torch._C.Future)  # torch.futures.Future is a subclass
    value = future.wait() if is_future else future
    if isinstance(value, list | tuple):  # a Future of the all-reduce's list of tensors
        value = value[0]
    return {"is_future": is_future, "calls": calls,
            "dtype": str(value.dtype), "shape": tuple(value.shape),
            "value": value.detach().float().cpu(),
            "is_the_bucket": value.data_ptr() == buffer.data_ptr(),
            "buffer_after": buffer.detach().cpu().clone()}


def _batch(rank: int, step: int, n: int = 16):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def train_steps(rank, world_size, hook, steps=3, attach="reference", opts=None, lr=0.1):
    """``steps`` SGD steps of an MLP under DDP with ``hook`` on rank-specific batches.

    ``attach``: "reference" (this file's) or "lesson" (task 10.9). Returns the parameters
    after the steps, the gradients of the last step, the losses, the bytes every step
    all-reduced (:class:`ReferenceCounter`), what DDP says is registered and the state, and
    this rank's own gradients of the first step computed without DDP (``local_grads``).
    """
    device = rank_device()
    torch.manual_seed(0)
    ddp = DDP(MLP().to(device))
    attach_fn = reference_attach if attach == "reference" else hooks().attach_hook
    state = attach_fn(ddp, hook, **(opts or {}))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses, step_bytes = [], []
    for step in range(steps):
        x, y = _batch(rank, step % 4)
        with ReferenceCounter() as counter:
            loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
        step_bytes.append(counter.bytes)
    torch.manual_seed(0)  # this rank's own gradients of the first step, without DDP
    plain = MLP().to(device)
    x, y = _batch(rank, 0)
    F.cross_entropy(plain(x.to(device)), y.to(device)).backward()
    logged = ddp._get_ddp_logging_data().get("comm_hook")
    if hasattr(ddp, "_comm_hooks"):  # what register_comm_hook kept
        registered = [getattr(h, "__name__", repr(h)) for h, _ in ddp._comm_hooks]
    else:  # an older torch: its logging data names the hook
        registered = [logged] if logged else []
    ps = None
    if isinstance(state, powerSGD_hook.PowerSGDState):
        ps = {"rank": state.matrix_approximation_rank, "start_iter": state.start_powerSGD_iter,
              "error_feedback": state.use_error_feedback}
    return {"params": [p.detach().cpu().clone() for p in ddp.module.parameters()],
            "grads": [None if p.grad is None else p.grad.detach().cpu().clone()
                      for p in ddp.module.parameters()],
            "local_grads": [p.grad.detach().cpu().clone() for p in plain.parameters()],
            "losses": losses, "bytes": step_bytes, "registered": registered,
            "logged_hook": logged,
            "state_type": type(state).__name__, "powersgd": ps}


def counter_on_known_calls(rank, world_size):
    """Task 10.10's counter around all-reduces of known sizes, sync and async, and after."""
    ch = hooks()
    real = dist.all_reduce
    device = rank_device()
    out = {}
    with ch.AllReduceCounter() as c:
        out["inside_is_wrapped"] = dist.all_reduce is not real
        a = torch.ones(100, device=device)
        dist.all_reduce(a)
        b = torch.ones(50, dtype=torch.bfloat16, device=device)
        work = dist.all_reduce(b, group=None, async_op=True)
        out["async_returns_work"] = work is not None and hasattr(work, "wait")
        if work is not None:
            work.wait()
        ints = torch.ones(3, dtype=torch.int64, device=device)
        dist.all_reduce(ints, dist.ReduceOp.SUM)
        out["sums"] = [a[0].item(), b[0].item(), ints[0].item()]
    out["bytes"], out["calls"] = c.bytes, c.calls
    out["restored"] = dist.all_reduce is real
    try:
        with ch.AllReduceCounter():
            raise KeyError("boom")
    except KeyError:
        pass
    out["restored_after_error"] = dist.all_reduce is real
    dist.all_reduce = real
    return out


def counted_steps(rank, world_size, configs, steps=4):
    """Per ``(hook, opts)`` of ``configs``: the bytes and calls task 10.10's counter sees in
    each of ``steps`` DDP steps (hooks attached by the reference)."""
    ch = hooks()
    device = rank_device()
    out = []
    for hook, opts in configs:
        torch.manual_seed(0)
        ddp = DDP(MLP().to(device))
        reference_attach(ddp, hook, **(opts or {}))
        seen = []
        for step in range(steps):
            x, y = _batch(rank, step)
            with ch.AllReduceCounter() as c:
                F.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
            seen.append((c.bytes, c.calls))
            ddp.zero_grad(set_to_none=True)
        out.append(seen)
    return out


def attach_each(rank, world_size, names, steps=2):
    """Task 10.9 on each of ``names`` in turn: what it registered and what a step sends.

    No steps under "bf16_by_hand": they would run task 10.8, which its own tests grade."""
    return {name: {k: v for k, v in train_steps(
                rank, world_size, name, steps=0 if name == "bf16_by_hand" else steps,
                attach="lesson").items()
                   if k not in ("params", "grads", "local_grads")}
            for name in names}
