# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 09: FSDP written by hand: shard, gather, free, reduce-scatter, with prefetch.

Lesson 08's ZeRO sharded the optimizer state and the gradients; the parameters stayed whole on
every rank. Fully sharded data parallel (FSDP, ZeRO-3) shards them too: each rank keeps 1/N of
every parameter, and a layer's full weights exist only while that layer computes.

The model is cut into *units* (here: each transformer block; the rest of the model, the
embeddings, the final norm and the head, is the *root* unit). Each unit keeps its parameters as
ONE flat fp32 vector, padded with zeros to a multiple of N, of which this rank holds one chunk,
the *shard*: an ``nn.Parameter`` the optimizer steps, the fp32 master weights. Per step:

- forward: just before a unit runs, all-gather its shards into the full flat vector (cast to
  the compute dtype), point the modules' parameters at views of it, run, free it;
- backward: gather it again (autograd saved views of it), compute its gradients, then
  reduce-scatter them: each rank gets the average over ranks of its own chunk, in fp32; free;
- after ``loss.backward()``, :meth:`FSDP.finish_grad_sync` waits for the last reduce-scatters
  and puts each result in its shard's ``.grad``; any ``torch.optim`` optimizer then steps the
  shards, each rank its own chunk.

With prefetch the next unit's all-gather is issued as this unit starts computing, so the
network works while the processor does. One step on one rank, 3 blocks; each name stands
where that unit's collective is issued or its memory freed, ' marks a backward; the root (the
embeddings, the final norm and the head) is gathered at the start and held to the end::

                    forward                               backward
    all-gather      root,b0 b1        b2                     b2,b1           b0
    compute                 [b0      ][b1      ][b2      ]         [b2'     ][b1'     ][b0'     ][root']
    reduce-scatter                                                          b2        b1        b0     root
    free                             b0        b1        b2                 b2        b1        b0     root

At most the root, the unit computing and the one prefetched are whole at any time: the
parameters take (root + 2 units + the shards) of memory, not the model. The first backward
unit waits for its gather (nothing prefetched it); each reduce-scatter travels while the
units before it compute their backward. ``schedule.py`` draws this from a measured step.

The padding: the flat vector is the parameters followed by zeros up to a multiple of N. No
parameter's view reaches into the padding, so the model never reads it; its gradient is zero
(autograd fills the unused piece with zeros), so reduce-scatter gives it zero, AdamW leaves a
zero with a zero gradient at zero (weight decay of zero is zero), and
:meth:`FSDP.gather_full_params` cuts it off. It never enters the loss, the gradients or a
saved model.

What it costs on the network, per unit and step, in units of the unit's bytes: the forward
all-gather and the backward one each move (N-1)/N, the reduce-scatter (N-1)/N: 3(N-1)/N in
all, 1.5 times DDP's all-reduce (2(N-1)/N), the price of not keeping the parameters. With
``compute_dtype=torch.bfloat16`` the gathers move half of that (the shards are cast before
they are sent); the gradients are reduced in fp32. Where a backend has no reduce-scatter of
its own, an all-reduce followed by keeping one's own chunk gives the same numbers and moves
2(N-1)/N of the gradient instead of (N-1)/N: that is how gloo, the CPU backend, carries out
``reduce_scatter_tensor``; NCCL's is a true reduce-scatter.

    .venv/bin/python exercises/09_fsdp/fsdp_by_hand.py                  # 2 CPU ranks, gloo
    .venv/bin/python exercises/09_fsdp/fsdp_by_hand.py --dtype bf16     # compute in bf16
    .venv/bin/python exercises/09_fsdp/fsdp_by_hand.py --dtype auto     # bf16, or fp16 on a T4
    .venv/bin/python exercises/09_fsdp/fsdp_by_hand.py --no-prefetch --nproc 4

``schedule.py`` (beside this file) records when each gather, compute, free and reduce-scatter
happened, by wrapping an FSDP object's methods from outside, and draws one step's timeline.
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

from dpt.dist import rank_device
from dpt.models import TinyTransformer, token_batch


