"""Lesson 10: a hang clinic. Five hangs that data-parallel code gets by accident, and their cures.

A collective (``all_reduce``, ``broadcast``, ``all_gather``, ``barrier``, DDP's gradient
all-reduce) completes only when **every rank of the group calls it, in the same order, with
matching tensors**. Each rank numbers its collectives 1, 2, 3, ... and the n-th call of one
rank meets the n-th call of every other. When one rank calls something else, or nothing, the
others wait; on gloo until the group's timeout, on NCCL until the watchdog aborts, and without
a timeout forever. Sometimes nothing waits at all: two calls of different sizes can "succeed"
with garbage, or kill a process from inside gloo.

The five patients (each a broken function, given, and a fixed one, which you write):

==========  ==========================================================================
order       two helpers that call collectives, called in a rank-dependent order
rank0       a mean loss for the log, computed with an ``all_reduce`` inside ``if rank == 0``
shapes      evaluation predictions gathered with ``all_gather`` when the ranks hold
            different numbers of samples
uneven      DDP training where the ranks have different numbers of batches (cure: ``Join``)
nonfinite   a rank that skips its step when its own loss is not finite
==========  ==========================================================================

For each case you run the broken code under a tool (``hang_runner.py`` explains them: the
short ``timeout``, ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, the ``flight`` recorder, ``stacks``),
read the report, write the **diagnosis** (the cause, the tool, and a line of its report that
shows it), then write the fix::

    .venv/bin/python solutions/10_inside_a_step/hang_clinic.py --case order --tool detail
    .venv/bin/python solutions/10_inside_a_step/hang_clinic.py --case order --fixed
    .venv/bin/python solutions/10_inside_a_step/hang_clinic.py --check    # every case

Nothing here can hang your machine: every run has a 3 s process-group timeout and a hard
deadline, after which its processes are killed.
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import enum
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hang_runner import TOOLS, Report, evidence_found, run_ranks
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

LR = 0.1
BATCHES = 3  # batches of the rank with the fewest (uneven, nonfinite)
BAD_STEP = 1  # the step at which rank 1 meets a sample with a NaN (nonfinite)


# --- the diagnosis you write for each case ---------------------------------------------------

class Cause(enum.Enum):
    ORDER = "the ranks call the same collectives in a different order"
    RANK_BRANCH = "a collective sits in a branch that only some ranks take (if rank == 0)"
    SHAPES = "the ranks give one collective tensors of different shapes"
    UNEVEN = "the ranks have different numbers of batches: one runs steps the others do not"
    LOCAL_SKIP = "a rank skips a collective on a condition only it sees"


@dataclass(frozen=True)
class Diagnosis:
    cause: Cause
    tool: str  # the tool whose report you read: one of hang_runner.TOOLS
    evidence: str  # a line (or part of one) copied from that tool's report on the broken code


# --- shared pieces of the cases (given) ------------------------------------------------------

def make_model() -> nn.Module:
    """The same small regression model on every rank."""
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: 3 samples, the same on every run."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def uneven_batches(rank: int) -> list:
    """Rank r holds BATCHES + r batches: a dataset that does not split evenly."""
    return [batch(rank, step) for step in range(BATCHES + rank)]


def nonfinite_batches(rank: int) -> list:
    """BATCHES batches per rank; rank 1's batch BAD_STEP holds a corrupt sample (a NaN)."""
    batches = [batch(rank, step) for step in range(BATCHES)]
    if rank == 1:
        batches[BAD_STEP][0][0, 0] = float("nan")
    return batches


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def average_gradients(model: nn.Module, world_size: int) -> None:
    """Lesson 05's gradient averaging: one all_reduce per parameter."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size


def sgd_step(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
            p.grad = None


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


# --- case "order": two helpers, called in a rank-dependent order -----------------------------

def share_settings(settings: torch.Tensor) -> None:
    """Rank 0 read the run's settings (learning rate, warmup) from a file: it sends them."""
    dist.broadcast(settings, src=0)


