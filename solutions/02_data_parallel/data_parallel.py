"""Lesson 02: training with ``nn.DataParallel``, and a checkpoint that loads into a plain model.

``nn.DataParallel(model, device_ids=[0, 1])`` is one process driving several GPUs: every
forward scatters the batch, replicates the model, runs the replicas in threads and gathers
the outputs on ``device_ids[0]`` (see ``dp_by_hand.py`` for those four steps written out).
The training loop does not change at all; only two details matter:

- the model must sit on the root device, ``device_ids[0]``, before it is wrapped, and the
  batch goes there too (DataParallel scatters from the root);
- the wrapper prefixes every key of its ``state_dict`` with ``module.``. Save
  ``dp.module.state_dict()`` instead, and the checkpoint loads into a plain model.

With fewer than two GPUs it runs anyway: with no GPU, ``nn.DataParallel`` keeps no device ids
and its forward simply calls the module; with one GPU it "scatters" to that one device and
calls the module there. Either way it is lesson 01's training, which this script says.

Run it::

    .venv/bin/python solutions/02_data_parallel/data_parallel.py --limit-batches 200
    .venv/bin/python solutions/02_data_parallel/data_parallel.py --device-ids 0,1 --epochs 1   # 2 GPUs
    .venv/bin/python solutions/02_data_parallel/data_parallel.py --checkpoint /tmp/dp.pt --limit-batches 50
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from dpt import checkpoint as ckpt
from dpt import cli
from dpt.data import DATASETS, DEFAULT_DATASET, make_loader, prepare
from dpt.device import DeviceError
from dpt.models import MODELS, build_model


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def explain_devices(device_ids: list[int] | None = None) -> str:
    """One paragraph on what ``nn.DataParallel`` will do on this machine."""
    gpus = gpu_count()
    ids = list(range(gpus)) if device_ids is None else list(device_ids)
    if gpus == 0:
        return ("No CUDA GPU here: nn.DataParallel keeps an empty device list and its forward "
                "just calls the wrapped module on the CPU. No scatter, no replicas, no gather: "
                "this is lesson 01's training with a wrapper around it. The code is the same "
                "code that splits each batch over GPUs on a multi-GPU machine; dp_by_hand.py "
                "shows the splitting on the CPU.")
    if len(ids) < 2:
        return (f"{gpus} GPU(s), DataParallel over {len(ids)} device: it moves the batch to "
                f"cuda:{ids[0] if ids else 0} and calls the module there, without replicas. "
                "Data parallelism needs at least two devices.")
    return (f"nn.DataParallel over GPUs {ids}: each batch is split into {len(ids)} chunks, the "
            f"model is copied to every GPU on every forward, and outputs are gathered on "
            f"cuda:{ids[0]}, where the loss and the optimizer step run.")


def wrap(model: nn.Module, device_ids: list[int] | None = None
         ) -> tuple[nn.DataParallel, torch.device]:
    """Put ``model`` on the root device and wrap it; return ``(dp_model, root_device)``.

    ``device_ids=None`` means every visible GPU (the CPU when there is none).
    """
    # BEGIN SOLUTION 02.7: put the model on the root device, then wrap it in nn.DataParallel
    if gpu_count() == 0:
        root = torch.device("cpu")
    else:
        root = torch.device("cuda", device_ids[0] if device_ids else 0)
    model = model.to(root)
    return nn.DataParallel(model, device_ids=device_ids), root
    # END SOLUTION


def train_step(dp_model: nn.Module, batch, optimizer: torch.optim.Optimizer,
               root: torch.device) -> float:
    """Lesson 01's step: the batch goes to the root device, DataParallel does the rest."""
    inputs, targets = (t.to(root, non_blocking=True) for t in batch)
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(dp_model(inputs), targets)  # mean over the whole gathered batch
    loss.backward()  # gradients of the replicas are summed into the root's parameters
    optimizer.step()
    return loss.item()


