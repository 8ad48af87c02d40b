"""Lesson 11, tasks 11.1 and 11.2: N ranks x 1 micro-batch = 1 process x N micro-batches =
1 process on the global batch.

11.1 runs in this process. 11.2 runs twice: here, one process accumulating ``ACCUM``
micro-batches, and on ``N`` ranks under DDP (one launch, every run in it), each against one
process stepping on the whole batch, computed here by the test's own code. When a result is
wrong the test computes the usual mistakes too and names the one it matches: gradients
``ACCUM`` times too large (no division), only the last micro-batch's gradient (zeroed in the
loop), ranks that never synchronise. AdamW divides by the gradient's own size, so the missing
division shows under SGD only; AdamW is checked for the rest.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import checked_part, ranks_or_fail
from tests.l11_time_to_accuracy import rank_fns_global_batch as rf
from tests.lessons import load
from tests.references import put

LESSON = rf.LESSON
TIMEOUT = 250
ATOL = {"sgd": 1e-6, "adamw": 1e-5}  # float32 sums in another order, 5 steps


@pytest.fixture(scope="module")
def ddp_runs():
    return ranks_or_fail(rf.accumulation_checks, rf.N, timeout=TIMEOUT)


# --- the test's own references: the whole batch, and the usual mistakes -----------------------

def whole_batch(optimizer: str, scale: float = 1.0, last_only: int = 0) -> list[torch.Tensor]:
    """One process stepping once per global batch. ``scale`` multiplies the loss (the
    gradient); ``last_only`` = K: the gradient is that of the last of K micro-batches over K."""
    model = rf.tiny_model()
    opt = rf.make_optimizer(optimizer, model.parameters())
    for x, y in rf.global_batches():
        if last_only:
            size = len(x) // last_only
            x, y = x[-size:], y[-size:]
            scale = 1 / last_only
        opt.zero_grad(set_to_none=True)
        (scale * F.cross_entropy(model(x), y)).backward()
        opt.step()
    return rf.params_of(model)


def largest_gap(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def equal(a, b, optimizer: str) -> bool:
    return largest_gap(a, b) <= ATOL[optimizer]


def diagnose(got, optimizer: str, accum: int, who: str) -> str | None:
    """None when ``got`` is the whole batch's weights, else what it is."""
    want = whole_batch(optimizer)
    if equal(got, want, optimizer):
        return None
    if accum > 1 and equal(got, whole_batch(optimizer, scale=accum), optimizer):
        return (f"{who}: the gradients are {accum} times too large: divide each micro-batch's "
                f"loss by their count ({accum}), so that the sum is the mean")
    if accum > 1 and equal(got, whole_batch(optimizer, last_only=accum), optimizer):
        return (f"{who}: only the last micro-batch's gradient survives: zero the gradients "
                "once, before the loop (backward adds into .grad)")
    return (f"{who}: the weights are not those of one process stepping on the whole global "
            f"batch (largest gap {largest_gap(got, want):.3g} after {rf.STEPS} {optimizer} "
            "steps): zero once, divide each loss by the number of micro-batches, step once")


def one_process(optimizer: str, accum: int, monkeypatch) -> list[torch.Tensor]:
    """The lesson's accumulation_step in this process, ``accum`` micro-batches per step."""
    put(LESSON, ["11.1"], monkeypatch.setattr)
    gb = load(LESSON, "global_batch")
    model = rf.tiny_model()
    opt = rf.make_optimizer(optimizer, model.parameters())
    for x, y in rf.global_batches():
        gb.accumulation_step(model, opt, gb.micro_batches(x, y, 0, 1, accum), F.cross_entropy)
    return rf.params_of(model)


def check_optimizer(optimizer: str, ddp_runs, monkeypatch) -> None:
    for accum in (rf.ACCUM, 2 * rf.ACCUM):
        wrong = diagnose(one_process(optimizer, accum, monkeypatch), optimizer, accum,
                         f"1 process x {accum} micro-batches")
        if wrong:
            pytest.fail(wrong, pytrace=False)
    for accum in (1, rf.ACCUM):
        runs = [checked_part(res[f"{optimizer} x{accum}"]) for res in ddp_runs]
        who = f"{rf.N} ranks x {accum} micro-batch(es) under DDP"
        gap = max(largest_gap(r["params"], runs[0]["params"]) for r in runs)
        if gap > 0:
            pytest.fail(f"{who}: the ranks differ (by up to {gap:.3g}) after {rf.STEPS} steps: "
                        "the last micro-batch must synchronise (its backward outside "
                        "no_sync, so DDP all-reduces the accumulated gradients)",
                        pytrace=False)
        wrong = diagnose(runs[0]["params"], optimizer, accum, who)
        if wrong:
            pytest.fail(wrong, pytrace=False)