def average_metrics(metrics: torch.Tensor, world_size: int) -> None:
    """Every rank's (loss, accuracy), averaged over the ranks."""
    dist.all_reduce(metrics)
    metrics /= world_size


def order_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    settings = torch.tensor([0.1, 100.0]) if rank == 0 else torch.zeros(2)
    metrics = torch.tensor([2.0 + rank, 0.5 + 0.1 * rank])
    return settings, metrics


def order_broken(rank: int, world_size: int):
    settings, metrics = order_inputs(rank)
    if rank == 0:  # rank 0 has the settings at hand: it shares them first
        share_settings(settings)
        average_metrics(metrics, world_size)
    else:  # the others have nothing to share: they average their metrics first
        average_metrics(metrics, world_size)
        share_settings(settings)
    return settings, metrics


def order_fixed(rank: int, world_size: int):
    settings, metrics = order_inputs(rank)
    # BEGIN SOLUTION 10.11: call the two helpers so that every rank's collectives line up
    share_settings(settings)
    average_metrics(metrics, world_size)
    # END SOLUTION
    return settings, metrics


def diagnose_order() -> Diagnosis:
    # BEGIN SOLUTION 10.11: run the broken case with a tool and copy the line that shows the cause
    return Diagnosis(Cause.ORDER, tool="detail",
                     evidence="Rank 0 is running collective: CollectiveFingerPrint("
                              "SequenceNumber=0, OpType=BROADCAST")
    # END SOLUTION


# --- case "rank0": a collective inside `if rank == 0` -------------------------------------------

def epoch_losses(rank: int) -> torch.Tensor:
    """The losses of this rank's batches in the last epoch (rank 1 ran one more batch)."""
    return torch.arange(1.0, 4.0 + rank) / (rank + 1)


def mean_loss(losses: torch.Tensor) -> float:
    """The mean over every rank's losses: sum and count all-reduced together."""
    total = torch.stack([losses.sum(), torch.tensor(float(losses.numel()))])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def rank0_broken(rank: int, world_size: int):
    losses = epoch_losses(rank)
    mean = None
    if rank == 0:  # only rank 0 logs, so only rank 0 computes what it logs
        mean = mean_loss(losses)
        print(f"epoch mean loss {mean:.4f}")
    dist.barrier()  # everyone waits while rank 0 writes the checkpoint
    return mean


def rank0_fixed(rank: int, world_size: int):
    losses = epoch_losses(rank)
    mean = None
    # BEGIN SOLUTION 10.12: every rank takes part in the mean; rank 0 alone prints it
    mean = mean_loss(losses)
    if rank == 0:
        print(f"epoch mean loss {mean:.4f}")
    # END SOLUTION
    dist.barrier()
    return mean


def diagnose_rank0() -> Diagnosis:
    # BEGIN SOLUTION 10.12: run the broken case with a tool and copy the line that shows the cause
    return Diagnosis(Cause.RANK_BRANCH, tool="stacks",
                     evidence='File "hang_clinic.py", line 184 in mean_loss')
    # END SOLUTION


# --- case "shapes": all_gather of predictions of different lengths --------------------------

def eval_predictions(rank: int, world_size: int) -> torch.Tensor:
    """This rank's predicted classes on its part of a 7-sample evaluation set (4 + 3 on 2 ranks:
    a sampler without padding)."""
    mine = range(rank, 7, world_size)
    return torch.tensor([(3 * i) % 5 for i in mine], dtype=torch.float32)


def shapes_broken(rank: int, world_size: int):
    preds = eval_predictions(rank, world_size)
    gathered = [torch.empty_like(preds) for _ in range(world_size)]
    dist.all_gather(gathered, preds)
    return torch.cat(gathered)


def gather_predictions(preds: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's 1-D ``preds``, whatever their lengths, concatenated in rank order."""
    # BEGIN SOLUTION 10.13: share the lengths, pad to the longest, all_gather, cut the padding off
    length = torch.tensor([preds.numel()])
    lengths = [torch.zeros_like(length) for _ in range(world_size)]
    dist.all_gather(lengths, length)
    longest = max(int(n) for n in lengths)
    padded = F.pad(preds, (0, longest - preds.numel()))
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[: int(n)] for g, n in zip(gathered, lengths)])
    # END SOLUTION


