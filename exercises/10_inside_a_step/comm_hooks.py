# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 10: what DDP sends in a step, and how a communication hook changes it.

DDP packs the gradients into **buckets** (flat fp32 tensors of about 25 MB; the first one
smaller) and, as each bucket fills during backward, all-reduces it. A **communication hook**
replaces that all-reduce::

    ddp.register_comm_hook(state, hook)       # once, before training

    def hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
        ...                                   # bucket.buffer(): the bucket's flat gradients

DDP calls ``hook`` for every bucket and, when the returned Future is done, copies its value
(the **averaged** gradients, same size and dtype as ``bucket.buffer()``) into the ``.grad`` of
the bucket's parameters. What the hook sends in between is its own business:

- ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``: cast the bucket to 16 bits,
  all-reduce half the bytes, cast back. bf16 keeps fp32's range (no overflow, no scaling) with
  8 bits of mantissa; fp16 has 11 bits of mantissa but overflows above 65504;
- ``powerSGD_hook.powerSGD_hook``: each gradient matrix M (n x m) is sent as two thin
  matrices P (n x r) and Q (m x r) with M ~ P Q^T; 1-D tensors (biases) go uncompressed, and
  so does every matrix too small to gain from it. The error of the approximation is kept and
  added to the next step's gradient (*error feedback*), and the first ``start_powerSGD_iter``
  steps run plain all-reduce.

Which backends run them: all three on NCCL (CUDA) and, as measured in this lesson with torch
2.14, on gloo (CPU) too, bf16 sums included (gloo adds two bf16 numbers in fp32 and rounds
once, as torch does). A backend without bf16 all-reduce fails in the first backward with a
one-line error from the backend; the lesson then runs its examples with ``--hooks fp16``.
One more catch: ``register_comm_hook`` refuses torch's own ``bf16_compress_hook`` (by its
name) on a torch built without CUDA 11+ and NCCL 2.10+ (the CPU-only wheels), whatever the
backend; the hand-written hook has no such check (:func:`torch_bf16_registers`).

Your tasks:

- 10.8 :func:`bf16_hook_by_hand`: a bf16 compression hook written by hand;
- 10.9 :func:`attach_hook`: one name -> one registered hook (PowerSGD with its state);
- 10.10 :class:`AllReduceCounter`: count the bytes every ``dist.all_reduce`` sends, so that a
  step's traffic is measured, not assumed.

Given: :func:`train_worker` trains the PyTorch MNIST-example MLP on Fashion-MNIST with DDP and
a hook, and returns loss, test accuracy, step time and bytes all-reduced per step;
:func:`predicted_bytes` says what each hook should send. The CLI runs each hook over seeds::

    .venv/bin/python exercises/10_inside_a_step/comm_hooks.py                # all hooks, 3 seeds
    .venv/bin/python exercises/10_inside_a_step/comm_hooks.py --hooks none bf16 powersgd --seeds 2
"""

# No `from __future__ import annotations` here: DDP compares a hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] themselves, not with their names.
import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from dpt import stats
from dpt.device import synchronize
from dpt.dist import rank_device

HOOKS = ("none", "fp16", "bf16", "bf16_by_hand", "powersgd")
POWERSGD_DEFAULTS = {"rank": 1, "start_iter": 10, "error_feedback": True}


def torch_bf16_registers() -> bool:
    """Whether DDP accepts torch's ``bf16_compress_hook`` on this build (its own check)."""
    cuda = torch.version.cuda is not None or torch.version.hip is not None
    nccl = cuda and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    xpu = getattr(dist, "is_xccl_available", lambda: False)() and torch.xpu.is_available()
    return bool(nccl or xpu)


# --- 10.8 a compression hook by hand -------------------------------------------------------

