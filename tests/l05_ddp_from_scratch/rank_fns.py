"""Rank functions and toy models for lesson 05's tests.

The graded tests check one task at a time: every *other* task the variant needs is replaced
by the solution's code (:func:`apply_patches`, the references generated from solutions/), so a
stub fails with its own message and a bug in one task does not fail another task's tests. Ungraded tests run the lesson code unpatched.

Every tensor and model a rank function makes is put on ``dpt.dist.rank_device()`` (the GPU
under NCCL, the CPU under gloo), so the same tests run on N GPUs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import dpt.dist
from tests import references as refs
from tests.helpers import tensors_in, watching_collectives
from tests.lessons import load

LESSON = "05_ddp_from_scratch"
D_IN, HIDDEN, CLASSES, VOCAB = 6, 12, 5, 10


def device() -> torch.device:
    return dpt.dist.rank_device()


# --------------------------------------------------------------------------- toy models
class ToyNet(nn.Module):
    """An MLP with a frozen layer, two layers sharing one weight, and a buffer in forward."""

    def __init__(self, unused: bool = False):
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, HIDDEN)
        self.b.weight = self.a.weight  # tied: one Parameter used twice
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.register_buffer("scale", torch.rand(D_IN) + 0.5)
        self.unused = nn.Linear(HIDDEN, HIDDEN) if unused else None

    def forward(self, x):
        h = torch.tanh(self.inp(x * self.scale))
        h = torch.tanh(self.frozen(h))
        h = torch.tanh(self.a(h))
        h = torch.tanh(self.b(h))
        return self.head(h)


class TiedEmbeddingNet(nn.Module):
    """Embedding tied to the output projection, a frozen positional table, a buffer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(3, HIDDEN), requires_grad=False)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("temperature", torch.rand(1) + 0.5)

    def forward(self, idx):  # idx: (batch, 3) token ids
        h = torch.tanh(self.mix(self.emb(idx) + self.pos)).mean(1)
        return F.linear(h, self.emb.weight) / self.temperature


MODELS = {"toy": ToyNet, "tied_emb": TiedEmbeddingNet}


def build(model_name: str, seed: int, **kw) -> nn.Module:
    """The model, seeded (on the CPU, so every device starts alike), on the rank's device."""
    torch.manual_seed(seed)
    return MODELS[model_name](**kw).double().to(device())


def global_batch(model_name: str, step: int, n: int = 8):
    g = torch.Generator().manual_seed(1000 + step)
    if model_name == "toy":
        x = torch.randn(n, D_IN, generator=g, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (n,), generator=g)
    else:
        x = torch.randint(0, VOCAB, (n, 3), generator=g)
        y = torch.randint(0, VOCAB, (n,), generator=g)
    return x.to(device()), y.to(device())


class SGD:
    """SGD with momentum, as torch.optim.SGD computes it. Written out because the first
    ``torch.optim`` step imports torch._dynamo, which costs seconds in every rank process."""

    def __init__(self, params, lr, momentum=0.0):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.momentum, self.bufs = lr, momentum, {}

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:  # what torch.optim does: zero in place, keep the tensor
                p.grad.requires_grad_(False)
                p.grad.zero_()

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad
            if self.momentum:
                buf = self.bufs.get(id(p))
                buf = g.clone() if buf is None else buf.mul_(self.momentum).add_(g)
                self.bufs[id(p)] = buf
                g = buf
            p.add_(g, alpha=-self.lr)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone().cpu() for n, p in model.named_parameters()
            if p.grad is not None}


def _cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}


def train_single(model_name: str, steps: int, lr: float = 0.2, seed: int = 0) -> dict:
    """The reference: one process, the whole global batch, plain SGD with momentum.

    Returns the final state and the gradients of the first step.
    """
    model = build(model_name, seed)
    opt = SGD(model.parameters(), lr=lr, momentum=0.9)
    first_grads = None
    for step in range(steps):
        x, y = global_batch(model_name, step)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if first_grads is None:
            first_grads = _grads(model)
        opt.step()
    return {"state": _cpu_state(model), "first_grads": first_grads}