def shapes_fixed(rank: int, world_size: int):
    return gather_predictions(eval_predictions(rank, world_size), world_size)


def diagnose_shapes() -> Diagnosis:
    # BEGIN SOLUTION 10.13: run the broken case with a tool and copy the line that shows the cause
    return Diagnosis(Cause.SHAPES, tool="detail",
                     evidence="OpType=ALLGATHER, TensorShape=[3]")
    # END SOLUTION


# --- case "uneven": DDP on a dataset that does not split evenly -----------------------------

def ddp_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """One step of DDP training (its backward all-reduces the gradients); the samples used."""
    loss_fn(model, x, y).backward()
    sgd_step(model)
    return len(x)


def uneven_broken(rank: int, world_size: int):
    model = DDP(make_model())
    seen = 0
    for x, y in uneven_batches(rank):
        seen += ddp_step(model, x, y)
    dist.barrier()  # wait for everyone before rank 0 saves the model
    return seen, flat_params(model)


def uneven_fixed(rank: int, world_size: int):
    model = DDP(make_model())
    seen = 0
    # BEGIN SOLUTION 10.14: train on all of this rank's batches under Join, DDP's cure for this
    with Join([model]):
        for x, y in uneven_batches(rank):
            seen += ddp_step(model, x, y)
    # END SOLUTION
    dist.barrier()
    return seen, flat_params(model)


def diagnose_uneven() -> Diagnosis:
    # BEGIN SOLUTION 10.14: run the broken case with a tool and copy the line that shows the cause
    return Diagnosis(Cause.UNEVEN, tool="stacks",
                     evidence='File "hang_clinic.py", line 262 in ddp_step')
    # END SOLUTION


# --- case "nonfinite": a rank that skips its step on its own ----------------------------------

def nonfinite_broken(rank: int, world_size: int):
    model = make_model()
    steps = 0
    for x, y in nonfinite_batches(rank):
        loss = loss_fn(model, x, y)
        loss.backward()
        if not torch.isfinite(loss):  # a corrupt batch: skip the step rather than spoil the model
            model.zero_grad(set_to_none=True)
            continue
        average_gradients(model, world_size)
        sgd_step(model)
        steps += 1
    dist.barrier()
    return steps, flat_params(model)


def nonfinite_fixed(rank: int, world_size: int):
    model = make_model()
    steps = 0
    for x, y in nonfinite_batches(rank):
        loss = loss_fn(model, x, y)
        loss.backward()
        # BEGIN SOLUTION 10.15: decide together: skip the step on every rank if any rank's loss is bad
        bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0])
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() > 0:
            model.zero_grad(set_to_none=True)
            continue
        # END SOLUTION
        average_gradients(model, world_size)
        sgd_step(model)
        steps += 1
    dist.barrier()
    return steps, flat_params(model)


def diagnose_nonfinite() -> Diagnosis:
    # BEGIN SOLUTION 10.15: run the broken case with a tool and copy the line that shows the cause
    return Diagnosis(Cause.LOCAL_SKIP, tool="detail",
                     evidence="Rank 0 is running collective: CollectiveFingerPrint("
                              "SequenceNumber=4, OpType=ALLREDUCE")
    # END SOLUTION


# --- the clinic's register and command line --------------------------------------------------

CASES = {  # name: (broken, fixed, diagnosis)
    "order": (order_broken, order_fixed, diagnose_order),
    "rank0": (rank0_broken, rank0_fixed, diagnose_rank0),
    "shapes": (shapes_broken, shapes_fixed, diagnose_shapes),
    "uneven": (uneven_broken, uneven_fixed, diagnose_uneven),
    "nonfinite": (nonfinite_broken, nonfinite_fixed, diagnose_nonfinite),
}
NO_DETAIL = {"uneven"}  # DDP segfaults under TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo (torch 2.14)


