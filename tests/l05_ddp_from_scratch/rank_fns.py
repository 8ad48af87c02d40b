"""Rank functions, toy models and reference parts for lesson 05's tests.

The graded tests check one task at a time: every *other* task the variant needs is replaced
by the reference version below (``patches``), so a stub fails with its own message and a bug
in one task does not fail another task's tests. Ungraded tests run the lesson code unpatched.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from tests.lessons import load

LESSON = "05_ddp_from_scratch"
D_IN, HIDDEN, CLASSES, VOCAB = 6, 12, 5, 10


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
    torch.manual_seed(seed)
    return MODELS[model_name](**kw).double()


def global_batch(model_name: str, step: int, n: int = 8):
    g = torch.Generator().manual_seed(1000 + step)
    if model_name == "toy":
        x = torch.randn(n, D_IN, generator=g, dtype=torch.float64)
        return x, torch.randint(0, CLASSES, (n,), generator=g)
    x = torch.randint(0, VOCAB, (n, 3), generator=g)
    return x, torch.randint(0, VOCAB, (n,), generator=g)


class SGD:
    """SGD with momentum, as torch.optim.SGD computes it. Written out because the first
    ``torch.optim`` step imports torch._dynamo, which costs seconds in every rank process."""

    def __init__(self, params, lr, momentum=0.0):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.momentum, self.bufs = lr, momentum, {}

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

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


def train_single(model_name: str, steps: int, lr: float = 0.2, seed: int = 0) -> dict:
    """The reference: one process, the whole global batch, plain SGD with momentum."""
    model = build(model_name, seed)
    opt = SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        x, y = global_batch(model_name, step)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def trainable_numel(model_name: str, **kw) -> int:
    model = MODELS[model_name](**kw)
    return sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())


def param_sizes_in_order(model_name: str) -> list[int]:
    model = MODELS[model_name]()
    return [p.numel() for p in model.parameters() if p.requires_grad]


# --------------------------------------------------------------------------- references
def ref_broadcast_state(module, src=0):
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src)


def ref_naive_finish(self):
    if not self.require_sync:
        return
    for p in self.params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(self.world_size)


@contextlib.contextmanager
def ref_no_sync(self):
    previous, self.require_sync = self.require_sync, False
    try:
        yield
    finally:
        self.require_sync = previous


def ref_overlap_hooks(self):
    def hook(param):
        if self.require_sync:
            self.pending.append((dist.all_reduce(param.grad, async_op=True), param))

    for p in self.params:
        self.hook_handles.append(p.register_post_accumulate_grad_hook(hook))


def ref_overlap_finish(self):
    if not self.require_sync:
        return
    launched = {id(p) for _, p in self.pending}
    if any(id(p) not in launched for p in self.params):
        self.pending.clear()
        raise RuntimeError("reference: a parameter got no gradient (unused)")
    for work, p in self.pending:
        work.wait()
        p.grad.div_(self.world_size)
    self.pending.clear()


def ref_assign_buckets(params, bucket_cap_mb):
    cap, buckets, current, size = bucket_cap_mb * 2**20, [], [], 0
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    return buckets + ([current] if current else [])


def ref_bucket_hooks(self):
    def hook(param):
        if not self.require_sync:
            return
        b = self.bucket_of[id(param)]
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[b]])
            self.pending[b] = (dist.all_reduce(flat, async_op=True), flat)

    for bucket in self.buckets:
        for p in bucket:
            self.hook_handles.append(p.register_post_accumulate_grad_hook(hook))


def ref_bucket_finish(self):
    if not self.require_sync:
        return
    if len(self.pending) != len(self.buckets):
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
        raise RuntimeError("reference: a bucket never became ready (unused parameter)")
    for b, (work, flat) in sorted(self.pending.items()):
        work.wait()
        flat.div_(self.world_size)
        offset = 0
        for p in self.buckets[b]:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    self.pending.clear()
    self.ready = [0] * len(self.buckets)


# Which task each patchable part belongs to, and how to put the reference in its place.
TASK_PARTS = {"05.2": "broadcast", "05.3": "naive_finish", "05.4": "overlap_hooks",
              "05.5": "overlap_finish", "05.6": "assign", "05.7": "bucket_hooks",
              "05.8": "bucket_finish", "05.9": "no_sync"}
VARIANT_TASKS = {"naive": ["05.2", "05.3", "05.9"], "overlap": ["05.2", "05.4", "05.5"],
                 "bucketed": ["05.2", "05.6", "05.7", "05.8"]}


def apply_patches(parts) -> None:
    naive, overlap, bucketed = (load(LESSON, m) for m in ("naive_ddp", "overlap_ddp",
                                                          "bucketed_ddp"))
    for part in parts:
        if part == "broadcast":
            for mod in (naive, overlap, bucketed):
                mod.broadcast_state = ref_broadcast_state
        elif part == "naive_finish":
            naive.NaiveDDP.finish_gradient_synchronization = ref_naive_finish
        elif part == "no_sync":
            naive.NaiveDDP.no_sync = ref_no_sync
        elif part == "overlap_hooks":
            overlap.OverlapDDP._register_hooks = ref_overlap_hooks
        elif part == "overlap_finish":
            overlap.OverlapDDP.finish_gradient_synchronization = ref_overlap_finish
        elif part == "assign":
            bucketed.assign_buckets = ref_assign_buckets
        elif part == "bucket_hooks":
            bucketed.BucketedDDP._register_hooks = ref_bucket_hooks
        elif part == "bucket_finish":
            bucketed.BucketedDDP.finish_gradient_synchronization = ref_bucket_finish
        else:
            raise ValueError(part)


def parts_except(variant: str, task: str | None) -> list[str]:
    """Reference parts for every task of ``variant`` but ``task`` (None: patch nothing)."""
    if task is None:
        return []
    return [TASK_PARTS[t] for t in VARIANT_TASKS[variant] if t != task]


def wrap(variant: str, module: nn.Module, bucket_cap_mb: float = 25.0):
    if variant == "naive":
        return load(LESSON, "naive_ddp").NaiveDDP(module)
    if variant == "overlap":
        return load(LESSON, "overlap_ddp").OverlapDDP(module)
    if variant == "bucketed":
        return load(LESSON, "bucketed_ddp").BucketedDDP(module, bucket_cap_mb=bucket_cap_mb)
    if variant == "torch":
        return TorchDDP(module)
    raise ValueError(variant)


# --------------------------------------------------------------------------- instrumentation
class LazyWork:
    """A network so slow that nothing arrives before ``wait()``: the sum happens there."""

    def __init__(self, real, tensor, kwargs):
        self.real, self.tensor, self.kwargs, self.done = real, tensor, kwargs, False

    def wait(self, timeout=None):
        if not self.done:
            self.real(self.tensor, **self.kwargs)
            self.done = True
        return True

    def is_completed(self):
        return self.done


@contextlib.contextmanager
def instrumented_all_reduce(lazy: bool, log: list):
    """Record the numel of every all_reduce; with ``lazy``, defer async ones until wait()."""
    real = dist.all_reduce

    def fake(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        log.append(tensor.numel())
        if async_op and lazy:
            return LazyWork(real, tensor, {"op": op, "group": group})
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = fake
    try:
        yield
    finally:
        dist.all_reduce = real


# --------------------------------------------------------------------------- rank functions
def _run_steps(model, opt, sync, model_name, rank, world_size, steps, accumulate=1):
    for step in range(steps):
        x, y = global_batch(model_name, step)
        per_rank = x.shape[0] // world_size
        xr = x[rank * per_rank:(rank + 1) * per_rank]
        yr = y[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad(set_to_none=True)
        micro = per_rank // accumulate
        for k in range(accumulate):
            xs, ys = xr[k * micro:(k + 1) * micro], yr[k * micro:(k + 1) * micro]
            last = k == accumulate - 1
            ctx = contextlib.nullcontext() if last else model.no_sync()
            with ctx:
                (F.cross_entropy(model(xs), ys) / accumulate).backward()
                sync(model)
        opt.step()


def train_rank(rank, world_size, variant, model_name="toy", steps=3, task=None,
               bucket_cap_mb=25.0, lazy=False, accumulate=1, with_torch=False):
    """Train ``variant`` from rank-dependent initial weights; return states and comm log."""
    apply_patches(parts_except(variant, task))
    lr = 0.2
    module = build(model_name, seed=rank)  # different on each rank: the broadcast must fix it
    model = wrap(variant, module, bucket_cap_mb)
    assert model.module is module
    opt = SGD(model.parameters(), lr=lr, momentum=0.9)
    log: list[int] = []
    with instrumented_all_reduce(lazy, log):
        _run_steps(model, opt, lambda m: m.finish_gradient_synchronization(), model_name,
                   rank, world_size, steps, accumulate)
    names = {id(p): n for n, p in module.named_parameters()}
    out = {"state": {k: v.clone() for k, v in model.module.state_dict().items()},
           "reduced_numel_per_step": sum(log) / steps,
           "buckets": [[names[id(p)] for p in b] for b in getattr(model, "buckets", [])]}
    if with_torch:
        tmodel = TorchDDP(build(model_name, seed=rank))
        topt = SGD(tmodel.parameters(), lr=lr, momentum=0.9)
        _run_steps(tmodel, topt, lambda m: None, model_name, rank, world_size, steps, accumulate)
        out["torch_state"] = {k: v.clone() for k, v in tmodel.module.state_dict().items()}
    return out


def unused_rank(rank, world_size, variant, task=None):
    """One step with a parameter no rank uses: return ('ok', state) or ('error', message)."""
    apply_patches(parts_except(variant, task))
    module = build("toy", seed=0, unused=True)
    before = module.unused.weight.detach().clone()
    model = wrap(variant, module)
    opt = SGD(model.parameters(), lr=0.2)
    x, y = global_batch("toy", 0)
    F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()
    try:
        model.finish_gradient_synchronization()
    except RuntimeError as exc:
        return ("error", str(exc))
    opt.step()
    return ("ok", torch.equal(before, module.unused.weight.detach()))


def collectives_rank(rank, world_size):
    return load(LESSON, "collectives").check_collectives(rank, world_size)


def ring_rank(rank, world_size, shapes):
    ring_all_reduce = load(LESSON, "collectives").ring_all_reduce
    results = []
    for i, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(rank * 100 + i)
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        expected = x.clone()
        dist.all_reduce(expected)
        got = ring_all_reduce(x)
        results.append((torch.allclose(got, expected), torch.allclose(x, expected),
                        x.data_ptr() == got.data_ptr()))
    # a non-contiguous view must be reduced in place too
    base = torch.full((4, 6), float(rank + 1), dtype=torch.float64)
    view = base.t()
    ring_all_reduce(view)
    results.append((torch.all(base == sum(range(1, world_size + 1))).item(), True, True))
    return results