def trainable_numel(model_name: str, **kw) -> int:
    model = MODELS[model_name](**kw)
    return sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())


# --------------------------------------------------------------------------- references
# The tasks each wrapper needs; a test of one of them puts the solution's code (the references
# generated from solutions/, tests/references.py) in place of the others.
VARIANT_TASKS = {"naive": ["05.2", "05.3", "05.9"], "overlap": ["05.2", "05.4", "05.5", "05.9"],
                 "bucketed": ["05.2", "05.6", "05.7", "05.8", "05.9"]}
TASKS = sorted({t for tasks in VARIANT_TASKS.values() for t in tasks})


def apply_patches(tasks, set_attr=setattr) -> None:
    """Put the references of ``tasks`` in place. In a rank process for good (``setattr``); in
    the test process pass ``monkeypatch.setattr``, so that the lesson code is restored after."""
    refs.put(LESSON, tasks, set_attr)


def parts_except(variant: str, task: str | None) -> list[str]:
    """Every task of ``variant`` but ``task`` (None: none, the lesson's code as it is)."""
    if task is None:
        return []
    return [t for t in VARIANT_TASKS[variant] if t != task]


def wrap(variant: str, module: nn.Module, bucket_cap_mb: float = 25.0, as_view: bool = False):
    if variant == "naive":
        return load(LESSON, "naive_ddp").NaiveDDP(module)
    if variant == "overlap":
        return load(LESSON, "overlap_ddp").OverlapDDP(module)
    if variant == "bucketed":
        return load(LESSON, "bucketed_ddp").BucketedDDP(
            module, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view)
    if variant == "torch":
        return TorchDDP(module)
    raise ValueError(variant)


# --------------------------------------------------------------------------- instrumentation
class SlowNetworkWork:
    """An async all-reduce on a network so slow that nothing arrives before ``wait()``.

    The input is captured when the collective is launched, as a real backend reads it then;
    the sum is written into the tensor only in ``wait()``. So a gradient used before
    ``wait()`` is still this rank's own, and work done on it between launch and ``wait()``
    (a division, say) is overwritten, on every run, whatever the machine's timing.
    """

    def __init__(self, real, tensor, kwargs):
        self.real, self.tensor, self.kwargs, self.done = real, tensor, kwargs, False
        self.sent = tensor.detach().clone()

    def wait(self, timeout=None):
        if not self.done:
            self.real(self.sent, **self.kwargs)  # synchronous: no tensor left to another thread
            self.tensor.copy_(self.sent)
            self.done = True
        return True

    def is_completed(self):
        return self.done


# isend/irecv are left alone: dist.P2POp accepts only the real functions. Point-to-point
# traffic is seen through batch_isend_irecv, send and recv.
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_reduce_coalesced", "reduce",
               "send", "recv", "batch_isend_irecv")


class CommLog:
    """Every collective a rank issues: (name, elements, device, inside no_sync?)."""

    def __init__(self):
        self.calls: list[tuple[str, int, str, bool]] = []
        self.in_no_sync = False

    def add(self, name, tensors):
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        for t in tensors or [None]:
            self.calls.append((name, 0 if t is None else t.numel(),
                               "" if t is None else str(t.device), self.in_no_sync))

    def numel(self, name="all_reduce", in_no_sync=False):
        return sum(n for c, n, _, flag in self.calls if c == name and flag == in_no_sync)

    def count_in_no_sync(self):
        return sum(1 for *_, flag in self.calls if flag)


