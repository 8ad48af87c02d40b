"""Functions the lesson 03 tests run on every rank through ``dpt.ranks.run_distributed``."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from dpt.data import TensorLoader
from dpt.dist import cpu_budget, rank_device
from dpt.models import ConvNet
from tests.helpers import (
    TRAINING_ARGS,
    recording_moves,
    run_leaving_the_group,
    slowed,
    unsent_message,
    watching_collectives,
)
from tests.lessons import load

LESSON = "03_ddp_spawn"


def _mod():
    return load(LESSON, "ddp_spawn")


def setup_ranks_without_joining(rank, world_size, nodes, gpus, timeout=60.0, threads=None):
    """As :func:`setup_as_node_process`, but the lesson's ``join_group`` is replaced here by one
    that only records what it is given: a wrong rank then fails by name, not as a rendezvous
    of two rank 0s. ``call`` holds every argument ``join_group`` got."""
    import inspect

    mod = _mod()
    seen = {}

    def record(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)
        seen["joined"] = (bound.arguments.get("rank"), bound.arguments.get("world_size"))
        seen["call"] = dict(bound.arguments)
        return torch.device("cpu")

    real = mod.join_group
    mod.join_group = record
    try:
        args = Namespace(nodes=nodes, gpus=gpus, nr=rank // gpus, device="cpu", timeout=timeout,
                         threads=threads)
        got_rank, got_world, _ = mod.ddp_setup(rank % gpus, args)
    finally:
        mod.join_group = real
    return {"joined": seen.get("joined"), "returned": (got_rank, got_world),
            "call": seen.get("call")}


def setup_as_node_process(rank, world_size, nodes, gpus):
    """Process ``rank`` of the test plays local process ``rank % gpus`` of node
    ``rank // gpus``; it must find its global rank and join the group with it."""
    mod = _mod()
    torch.set_num_threads(cpu_budget())  # as if nobody had split the cores yet
    args = Namespace(nodes=nodes, gpus=gpus, nr=rank // gpus, device="cpu", timeout=60.0,
                     threads=None)
    got_rank, got_world, device = mod.ddp_setup(rank % gpus, args)
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t)
    info = {"returned": (got_rank, got_world), "group": (dist.get_rank(), dist.get_world_size()),
            "device": str(device), "backend": dist.get_backend(), "sum": t.item(),
            "threads": torch.get_num_threads()}
    dist.destroy_process_group()
    return info


def loader_orders(rank, world_size, n, batch_size, shuffle, seed):
    """The sample indices, batch by batch, this rank's loader gives in epochs 0 and 1."""
    mod = _mod()
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    loader = mod.prepare_dataloader(x, torch.zeros(n, dtype=torch.long), batch_size,
                                    shuffle=shuffle, seed=seed)
    orders = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        orders.append([[int(i) for i in xb[:, 0]] for xb, _ in loader])
    return orders


class SpySampler(DistributedSampler):
    """A DistributedSampler that records the epoch and the indices of every pass."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes: list[tuple[int, list[int]]] = []

    def __iter__(self):
        order = list(super().__iter__())
        self.passes.append((self.epoch, order))
        return iter(order)


def _data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def trainer_sampler_passes(rank, world_size, start_epoch, max_epochs):
    """The sampler passes a Trainer makes training from ``start_epoch`` to ``max_epochs``."""
    mod = _mod()
    x, y = _data(64)
    sampler = SpySampler(range(len(x)), num_replicas=world_size, rank=rank, shuffle=True, seed=3)
    torch.manual_seed(0)
    model = ConvNet()
    with recording_moves() as moves:
        trainer = mod.Trainer(model, moves.loader(TensorLoader(x, y, batch_size=8,
                                                               sampler=sampler)),
                              torch.optim.SGD(model.parameters(), lr=0.01), rank_device())
        trainer.epochs_run = start_epoch
        modes = []  # the mode of each training forward
        model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
        model.eval()  # as evaluate() may have left it: each epoch must switch it back
        epoch_losses = trainer.train(max_epochs, limit_batches=2)
    return {"passes": sampler.passes, "epochs_run": trainer.epochs_run, "modes": modes,
            "epoch_losses": epoch_losses, "history": list(trainer.history),
            "model_sent": moves.module_sent(model, rank_device()),
            "unsent": unsent_message(moves, rank_device(), "the training batches",
                                     "the Trainer's epoch loop")}


def progress_bar_text(rank, world_size):
    """What one epoch of a Trainer with ``progress=True`` writes to this rank's stderr."""
    import io
    import sys

    mod = _mod()
    x, y = _data(16)
    model = ConvNet()
    loader = TensorLoader(x, y, batch_size=4, sampler=DistributedSampler(
        range(len(x)), num_replicas=world_size, rank=rank))
    trainer = mod.Trainer(model, loader, torch.optim.SGD(model.parameters(), lr=0.01),
                          rank_device(), progress=True)
    trainer._run_batch = lambda source, targets: 0.0  # task 01.1 stood in for
    err, sys.stderr = sys.stderr, io.StringIO()
    try:
        trainer._run_epoch(0)
        return sys.stderr.getvalue()
    finally:
        sys.stderr = err


