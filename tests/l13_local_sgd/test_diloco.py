"""Lesson 13, tasks 13.3-13.4: DiLoCo's outer step on the averaged pseudo-gradient.

13.3 is checked here, in this process, on hand-set tensors. 13.4 runs on three gloo ranks
(``rank_fns_local_sgd.diloco_checks``, one launch, with 13.1-13.3's references in place) with
the float64 model S, against one-process simulators to 1e-10:

- H = 1, inner SGD, outer SGD of lr 1 without momentum is DDP, step by step, for 30 steps;
- H = 5, inner AdamW, outer Nesterov SGD (0.7, 0.9), 4 rounds: every rank's weights after
  every round are the simulator's (when they are not, the test names the mistake whose
  simulator they match: no restore to the snapshot, or a snapshot taken before the outer step);
- the outer momentum buffers are bitwise equal on every rank after every round: the outer
  optimizer is stepped on the same averaged Δ, so its state needs no communication.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import checked_part, ranks_or_fail
from tests.l13_local_sgd import rank_fns_local_sgd as rf
from tests.lessons import load

LESSON = rf.LESSON
N = rf.N
TIMEOUT = 250
TOL = 1e-10


@pytest.fixture(scope="module")
def runs():
    return ranks_or_fail(rf.diloco_checks, N, timeout=TIMEOUT, backend="gloo")


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    return a.shape == b.shape and bool(((a - b).abs() <= tol * (1 + b.abs())).all())


# --- 13.3 ---------------------------------------------------------------------------------------

@pytest.mark.task("13.3")
def test_pseudo_gradient_is_start_minus_now():
    dl = load(LESSON, "diloco")
    g = torch.Generator().manual_seed(3)
    snapshot = [torch.randn(4, 3, generator=g, dtype=torch.float64),
                torch.randn(5, generator=g, dtype=torch.float64)]
    params = [torch.nn.Parameter(s + torch.randn(s.shape, generator=g, dtype=torch.float64))
              for s in snapshot]
    want = [s - p.detach() for s, p in zip(snapshot, params)]
    got = dl.pseudo_gradients(snapshot, params)
    assert isinstance(got, list) and len(got) == len(want), (
        f"pseudo_gradients returned {type(got).__name__} of {len(got)}, expected a list of "
        f"{len(want)} tensors")
    for i, (d, w) in enumerate(zip(got, want)):
        if close(d, -w):
            pytest.fail(f"tensor {i}: the outer step moved away from the average: "
                        f"Δ = start − now (snapshot − params), not now − start", pytrace=False)
        assert close(d, w), (f"tensor {i}: Δ is not snapshot − params (largest error "
                             f"{(d - w).abs().max():.2e})")
        assert d.grad_fn is None and not d.requires_grad, (
            f"tensor {i}: Δ is part of autograd's graph; compute it without autograd "
            f"(torch.no_grad() or .detach())")
    with torch.no_grad():
        for p, s in zip(params, snapshot):
            p.add_(1.0)
            s.mul_(2.0)
    for i, (d, w) in enumerate(zip(got, want)):
        assert close(d, w), (f"tensor {i}: Δ changed when the parameters or the snapshot did: "
                             f"return new tensors, not views of either")


# --- 13.4 ---------------------------------------------------------------------------------------

@pytest.mark.task("13.4")
@pytest.mark.timeout(TIMEOUT + 50)
def test_diloco_h1_equals_ddp(runs):
    want = rf.ddp_history(rf.DILOCO_H1_STEPS, "sgd")
    for r, res in enumerate(runs):
        history = checked_part(res["h1"], "DiLoCo at H=1 failed")["history"]
        for step, (g, w) in enumerate(zip(history, want), start=1):
            assert close(g, w), (
                f"rank {r}: DiLoCo at H=1 with an outer SGD of lr 1 differs from DDP after "
                f"step {step} (largest difference {(g - w).abs().max():.2e}): the outer step "
                f"must start from the snapshot and move by the AVERAGED Δ")


MISTAKES = (  # (simulator flags, what it means)
    ({"restore": False}, "outer step applied to the local weights: restore the snapshot first"),
    ({"snapshot_after": False}, "pseudo-gradient measured from the previous round's start: "
                                "snapshot after the outer step"),
)


@pytest.mark.task("13.4")
@pytest.mark.timeout(TIMEOUT + 50)
def test_diloco_equals_simulator(runs):
    sim = dict(h=rf.DILOCO_H, rounds=rf.DILOCO_ROUNDS, inner="adamw", outer_lr=rf.OUTER_LR,
               outer_momentum=rf.OUTER_MOMENTUM, seed=2)
    want = rf.diloco_rounds(**sim)
    got = [[rd["weights"] for rd in checked_part(res["rounds"], "DiLoCo failed")["rounds"]]
           for res in runs]
    for r in range(N):
        assert len(got[r]) == rf.DILOCO_ROUNDS
    for k in range(rf.DILOCO_ROUNDS):
        mine = torch.stack([got[r][k] for r in range(N)])
        if close(mine, want[k]):
            continue
        for flags, meaning in MISTAKES:
            wrong = rf.diloco_rounds(**sim, **flags)
            if all(close(torch.stack([got[r][j] for r in range(N)]), wrong[j])
                   for j in range(k + 1)):
                pytest.fail(f"round {k + 1}: {meaning}", pytrace=False)
        pytest.fail(f"after round {k + 1} of H={rf.DILOCO_H} AdamW steps, the weights differ "
                    f"from DiLoCo's (largest difference {(mine - want[k]).abs().max():.2e}): "
                    f"Δ = snapshot − weights, averaged; the params back to the snapshot; "
                    f"one outer step; the new snapshot after it", pytrace=False)


@pytest.mark.task("13.4")
@pytest.mark.timeout(TIMEOUT + 50)
def test_outer_state_identical_on_every_rank(runs):
    rounds = [checked_part(res["rounds"], "DiLoCo failed")["rounds"] for res in runs]
    for k in range(rf.DILOCO_ROUNDS):
        buffers = [rounds[r][k]["momentum"] for r in range(N)]
        assert all(b is not None for b in buffers[0]), (
            f"round {k + 1}: the outer optimizer has no momentum buffer: step it once per round")
        for r in range(1, N):
            same = all(torch.equal(a, b) for a, b in zip(buffers[0], buffers[r]))
            assert same, (
                f"round {k + 1}: outer momentum differs between ranks 0 and {r}: step the outer "
                f"optimizer on the AVERAGED pseudo-gradient (each rank's own Δ gives each "
                f"rank its own momentum)")