@contextlib.contextmanager
def instrumented(log: CommLog, lazy: bool = False):
    """Record every collective; with ``lazy``, async all-reduces complete only at wait()."""
    real = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(name):
        def fake(*args, **kwargs):
            log.add(name, tensors_in(args, kwargs))
            return real[name](*args, **kwargs)
        return fake

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        log.add("all_reduce", [tensor])
        if async_op and lazy:
            return SlowNetworkWork(real["all_reduce"], tensor, {"op": op, "group": group})
        return real["all_reduce"](tensor, op=op, group=group, async_op=async_op)

    for name in real:
        setattr(dist, name, counting(name))
    dist.all_reduce = all_reduce
    try:
        yield log
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


class MarkNoSync:
    """``model.no_sync()`` that also tells the log the block is running."""

    def __init__(self, model, log: CommLog):
        self.model, self.log = model, log

    @contextlib.contextmanager
    def __call__(self):
        with self.model.no_sync():
            self.log.in_no_sync = True
            try:
                yield
            finally:
                self.log.in_no_sync = False


# --------------------------------------------------------------------------- rank functions
def _slice(model_name, step, rank, world_size):
    x, y = global_batch(model_name, step)
    per_rank = x.shape[0] // world_size
    return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]


def _run_steps(model, opt, sync, model_name, rank, world_size, steps, accumulate=1,
               no_sync=None, set_to_none=True, on_first_sync=None):
    no_sync = no_sync or model.no_sync
    for step in range(steps):
        xr, yr = _slice(model_name, step, rank, world_size)
        opt.zero_grad(set_to_none=set_to_none)
        micro = xr.shape[0] // accumulate
        for k in range(accumulate):
            xs, ys = xr[k * micro:(k + 1) * micro], yr[k * micro:(k + 1) * micro]
            last = k == accumulate - 1
            with contextlib.nullcontext() if last else no_sync():
                (F.cross_entropy(model(xs), ys) / accumulate).backward()
                sync(model)
        if step == 0 and on_first_sync is not None:
            on_first_sync()
        opt.step()


def local_first_grads(model_name, rank, world_size):
    """The gradients this rank computes alone on its slice of step 0, from rank 0's start."""
    model = build(model_name, seed=0)
    xr, yr = _slice(model_name, 0, rank, world_size)
    F.cross_entropy(model(xr), yr).backward()
    return _grads(model)


def train_rank(rank, world_size, variant, model_name="toy", steps=3, task=None,
               bucket_cap_mb=25.0, lazy=False, accumulate=1, with_torch=False,
               as_view=False, set_to_none=True):
    """Train ``variant`` from rank-dependent initial weights; return states and comm log."""
    apply_patches(parts_except(variant, task))
    lr = 0.2
    module = build(model_name, seed=rank)  # different on each rank: the broadcast must fix it
    model = wrap(variant, module, bucket_cap_mb, as_view)
    assert model.module is module
    out = {"init_state": _cpu_state(module)}
    opt = SGD(model.parameters(), lr=lr, momentum=0.9)
    log = CommLog()

    def record_first():
        out["first_grads"] = _grads(module)

    leftovers = []  # handles and ready counts a finish call left behind for the next step

    def finish(m):
        m.finish_gradient_synchronization()
        left = len(getattr(m, "pending", ())) + sum(getattr(m, "ready", ()))
        leftovers.append(left)
        # Said here, on the rank: left behind, the counts or handles make the next step fail
        # somewhere else (a bucket that "never became ready"), which names the wrong cause.
        assert not left, (
            f"rank {rank}: after finish_gradient_synchronization() returned, self.pending (or "
            f"self.ready) still held this step's work: clear them, or the next step waits on "
            f"and divides these gradients again (or, with ready counts, never launches)")

    with instrumented(log, lazy):
        _run_steps(model, opt, finish, model_name,
                   rank, world_size, steps, accumulate, no_sync=MarkNoSync(model, log),
                   set_to_none=set_to_none, on_first_sync=record_first)
    out["leftover_after_sync"] = leftovers
    names = {id(p): n for n, p in module.named_parameters()}
    out.update({
        "state": _cpu_state(module),
        "local_first_grads": local_first_grads(model_name, rank, world_size),
        "reduced_numel_per_step": log.numel("all_reduce") / steps,
        "collectives_in_no_sync": log.count_in_no_sync(),
        "devices": sorted({d for *_, d, _ in log.calls if d} | {str(p.device) for p in module.parameters()}),
        "buckets": [[names[id(p)] for p in b] for b in getattr(model, "buckets", [])]})
    if as_view:
        out["grads_are_bucket_views"] = all(
            p.grad is not None and p.grad.data_ptr() == view.data_ptr()
            for bucket, views in zip(model.buckets, model.views) for p, view in zip(bucket, views))
    if with_torch:
        tmodel = TorchDDP(build(model_name, seed=rank))
        topt = SGD(tmodel.parameters(), lr=lr, momentum=0.9)
        _run_steps(tmodel, topt, lambda m: None, model_name, rank, world_size, steps, accumulate)
        out["torch_state"] = _cpu_state(tmodel.module)
    return out