def ddp_steps(rank, world_size, x, y, per_rank, steps, lr):
    """Several Trainer steps; step s uses rank r's slice of global batch s. The ranks start
    from different weights: DDP must give them rank 0's."""
    mod = _mod()
    torch.manual_seed(0 if rank == 0 else 100 + rank)
    model = ConvNet(batch_norm=False)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    trainer = mod.Trainer(model, None, opt, rank_device())
    for s in range(steps):
        lo = s * per_rank * world_size + rank * per_rank
        trainer._run_batch(x[lo:lo + per_rank].to(trainer.device),
                           y[lo:lo + per_rank].to(trainer.device))
    return {k: v.cpu().clone() for k, v in trainer.model.module.state_dict().items()}


def norm_statistics_at_each_forward(rank, world_size, steps):
    """Plain steps (not the task's ``_run_batch``) through a Trainer's DDP model, each rank on
    its own data: the first batch-norm layer's running mean as each forward reaches it."""
    mod = _mod()
    torch.manual_seed(0)
    model = ConvNet()  # with batch norm: running statistics, buffers rather than parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = mod.Trainer(model, None, opt, rank_device())
    norm = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    seen = []
    norm.register_forward_pre_hook(lambda m, args: seen.append(m.running_mean.cpu().clone()))
    x, y = _data(8 * steps, seed=rank)
    for s in range(steps):
        opt.zero_grad()
        batch = slice(8 * s, 8 * (s + 1))
        F.cross_entropy(trainer.model(x[batch].to(rank_device())),
                        y[batch].to(rank_device())).backward()
        opt.step()
    return seen


def save_on_ranks(rank, world_size, folder):
    """First every rank saves to its OWN path (only rank 0 may write a file); then all save to
    one path while rank 0 writes slowly: nobody may return before the file is there."""
    mod = _mod()
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(4, seed=rank)
    F.cross_entropy(model(x), y).backward()  # a plain step: the optimizer gets momentum
    opt.step()
    trainer = mod.Trainer(model, None, opt, rank_device(),
                          checkpoint_path=Path(folder) / f"own{rank}.pt")
    trainer._save_checkpoint(2)
    dist.barrier()
    with slowed(mod, "save_checkpoint"):
        trainer.checkpoint_path = Path(folder) / "shared.pt"
        trainer._save_checkpoint(3)
        there_on_return = trainer.checkpoint_path.is_file()
    return {"state": {k: v.cpu().clone() for k, v in trainer.model.module.state_dict().items()},
            "there_on_return": there_on_return}


def resume_on_ranks(rank, world_size, path):
    """Every rank builds a Trainer with ``resume_from=path`` (rank 0's checkpoint, momentum
    included): the epoch it starts at, and its optimizer's momentum buffers. Run apart from
    :func:`save_on_ranks`, so that a save bug there cannot turn this into a hang."""
    mod = _mod()
    fresh = ConvNet()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    resumed = mod.Trainer(fresh, None, fresh_opt, rank_device(), resume_from=Path(path))
    return {"epochs_run": resumed.epochs_run,
            "momentum": [s["momentum_buffer"].cpu().clone()
                         for s in fresh_opt.state_dict()["state"].values()]}


def evaluate_counts(rank, world_size, x, y):
    mod = _mod()
    torch.manual_seed(0)
    model = ConvNet().to(rank_device())
    model.train()
    graphs = []  # whether each forward built an autograd graph
    model.register_forward_hook(lambda m, args, out: graphs.append(out.requires_grad))
    sampler = DistributedSampler(range(len(x)), shuffle=False)
    loader = TensorLoader(x, y, batch_size=16, sampler=sampler)
    with recording_moves() as moves, watching_collectives(rank_device()) as watch:
        counts = mod.evaluate(model, moves.loader(loader), rank_device())
    training_after = model.training
    model.eval()  # and a model that was in eval mode stays in eval mode
    again = mod.evaluate(model, loader, rank_device())
    return {"counts": counts, "training_after": training_after, "again": again,
            "eval_after": not model.training, "graphs": graphs,
            "unsent": unsent_message(moves, rank_device(), "this rank's test batches",
                                     "evaluate"),
            "collective_problems": watch.problems}


def run_leaves_the_group(rank, world_size, fail):
    """The lesson's ``main`` (one spawned process) with a stand-in for the training: whether it
    returns or raises, the process must have left the process group afterwards."""
    args = Namespace(nodes=1, gpus=world_size, nr=0, device="cpu", timeout=60.0, threads=1,
                     checkpoint=None, resume=None, **TRAINING_ARGS)
    return run_leaving_the_group(lambda: _mod().main(rank, args), fail, _mod())