def run_case(case: str, fixed: bool = False, tool: str = "timeout", world_size: int = 2,
             timeout_s: float = 3.0, wall_s: float | None = None) -> Report:
    """Run ``case`` (broken, or ``fixed``) on ``world_size`` gloo ranks with ``tool``, through
    ``hang_runner.run_ranks``: it never hangs (the process group gives up after ``timeout_s``,
    every rank is killed after ``wall_s``). Raises the task's ``NotImplementedError`` when the
    ranks reached a task not done yet."""
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}: choose one of {', '.join(CASES)}")
    if tool == "detail" and case in NO_DETAIL:
        raise ValueError(f"case {case!r} uses DDP, which crashes under TORCH_DISTRIBUTED_DEBUG="
                         "DETAIL on gloo (a segfault in torch 2.14): use --tool flight or stacks")
    return run_ranks(CASES[case][1 if fixed else 0],
                     f"case {case} ({'fixed' if fixed else 'broken'})", tool=tool,
                     world_size=world_size, timeout_s=timeout_s, wall_s=wall_s)


def check_case(case: str, world_size: int = 2, timeout_s: float = 3.0) -> list[str]:
    """Grade one case as the tests do: the diagnosis's evidence is in its tool's report on the
    broken code, and the fixed code finishes. One line per finding."""
    diagnosis = CASES[case][2]()
    lines = [f"{case}: diagnosis {diagnosis.cause.name} with tool {diagnosis.tool}"]
    broken = run_case(case, fixed=False, tool=diagnosis.tool, world_size=world_size,
                      timeout_s=timeout_s)
    found = evidence_found(diagnosis.evidence, broken.text)
    lines.append(f"  broken: {'finished (!)' if broken.finished else 'failed, as it should'}; "
                 f"evidence {'found' if found else 'NOT found'} in its {diagnosis.tool} report")
    fixed = run_case(case, fixed=True, world_size=world_size, timeout_s=timeout_s)
    lines.append(f"  fixed: {'finished' if fixed.finished else 'FAILED'} "
                 f"in {fixed.seconds:.1f} s")
    if not fixed.finished:
        lines.append(fixed.text)
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=list(CASES), help="the case to run")
    parser.add_argument("--fixed", action="store_true", help="run your fix, not the broken code")
    parser.add_argument("--tool", choices=TOOLS, default="timeout",
                        help="the diagnostic tool (default: timeout)")
    parser.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--timeout", type=float, default=3.0,
                        help="process-group timeout in seconds (default 3)")
    parser.add_argument("--check", action="store_true",
                        help="check your diagnosis and fix of --case, or of every case")
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error("--ranks must be at least 2: a hang needs two ranks")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    import hang_clinic  # this file by name (also when run as a script): the ranks import it

    if args.check:
        failed = []
        for case in [args.case] if args.case else list(CASES):
            print(f"checking {case} ...", flush=True)
            try:
                lines = hang_clinic.check_case(case, args.ranks, args.timeout)
            except NotImplementedError as e:
                print(f"  skipped: {e}")
                failed.append(case)
                continue
            print("\n".join(lines))
            if any("NOT found" in line or "FAILED" in line or "(!)" in line for line in lines):
                failed.append(case)
        if failed:
            sys.exit(f"not passed yet: {', '.join(failed)}")
        print("every case checked: diagnosed and fixed")
        return
    if args.case is None:
        parser.error("give --case (or --check)")
    try:
        report = hang_clinic.run_case(args.case, fixed=args.fixed, tool=args.tool,
                                      world_size=args.ranks, timeout_s=args.timeout)
    except ValueError as e:
        sys.exit(f"error: {e}")
    except NotImplementedError as e:
        sys.exit(f"error: {e} (not done yet: write it in hang_clinic.py)")
    print(report.text)
    print(f"=== {'every rank finished' if report.finished else 'it did not finish'} "
          f"({report.seconds:.1f} s) ===")


if __name__ == "__main__":
    main()