def save_plain(dp_model: nn.Module, path: str | Path, **extra) -> Path:
    """Save the weights through ``.module`` so the keys have no ``module.`` prefix."""
    # BEGIN SOLUTION 02.8: save the unwrapped model's weights (no 'module.' prefix) and the extras
    plain = getattr(dp_model, "module", dp_model)
    return ckpt.atomic_save({"model": plain.state_dict(), **extra}, path)
    # END SOLUTION


def load_plain(path: str | Path, model: nn.Module, map_location="cpu") -> dict:
    """Load what :func:`save_plain` wrote into a plain model (or into a wrapper's ``.module``).

    Returns the whole checkpoint dictionary.
    """
    # BEGIN SOLUTION 02.8: load the checkpoint into the plain model (or a wrapper's .module); return it
    state = ckpt.load(path, map_location=map_location)
    getattr(model, "module", model).load_state_dict(state["model"])
    return state
    # END SOLUTION


@torch.no_grad()
def accuracy(model: nn.Module, loader, device: torch.device) -> float:
    was = model.training
    model.eval()
    correct = total = 0
    for x, y in loader:
        correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
        total += y.numel()
    model.train(was)
    return correct / max(1, total)


# ---------------------------------------------------------------------------------- CLI


def parse_ids(text: str | None) -> list[int] | None:
    if text is None or text == "":
        return None
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--device-ids must be comma-separated integers, got {text!r}") from None
    gpus = gpu_count()
    bad = [i for i in ids if i < 0 or i >= gpus]
    if bad:
        raise DeviceError(f"--device-ids {text}: this machine has {gpus} CUDA GPU(s), "
                          f"so {bad} do not exist")
    return ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Lesson 02: train with nn.DataParallel.")
    p.add_argument("--dataset", default=DEFAULT_DATASET, choices=sorted(DATASETS))
    p.add_argument("--model", default="fashioncnn", choices=sorted(MODELS))
    p.add_argument("--device-ids", default=None,
                   help="comma-separated CUDA ids, e.g. 0,1 (default: every visible GPU)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=128,
                   help="global batch, split over the devices")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--limit-batches", type=int, default=None)
    p.add_argument("--checkpoint", default=None, help="save the plain model here, then reload it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def run(args: argparse.Namespace) -> dict:
    cli.validate(args)  # the checks every training lesson shares (batch size, epochs, paths)
    ids = parse_ids(args.device_ids)
    print(explain_devices(ids))
    prepare(args.dataset)
    torch.manual_seed(args.seed)
    train = make_loader(args.dataset, train=True, batch_size=args.batch_size, seed=args.seed)
    test = make_loader(args.dataset, train=False, batch_size=1000)
    dp_model, root = wrap(build_model(args.model), ids)
    optimizer = torch.optim.SGD(dp_model.parameters(), lr=args.lr, momentum=0.9)
    start = time.perf_counter()
    losses = []
    for epoch in range(args.epochs):
        total = len(train) if args.limit_batches is None else min(len(train), args.limit_batches)
        bar = tqdm(train, total=total, desc=f"epoch {epoch}", disable=args.no_progress,
                   leave=False)
        for i, batch in enumerate(bar):
            if i >= total:
                break
            losses.append(train_step(dp_model, batch, optimizer, root))
        bar.close()
    seconds = time.perf_counter() - start
    acc = accuracy(dp_model, test, root)
    print(f"{len(losses)} steps in {seconds:.1f}s, last loss {losses[-1]:.4f}, "
          f"test accuracy {acc:.4f}")
    result = {"accuracy": acc, "seconds": seconds, "losses": losses}
    if args.checkpoint:
        save_plain(dp_model, args.checkpoint, epoch=args.epochs)
        plain = build_model(args.model)
        load_plain(args.checkpoint, plain)  # no wrapper, no "module." prefix
        reloaded = accuracy(plain, test, torch.device("cpu"))
        print(f"checkpoint {args.checkpoint} reloaded into a plain {args.model}: "
              f"test accuracy {reloaded:.4f}")
        result["reloaded_accuracy"] = reloaded
    return result


def main(argv: list[str] | None = None) -> int:
    return cli.main(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
