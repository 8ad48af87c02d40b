"""Rank functions for lesson 08's tests (run by dpt.ranks.run_distributed).

Each one loads the lesson code through tests.lessons.load inside the rank, and uses torch's
own tools (DDP, ZeroRedundancyOptimizer, fully_shard, DTensor.full_tensor) as references.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from dpt.dist import device_mesh, rank_device
from dpt.models import ConvNet
from tests.helpers import rank_part, recording_moves, unsent_message
from tests.lessons import load

LESSON = "08_sharding"


def reference_partition(sizes, world_size):
    """Each parameter, in the given order, to the least-loaded rank so far.

    Deliberately not the lesson's algorithm (no sorting), so step() is tested on an
    assignment of the test's choosing.
    """
    loads, owners = [0] * world_size, []
    for s in sizes:
        r = loads.index(min(loads))
        owners.append(r)
        loads[r] += s
    return owners


def use_reference_partition(zo) -> None:
    """From now on in this rank process, the lesson's ShardedOptimizer assigns owners with
    :func:`reference_partition`: its __init__ calls the module's ``partition_params``, which
    the test replaces here, so step() is graded without task 08.2's answer."""
    zo.partition_params = reference_partition


def batch(rank, step, n=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def _groups(model, lr):
    """Three parameter groups: the last bias alone, with its own lr (one rank owns nothing of
    that group), the other weights with decay, the other biases and norms without, other lr."""
    named = list(model.named_parameters())
    alone = [named[-1][1]]
    decay = [p for n, p in named[:-1] if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in named[:-1] if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": alone, "lr": lr * 3}, {"params": decay},
            {"params": rest, "weight_decay": 0.0, "lr": lr * 2}]


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 1e-3, "weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.05}),
}


def sharded_vs_plain(rank, world_size, opt_name="adam", steps=4, own_partition=False):
    """DDP + plain optimizer, DDP + the lesson's ShardedOptimizer, DDP + torch's ZeRO.

    Same initial weights, same per-rank data. Returns the three models' parameters, which
    params hold optimizer state on this rank, and the state's size.
    """
    zo = load(LESSON, "zero_optimizer")
    cls, kwargs = OPTIMIZERS[opt_name]
    torch.manual_seed(0)
    base = ConvNet()
    models = [DDP(copy.deepcopy(base)) for _ in range(3)]
    plain = cls(_groups(models[0].module, kwargs["lr"]), **kwargs)
    if not own_partition:  # test step() alone, on an assignment the test chooses
        use_reference_partition(zo)
    groups = _groups(models[1].module, kwargs["lr"])
    # the optimizer's parameter order: group by group
    all_params = [p for g in groups for p in g["params"]]
    sharded = zo.ShardedOptimizer(groups, cls, **kwargs)
    torch_zero = ZeroRedundancyOptimizer(_groups(models[2].module, kwargs["lr"]),
                                         optimizer_class=cls, **kwargs)
    opts = [plain, sharded, torch_zero]
    for step in range(steps):
        if step == steps // 2:  # what an LR scheduler does: edit param_groups
            for opt in opts:
                for g in opt.param_groups:
                    g["lr"] *= 0.5
                    g["weight_decay"] += 0.02  # other options change too (OneCycleLR: momentum)
        x, y = batch(rank, step)
        for model, opt in zip(models, opts):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    params = [[p.detach().clone() for p in m.module.parameters()] for m in models]
    inner = sharded.local_optimizer
    with_state = []
    state_bytes = 0
    if inner is not None:
        for i, p in enumerate(all_params):
            st = inner.state.get(p, {})
            tensors = [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
            if tensors:
                with_state.append(i)
                state_bytes += sum(t.numel() * t.element_size() for t in tensors)
    # Also count any state the outer object may have put in its own .state
    outer_state = sum(1 for p in all_params if sharded.state.get(p))
    plain_bytes = sum(t.numel() * t.element_size() for st in plain.state.values()
                      for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    sizes = [p.numel() for p in all_params]
    owners = (zo.partition_params(sizes, world_size) if own_partition
              else reference_partition(sizes, world_size))
    return {"params": params, "with_state": with_state, "state_bytes": state_bytes,
            "plain_state_bytes": plain_bytes, "outer_state": outer_state, "owners": owners,
            "sizes": sizes}


def zero2_vs_plain(rank, world_size, steps=3):
    """ZeRO-2: no DDP; the lesson optimizer's reduce_gradients() then step()."""
    zo = load(LESSON, "zero_optimizer")
    torch.manual_seed(0)
    base = ConvNet()
    ref, model = DDP(copy.deepcopy(base)), copy.deepcopy(base)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3, weight_decay=0.01)
    use_reference_partition(zo)
    opt = zo.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3, weight_decay=0.01)
    grad_bytes = []
    for step in range(steps):
        x, y = batch(rank, step)
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            if o is opt:
                o.reduce_gradients()
                grad_bytes.append(sum(p.grad.numel() * p.grad.element_size()
                                      for p in model.parameters() if p.grad is not None))
            o.step()
    # ref's buffers (batch norm) come from rank 0 via DDP; compare parameters only
    diff = max((p - q).abs().max().item() for p, q in zip(ref.module.parameters(),
                                                             model.parameters()))
    owned = sum(p.numel() * p.element_size() for p in opt.params_of[rank])
    return {"diff": diff, "grad_bytes": grad_bytes, "owned_bytes": owned}