def view_bucket_rank(rank, world_size, set_to_none, steps=3, task=None):
    """Gradients as views into the buckets, with zero_grad(set_to_none) between steps.

    Returns the state after training, and per step whether every ``.grad`` is its bucket's
    view after the sync and whether the bucket buffers are still the ones built at the start.
    """
    apply_patches(parts_except("bucketed", task))
    module = build("toy", seed=rank)
    model = wrap("bucketed", module, bucket_cap_mb=600 / 2**20, as_view=True)
    buffers = [b.data_ptr() for b in model.bucket_buffers]
    opt = SGD(model.parameters(), lr=0.2, momentum=0.9)
    views_ok, same_buffers = [], []
    for step in range(steps):
        xr, yr = _slice("toy", step, rank, world_size)
        opt.zero_grad(set_to_none=set_to_none)
        F.cross_entropy(model(xr), yr).backward()
        model.finish_gradient_synchronization()
        views_ok.append(all(p.grad is not None and p.grad.data_ptr() == v.data_ptr()
                            for bucket, vs in zip(model.buckets, model.views)
                            for p, v in zip(bucket, vs)))
        same_buffers.append([b.data_ptr() for b in model.bucket_buffers] == buffers)
        opt.step()
    return {"state": _cpu_state(module), "views_ok": views_ok, "same_buffers": same_buffers}


def unused_rank(rank, world_size, variant, task=None):
    """One step with a parameter no rank uses: ``('ok', state, None)``, or
    ``('error', message, after)``: ``after`` is None when the next step, which uses every
    parameter, then synchronizes without an error, else what it raised."""
    apply_patches(parts_except(variant, task))
    module = build("toy", seed=0, unused=True)
    before = module.unused.weight.detach().clone()
    model = wrap(variant, module)
    opt = SGD(model.parameters(), lr=0.2)
    x, y = global_batch("toy", 0)
    x, y = x[rank::world_size], y[rank::world_size]
    F.cross_entropy(model(x), y).backward()
    try:
        model.finish_gradient_synchronization()
    except NotImplementedError:  # a stub (a RuntimeError too) is not a clear error message
        raise
    except RuntimeError as exc:
        # The error must leave the wrapper usable: nothing of the failed step kept (the
        # docstring's contract, checked directly: a leftover count launches a bucket early,
        # which a timing race may hide), and a step using every parameter works again.
        kept = []
        if any(getattr(model, "ready", None) or []):
            kept.append(f"self.ready is {list(model.ready)}, not all zeros")
        if getattr(model, "pending", None):
            kept.append(f"self.pending still holds {len(model.pending)} entries")
        if kept:
            return ("error", str(exc), "the failed step left " + " and ".join(kept))
        extra = torch.ones(2, HIDDEN, dtype=torch.float64, device=device())

        def loss():
            return F.cross_entropy(model(x), y) + module.unused(extra).pow(2).mean()

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        want = []  # the mean of the local gradients (autograd.grad fires no hook)
        for g in torch.autograd.grad(loss(), [p for _, p in named]):
            g = g.detach().clone()
            dist.all_reduce(g)
            want.append(g / world_size)
        opt.zero_grad(set_to_none=True)
        loss().backward()
        try:
            model.finish_gradient_synchronization()
        except RuntimeError as again:
            return ("error", str(exc), f"the next step (every parameter used) raised "
                                        f"{type(again).__name__}: {again}")
        wrong = [n for (n, p), w in zip(named, want)
                 if p.grad is None or not torch.allclose(p.grad, w, rtol=1e-12, atol=1e-12)]
        return ("error", str(exc), f"the next step's gradients of {wrong} are not the mean "
                "over the ranks"
                if wrong else None)
    opt.step()
    return ("ok", torch.equal(before, module.unused.weight.detach()), None)