def bf16_hook_by_hand(process_group, bucket: dist.GradBucket
                      ) -> torch.futures.Future[torch.Tensor]:
    """All-reduce ``bucket``'s gradients in bf16: half the bytes of fp32.

    ``process_group`` is the state given to ``register_comm_hook`` (None: every rank). Cast
    the bucket's buffer to bf16, divide it by the world size (the mean is a sum of shares),
    start an **asynchronous** all-reduce of it, and return a Future that, once the sum has
    arrived, holds the result cast back into ``bucket.buffer()`` itself (fp32, its original
    dtype). Must give, bit for bit, what ``default_hooks.bf16_compress_hook`` gives.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    raise NotImplementedError("Task 10.8: compress and pre-divide, launch an async all-reduce, then (in a callback) decompress into the bucket's own buffer and return it")


# --- 10.9 one name, one hook -------------------------------------------------------------------

def attach_hook(ddp: DDP, name: str, **opts):
    """Register the communication hook called ``name`` on ``ddp``; return its state.

    Names (:data:`HOOKS`): ``"none"`` (DDP's own fp32 all-reduce: register nothing),
    ``"fp16"`` and ``"bf16"`` (torch's compression hooks), ``"bf16_by_hand"``
    (:func:`bf16_hook_by_hand`), ``"powersgd"`` (torch's PowerSGD). (DDP refuses ``"bf16"``
    on a torch without CUDA: :func:`torch_bf16_registers`.) The state of the first
    four is the process group (None: every rank); PowerSGD's is a ``PowerSGDState`` built from
    ``opts`` over :data:`POWERSGD_DEFAULTS`: ``rank`` (of the approximation), ``start_iter``
    (plain all-reduce before it), ``error_feedback``. Any other name or option: ValueError.
    Returns the registered state (None for ``"none"``).
    """
    if name not in HOOKS:
        raise ValueError(f"unknown hook {name!r}; choose from {', '.join(HOOKS)}")
    allowed = POWERSGD_DEFAULTS if name == "powersgd" else {}
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise ValueError(f"hook {name!r} takes no option {', '.join(unknown)}"
                         + (f" (it takes {', '.join(allowed)})" if allowed else ""))
    raise NotImplementedError("Task 10.9: no hook for \"none\"; the three compression hooks take the process group as state; PowerSGD takes a PowerSGDState from the options")


# --- 10.10 measuring what is sent ---------------------------------------------------------------

class AllReduceCounter:
    """``with AllReduceCounter() as c:`` counts every ``torch.distributed.all_reduce`` call.

    ``c.bytes``: the bytes of the tensors all-reduced (each call: its elements times their
    size); ``c.calls``: how many. Inside the block ``dist.all_reduce`` is a wrapper that counts
    and then calls the real one with the same arguments, returning what it returns (a work
    handle when ``async_op=True``); leaving the block, by an exception too, puts the real one
    back. The hooks above and torch's, PowerSGD's chained all-reduces included, all call
    ``dist.all_reduce``; DDP's own all-reduce (no hook) runs in C++, out of Python's sight:
    :func:`train_worker` measures "none" through ``default_hooks.allreduce_hook``, which sends
    the same buckets.
    """

    def __init__(self):
        self.bytes = 0
        self.calls = 0
        self._real = None

    def __enter__(self) -> "AllReduceCounter":
        raise NotImplementedError("Task 10.10: keep the real all_reduce, put a counting wrapper in its place on the torch.distributed module")
        return self

    def __exit__(self, *exc) -> None:
        raise NotImplementedError("Task 10.10: put the real all_reduce back")


# --- given: what each hook should send ---------------------------------------------------------

def predicted_bytes(model: nn.Module, name: str, rank: int = 1, compressed: bool = True,
                    min_compression_rate: float = 2.0) -> int:
    """Bytes one rank all-reduces per step under hook ``name`` (payload, not wire bytes).

    fp32: 4 per gradient element; fp16 and bf16: 2. PowerSGD (``compressed``: after its start
    iteration) views each gradient as a matrix (its first dim x the rest) and sends P and Q,
    ``r * (n + m)`` fp32 elements, with ``r = min(n, m, rank)``, when that is worth it
    (``r * (n + m) * min_compression_rate < n * m``), else the whole tensor, as for 1-D ones.
    A ring all-reduce of B bytes on N ranks puts ``2 (N - 1) / N * B`` on each rank's link.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if name not in HOOKS:
        raise ValueError(f"unknown hook {name!r}; choose from {', '.join(HOOKS)}")
    if name in ("fp16", "bf16", "bf16_by_hand"):
        return 2 * sum(p.numel() for p in params)
    if name == "none" or not compressed:
        return 4 * sum(p.numel() for p in params)
    elements = 0
    for p in params:
        n = p.shape[0] if p.dim() else 1
        m = p.numel() // max(n, 1)
        r = min(n, m, rank)
        elements += r * (n + m) if p.dim() > 1 and r * (n + m) * min_compression_rate < n * m \
            else p.numel()
    return 4 * elements


# --- given: training with a hook -----------------------------------------------------------------

def _data(train: bool, limit: int | None, dataset: str):
    from dpt.data import load_tensors, prepare_distributed

    prepare_distributed(dataset)
    return load_tensors(dataset, train=train, limit=limit)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
             batch: int = 2000) -> tuple[float, float]:
    """Mean loss and accuracy of ``model`` on ``(x, y)``."""
    model.eval()
    loss, correct = 0.0, 0
    for i in range(0, len(x), batch):
        out = model(x[i:i + batch].to(device))
        target = y[i:i + batch].to(device)
        loss += F.cross_entropy(out, target, reduction="sum").item()
        correct += (out.argmax(1) == target).sum().item()
    model.train()
    return loss / len(x), correct / len(x)


def train_worker(rank: int, world_size: int, hook: str = "none", seed: int = 0,
                 epochs: float = 1.0, batch_size: int = 64, lr: float = 0.05,
                 train_limit: int | None = None, test_limit: int | None = None,
                 dataset: str = "fashion-mnist", log_every: int = 0,
                 hook_opts: dict | None = None) -> dict:
    """Train ``dpt.models.MLP`` with DDP and ``hook`` (:func:`attach_hook`, given
    ``hook_opts``); its results.

    SGD with momentum 0.9, ``batch_size`` images per rank per step, ``epochs`` passes over the
    training split (a fraction: fewer steps), shuffled by ``seed``, which also seeds the model.
    Every step is timed (the slower rank's median is the step time) and every step's
    all-reduced bytes are counted (:class:`AllReduceCounter`). For ``"none"``, whose
    all-reduce is out of Python's sight, one extra step after training, with torch's
    ``allreduce_hook`` (the same buckets, fp32) and no optimizer step, gives the bytes.
    """
    from torch.utils.data.distributed import DistributedSampler

    from dpt.data import TensorLoader
    from dpt.models import MLP

    device = rank_device()
    torch.manual_seed(seed)
    ddp = DDP(MLP().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    state = attach_hook(ddp, hook, **(hook_opts or {}))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    x, y = _data(True, train_limit, dataset)
    sampler = DistributedSampler(range(len(x)), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed, drop_last=True)
    loader = TensorLoader(x, y, batch_size=batch_size, sampler=sampler, drop_last=True)
    total_steps = max(1, math.ceil(epochs * len(loader)))
    step_s, step_bytes, losses = [], [], []
    step = 0
    with AllReduceCounter() as counter:
        while step < total_steps:
            sampler.set_epoch(step // len(loader))
            for xb, yb in loader:
                if step == total_steps:
                    break
                xb, yb = xb.to(device), yb.to(device)
                before = counter.bytes
                synchronize(device)
                t0 = time.perf_counter()
                loss = F.cross_entropy(ddp(xb), yb)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                synchronize(device)
                step_s.append(time.perf_counter() - t0)
                step_bytes.append(counter.bytes - before)
                losses.append(loss.item())
                step += 1
                if log_every and rank == 0 and step % log_every == 0:
                    print(f"  [{hook} seed {seed}] step {step}/{total_steps} "
                          f"loss {statistics.fmean(losses[-log_every:]):.3f}", flush=True)
    xt, yt = _data(False, test_limit, dataset)
    test_loss, accuracy = evaluate(ddp.module, xt, yt, device)
    if hook == "none":  # DDP's C++ all-reduce: count the same buckets through a Python hook
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        with AllReduceCounter() as counter:
            # a batch of the last epoch (the loop may have fetched one more, on the CPU, and broken)
            F.cross_entropy(ddp(xb.to(device)), yb.to(device)).backward()
        optimizer.zero_grad(set_to_none=True)
        step_bytes = [counter.bytes] * len(step_bytes)  # every step sends the same buckets
    return {"rank": rank, "hook": hook, "seed": seed, "steps": total_steps, "losses": losses,
            "test_loss": test_loss, "accuracy": accuracy,
            "step_s": statistics.median(step_s[1:] or step_s),
            "bytes_per_step": step_bytes[-1], "bytes_first_step": step_bytes[0],
            "predicted_bytes": predicted_bytes(ddp.module, hook, **(
                {"rank": state.matrix_approximation_rank,
                 "compressed": total_steps > state.start_powerSGD_iter}
                if hook == "powersgd" else {})),
            "params": [p.detach().cpu().clone() for p in ddp.module.parameters()]
            if train_limit is not None and train_limit <= 4096 else None}


# --- given: the CLI --------------------------------------------------------------------------------

def mean_ci(values: list[float], positive: bool = False) -> dict:
    """Mean and 95% t-interval over seeds (``lo``/``hi`` None from a single seed). With
    ``positive`` (times): the geometric mean and a t-interval on the logarithms, which never
    goes below zero (``dpt.stats.positive_ci``)."""
    mean, lo, hi = (stats.positive_ci if positive else stats.mean_ci)(values)
    return {"mean": mean, "lo": lo, "hi": hi, "values": values}


def summarize(results: dict[str, list[list[dict]]]) -> list[dict]:
    """Per hook, over seeds: bytes per step (the same every seed), and the step time (each
    seed's slower rank), test accuracy and loss, each as mean and 95% interval (the step
    time's a geometric mean, its interval on log times: never below zero)."""
    rows = []
    for hook, runs in results.items():
        rows.append({
            "hook": hook, "seeds": len(runs), "steps": runs[0][0]["steps"],
            "bytes_per_step": mean_ci([ranks[0]["bytes_per_step"] for ranks in runs]),
            "predicted_bytes": runs[0][0]["predicted_bytes"],
            "step_ms": mean_ci([1000 * max(r["step_s"] for r in ranks) for ranks in runs],
                               positive=True),
            "accuracy": mean_ci([100 * ranks[0]["accuracy"] for ranks in runs]),
            "test_loss": mean_ci([ranks[0]["test_loss"] for ranks in runs])})
    return rows


def _ci(d: dict, fmt: str) -> str:
    if d["lo"] is None:
        return format(d["mean"], fmt)
    return f"{d['mean']:{fmt}} [{d['lo']:{fmt}}, {d['hi']:{fmt}}]"


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'hook':<13} {'KiB/step (predicted)':>21} {'step ms [95% CI]':>24} "
             f"{'test accuracy % [95% CI]':>26}"]
    for r in rows:
        kib = f"{r['bytes_per_step']['mean'] / 1024:.1f} ({r['predicted_bytes'] / 1024:.1f})"
        lines.append(f"{r['hook']:<13} {kib:>21} {_ci(r['step_ms'], '.3f'):>24} "
                     f"{_ci(r['accuracy'], '.2f'):>26}")
    return "\n".join(lines)


def run_hooks(hooks, seeds: int, epochs: float, nproc: int, timeout: float = 600,
              powersgd: dict | None = None, backend: str = "auto", rotate: bool = False,
              **kwargs) -> dict[str, list[list[dict]]]:
    """Every hook for each seed, each in fresh processes (:func:`train_worker`, ``kwargs``
    passed on). A hook is a name (``powersgd`` takes the options ``powersgd``) or a
    ``(label, name, options)`` triple, results keyed by label. Seeds outermost, so a drift of
    the machine's speed spreads over every hook alike; ``rotate`` also turns the order of the
    hooks by one each seed."""
    from dpt.ranks import run_distributed

    runs = [h if isinstance(h, tuple) else (h, h, powersgd if h == "powersgd" else None)
            for h in hooks]
    results: dict[str, list] = {label: [] for label, _, _ in runs}
    for seed in range(seeds):
        k = seed % len(runs) if rotate else 0
        for label, hook, opts in runs[k:] + runs[:k]:
            t0 = time.perf_counter()
            ranks = run_distributed(train_worker, world_size=nproc, timeout=timeout, echo=False,
                                    backend=backend, kwargs={"hook": hook, "seed": seed,
                                                             "epochs": epochs,
                                                             "hook_opts": opts, **kwargs})
            for r in ranks:
                r.pop("params", None)
                r["losses"] = r["losses"][-50:]
            results[label].append(ranks)
            print(f"  {label} seed {seed}: accuracy {100 * ranks[0]['accuracy']:.2f}%, "
                  f"{1000 * max(r['step_s'] for r in ranks):.2f} ms/step, "
                  f"{ranks[0]['bytes_per_step']} B/step ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hooks", nargs="+", default=list(HOOKS), metavar="HOOK",
                    help=f"any of {', '.join(HOOKS)}")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--powersgd-rank", type=int, default=POWERSGD_DEFAULTS["rank"])
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    try:
        bad = [h for h in args.hooks if h not in HOOKS]
        if bad:
            raise ValueError(f"unknown hook {bad[0]!r}; choose from {', '.join(HOOKS)}")
        if args.seeds < 1 or args.nproc < 1 or not 0 < args.epochs <= 100:
            raise ValueError("--seeds and --nproc must be at least 1, --epochs in (0, 100]")
        if "bf16" in args.hooks and not torch_bf16_registers():
            print("note: this torch has no CUDA/NCCL 2.10+, and DDP refuses torch's bf16 hook "
                  "on it: skipping bf16 (bf16_by_hand runs)", file=sys.stderr)
            args.hooks = [h for h in args.hooks if h != "bf16"]
        raw = run_hooks(args.hooks, args.seeds, args.epochs, args.nproc, args.timeout,
                        powersgd={"rank": args.powersgd_rank})
    except (ValueError, RuntimeError, OSError, ImportError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    from dpt.ranks import placement

    print(f"{args.nproc} rank(s), {placement(args.nproc).label}:")
    print(format_rows(summarize(raw)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