def sharded_on_a_subgroup(rank, world_size, steps=3):
    """The optimizer over ``process_group=new_group([1, 2])`` of a 3-process job.

    Group rank r is global rank r + 1 there, so code that passes a group rank where
    torch.distributed wants a global one (``src=``/``dst=``) fails or sends from the wrong
    rank. Rank 0 is outside the group: it takes part in creating it, then waits. Ranks 1 and 2
    average their gradients over the group by hand, then step a plain Adam (the reference)
    and the lesson's ShardedOptimizer (stage 1); a third copy goes through
    reduce_gradients() (stage 2) from its raw gradients.
    """
    import torch.distributed as dist
    from torch import nn

    group = dist.new_group([1, 2])
    if rank == 0:  # it hosts the job's store: it waits for the group before it leaves
        dist.barrier()
        return {"in_group": False}
    zo = load(LESSON, "zero_optimizer")
    use_reference_partition(zo)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    models = [copy.deepcopy(base) for _ in range(3)]
    kwargs = {"lr": 1e-2, "weight_decay": 0.01}
    opts = [torch.optim.Adam(models[0].parameters(), **kwargs),
            zo.ShardedOptimizer(models[1].parameters(), torch.optim.Adam, process_group=group,
                                **kwargs),
            zo.ShardedOptimizer(models[2].parameters(), torch.optim.Adam, process_group=group,
                                **kwargs)]
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        for i, (model, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if i < 2:  # the group's mean gradient, by hand
                for p in model.parameters():
                    dist.all_reduce(p.grad, group=group)
                    p.grad /= 2
            else:
                opt.reduce_gradients()
            opt.step()
    dist.barrier()
    return {"in_group": True,
            "params": [[p.detach().clone() for p in m.parameters()] for m in models]}


def reference_memory(rank, world_size):
    """Measured bytes per rank under DDP, torch ZeRO-1 and torch FSDP2 (reference code)."""
    from torch.distributed.fsdp import fully_shard

    def count(tensors):
        out = 0
        for t in tensors:
            t = t.to_local() if hasattr(t, "to_local") else t
            out += t.numel() * t.element_size()
        return out

    def state_of(opt):
        return count(v for st in opt.state.values() for v in st.values()
                     if torch.is_tensor(v) and v.dim() > 0)

    x, y = batch(rank, 0)
    out = {}
    for stage in ("ddp", "zero1", "zero3"):
        torch.manual_seed(0)
        model = ConvNet()
        if stage == "zero3":
            mesh = device_mesh()  # not the accelerator's default mesh: see dpt.dist.device_mesh
            for block in (model.layer1, model.layer2, model.fc):
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        else:
            model = DDP(model)
            opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if stage == "ddp" else
                   ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3))
        F.cross_entropy(model(x), y).backward()
        opt.step()
        inner = getattr(opt, "optim", opt)
        out[stage] = {"params": count(model.parameters()),
                      "grads": count(p.grad for p in model.parameters() if p.grad is not None),
                      "optimizer": state_of(inner)}
    out["num_params"] = sum(p.numel() for p in ConvNet().parameters())
    return out