def shard_flat(tensors: list[torch.Tensor], rank: int,
               world_size: int) -> tuple[torch.Tensor, int]:
    """Return ``(shard, padded)``: the ``tensors`` flattened one after the other into one fp32
    vector, padded with zeros at the end to ``padded`` elements (the smallest multiple of
    ``world_size`` that holds them all), and ``shard``, chunk number ``rank`` of it
    (``padded // world_size`` elements): a copy of its own, not a view of the tensors."""
    raise NotImplementedError("Task 09.1: one fp32 vector of every tensor, zeros up to a multiple of world_size, your chunk")


class Unit:
    """One all-gather unit: the parameters of some modules, kept as one flat shard per rank.

    Given: ``__init__`` (it takes the parameters out of the modules and keeps this rank's
    shard), ``wait`` and ``wait_grad``. Yours: ``gather``, ``use``, ``free`` and
    ``reduce_scatter``.

    - ``name``: ``"root"`` or the unit module's name in the model (``"blocks.0"``);
      ``module``: the module whose forward runs it (the whole model for the root);
      ``index``: its place among the non-root units, in forward order (the root: -1).
    - ``slots``: ``(module, attribute)`` of each parameter; ``names``, ``shapes``, ``numels``:
      its full name, shape and number of elements, in the flat order; ``numel``: their sum;
      ``padded``: ``numel`` rounded up to a multiple of the world size.
    - ``shard``: this rank's chunk of the padded flat vector, fp32, an ``nn.Parameter``.
    - ``full``: the gathered flat vector (``padded`` elements, in the compute dtype), a leaf
      that requires grad. While the unit is freed its storage holds 0 bytes.
    - ``handle``: the pending all-gather (what ``gather`` returned), or None.
    - ``grad_handle``: the pending reduce-scatter (what ``reduce_scatter`` returned), or None;
      ``grad_shard``: where it writes this rank's fp32 chunk of the averaged gradient;
      ``grad_full``: the gradient it sends, kept alive until it is done.
    """

    def __init__(self, name: str, module: nn.Module, params: list[tuple[str, nn.Module, str]],
                 index: int, group, compute_dtype: torch.dtype | None):
        self.name, self.module, self.index, self.group = name, module, index, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.names = [name for name, _, _ in params]
        self.slots = [(mod, attr) for _, mod, attr in params]
        tensors = [getattr(mod, attr) for mod, attr in self.slots]
        self.shapes = [t.shape for t in tensors]
        self.numels = [t.numel() for t in tensors]
        self.numel = sum(self.numels)
        shard, self.padded = shard_flat(tensors, self.rank, self.world_size)
        self.shard = nn.Parameter(shard.to(tensors[0].device))
        for mod, attr in self.slots:  # from now on the attribute is a view of self.full
            del mod._parameters[attr]
        self.full = torch.empty(self.padded, dtype=compute_dtype or torch.float32,
                                device=self.shard.device, requires_grad=True)
        self.full.untyped_storage().resize_(0)  # nothing gathered yet
        self.handle = self.grad_handle = self.grad_shard = self.grad_full = None

    def gather(self) -> dist.Work:
        """Start gathering the whole unit into ``self.full`` and return the handle at once
        (``async_op=True``): give ``self.full`` its memory back and fill it with every rank's
        shard, cast to ``self.full``'s dtype. Write into ``self.full.data``: autograd keeps
        views of ``self.full`` for backward, and a gather into ``self.full`` itself would be
        an in-place change of them."""
        raise NotImplementedError("Task 09.2: the storage's bytes back, then an async all-gather of your shard, cast to self.full's dtype")

    def use(self) -> None:
        """Point each of ``self.slots`` at its piece of ``self.full``, viewed in its
        parameter's shape; the padding at the end is nobody's.

        Views, not copies: autograd then traces every parameter back to ``self.full``, whose
        ``.grad`` receives the whole unit's gradient in one flat tensor. Call it in forward
        just before the unit computes: autograd runs a node made earlier later in backward,
        and a unit whose views were made early would get its gradient late."""
        raise NotImplementedError("Task 09.3: split self.full by the parameters' sizes, view each piece in its shape, set it on its module")

    def wait(self) -> None:
        """Wait for the pending all-gather: ``self.full`` then holds the whole unit."""
        if self.handle is None:
            raise RuntimeError(f"unit {self.name}: wait() with no gather pending; "
                               "call gather() first")
        self.handle.wait()
        self.handle = None

    def free(self) -> None:
        """Release the gathered copy: ``self.full``'s memory and its gradient.

        Keep the tensor ``self.full`` itself: autograd holds views of it for backward, and
        the next gather fills the same tensor again."""
        raise NotImplementedError("Task 09.4: give back the storage's bytes (keep the tensor) and drop its gradient")

    def reduce_scatter(self) -> dist.Work:
        """Start the reduce-scatter of the unit's gradient (``self.full.grad``) and return the
        handle at once (``async_op=True``).

        Each rank must end up with the AVERAGE over ranks of its chunk of the gradient, in
        fp32 whatever the compute dtype, in a new tensor ``self.grad_shard`` (the shard's
        shape); keep the tensor sent in ``self.grad_full`` until the handle is waited."""
        raise NotImplementedError("Task 09.5: fp32 average of the gradient, reduce-scattered into self.grad_shard")

    def wait_grad(self) -> None:
        """Wait for the pending reduce-scatter: ``self.grad_shard`` then holds the result."""
        if self.grad_handle is None:
            raise RuntimeError(f"unit {self.name}: wait_grad() with no reduce-scatter pending")
        self.grad_handle.wait()
        self.grad_handle = self.grad_full = None


