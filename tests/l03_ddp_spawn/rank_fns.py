"""Functions the lesson 03 tests run on every rank through ``dpt.testing.run_distributed``."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from dpt.data import TensorLoader
from dpt.dist import cpu_budget
from dpt.models import ConvNet
from tests.lessons import load

LESSON = "03_ddp_spawn"
CPU = torch.device("cpu")


def _mod():
    return load(LESSON, "ddp_spawn")


def setup_and_report(rank, world_size):
    mod = _mod()
    torch.set_num_threads(cpu_budget())  # as if nobody had split the cores yet
    device = mod.ddp_setup(rank, world_size, device="cpu")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    info = {"device": str(device), "backend": dist.get_backend(), "rank": dist.get_rank(),
            "world_size": dist.get_world_size(), "sum": t.item(),
            "threads": torch.get_num_threads()}
    mod.ddp_teardown()
    info["initialized_after"] = dist.is_initialized()
    mod.ddp_teardown()  # a second call must be harmless
    return info


def session_that_raises(rank, world_size):
    mod = _mod()
    try:
        with mod.ddp_session(rank, world_size, device="cpu"):
            raise ValueError("training broke")
    except ValueError:
        pass
    return dist.is_initialized()


def setup_without_port(rank, world_size):
    mod = _mod()
    del os.environ["MASTER_PORT"]
    try:
        mod.ddp_setup(rank, world_size, device="cpu", timeout_s=10)
    except Exception as exc:  # noqa: BLE001 - the test looks at what was raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    port = os.environ.get("MASTER_PORT")
    mod.ddp_teardown()
    return {"port": port}


def loader_shards(rank, world_size, n, batch_size):
    mod = _mod()
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    loader = mod.make_train_loader(x, torch.zeros(n, dtype=torch.long), batch_size, rank,
                                   world_size, seed=0)
    return [int(i) for xb, _ in loader for i in xb[:, 0]]


class Recorder(nn.Module):
    """A tiny classifier whose input is the sample's index; it remembers what it saw."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(1, 10)
        self.seen: list[int] = []

    def forward(self, x):
        self.seen.extend(int(i) for i in x[:, 0])
        return self.fc(x)


def epoch_orders(rank, world_size, n, batch_size, epochs):
    mod = _mod()
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=0)
    loader = TensorLoader(x, torch.zeros(n, dtype=torch.long), batch_size=batch_size,
                          sampler=sampler)
    model = Recorder()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    orders, losses = [], []
    for epoch in range(epochs):
        model.seen = []
        losses.append(mod.train_epoch(model, loader, opt, CPU, epoch))
        orders.append(list(model.seen))
    return {"orders": orders, "losses": losses}


def wrap_from_different_seeds(rank, world_size):
    mod = _mod()
    torch.manual_seed(100 + rank)  # each rank builds different initial weights
    wrapped = mod.wrap_model(ConvNet(), CPU)
    return {"is_ddp": isinstance(wrapped, DDP),
            "state": {k: v.clone() for k, v in wrapped.module.state_dict().items()}}


def ddp_steps(rank, world_size, x, y, per_rank, steps, lr):
    """Several SGD steps; step s uses rank r's slice of global batch s."""
    mod = _mod()
    torch.manual_seed(0)
    model = mod.wrap_model(ConvNet(batch_norm=False), CPU)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for s in range(steps):
        lo = s * per_rank * world_size + rank * per_rank
        opt.zero_grad()
        F.cross_entropy(model(x[lo:lo + per_rank]), y[lo:lo + per_rank]).backward()
        opt.step()
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def save_on_ranks(rank, world_size, path):
    mod = _mod()
    torch.manual_seed(0)
    model = DDP(ConvNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    opt.zero_grad()
    F.cross_entropy(model(torch.randn(4, 1, 28, 28, generator=g)),
                    torch.randint(0, 10, (4,), generator=g)).backward()
    opt.step()
    calls = []
    real_save = torch.save

    def counting_save(*args, **kwargs):
        calls.append(1)
        return real_save(*args, **kwargs)

    torch.save = counting_save
    try:
        mod.save_checkpoint(path, model, opt, epoch=2)
    finally:
        torch.save = real_save
    dist.barrier()
    return {"saves": len(calls),
            "state": {k: v.clone() for k, v in model.module.state_dict().items()}}


def evaluate_counts(rank, world_size, x, y):
    mod = _mod()
    torch.manual_seed(0)
    model = ConvNet()
    model.train()
    counts = mod.evaluate_distributed(model, x, y, CPU, batch_size=16)
    return {"counts": counts, "training_after": model.training}


def train_end_to_end(rank, world_size, args):
    return _mod().run_training(rank, world_size, args)
