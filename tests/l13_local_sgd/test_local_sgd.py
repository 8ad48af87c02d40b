"""Lesson 13, tasks 13.1-13.2: LocalSGD averages with one all-reduce every H steps.

Three gloo ranks train the float64 model S of ``rank_fns_local_sgd`` (P = 101 parameters in 4
tensors) on their own batches; the references are one-process simulators (no collective) to
1e-10. One launch (``rank_fns_local_sgd.local_sgd_checks``) runs every part, each grading one
task with the other task's reference in place:

- 13.1: ``average_`` on three tensors of odd shapes is the mean, with ONE all-reduce, and
  returns the bytes; LocalSGD at H = 1 with plain SGD is DDP, step by step, for 50 steps;
- 13.2: in 60 steps at H = 1, 4 and 6 the counted all-reduces are 60/H of P·8 bytes each
  (60 is divisible by 4 and 6 but not by 5 or 7: syncing one step late or early changes the
  count), and the ranks' weights agree exactly at steps 4, 8, 12 at H = 4, and at no other.

Unmarked, the lesson's point: H = 1 is still DDP with momentum SGD (the buffers are linear in
the gradients), but not with AdamW (each rank's moments are its own).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import checked_part, ranks_or_fail
from tests.l13_local_sgd import rank_fns_local_sgd as rf

N = rf.N
TIMEOUT = 250
TOL = 1e-10


@pytest.fixture(scope="module")
def runs():
    return ranks_or_fail(rf.local_sgd_checks, N, timeout=TIMEOUT, backend="gloo")


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    return a.shape == b.shape and bool(((a - b).abs() <= tol * (1 + b.abs())).all())


def n_params() -> int:
    return sum(p.numel() for p in rf.model().parameters())


# --- 13.1 ---------------------------------------------------------------------------------------

@pytest.mark.task("13.1")
@pytest.mark.timeout(TIMEOUT + 50)
def test_average_is_the_mean_with_one_all_reduce(runs):
    ranks = [rf.hand_tensors(r) for r in range(N)]
    want = [sum(ts[i] for ts in ranks) / N for i in range(len(ranks[0]))]
    total = [sum(ts[i] for ts in ranks) for i in range(len(ranks[0]))]
    nbytes = sum(t.numel() * t.element_size() for t in want)
    for r, res in enumerate(runs):
        got = checked_part(res["average"], "average_ failed")
        calls = [op for op, _, _ in got["records"]]
        assert calls == ["all_reduce"], (
            f"rank {r}: average_ made the collectives {calls} for {len(want)} tensors; expected "
            f"one all_reduce: {len(calls)} all-reduces per sync: one flat buffer "
            f"(local_sgd.flat), one collective")
        for i, (g, w) in enumerate(zip(got["tensors"], want)):
            if close(g, total[i]):
                pytest.fail(f"rank {r}, tensor {i}: the weights are N times the average: "
                            f"divide the sum by the group's size", pytrace=False)
            assert close(g, w), (
                f"rank {r}, tensor {i} of shape {tuple(w.shape)}: not the mean over the "
                f"{N} ranks (largest error {(g - w).abs().max():.2e}); it must be changed in "
                f"place")
        assert got["sent"] == nbytes, (
            f"rank {r}: average_ returned {got['sent']}, expected {nbytes} bytes "
            f"(numel x element_size of the one buffer: {nbytes // 8} float64 values)")
        assert got["records"][0][2] == nbytes, (
            f"rank {r}: the all-reduce carried {got['records'][0][2]} bytes, expected {nbytes}")


@pytest.mark.task("13.1")
@pytest.mark.timeout(TIMEOUT + 50)
def test_local_sgd_h1_equals_ddp(runs):
    want = rf.ddp_history(rf.H1_STEPS, "sgd")
    for r, res in enumerate(runs):
        history = checked_part(res["h1"], "LocalSGD at H=1 failed")["history"]
        for step, (g, w) in enumerate(zip(history, want), start=1):
            if close(g, w):
                continue
            if step == 1 and close(g, N * w):
                pytest.fail(f"rank {r}, step 1: the weights are N times the average: divide "
                            f"the sum by the group's size", pytrace=False)
            pytest.fail(f"rank {r}: LocalSGD at H=1 with SGD differs from DDP after step "
                        f"{step} (largest difference {(g - w).abs().max():.2e}): at H=1 every "
                        f"step must end with the weights averaged over the ranks",
                        pytrace=False)


# --- 13.2 ---------------------------------------------------------------------------------------

def sync_hint(h: int, got: int, want: int, steps: int) -> str:
    if got > want:
        return "reset the count after a sync (it keeps syncing at every step after the H-th)"
    if got == 1 and want > 1:
        return "reset the count after a sync"
    if got == steps // (h + 1):
        return "sync at the H-th step, not after H + 1"
    if h > 1 and got == steps // (h - 1):
        return "sync at the H-th step, not at the (H-1)-th"
    return "sync once every H optimizer steps, at the H-th"


@pytest.mark.task("13.2")
@pytest.mark.timeout(TIMEOUT + 50)
def test_bytes_are_ddps_over_h(runs):
    per_sync = n_params() * 8  # float64
    steps = rf.BYTES_STEPS
    for r, res in enumerate(runs):
        counts = checked_part(res["bytes"], "LocalSGD failed")["counts"]
        for h in rf.BYTES_HS:
            want = steps // h
            got = counts[h]["calls"]
            assert got == want, (
                f"rank {r}: expected {want} syncs in {steps} steps at H={h}, got {got}: "
                f"{sync_hint(h, got, want, steps)}")
            assert counts[h]["bytes"] == want * per_sync, (
                f"rank {r}, H={h}: {counts[h]['bytes']:,} bytes counted, expected "
                f"{want} x {per_sync} = {want * per_sync:,} (DDP's {steps} x {per_sync} / H)")


@pytest.mark.task("13.2")
@pytest.mark.timeout(TIMEOUT + 50)
def test_ranks_agree_exactly_at_every_h_th_step(runs):
    histories = [checked_part(res["bytes"], "LocalSGD failed")["history"] for res in runs]
    agree = [step for step in range(1, rf.SPY_STEPS + 1)
             if all(torch.equal(h[step - 1], histories[0][step - 1]) for h in histories)]
    want = list(range(rf.SPY_H, rf.SPY_STEPS + 1, rf.SPY_H))
    assert agree == want, (
        f"at H={rf.SPY_H} the ranks' weights agree after steps {agree} of {rf.SPY_STEPS}, "
        f"expected {want}: {sync_hint(rf.SPY_H, len(agree), len(want), rf.SPY_STEPS)}")


# --- the lesson's point (unmarked) ----------------------------------------------------------------

@pytest.mark.timeout(TIMEOUT + 50)
def test_h1_is_ddp_with_momentum_but_not_with_adamw(runs):
    momentum = rf.ddp_history(rf.H1_STEPS, "momentum")[-1]
    adamw = rf.ddp_history(rf.H1_STEPS, "adamw")[-1]
    for r, res in enumerate(runs):
        got = checked_part(res["momentum"])["history"][-1]
        assert close(got, momentum), (
            f"rank {r}: LocalSGD H=1 with momentum SGD should be DDP (the average of the "
            f"ranks' buffers follows DDP's buffer); differs by {(got - momentum).abs().max():.2e}")
        got = checked_part(res["adamw"])["history"][-1]
        gap = (got - adamw).abs().max().item()
        assert gap > 1e-4, (
            f"rank {r}: LocalSGD H=1 with AdamW is within {gap:.1e} of DDP; the ranks' own "
            f"second moments should make it differ")