class FSDP(nn.Module):
    """Fully sharded data parallel, by hand: ``FSDP(model)`` on every rank of the group.

    ``units``: the modules gathered one at a time (default: each of ``module.blocks``); every
    other parameter belongs to the root unit, gathered from the start of forward to the end of
    backward. ``compute_dtype``: the dtype the units compute in (None: fp32); the shards, the
    optimizer's parameters, stay fp32. ``prefetch``: issue the next unit's all-gather before
    this one computes. ``group``: the process group (default: every rank).

    ``parameters()`` are the flat fp32 shards, one per unit: give them to any optimizer, and
    call :meth:`finish_grad_sync` between ``loss.backward()`` and ``optimizer.step()``.
    ``schedule.record(fsdp)`` logs each gather, compute, wait, free and reduce-scatter of one
    FSDP object, wrapping its methods from outside (``schedule.py`` draws them).
    """

    def __init__(self, module: nn.Module, units: list[nn.Module] | None = None,
                 compute_dtype: torch.dtype | None = None, prefetch: bool = True, group=None):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("FSDP needs a process group: call it on every rank, after "
                               "dist.init_process_group")
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype must be a floating dtype, not {compute_dtype}")
        if units is None:
            if not isinstance(getattr(module, "blocks", None), nn.ModuleList):
                raise ValueError("this model has no .blocks: pass units=[...], the modules "
                                 "to gather one at a time")
            units = list(module.blocks)
        self.module, self.group, self.prefetch = module, group, prefetch
        self.compute_dtype = compute_dtype
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.param_names = [name for name, _ in module.named_parameters()]
        groups = self._assign(module, list(units))
        self.units = [Unit(name, mod, params, i, group, compute_dtype)
                      for i, (name, mod, params) in enumerate(groups[1:])]
        self.root = (Unit("root", module, groups[0][2], -1, group, compute_dtype)
                     if groups[0][2] else None)
        self.all_units = ([self.root] if self.root else []) + self.units
        self.flat_shards = nn.ParameterList([unit.shard for unit in self.all_units])
        self._register_hooks()

    @staticmethod
    def _assign(module: nn.Module, units: list[nn.Module]):
        """[(name, module, [(param name, owning module, attribute)])]: the root first, then
        each unit, in forward order; each parameter goes to the unit that contains it."""
        names = {id(m): n for n, m in module.named_modules()}
        owner: dict[int, int] = {}
        for i, unit in enumerate(units):
            if id(unit) not in names or unit is module:
                raise ValueError(f"unit {i} ({type(unit).__name__}) is not a submodule of the "
                                 "model (the model itself is the root unit)")
            for sub in unit.modules():
                if owner.setdefault(id(sub), i) != i:
                    raise ValueError(f"unit {names[id(unit)]} is inside another unit; "
                                     "units must not overlap")
        groups = [("root", module, [])] + [(names[id(u)], u, []) for u in units]
        seen = set()
        for mod_name, mod in module.named_modules():
            for attr, p in mod._parameters.items():
                if p is None:
                    continue
                name = f"{mod_name}.{attr}" if mod_name else attr
                if id(p) in seen:
                    raise ValueError(f"parameter {name} is shared with another module "
                                     "(tied weights): not supported here")
                if not p.requires_grad:
                    raise ValueError(f"parameter {name} is frozen: every parameter must train")
                seen.add(id(p))
                i = owner.get(id(mod))
                groups[0 if i is None else i + 1][2].append((name, mod, attr))
        for name, _, params in groups[1:]:
            if not params:
                raise ValueError(f"unit {name} has no parameters")
        return groups

    def _register_hooks(self) -> None:
        """Hook each unit so that ``_pre_forward(unit)`` runs just before its module's
        forward, ``_post_forward(unit, output)`` just after it, and ``_post_backward(unit)``
        once the unit's whole gradient has been accumulated in ``unit.full.grad`` (the root
        too: it has no module hooks, its gathers are in ``forward``)."""
        raise NotImplementedError("Task 09.6: forward pre- and post-hooks on each unit's module; for every unit, a hook when the grad of its flat full tensor is accumulated")

    def forward(self, *args, **kwargs):
        if self.compute_dtype is not None:  # floating-point inputs computed in that dtype too
            def cast(x):
                return (x.to(self.compute_dtype) if torch.is_tensor(x) and x.is_floating_point()
                        else x)

            args, kwargs = tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}
        if self.root is not None:
            self.root.handle = self.root.gather()
        if self.prefetch and self.units:
            self.units[0].handle = self.units[0].gather()
        if self.root is not None:
            self.root.wait()
            self.root.use()
        output = self.module(*args, **kwargs)
        if self.root is not None and not torch.is_grad_enabled():
            self.root.free()  # no backward will come to free it
        return output

    def _pre_forward(self, unit: Unit) -> None:
        """Before ``unit`` computes: its parameters must be gathered, and its modules must use
        them. With ``self.prefetch``, also start the gather of the unit that runs next, so it
        travels while this one computes. A unit whose gather is already pending (prefetched)
        has ``unit.handle`` set."""
        raise NotImplementedError("Task 09.7: this unit's gather issued (unless pending), the next one's too if prefetching; wait for this one, use it")

    def _post_forward(self, unit: Unit, output: torch.Tensor) -> None:
        """After ``unit`` computed: free its gathered parameters, and make sure that in
        backward ``_pre_backward(unit)`` runs before autograd computes its gradients (when
        the gradient of its ``output`` arrives). In a forward without grad (``torch.no_grad``,
        evaluation) there is no backward to prepare."""
        raise NotImplementedError("Task 09.8: free the unit; a hook on the output's gradient calls _pre_backward")

    def _pre_backward(self, unit: Unit) -> None:
        """Before autograd computes ``unit``'s gradients: the forward freed its parameters, and
        backward needs them again (autograd saved the views ``use`` made: they need only the
        memory under them filled again). With ``self.prefetch``, also start the gather of the
        unit whose backward comes next (backward runs the units in reverse)."""
        raise NotImplementedError("Task 09.9: gather again unless already pending, prefetch the previous unit, wait")

    def _post_backward(self, unit: Unit) -> None:
        """``unit.full.grad`` holds the unit's whole gradient: start sending it (keep the
        handle in ``unit.grad_handle``), and free what is gathered."""
        raise NotImplementedError("Task 09.10: start the reduce-scatter, then free the unit")

    def finish_grad_sync(self) -> None:
        """Call after ``loss.backward()``, before ``optimizer.step()``: every shard's ``.grad``
        then holds its chunk of the gradient averaged over ranks, added to the ``.grad`` it
        had (None after ``zero_grad``), as autograd adds to a parameter's."""
        missing = [unit.name for unit in self.all_units if unit.grad_handle is None]
        if missing:
            raise RuntimeError(f"no gradient was sent for unit(s) {missing} in this step: "
                               "call finish_grad_sync() once after each loss.backward(), and "
                               "use every unit in forward")
        raise NotImplementedError("Task 09.11: for each unit, wait for its reduce-scatter and put the result in (or add it to) the shard's .grad")

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters, fp32, by their names in the original model, on every
        rank (each rank must call it: it gathers). For saving, and checking."""
        full_params: dict[str, torch.Tensor] = {}
        raise NotImplementedError("Task 09.12: for each unit: all-gather the fp32 shards, drop the padding, cut into named tensors of their shapes")
        return {name: full_params[name] for name in self.param_names}

    @torch.no_grad()
    def load_full_params(self, state: dict[str, torch.Tensor]) -> None:
        """Load the whole model's parameters (names as in the original model); each rank keeps
        its shard of each unit. The optimizer's state is not touched."""
        missing = [name for name in self.param_names if name not in state]
        if missing:
            raise KeyError(f"the state lacks {len(missing)} parameter(s), e.g. {missing[0]}")
        for unit in self.all_units:
            for name, shape in zip(unit.names, unit.shapes):
                if state[name].shape != shape:
                    raise ValueError(f"{name}: shape {tuple(state[name].shape)} in the state, "
                                     f"{tuple(shape)} in the model")
            tensors = [state[name].to(unit.shard.device) for name in unit.names]
            shard, _ = shard_flat(tensors, self.rank, self.world_size)
            unit.shard.copy_(shard)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now: ``shards`` (the fp32 master shards), ``shard_grads``,
        ``gathered`` (gathered units alive) and ``gathered_grads``."""
        return {
            "shards": sum(u.shard.numel() * u.shard.element_size() for u in self.all_units),
            "shard_grads": sum(u.shard.grad.numel() * u.shard.grad.element_size()
                               for u in self.all_units if u.shard.grad is not None),
            "gathered": sum(u.full.untyped_storage().nbytes() for u in self.all_units),
            "gathered_grads": sum(u.full.grad.untyped_storage().nbytes()
                                  for u in self.all_units if u.full.grad is not None),
        }


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def rank_batch(step: int, rank: int, world_size: int, batch_size: int, model: TinyTransformer,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``batch_size`` rows of step ``step``'s global batch of synthetic tokens."""
    inputs, targets = token_batch(batch_size * world_size, model.seq_len,
                                  model.embed.num_embeddings,
                                  seed=seed * 100_003 + step)
    rows = slice(rank * batch_size, (rank + 1) * batch_size)
    return inputs[rows], targets[rows]


