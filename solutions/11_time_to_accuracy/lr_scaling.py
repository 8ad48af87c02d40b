"""Lesson 11: the learning rate a larger global batch needs, and how many steps it saves.

N ranks at a per-rank batch b train on a global batch B = N b: each step averages N times
more samples, so the gradient is less noisy, but an epoch has N times fewer steps. Keep the
learning rate of the small batch and the model moves N times less per epoch: throughput went
up, time to accuracy did not. Goyal et al. 2017 ("Accurate, Large Minibatch SGD: Training
ImageNet in 1 Hour", arXiv 1706.02677) give the two rules that fix it for SGD:

- **linear scaling**: when the batch grows k times, multiply the learning rate by k::

      lr(B) = base_lr * B / B0

  (k small steps of lr on k batches ~ one step of k*lr on their union, while the gradient
  changes little over those k steps). A milder rule, ``sqrt``, multiplies by sqrt(B / B0)
  (it keeps the variance of the update equal; common with Adam);
- **gradual warmup**: the scaled lr is too large while the weights still change fast, so
  the first W steps ramp it linearly from base_lr to the scaled (peak) lr::

      lr(step) = base_lr + (peak_lr - base_lr) * step / W     for step < W,  peak_lr after.

Linear scaling stops paying at some batch. McCandlish et al. 2018 ("An Empirical Model of
Large-Batch Training", arXiv 1812.06162) model the steps S and samples E to a target as::

      S = S_min * (1 + B_noise / B)          E = E_min * (1 + B / B_noise)

Below the *critical batch* B_crit ~ B_noise, doubling B nearly halves the steps (perfect
scaling: more ranks, less time); far above it the steps stay near S_min and the extra
samples are wasted (more ranks, same time). S is linear in 1/B, so a least-squares line of
measured steps on 1/B gives S_min (its intercept) and B_noise (slope / intercept).

Your tasks:

- 11.6 :func:`scaled_lr`: the learning rate for a global batch, by rule;
- 11.7 :func:`warmup_lr`: Goyal et al.'s linear warmup, step by step;
- 11.8 :func:`train_to_target`: train until an evaluation reaches a target; report the steps,
  samples and seconds it took (the *time to accuracy*, MLPerf's measure);
- 11.9 :func:`critical_batch`: S_min and B_crit from measured steps at several batches.

Given: :func:`lr_schedule` puts 11.6 and 11.7 together into the ``lr_at(step)`` that 11.8
takes. The CLI prints the learning rate of the first steps at a few global batches::

    .venv/bin/python solutions/11_time_to_accuracy/lr_scaling.py
    .venv/bin/python solutions/11_time_to_accuracy/lr_scaling.py --batches 64 512 4096 --rule sqrt
"""

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

RULES = ("linear", "sqrt", "none")


# --- 11.6 the learning rate of a larger batch -----------------------------------------------

def scaled_lr(base_lr: float, base_batch: int, global_batch: int, rule: str = "linear"
              ) -> float:
    """The learning rate for ``global_batch`` when ``base_lr`` suits ``base_batch``.

    ``rule``: ``"linear"`` multiplies by global_batch / base_batch (Goyal et al.), ``"sqrt"``
    by its square root, ``"none"`` keeps base_lr. Any other rule, a batch below 1 or a
    learning rate that is not positive: ValueError. The ratio is a float: 96 / 64 is 1.5.
    """
    if rule not in RULES:
        raise ValueError(f"unknown scaling rule {rule!r}; choose from {', '.join(RULES)}")
    if base_batch < 1 or global_batch < 1:
        raise ValueError(f"batch sizes must be at least 1, got base {base_batch} and "
                         f"global {global_batch}")
    if not base_lr > 0:
        raise ValueError(f"the base learning rate must be positive, got {base_lr}")
    # BEGIN SOLUTION 11.6: k = global / base batch (a float); linear multiplies the lr by k, sqrt by the square root of k, none by 1
    k = global_batch / base_batch
    if rule == "linear":
        return base_lr * k
    if rule == "sqrt":
        return base_lr * math.sqrt(k)
    return base_lr
    # END SOLUTION


# --- 11.7 gradual warmup -------------------------------------------------------------------

def warmup_lr(step: int, base_lr: float, peak_lr: float, warmup_steps: int) -> float:
    """The learning rate of step ``step`` (0 is the first) under a linear warmup.

    Step 0 uses ``base_lr``; the lr grows by (peak_lr - base_lr) / warmup_steps a step and is
    ``peak_lr`` from step ``warmup_steps`` on. ``warmup_steps`` 0: peak_lr from the start.
    A negative step or warmup: ValueError.
    """
    if step < 0 or warmup_steps < 0:
        raise ValueError(f"step and warmup_steps must be at least 0, got {step} and "
                         f"{warmup_steps}")
    # BEGIN SOLUTION 11.7: before warmup_steps, move from base_lr towards peak_lr by the fraction step / warmup_steps; from then on (or with no warmup) peak_lr
    if step >= warmup_steps:
        return peak_lr
    return base_lr + (peak_lr - base_lr) * step / warmup_steps
    # END SOLUTION


def lr_schedule(base_lr: float, base_batch: int, global_batch: int, rule: str = "linear",
                warmup_steps: int = 0) -> Callable[[int], float]:
    """``lr_at(step)``: warm up from ``base_lr`` to ``scaled_lr(...)`` over ``warmup_steps``."""
    peak = scaled_lr(base_lr, base_batch, global_batch, rule)
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be at least 0, got {warmup_steps}")

    def lr_at(step: int) -> float:
        return warmup_lr(step, base_lr, peak, warmup_steps)

    return lr_at


# --- 11.8 time to accuracy -----------------------------------------------------------------

