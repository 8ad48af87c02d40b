"""Reproduce the MNIST figures of two source tutorials, with their own settings, on the CPU.

- ``mlp``: the PyTorch Lightning MNIST notebook's two-layer MLP (784 -> 128 -> 10), Adam at
  lr 1e-4, batch 16, one epoch over 55,000 of the 60,000 training images (a 55,000/5,000
  ``random_split`` drawn right after the model, from global seed 1), no shuffling; the notebook
  prints ``test_acc 0.9268``.
- ``convnet``: the ConvNet of "Distributed data parallel training in PyTorch" (two conv,
  batch-norm, ReLU, max-pool blocks and a linear head), plain SGD at lr 1e-4, batch 100,
  shuffled, inputs scaled to [0, 1] with no normalization, two epochs. That tutorial prints
  the loss every 100 steps and the training time, but no accuracy; we add the test accuracy.

Run::

    python tools/reproduce_mnist.py mlp --seeds 1 2 3
    python tools/reproduce_mnist.py convnet --seeds 0 1 2

Needs MNIST under data/ (``make data``). One CPU thread by default, so that figures taken on a
shared machine are comparable from run to run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from dpt.data import MNIST, DataError, TensorLoader, dataset_info, load_tensors, prepare
from dpt.models import MLP, ConvNet


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    correct = sum((model(xb).argmax(1) == yb).sum().item()
                  for xb, yb in zip(x.split(1000), y.split(1000)))
    model.train()
    return correct / len(y)


def run_mlp(seed: int) -> dict:
    """The Lightning notebook's quick test run, written in plain PyTorch."""
    x, y = load_tensors(MNIST, train=True)  # ToTensor + Normalize(0.1307, 0.3081)
    xt, yt = load_tensors(MNIST, train=False)
    torch.manual_seed(seed)  # seed_everything(seed), then the model, then the split
    model = MLP(hidden_dim=128)
    train_idx, _val_idx = torch.utils.data.random_split(range(len(x)), [55000, 5000])
    idx = torch.tensor(list(train_idx))
    loader = TensorLoader(x[idx], y[idx], batch_size=16)  # the notebook does not shuffle
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    for xb, yb in loader:
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    seconds = time.perf_counter() - start
    return {"test_acc": accuracy(model, xt, yt), "seconds": seconds, "steps": len(loader)}


def run_convnet(seed: int, epochs: int = 2) -> dict:
    """The ConvNet tutorial's single-device training, plus a test-set evaluation."""
    info = dataset_info(MNIST)
    # the tutorial uses transforms.ToTensor() only: undo our normalization to get [0, 1]
    x, y = load_tensors(MNIST, train=True)
    x = x.mul_(info.std).add_(info.mean)
    xt, yt = load_tensors(MNIST, train=False)
    xt = xt.mul_(info.std).add_(info.mean)
    torch.manual_seed(seed)
    model = ConvNet()
    loader = TensorLoader(x, y, batch_size=100, shuffle=True,
                          generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    losses = []
    start = time.perf_counter()
    for _epoch in range(epochs):
        for i, (xb, yb) in enumerate(loader):
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if (i + 1) % 100 == 0:
                losses.append(round(loss.item(), 4))
    seconds = time.perf_counter() - start
    return {"test_acc": accuracy(model, xt, yt), "seconds": seconds,
            "last_loss": losses[-1], "losses_every_100_steps": losses}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=["mlp", "convnet"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        prepare(MNIST)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = []
    for seed in args.seeds:
        r = run_mlp(seed) if args.which == "mlp" else run_convnet(seed)
        results.append(r)
        print(f"{args.which} seed {seed}: " + ", ".join(f"{k} {v}" for k, v in r.items()),
              flush=True)
    accs = [r["test_acc"] for r in results]
    secs = [r["seconds"] for r in results]
    spread = f" (min {min(accs):.4f}, max {max(accs):.4f})" if len(accs) > 1 else ""
    print(f"{args.which}: test accuracy mean {statistics.mean(accs):.4f}{spread} over "
          f"{len(accs)} seeds; training time median {statistics.median(secs):.1f}s "
          f"on {args.threads} thread(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