def unused_error_handles(rank, world_size, variant, task=None, bucket_cap_mb=25.0):
    """One step with a parameter no rank uses, on a network where nothing arrives before
    ``wait()`` (:class:`SlowNetworkWork`). Returns ``(message, launched, never_waited)``: the
    RuntimeError's text (None if nothing raised), and how many async all-reduces the step
    launched and how many of them were dropped without a ``wait()``."""
    apply_patches(parts_except(variant, task))
    module = build("toy", seed=0, unused=True)
    model = wrap(variant, module, bucket_cap_mb=bucket_cap_mb)
    x, y = global_batch("toy", 0)
    x, y = x[rank::world_size], y[rank::world_size]
    real, works = dist.all_reduce, []

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not async_op:
            return real(tensor, op=op, group=group)
        works.append(SlowNetworkWork(real, tensor, {"op": op, "group": group}))
        return works[-1]

    dist.all_reduce = all_reduce
    try:
        F.cross_entropy(model(x), y).backward()
        try:
            model.finish_gradient_synchronization()
            message = None
        except NotImplementedError:
            raise
        except RuntimeError as exc:
            message = str(exc)
    finally:
        dist.all_reduce = real
    return message, len(works), sum(1 for w in works if not w.done)


def grads_alias_buckets(rank, world_size, as_view, task=None):
    """Two bucketed steps; after each finish, the names of the parameters whose ``.grad``
    shares memory with a bucket buffer."""
    apply_patches(parts_except("bucketed", task))
    module = build("toy", seed=0)
    model = wrap("bucketed", module, as_view=as_view)
    buffers = {b.untyped_storage().data_ptr() for b in model.bucket_buffers}
    names = {id(p): n for n, p in module.named_parameters()}
    aliased = []
    for step in range(2):
        x, y = global_batch("toy", step)
        for p in model.params:
            p.grad = None
        F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()
        model.finish_gradient_synchronization()
        aliased.append(sorted(names[id(p)] for p in model.params
                              if p.grad.untyped_storage().data_ptr() in buffers))
    return aliased


def broadcast_from_rank_1(rank, world_size, task=None):
    """``broadcast_state(module, src=1)``: every rank's parameters and buffers after it."""
    apply_patches(parts_except("naive", task))
    module = build("toy", seed=rank)
    load(LESSON, "ddp_base").broadcast_state(module, src=1)
    return _cpu_state(module)


def unused_on_one_rank(rank, world_size, variant, task=None):
    """One step where only rank 0's forward uses ``unused`` (a branch some inputs take).

    Returns ``(local, synced)``: this rank's own gradient of ``unused.weight`` before the sync
    (None where the rank did not use it) and the one after it."""
    apply_patches(parts_except(variant, task))
    module = build("toy", seed=0, unused=True)
    model = wrap(variant, module)
    x, y = global_batch("toy", 0)
    loss = F.cross_entropy(model(x[rank::world_size]), y[rank::world_size])
    if rank == 0:
        extra = torch.ones(2, HIDDEN, dtype=torch.float64, device=device())
        loss = loss + module.unused(extra).pow(2).mean()
    loss.backward()
    grad = module.unused.weight.grad
    local = None if grad is None else grad.detach().cpu().clone()
    model.finish_gradient_synchronization()
    grad = module.unused.weight.grad
    return local, None if grad is None else grad.detach().cpu().clone()