def fsdp_options_reach_every_block(rank, world_size):
    """shard_model(..., mp_policy=...) with float64 parameters in compute.

    The root casts the input to float64; a block sharded without the options computes in
    float32 and fails on the float64 input. Returns the dtypes each block computed in.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    ft = load(LESSON, "fsdp2_train")
    torch.manual_seed(0)
    model = ConvNet(batch_norm=False)  # batch norm's running stats would stay float32
    seen = {}
    for name in ("layer1", "layer2", "fc"):
        block = getattr(model, name)
        block.register_forward_pre_hook(
            lambda m, args, name=name: seen.__setitem__(name, str(args[0].dtype)))
    # A mesh of the caller's own (named): shard_model must use it, not make its own.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_mesh().device_type, (world_size,), mesh_dim_names=("mine",))
    ft.shard_model(model, mesh=mesh,
                   mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64))
    meshes = {name: (p.device_mesh.mesh_dim_names if hasattr(p, "device_mesh") else None)
              for name, p in model.named_parameters()}
    x, y = batch(rank, 0)
    try:
        F.cross_entropy(model(x), y).backward()
        error = None
    except RuntimeError as exc:  # e.g. "mat1 and mat2 must have the same dtype"
        error = str(exc).splitlines()[0]
    return {"seen": seen, "error": error, "meshes": meshes}


def _torch_shard(model, **fsdp_kwargs):
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh()
    for block in (model.layer1, model.layer2, model.fc):
        fully_shard(block, mesh=mesh, **fsdp_kwargs)
    return fully_shard(model, mesh=mesh, **fsdp_kwargs)


def fsdp_vs_ddp(rank, world_size, steps=4, state_dict=False, own_shard=True):
    """The lesson's shard_model (or torch's, to test 08.5 alone) against DDP."""
    from torch.distributed.fsdp import FSDPModule

    ft = load(LESSON, "fsdp2_train")
    torch.manual_seed(0)
    base = ConvNet()
    ddp = DDP(copy.deepcopy(base))
    fsdp = (ft.shard_model if own_shard else _torch_shard)(copy.deepcopy(base))
    is_unit = {name: isinstance(m, FSDPModule) for name, m in
               [("root", fsdp), ("layer1", fsdp.layer1), ("layer2", fsdp.layer2), ("fc", fsdp.fc)]}
    shards = [(n, type(p).__name__, p.numel(),
               (p.to_local() if hasattr(p, "to_local") else p).numel())
              for n, p in fsdp.named_parameters()]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=0.01) for m in (ddp, fsdp)]
    losses = {"ddp": [], "fsdp": []}
    after_forward = None  # per parameter, between the first forward and its backward
    for step in range(steps):
        x, y = batch(rank, step)
        for key, m, o in (("ddp", ddp, opts[0]), ("fsdp", fsdp, opts[1])):
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            if key == "fsdp" and after_forward is None:
                after_forward = [(n, type(p).__name__, p.numel(),
                                  (p.to_local() if hasattr(p, "to_local") else p).numel())
                                 for n, p in fsdp.named_parameters()]
            loss.backward()
            o.step()
            losses[key].append(loss.item())
    full = [p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach()
            for p in fsdp.parameters()]
    diff = max((a - b.detach()).abs().max().item() for a, b in zip(full, ddp.module.parameters()))
    out = {"is_unit": is_unit, "shards": shards, "losses": losses, "diff": diff,
           "after_forward": after_forward}
    if state_dict:
        sd = ft.full_state_dict(fsdp)
        out["fsdp_sd"] = {k: (type(v).__name__, v.detach().clone() if torch.is_tensor(v) else v)
                          for k, v in sd.items()}
        out["ddp_sd"] = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    return out


def zero2_mean_of_known_gradients(rank, world_size):
    """ZeRO-2's reduce_gradients() alone, on gradients known in advance: rank r holds r + 1
    in every element, so each owner must end with the mean (world_size + 1) / 2 and every
    other rank with no gradient. Run with 3 ranks, where dividing by a hard-coded 2 shows.
    Returns, per parameter, this rank's gradient values after the call (None when freed),
    and the weights after the step() that follows."""
    import torch.distributed as dist
    from torch import nn

    zo = load(LESSON, "zero_optimizer")
    use_reference_partition(zo)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    opt = zo.ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    calls = []
    real = {name: getattr(dist, name) for name in ("reduce", "all_reduce")}

    def counting(name):
        def call(*a, **k):
            tensor = k.get("tensor", a[0] if a else None)
            if tensor is None or tensor.is_floating_point():  # gradients, not flags
                calls.append(name)
            return real[name](*a, **k)
        return call

    for name in real:
        setattr(dist, name, counting(name))
    try:
        opt.reduce_gradients()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    owners = reference_partition([p.numel() for p in model.parameters()], world_size)
    out = {"owners": owners, "collectives": sorted(set(calls)),
           "grads": [None if p.grad is None else sorted(set(p.grad.flatten().tolist()))
                     for p in model.parameters()]}
    opt.step()  # ZeRO-2's step after the reduce: every rank again holds the same weights
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def zero2_gradient_on_some_ranks(rank, world_size):
    """ZeRO-2's reduce_gradients() when the ranks' gradients are not on the same parameters,
    as after a branch that only some ranks' data takes. Rank r holds r + 1 in every element,
    except that rank 1 has no gradient for the second layer and no rank has one for the third.
    Returns, per parameter, this rank's gradient values after the call (None when it has none),
    and the weights after the step() that follows."""
    from torch import nn

    zo = load(LESSON, "zero_optimizer")
    use_reference_partition(zo)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(3, 2))
    opt = zo.ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    params = list(model.parameters())
    missing = {4, 5} | ({2, 3} if rank == 1 else set())
    for i, p in enumerate(params):
        if i not in missing:
            p.grad = torch.full_like(p, float(rank + 1))
    opt.reduce_gradients()
    owners = reference_partition([p.numel() for p in params], world_size)
    out = {"owners": owners,
           "grads": [None if p.grad is None else sorted(set(p.grad.flatten().tolist()))
                     for p in params]}
    opt.step()
    out["params"] = [p.detach().clone() for p in params]
    return out


def sharded_state_dict_round_trip(rank, world_size, steps=2):
    """Train with the lesson's ShardedOptimizer(Adam), save this rank's shard, load it into a
    fresh optimizer over a copy of the weights, and take one more step with both: the
    resumed copy must land exactly where the original does. Also loads the OTHER rank's
    shard, which must be refused."""
    import torch.distributed as dist

    zo = load(LESSON, "zero_optimizer")
    use_reference_partition(zo)
    torch.manual_seed(0)
    model = ConvNet(batch_norm=False)
    opt = zo.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)

    def step(m, o, s):
        o.zero_grad()
        x, y = batch(0, s)  # the same data on every rank: no gradient sync needed
        F.cross_entropy(m(x), y).backward()
        o.step()

    for s in range(steps):
        step(model, opt, s)
    saved = copy.deepcopy(opt.state_dict())
    resumed = copy.deepcopy(model)
    fresh = zo.ShardedOptimizer(resumed.parameters(), torch.optim.Adam, lr=1e-2)
    fresh.load_state_dict(saved)
    step(model, opt, steps)
    step(resumed, fresh, steps)
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(),
                                                             resumed.parameters()))
    shards = [None] * world_size
    dist.all_gather_object(shards, saved)
    try:
        fresh.load_state_dict(shards[(rank + 1) % world_size])
        other = "accepted"
    except ValueError as exc:
        other = str(exc)
    x, y = batch(0, steps + 1)
    given = []

    def closure():  # as LBFGS, or Lightning, calls a torch optimizer
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        given.append(loss)
        return loss

    returned = opt.step(closure)
    return {"diff": diff, "other": other, "closure_called": len(given),
            "closure_returned": bool(given) and returned is given[0]}


def train_worker_losses(rank, world_size, steps=2, batch_size=8, seed=0):
    """The lesson's ``train_worker`` under DDP (given code, no task's answer in its way):
    the losses it reports, which every rank must agree on."""
    ft = load(LESSON, "fsdp2_train")
    built, real_build, real_batch = [], ft.build_model, ft.synthetic_batch
    with recording_moves() as moves:
        def build(*args, **kwargs):
            built.append(real_build(*args, **kwargs))
            return built[-1]

        def batch(*args, **kwargs):
            x, y = real_batch(*args, **kwargs)
            moves.watch(x, y)
            return x, y

        ft.build_model, ft.synthetic_batch = build, batch
        try:
            out = ft.train_worker(rank, world_size, mode="ddp", steps=steps,
                                  batch_size=batch_size, seed=seed)
        finally:
            ft.build_model, ft.synthetic_batch = real_build, real_batch
    return {"losses": out["losses"],
            "model_sent": bool(built) and moves.module_sent(built[0], rank_device()),
            "unsent": unsent_message(moves, rank_device(), "the training batches",
                                     "train_worker")}


def _torch_full_state_dict(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def train_worker_both_modes(rank, world_size, save_dir, steps=2, batch_size=8, lr=4e-3,
                            weight_decay=0.01):
    """The lesson's ``train_worker`` run with DDP, then with FSDP2, as the script runs it.

    torch's own sharding and state-dict gathering stand in for tasks 08.4 and 08.5, so only
    the given code is graded. Records the options each Adam was built with and what each
    rank saved; each mode writes its state dict under ``save_dir``."""
    from pathlib import Path

    import dpt.checkpoint

    ft = load(LESSON, "fsdp2_train")
    ft.shard_model, ft.full_state_dict = _torch_shard, _torch_full_state_dict
    adams, saves = [], []
    real_adam, real_save = torch.optim.Adam, dpt.checkpoint.atomic_save

    class RecordingAdam(real_adam):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            adams.append({k: self.param_groups[0][k] for k in ("lr", "weight_decay")})

    def recording_save(obj, path, *args, **kwargs):
        saves.append(sorted(obj))
        return real_save(obj, path, *args, **kwargs)

    torch.optim.Adam, dpt.checkpoint.atomic_save = RecordingAdam, recording_save
    try:
        out = {mode: ft.train_worker(rank, world_size, mode=mode, steps=steps,
                                     batch_size=batch_size, lr=lr, weight_decay=weight_decay,
                                     save=str(Path(save_dir) / f"{mode}.pt"))
               for mode in ("ddp", "fsdp2")}
    finally:
        torch.optim.Adam, dpt.checkpoint.atomic_save = real_adam, real_save
    # --data fashion-mnist: which share of the set does the worker ask for? (synthetic
    # batches stand in for the real ones, so no data is needed)
    asked = []

    def fashion_batches(*args, **kwargs):
        asked.append(args[:2])
        return (ft.synthetic_batch(rank, s, batch_size) for s in range(steps))

    ft.fashion_batches = fashion_batches
    ft.train_worker(rank, world_size, mode="ddp", steps=steps, batch_size=batch_size,
                    data="fashion-mnist")
    return {"rank": rank, "losses": {m: o["losses"] for m, o in out.items()},
            "shards": out["fsdp2"]["shards"], "adams": adams, "saves": saves,
            "keys": sorted(ConvNet().state_dict()), "fashion_asked": asked}


def demo_with_reference_partition(rank, world_size, steps=3):
    """The notebook's ``demo_worker`` (given code), on the tests' partition."""
    zo = load(LESSON, "zero_optimizer")
    use_reference_partition(zo)
    return zo.demo_worker(rank, world_size, steps=steps)


# --- three ranks: uneven shards, three dtypes, who writes ------------------------------------

_part = rank_part  # one part of a 3-rank run fails its own test, not the whole run


# Parameters of three dtypes, in the order the tests' partition hands them out over 3 ranks:
# rank 0 owns the bf16 40, rank 1 the fp32 30 and 8, rank 2 the bf16 20 then the fp64 10 and 5.
# 113 elements: no rank's share is a third. Rank 2's first parameter is bf16 and its others
# fp64: a buffer made in its first parameter's dtype (or in fp32) rounds what it carries.
MIXED = ((40, torch.bfloat16), (30, torch.float32), (20, torch.bfloat16), (10, torch.float64),
         (8, torch.float32), (5, torch.float64))


def _mixed_step(zo, rank, world_size, steps=2):
    """The lesson's step() on MIXED, against a plain Adam on a copy, same gradients: the
    gradients are set by hand (as DDP would leave them: the same on every rank)."""
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=g, dtype=torch.float64).to(dt) for n, dt in MIXED]
    params = [torch.nn.Parameter(t.clone()) for t in base]
    plain = [torch.nn.Parameter(t.clone()) for t in base]
    kwargs = {"lr": 1e-2, "weight_decay": 0.01}
    sharded = zo.ShardedOptimizer(params, torch.optim.Adam, **kwargs)
    reference = torch.optim.Adam(plain, **kwargs)
    for step in range(steps):
        gs = torch.Generator().manual_seed(100 + step)  # the same on every rank
        for p, q in zip(params, plain):
            p.grad = torch.randn(p.shape, generator=gs, dtype=torch.float64).to(p.dtype)
            q.grad = p.grad.clone()
        sharded.step()
        reference.step()
    return {"params": [p.detach().clone() for p in params],
            "plain": [q.detach().clone() for q in plain],
            "dtypes": [str(p.dtype) for p in params],
            "owners": reference_partition([n for n, _ in MIXED], world_size)}


def _idle_rank_step(zo, rank, world_size, group_timeout=30.0):
    """Two parameters over three ranks: rank 2 owns none, and must still take part in every
    owner's broadcast. On a group with a short timeout, so that a rank that skips them makes
    the others fail here instead of hanging the run."""
    from datetime import timedelta

    import torch.distributed as dist

    group = dist.new_group(timeout=timedelta(seconds=group_timeout))
    params = [torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(3))]
    opt = zo.ShardedOptimizer(params, torch.optim.SGD, process_group=group, lr=0.5)
    for p, value in zip(params, (2.0, 4.0)):
        p.grad = torch.full_like(p, value)
    opt.step()  # an owner's new value is 1 - 0.5 * grad: 0 and -1
    return {"values": [sorted(set(p.detach().tolist())) for p in params],
            "owns": len(opt.params_of[rank])}


def zero_at_three(rank, world_size, steps=2):
    """Task 08.3's step() on 3 ranks (the tests' partition): parameters of three dtypes
    owned unevenly, then a rank that owns nothing (last: it may time out)."""
    zo = load(LESSON, "zero_optimizer")
    use_reference_partition(zo)
    return {"mixed": _part(_mixed_step, zo, rank, world_size, steps),
            "idle": _part(_idle_rank_step, zo, rank, world_size)}


def _fsdp_bf16(ft, rank, world_size):
    """The lesson's shard_model with a bf16 compute policy (fp32 reduce): what dtype the blocks
    compute in, and what dtype the sharded parameters and Adam's state (the masters) keep."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = ConvNet(batch_norm=False)
    seen = {}
    for name in ("layer1", "layer2", "fc"):
        getattr(model, name).register_forward_pre_hook(
            lambda m, args, name=name: seen.__setitem__(name, str(args[0].dtype)))
    ft.shard_model(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                          reduce_dtype=torch.float32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batch(rank, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return {"seen": seen,
            "masters": sorted({str(p.dtype) for p in model.parameters()}),
            "local": sorted({str(p.to_local().dtype) for p in model.parameters()
                             if hasattr(p, "to_local")}),
            "state": sorted({str(v.dtype) for st in opt.state.values() for v in st.values()
                             if torch.is_tensor(v) and v.dim() > 0})}


def _full_state_dict_bf16(ft, rank, world_size):
    """Task 08.5 on 3 ranks (uneven shards: 16 rows are 6, 6 and 4), the model sharded by
    torch with a bf16 compute policy and trained one step: rank 0's full state dict must hold
    the fp32 masters, gathered whole; the others an empty dict."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = _torch_shard(ConvNet(batch_norm=False), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batch(rank, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    want = {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}
    want.update((n, b.detach().cpu()) for n, b in model.named_buffers())
    sd = ft.full_state_dict(model)
    if rank != 0:
        return {"keys": sorted(sd)}
    got = {k: v for k, v in sd.items() if torch.is_tensor(v)}
    return {"keys": sorted(sd), "want": sorted(want),
            "got": {k: (type(v).__name__, str(v.dtype), v.device.type, tuple(v.shape))
                    for k, v in got.items()},
            "want_shapes": {k: tuple(v.shape) for k, v in want.items()},
            "equal": sorted(k for k, v in got.items() if k in want
                            and v.shape == want[k].shape and v.dtype == want[k].dtype
                            and torch.equal(v.cpu(), want[k]))}


def _worker_who_writes(ft, rank, world_size, save_dir, steps=2):
    """The script's train_worker (given code) in FSDP2 mode with a progress bar and a file to
    save, torch standing in for tasks 08.4 and 08.5: which ranks draw a bar, which write."""
    from pathlib import Path

    import tqdm as tqdm_module

    import dpt.checkpoint

    ft.shard_model, ft.full_state_dict = _torch_shard, _torch_full_state_dict
    bars, saves = [], []
    real_bar, real_save = tqdm_module.tqdm, dpt.checkpoint.atomic_save

    class RecordingBar(real_bar):
        def __init__(self, *args, **kwargs):
            bars.append(rank)
            super().__init__(*args, **{**kwargs, "disable": True})

    def recording_save(obj, path, *args, **kwargs):
        saves.append(len(obj))
        return real_save(obj, path, *args, **kwargs)

    tqdm_module.tqdm, dpt.checkpoint.atomic_save = RecordingBar, recording_save
    try:
        ft.train_worker(rank, world_size, mode="fsdp2", steps=steps, batch_size=8,
                        save=str(Path(save_dir) / "fsdp2.pt"), progress=True)
    finally:
        tqdm_module.tqdm, dpt.checkpoint.atomic_save = real_bar, real_save
    return {"bars": bars, "saves": saves}


def fsdp_at_three(rank, world_size, save_dir):
    """Lesson 08's FSDP2 parts on 3 ranks, where ConvNet's rows (16, 32, 10) do not divide
    evenly: 08.4 in fp32 against DDP, 08.4 with a bf16 compute policy, 08.5 gathering uneven
    shards of fp32 masters, and the worker's writes and progress bars."""
    ft = load(LESSON, "fsdp2_train")
    out = {"fp32": _part(fsdp_vs_ddp, rank, world_size, steps=2),
           "bf16": _part(_fsdp_bf16, ft, rank, world_size),
           "state": _part(_full_state_dict_bf16, ft, rank, world_size)}
    out["worker"] = _part(_worker_who_writes, ft, rank, world_size, save_dir)
    return out