# --- 11.2 ---------------------------------------------------------------------------------------

@pytest.mark.task("11.2")
@pytest.mark.timeout(TIMEOUT + 50)
def test_accumulation_sgd_equals_n_ranks(ddp_runs, monkeypatch):
    check_optimizer("sgd", ddp_runs, monkeypatch)


@pytest.mark.task("11.2")
@pytest.mark.timeout(TIMEOUT + 50)
def test_accumulation_adamw_equals_n_ranks(ddp_runs, monkeypatch):
    check_optimizer("adamw", ddp_runs, monkeypatch)


def counts(per_step: list[dict], what: str):
    """How many ``what`` each global batch made: one number when every batch made as many,
    else the list."""
    seen = [s[what] for s in per_step]
    return seen[0] if len(set(seen)) == 1 else seen


@pytest.mark.task("11.2")
@pytest.mark.timeout(TIMEOUT + 50)
def test_accumulation_all_reduces_once_per_step(ddp_runs):
    for optimizer in rf.OPTIMIZERS:
        for accum in (1, rf.ACCUM):
            for r, res in enumerate(ddp_runs):
                per_step = checked_part(res[f"{optimizer} x{accum}"])["per_step"]
                who = f"rank {r} of {rf.N}, {accum} micro-batch(es), {optimizer}"
                steps = counts(per_step, "steps")
                assert steps == 1, (
                    f"{who}: the optimizer stepped {steps} times per global batch: step once, "
                    "after the last micro-batch")
                reduces = counts(per_step, "all_reduces")
                if reduces == 0:
                    pytest.fail(f"{who}: DDP all-reduced 0 times per step: the last "
                                "micro-batch's backward must run outside no_sync",
                                pytrace=False)
                assert reduces == 1, (
                    f"{who}: DDP all-reduced {reduces} times per step (one bucket): no_sync "
                    "on all but the last micro-batch, so the gradients are all-reduced once")


# --- 11.1 ---------------------------------------------------------------------------------------

@pytest.mark.task("11.1")
def test_micro_batches_cover_the_global_batch():
    gb = load(LESSON, "global_batch")
    g, world, accum = 24, 3, 2
    x = torch.arange(g, dtype=torch.float32).repeat_interleave(2).view(g, 2)
    y = torch.arange(g)
    seen = []
    for rank in range(world):
        micro = gb.micro_batches(x, y, rank, world, accum)
        assert len(micro) == accum, f"rank {rank}: {len(micro)} micro-batches, not {accum}"
        for i, (xb, yb) in enumerate(micro):
            assert len(xb) == len(yb) == g // (world * accum), (
                f"rank {rank}, micro-batch {i}: {len(xb)} inputs and {len(yb)} targets; each "
                f"micro-batch holds G/(N·K) = {g // (world * accum)} of both")
            assert torch.equal(xb[:, 0].long(), yb), (
                f"rank {rank}, micro-batch {i}: inputs rows {xb[:, 0].long().tolist()} with "
                f"targets {yb.tolist()}: cut x and y alike")
            seen.append(yb.tolist())
    flat = [i for rows in seen for i in rows]
    if len(set(flat)) < len(flat):
        pytest.fail(f"the ranks' micro-batches overlap ({seen}): rank r takes the r-th share "
                    f"of the global batch, rows r·G/N to (r+1)·G/N", pytrace=False)
    share = g // (world * accum)
    want = [list(range(k * share, (k + 1) * share)) for k in range(world * accum)]
    assert seen == want, (
        f"rank 0's micro-batches, then rank 1's, ...: {seen}, not {want}: rank r takes the "
        "r-th contiguous share, cut into contiguous micro-batches in order")


@pytest.mark.task("11.1")
def test_micro_batches_refuse_a_batch_that_does_not_split():
    gb = load(LESSON, "global_batch")
    x, y = torch.zeros(10, 2), torch.zeros(10)
    with pytest.raises(ValueError, match="multiple of 4"):
        gb.micro_batches(x, y, 0, 2, 2)
    assert len(gb.micro_batches(x[:8], y[:8], 1, 2, 2)) == 2