def train_worker(rank: int, world_size: int, steps: int = 5, batch_size: int = 8,
                 lr: float = 1e-3, compute_dtype: torch.dtype | None = None,
                 prefetch: bool = True, seed: int = 0, model_kwargs: dict | None = None,
                 progress: bool = False) -> dict:
    """Train a TinyTransformer with :class:`FSDP` for ``steps`` AdamW steps on this rank.

    Returns the losses (averaged over ranks), this rank's memory after the step and the
    seconds per step. Every rank builds the same model from ``seed`` and keeps its shards of
    it. Run on every rank with the process group initialized (``dpt.ranks.run_distributed``).
    """
    device = rank_device()
    torch.manual_seed(seed)
    model = TinyTransformer(**(model_kwargs or {})).to(device)
    fsdp = FSDP(model, compute_dtype=compute_dtype, prefetch=prefetch)
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=lr)
    losses, times = [], []
    bar = range(steps)
    if progress and rank == 0:
        from tqdm import tqdm
        bar = tqdm(bar, desc=f"FSDP by hand x{world_size}")
    for step in bar:
        inputs, targets = (t.to(device) for t in rank_batch(step, rank, world_size, batch_size,
                                                            model, seed))
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(fsdp(inputs), targets)
        loss.backward()
        fsdp.finish_grad_sync()
        optimizer.step()
        losses.append(loss.detach())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    mean = torch.stack(losses).float()
    dist.all_reduce(mean)
    return {"rank": rank, "losses": (mean / world_size).tolist(), "memory": fsdp.memory(),
            "step_seconds": times}


