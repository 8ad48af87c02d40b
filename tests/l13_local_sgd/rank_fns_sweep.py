"""The rank function of lesson 13's sweep test (test_sweep.py): ``local_steps_sweep.py``'s
``sweep_worker`` on 3 ranks, at a size that fits the test's budget.

The sweep is given code built on tasks 13.1-13.4 (LocalSGD and DiLoCo): the references of
those tasks are put in place on each rank, so the test checks the given measurement whatever
state the student's tasks are in. The data are fake (Gaussian images labelled by a fixed
linear teacher), so no rank imports torchvision (seconds per process on a busy machine): the
script's own run reads Fashion-MNIST.
"""

from __future__ import annotations

import torch

from tests.lessons import load
from tests.references import put

LESSON = "13_local_sgd"
N = 3
HS = (2, 4)
STEPS = 8  # a multiple of every H: each run ends on a sync
PER_RANK = 16
N_EVAL = 200


N_TRAIN = 1024


def fake_tensors(name: str, train: bool = True, root=None, limit: int | None = None):
    """Stands in for ``dpt.data.load_tensors``: the same shapes and dtypes, learnable labels."""
    n = N_TRAIN if train else 10_000
    n = min(n, limit) if limit is not None else n
    x = torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(int(train) + 1))
    teacher = torch.randn(784, 10, generator=torch.Generator().manual_seed(7))
    return x, (x.flatten(1) @ teacher).argmax(1)


def sweep_rows(rank: int, world_size: int) -> list[dict]:
    import dpt.data

    put(LESSON, ("13.1", "13.2", "13.3", "13.4"))
    dpt.data.load_tensors = fake_tensors
    sweep = load(LESSON, "local_steps_sweep")
    return sweep.sweep_worker(rank, world_size, seed=0, hs=list(HS), steps=STEPS,
                              per_rank=PER_RANK, n_eval=N_EVAL)