def train_to_target(model: nn.Module, optimizer: torch.optim.Optimizer,
                    batches: Iterable, lr_at: Callable[[int], float] | None,
                    evaluate: Callable[[], float], target: float, eval_every: int,
                    max_steps: int, loss_fn: Callable | None = None) -> dict:
    """Train ``model`` until ``evaluate()`` reaches ``target``, at most ``max_steps`` steps.

    ``batches``: ``(x, y)`` pairs already on the model's device, iterated again (a new epoch)
    each time it ends (a list, a DataLoader, a ``dpt.data.TensorLoader``; a generator, which
    cannot restart, raises ValueError once spent). Step ``s`` (0, 1, ...) first sets every
    param group's ``"lr"`` to ``lr_at(s)`` (``lr_at`` None: the optimizer's lr stays), then
    zeroes the gradients, computes ``loss_fn(model(x), y)`` (None: cross-entropy),
    backpropagates and steps.
    ``evaluate()`` (no arguments; it may put the model in eval mode: training puts it back)
    runs after every ``eval_every`` steps, and after step ``max_steps`` if that is not one of
    them; training stops at the first evaluation >= ``target``. With several ranks,
    ``evaluate`` must return the same value on all of them (all-reduce it), so that they stop
    at the same step.

    Returns a dict: ``steps`` (taken), ``samples`` (their rows, this process's), ``seconds``
    (wall time of training and evaluations), ``reached`` (bool), ``accuracy`` (the last
    evaluation), ``evals`` (``[(step, value), ...]``) and ``lr`` (the last step's lr).
    """
    if eval_every < 1 or max_steps < 1:
        raise ValueError(f"eval_every and max_steps must be at least 1, got {eval_every} "
                         f"and {max_steps}")
    loss_fn = F.cross_entropy if loss_fn is None else loss_fn
    steps = samples = 0
    evals: list[tuple[int, float]] = []
    reached = False
    start = time.perf_counter()
    model.train()
    while steps < max_steps and not reached:
        epoch_steps = 0
        for x, y in batches:
            # BEGIN SOLUTION 11.8: the lr of this step goes into every param group first; then one ordinary step; count it; evaluate when due (and put the model back in train mode); stop once the target is reached
            if lr_at is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(steps)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            steps += 1
            samples += len(x)
            if steps % eval_every == 0 or steps == max_steps:
                value = float(evaluate())
                evals.append((steps, value))
                model.train()
                reached = value >= target
            # END SOLUTION
            epoch_steps += 1
            if reached or steps >= max_steps:
                break
        if epoch_steps == 0:
            raise ValueError("batches gave no batch: pass something that can be iterated "
                             "again each epoch (a list, a DataLoader), not a spent generator")
    return {"steps": steps, "samples": samples, "seconds": time.perf_counter() - start,
            "reached": reached, "accuracy": evals[-1][1] if evals else None, "evals": evals,
            "lr": optimizer.param_groups[0]["lr"]}


# --- 11.9 the critical batch ------------------------------------------------------------------

def critical_batch(batches: Sequence[float], steps: Sequence[float]) -> tuple[float, float]:
    """``(s_min, b_crit)`` from the steps to a target measured at several global batches.

    Fits McCandlish et al.'s ``S = S_min + S_min * B_noise / B`` by least squares of the
    steps on 1 / B: the intercept is S_min, slope / intercept is B_noise (~ B_crit). Needs at
    least two different batches; a fit whose S_min is not positive (steps that do not level
    off) raises ValueError. A negative b_crit means the steps grew with B: no noise scale here.
    """
    if len(batches) != len(steps):
        raise ValueError(f"{len(batches)} batches but {len(steps)} step counts")
    if any(not b > 0 for b in batches) or any(not s > 0 for s in steps):
        raise ValueError("batches and steps must be positive")
    if len(set(batches)) < 2:
        raise ValueError("the fit needs steps at two different batch sizes at least")
    # BEGIN SOLUTION 11.9: a straight line of steps against 1/B: its intercept is S_min, its slope S_min * B_noise
    slope, intercept = statistics.linear_regression([1 / b for b in batches],
                                                    [float(s) for s in steps])
    s_min, b_crit = intercept, (slope / intercept if intercept > 0 else math.nan)
    # END SOLUTION
    if not s_min > 0:
        raise ValueError(f"the fit gives S_min = {s_min:.3g} <= 0: the steps do not level "
                         "off over these batches (add larger ones)")
    return s_min, b_crit


# --- the command line ---------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-lr", type=float, default=0.05)
    ap.add_argument("--base-batch", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024, 4096],
                    metavar="B", help="global batches to show")
    ap.add_argument("--rule", default="linear", choices=RULES)
    ap.add_argument("--warmup", type=int, default=4, help="warmup steps")
    ap.add_argument("--steps", type=int, default=6, help="steps to print")
    args = ap.parse_args(argv)
    try:
        if args.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {args.steps}")
        schedules = {b: lr_schedule(args.base_lr, args.base_batch, b, args.rule, args.warmup)
                     for b in args.batches}
        rows = [[f"{schedules[b](s):.4g}" for b in args.batches] for s in range(args.steps)]
    except (ValueError, NotImplementedError) as exc:
        from dpt.errors import report_error

        return report_error(exc)
    print(f"lr per step: base lr {args.base_lr:g} at batch {args.base_batch}, rule "
          f"{args.rule}, {args.warmup} warmup steps")
    width = max(8, *(len(c) for r in rows for c in r))
    print("step  " + "  ".join(f"B={b}".rjust(width) for b in args.batches))
    for s, row in enumerate(rows):
        print(f"{s:>4}  " + "  ".join(c.rjust(width) for c in row))
    if args.steps > args.warmup:
        print("...   (every later step: the last row)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