def full_params_worker(rank: int, world_size: int, steps: int = 3, batch_size: int = 4,
                       lr: float = 1e-3, seed: int = 0) -> dict[str, torch.Tensor]:
    """Train :class:`FSDP` for ``steps`` AdamW steps, then return the whole model by name."""
    device = rank_device()
    torch.manual_seed(seed)
    model = TinyTransformer().to(device)
    fsdp = FSDP(model)
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=lr)
    for step in range(steps):
        inputs, targets = (t.to(device) for t in rank_batch(step, rank, world_size, batch_size,
                                                            model, seed))
        optimizer.zero_grad(set_to_none=True)
        loss_fn(fsdp(inputs), targets).backward()
        fsdp.finish_grad_sync()
        optimizer.step()
    return {k: v.cpu() for k, v in fsdp.gather_full_params().items()}


def compare_with_one_process(world_size: int = 2, steps: int = 3, batch_size: int = 4,
                             lr: float = 1e-3, seed: int = 0) -> float:
    """The largest difference between the weights :class:`FSDP` trains on ``world_size``
    ranks and those one process trains on the same global batches, after ``steps`` steps."""
    from dpt.ranks import run_distributed

    sharded = run_distributed(full_params_worker, world_size=world_size, timeout=240,
                              echo=False, kwargs={"steps": steps, "batch_size": batch_size,
                                                  "lr": lr, "seed": seed})[0]
    torch.manual_seed(seed)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        inputs, targets = rank_batch(step, 0, 1, batch_size * world_size, model, seed)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
    return max((sharded[name] - p.detach()).abs().max().item()
               for name, p in model.named_parameters())


