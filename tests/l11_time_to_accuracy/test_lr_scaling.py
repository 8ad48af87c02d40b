"""Lesson 11: learning-rate scaling, warmup, time to a target, the critical batch (11.6-11.9).

One process, no data: batch ratios that tell the rules apart (4: linear x4, sqrt x2; 1.5,
which integer division turns into 1), a real ``LambdaLR`` for the warmup, a one-weight model
whose SGD trajectory is computed here by hand, a scripted ``evaluate``, and steps made
exactly from McCandlish et al.'s model for the fit. Each failure names the mistake it found.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import pytest
import torch
from torch import nn

from tests.lessons import load

LESSON = "11_time_to_accuracy"


@pytest.fixture
def lrs():
    return load(LESSON, "lr_scaling")


# --- 11.6 scaled_lr ---------------------------------------------------------------------------

@pytest.mark.task("11.6")
def test_scaled_lr_by_rule(lrs):
    base = 0.1
    got = {(rule, b): lrs.scaled_lr(base, 64, b, rule)
           for rule in ("linear", "sqrt", "none") for b in (256, 96, 16)}
    lin = got["linear", 256]
    assert lin != pytest.approx(base * 2), (
        "linear rule gave the square-root rule's lr: linear scaling multiplies lr by "
        "global/base batch (4x here), not its square root")
    assert lin == pytest.approx(base * 4, rel=1e-12), (
        f"linear, batch 64 -> 256: lr {lin}, expected {base * 4}: linear scaling multiplies lr "
        "by global/base batch (4x here)")
    assert got["linear", 96] == pytest.approx(base * 1.5, rel=1e-12), (
        f"linear, batch 64 -> 96: lr {got['linear', 96]}, expected {base * 1.5}: the ratio is "
        "96 / 64 = 1.5 (a float; 96 // 64 is 1)")
    assert got["linear", 16] == pytest.approx(base / 4, rel=1e-12), (
        "linear, batch 64 -> 16: a smaller batch divides the lr (x0.25)")
    for b, k in ((256, 4), (96, 1.5), (16, 0.25)):
        assert got["sqrt", b] == pytest.approx(base * math.sqrt(k), rel=1e-12), (
            f"sqrt, batch 64 -> {b}: lr {got['sqrt', b]}, expected {base * math.sqrt(k)} "
            f"(x sqrt({b}/64))")
        assert got["none", b] == pytest.approx(base, rel=1e-12), (
            f"rule 'none' changed the lr at batch {b}: it keeps base_lr")


def test_scaled_lr_rejects_bad_input(lrs):
    with pytest.raises(ValueError, match="unknown scaling rule 'cubic'"):
        lrs.scaled_lr(0.1, 64, 128, "cubic")
    with pytest.raises(ValueError, match="at least 1"):
        lrs.scaled_lr(0.1, 64, 0, "linear")


# --- 11.7 warmup_lr -----------------------------------------------------------------------------

@pytest.mark.task("11.7")
def test_warmup_in_a_lambda_lr(lrs):
    base, peak, w = 0.05, 0.85, 4
    delta = peak - base
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lrs.warmup_lr(s, base, peak, w))
    seen = []
    for _ in range(7):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [base, base + delta / 4, base + delta / 2, base + 3 * delta / 4, peak, peak, peak]
    if seen[0] == pytest.approx(want[1]):
        pytest.fail(f"lr per step {seen}: step 0 got the lr of step 1: step 0 uses base_lr "
                    "(Goyal et al. start from eta), off by one", pytrace=False)
    assert seen == pytest.approx(want, rel=1e-12), (
        f"lr at steps 0..6 {seen}, expected {want}: a straight line from base_lr (step 0) to "
        f"peak_lr (step {w}), flat after")


@pytest.mark.task("11.7")
def test_warmup_without_warmup_steps(lrs):
    assert lrs.warmup_lr(0, 0.1, 0.8, 0) == pytest.approx(0.8), (
        "warmup_steps 0: peak_lr from step 0 (and no division by zero)")
    assert lrs.warmup_lr(1000, 0.1, 0.8, 5) == pytest.approx(0.8), "after warmup: peak_lr"


# --- 11.8 train_to_target ---------------------------------------------------------------------

class OneWeight(nn.Module):
    """``y = w x`` with one weight; records whether each forward ran in training mode."""

    def __init__(self, w0: float):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w0, dtype=torch.float64))
        self.modes: list[bool] = []

    def forward(self, x):
        self.modes.append(self.training)
        return self.w * x


def mse(out, y):
    return ((out - y) ** 2).mean()


# batches of 2, 3, 4 and 5 rows (samples are counted, not assumed), float64
BATCHES = [(torch.linspace(0.5, 1.5, n, dtype=torch.float64),
            torch.linspace(1.0, 2.0, n, dtype=torch.float64)) for n in (2, 3, 4, 5)]


def lr_at(step: int) -> float:
    return 0.1 + 0.02 * step


def hand_sgd(w: float, steps: int) -> float:
    """Plain SGD on the mean squared error, batch after batch, lr_at(s) at step s."""
    for s in range(steps):
        x, y = (t.tolist() for t in BATCHES[s % len(BATCHES)])
        grad = sum(2 * (w * xi - yi) * xi for xi, yi in zip(x, y)) / len(x)
        w -= lr_at(s) * grad
    return w


def scripted(values, model=None):
    """An ``evaluate`` returning ``values`` one by one (it switches ``model`` to eval)."""
    it = iter(values)
    calls = []

    def evaluate():
        if model is not None:
            model.eval()
        calls.append(1)
        return next(it)

    return evaluate, calls


def run_to_target(lrs, values, target, eval_every, max_steps):
    model = OneWeight(0.3)
    opt = torch.optim.SGD(model.parameters(), lr=123.0)  # replaced by lr_at before any step
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))
    evaluate, _ = scripted(values, model)
    t0 = time.perf_counter()
    out = lrs.train_to_target(model, opt, BATCHES, lr_at, evaluate, target, eval_every,
                              max_steps, loss_fn=mse)
    return model, seen, out, time.perf_counter() - t0


def check_lrs(seen, steps):
    want = [lr_at(s) for s in range(steps)]
    if seen[:1] == [123.0] or seen[1:] == pytest.approx(want[:-1]):
        pytest.fail(f"optimizer.step() saw lr {seen[:4]}..., expected {want[:4]}...: "
                    "lr_at(step) must be set before optimizer.step(), step 0 first",
                    pytrace=False)
    assert seen == pytest.approx(want, rel=1e-12), (
        f"lr seen by each optimizer.step(): {seen}, expected lr_at(0), lr_at(1), ...: {want}")


@pytest.mark.task("11.8")
def test_train_to_target_stops_at_first_eval_reaching_it(lrs):
    model, seen, out, wall = run_to_target(lrs, [0.1, 0.3, 0.6, 0.9], target=0.5,
                                           eval_every=3, max_steps=100)
    check_lrs(seen, len(seen))
    assert len(seen) == 9, (
        f"{len(seen)} optimizer steps; evaluations after steps 3, 6, 9 give .1, .3, .6: "
        "training must stop after step 9, the first evaluation >= target")
    assert out["steps"] == 9 and out["reached"] is True, (
        f"returned steps {out['steps']}, reached {out['reached']}: expected 9 and True")
    sizes = [len(BATCHES[s % 4][0]) for s in range(9)]
    assert out["samples"] == sum(sizes), (
        f"samples {out['samples']}, expected {sum(sizes)}: the rows of every batch stepped on")
    assert out["evals"] == [(3, 0.1), (6, 0.3), (9, 0.6)], (
        f"evals {out['evals']}: evaluate after every eval_every steps")
    assert out["accuracy"] == 0.6
    assert 0 <= out["seconds"] <= wall, f"seconds {out['seconds']} outside [0, {wall:.3f}]"
    assert all(model.modes), (
        "a forward ran in eval mode: evaluate() may switch the model to eval, training must "
        "put it back in train mode")
    want = hand_sgd(0.3, 9)
    assert model.w.item() == pytest.approx(want, abs=1e-12), (
        f"weight after 9 steps {model.w.item():.12f}, plain SGD gives {want:.12f}: each step "
        "zeroes the gradients, then loss_fn(model(x), y), backward, optimizer.step()")


@pytest.mark.task("11.8")
def test_train_to_target_never_reached(lrs):
    model, seen, out, _ = run_to_target(lrs, [0.2] * 10, target=0.5, eval_every=3,
                                        max_steps=7)
    check_lrs(seen, 7)
    assert out["steps"] == 7 and out["reached"] is False, (
        f"steps {out['steps']}, reached {out['reached']}: the target is never met, so all "
        "max_steps = 7 steps run and reached is False")
    assert [s for s, _ in out["evals"]] == [3, 6, 7], (
        f"evaluated after steps {[s for s, _ in out['evals']]}: every 3 steps, and after the "
        "last step (7)")
    assert model.w.item() == pytest.approx(hand_sgd(0.3, 7), abs=1e-12)


def test_train_to_target_refuses_a_spent_generator(lrs):
    model = OneWeight(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = (b for b in BATCHES[:1])
    with pytest.raises(ValueError, match="iterated"):
        lrs.train_to_target(model, opt, gen, None, lambda: 0.0, 1.0, 5, 3, loss_fn=mse)


# --- 11.9 critical_batch -----------------------------------------------------------------------

BS = [64, 128, 256, 512, 1024, 2048, 4096]


def model_steps(s_min, b_noise):
    return [s_min * (1 + b_noise / b) for b in BS]


@pytest.mark.task("11.9")
def test_critical_batch_from_exact_steps(lrs):
    s_min, b_crit = lrs.critical_batch(BS, model_steps(100.0, 512.0))
    if not (s_min == pytest.approx(100.0, rel=1e-6) and b_crit == pytest.approx(512.0, rel=1e-6)):
        steps = model_steps(100.0, 512.0)
        slope_b, icpt_b = statistics.linear_regression(BS, steps)
        slope_i, icpt_i = statistics.linear_regression([1 / b for b in BS], steps)
        if (s_min, b_crit) == pytest.approx((icpt_b, slope_b / icpt_b), rel=1e-6):
            why = "a line of steps against B: fit steps against 1/B (S = S_min + S_min B_noise / B)"
        elif b_crit == pytest.approx(slope_i, rel=1e-6):
            why = "b_crit is the slope itself: B_noise = slope / intercept"
        else:
            why = "fit steps against 1/B: intercept S_min, slope / intercept B_crit"
        pytest.fail(f"critical_batch gave S_min {s_min:.6g}, B_crit {b_crit:.6g} for steps made "
                    f"with S_min 100, B_noise 512: {why}", pytrace=False)


def least_squares(xs, ys):
    """Intercept and slope of the least-squares line, from the normal equations."""
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return (sy - slope * sx) / n, slope


@pytest.mark.task("11.9")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_critical_batch_from_noisy_steps(lrs, seed):
    """Measured steps are noisy: every point counts (two points fit exact steps too)."""
    rng = random.Random(seed)
    steps = [s * math.exp(rng.gauss(0, 0.03)) for s in model_steps(100.0, 512.0)]
    intercept, slope = least_squares([1 / b for b in BS], steps)
    s_min, b_crit = lrs.critical_batch(BS, steps)
    assert (s_min, b_crit) == pytest.approx((intercept, slope / intercept), rel=1e-9), (
        f"S_min {s_min:.6g}, B_crit {b_crit:.6g} from steps with 3% noise; the least-squares "
        f"line of steps on 1/B over all {len(BS)} batches gives {intercept:.6g} and "
        f"{slope / intercept:.6g}")
    assert s_min == pytest.approx(100, rel=0.15) and b_crit == pytest.approx(512, rel=0.3)


def test_critical_batch_rejects_bad_input(lrs):
    with pytest.raises(ValueError, match="two different batch"):
        lrs.critical_batch([64, 64], [10, 11])
    with pytest.raises(ValueError, match="3 batches but 2"):
        lrs.critical_batch([64, 128, 256], [10, 11])