def collectives_rank(rank, world_size):
    log = CommLog()
    with instrumented(log), watching_collectives(device()) as watch:
        out = load(LESSON, "collectives").check_collectives(rank, world_size)
    out["devices"] = sorted({d for *_, d, _ in log.calls if d})
    out["problems"] = watch.problems
    return out


def timing_rank(rank, world_size):
    """The lesson's all-reduce timing, at two tiny sizes, with every collective judged by
    NCCL's rule (its tensors on the rank's device)."""
    with watching_collectives(device()) as watch:
        out = load(LESSON, "collectives").time_all_reduce(rank, world_size, [64, 256],
                                                          repeats=2)
    return {"rows": out["rows"], "problems": watch.problems}


def ring_rank(rank, world_size, shapes):
    ring_all_reduce = load(LESSON, "collectives").ring_all_reduce
    results = []
    for i, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(rank * 100 + i)
        x = torch.randn(shape, generator=g, dtype=torch.float64).to(device())
        expected = x.clone()
        dist.all_reduce(expected)
        got = ring_all_reduce(x)
        results.append((torch.allclose(got, expected), torch.allclose(x, expected),
                        x.data_ptr() == got.data_ptr()))
    # a non-contiguous view must be reduced in place too
    base = torch.full((4, 6), float(rank + 1), dtype=torch.float64, device=device())
    view = base.t()
    ring_all_reduce(view)
    results.append((torch.all(base == sum(range(1, world_size + 1))).item(), True, True))
    return results


def broadcast_nested_buffers(rank, world_size, task=None):
    """``broadcast_state(module, src=0)`` on a model whose buffers all sit in submodules
    (batch norm's running statistics, as in any real network): every rank's state after it."""
    apply_patches(parts_except("naive", task))
    torch.manual_seed(rank)
    module = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Sequential(nn.BatchNorm1d(HIDDEN)))
    module = module.double().to(device())
    bn = module[1][0]
    with torch.no_grad():  # rank-dependent statistics: only a broadcast makes them equal
        bn.running_mean.copy_(torch.randn(HIDDEN, dtype=torch.float64))
        bn.running_var.copy_(torch.rand(HIDDEN, dtype=torch.float64) + 0.5)
        bn.num_batches_tracked.fill_(10 + rank)
    load(LESSON, "ddp_base").broadcast_state(module, src=0)
    return _cpu_state(module)


def mean_of_known_gradients(rank, world_size, variant, task=None, bucket_cap_mb=25.0,
                            as_view=False):
    """One backward whose gradient is ``rank + 1`` in every trainable element, then the
    wrapper's sync: every gradient must come out as the mean over ranks, (world_size + 1) / 2.

    Run with 3 ranks, so dividing by a hard-coded 2 (the world size of the other tests)
    gives 3.0 instead of 2.0. Returns this rank's gradients after the sync."""
    apply_patches(parts_except(variant, task))
    module = build("toy", seed=0)
    model = wrap(variant, module, bucket_cap_mb, as_view)
    sum((rank + 1.0) * p.sum() for p in model.params).backward()
    model.finish_gradient_synchronization()
    return _grads(module)


def demo_compare_rank(rank, world_size, x, y, steps):
    """The notebook's ``scratch_demo.compare_rank``, with every task's reference part in place
    (this checks the demo's slicing and step order, not the wrappers)."""
    apply_patches(TASKS)
    return load(LESSON, "scratch_demo").compare_rank(rank, world_size, x, y, steps)