def main(argv=None) -> int:
    from dpt.precision import DTYPES, compute_format

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks: one per GPU with NCCL when "
                    "there are enough GPUs, else CPU processes with gloo")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "auto"], default="fp32",
                    help="the dtype the units compute in; the shards stay fp32. auto: bf16, "
                         "or fp16 on a GPU of compute capability below 8 (bf16 is emulated)")
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    try:
        if args.nproc < 1 or args.steps < 1 or args.batch_size < 1:
            raise ValueError("--nproc, --steps and --batch-size must be at least 1")
        from dpt.dist import threads_per_rank
        from dpt.ranks import placement, run_distributed

        args.dtype, note = compute_format(args.dtype, placement(args.nproc).device)
        if note:
            print(note, file=sys.stderr)
        results = run_distributed(
            train_worker, world_size=args.nproc, backend="auto", timeout=args.timeout,
            threads=threads_per_rank(args.nproc), echo=False,
            kwargs={"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
                    "compute_dtype": DTYPES[args.dtype], "prefetch": not args.no_prefetch,
                    "progress": True})
    except (ValueError, RuntimeError, OSError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    losses = results[0]["losses"]
    k = max(1, len(losses) // 10)
    print(f"FSDP by hand on {args.nproc} rank(s), {args.dtype} compute, prefetch "
          f"{'off' if args.no_prefetch else 'on'}: loss {sum(losses[:k]) / k:.3f} -> "
          f"{sum(losses[-k:]) / k:.3f} (mean of first/last {k} steps)")
    for r in results:
        mem = r["memory"]
        times = sorted(r["step_seconds"][1:] or r["step_seconds"])
        print(f"rank {r['rank']}: shards {mem['shards'] / 1024:.1f} KiB, gathered now "
              f"{mem['gathered'] / 1024:.1f} KiB, median step {times[len(times) // 2] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
