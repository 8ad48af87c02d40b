"""Lesson 11: LARS, LAMB, and norms of element-sharded tensors (tasks 11.10-11.14).

LARS and LAMB are checked against references written here element by element (plain Python
floats, not the lesson's tensor code), over 20 steps, with settings under which every term
shows: gradients near 1e-4 (so where eps goes changes the update), weight decay 0.1 (so
wd * ||w|| dominates LARS's denominator), a group without decay, a tensor that starts at zero
(the zero-norm rule) and weight norms above LAMB's clamp. When a result differs, the test
runs the classic wrong variants of the reference and names the one it matches.

The sharded parts run on 2 and on 3 gloo ranks (CPU, any machine), with tensor sizes that
neither divides: the norms against the whole tensors', ShardedLAMB against LAMB, and the
sharded clip against ``torch.nn.utils.clip_grad_norm_``, in both of its cases. Clipping is
checked on its own, never through LAMB, whose trust ratio cancels any scale of the gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import checked_part, ranks_or_fail
from tests.l11_time_to_accuracy import rank_fns_large_batch as rf
from tests.lessons import load

LESSON = "11_time_to_accuracy"
STEPS = 20
TOL = 1e-6  # float64 both sides: a right answer is ~1e-15 away, each mistake far more


@pytest.fixture
def lb():
    return load(LESSON, "large_batch")


# --- a tiny model and its 20 steps ------------------------------------------------------------

def start_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 5)).double()
    with torch.no_grad():
        model[2].bias.zero_()  # a tensor with ||w|| = 0 at the first step
    return model


def loss_at(model, step):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(16, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (16,), generator=gen)
    return F.cross_entropy(model(x), y) * 1e-3  # gradients near 1e-4


def param_groups(params, wd):
    """Weights decay (``wd``); the first bias does not; the zeroed last bias does."""
    w1, b1, w2, b2 = params
    return [{"params": [w1, w2, b2], "weight_decay": wd}, {"params": [b1], "weight_decay": 0.0}]


def run_optimizer(make):
    model = start_model()
    opt = make(param_groups(list(model.parameters()), 0.1))
    for step in range(STEPS):
        opt.zero_grad()
        loss_at(model, step).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def run_reference(update):
    """20 steps where ``update(group_index, ws, gs, state)`` changes the Python lists ``ws``
    (one tensor's weights) in place from its gradient ``gs``; returns the tensors."""
    model = start_model()
    params = list(model.parameters())
    groups = param_groups(params, 0.1)
    states = {id(p): {} for p in params}
    for step in range(STEPS):
        model.zero_grad()
        loss_at(model, step).backward()
        for group in groups:
            for p in group["params"]:
                ws, gs = p.detach().reshape(-1).tolist(), p.grad.reshape(-1).tolist()
                update(group, ws, gs, states[id(p)])
                with torch.no_grad():
                    p.copy_(torch.tensor(ws, dtype=p.dtype).view_as(p))
    return [p.detach().clone() for p in params]


def diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def norm(xs) -> float:
    return math.sqrt(sum(x * x for x in xs))


def check_against(got, variants: dict, what: str):
    """``got`` must match ``variants["right"]``; else name the wrong variant it matches."""
    d = diff(got, variants["right"])
    if d <= TOL:
        return
    if not all(bool(torch.isfinite(p).all()) for p in got):
        pytest.fail(f"{what}'s weights are not finite after {STEPS} steps (a step far too "
                    "large: check the trust ratio's denominator)", pytrace=False)
    for name, params in variants.items():
        if name != "right" and diff(got, params) <= TOL:
            pytest.fail(f"{what} differs from the reference by {d:.3g} after {STEPS} steps, "
                        f"and matches a known mistake: {name}", pytrace=False)
    pytest.fail(f"{what} differs from the reference by {d:.3g} after {STEPS} steps (no known "
                "mistake matches: compare your step with the formulas in the docstring)",
                pytrace=False)


# --- 11.10 LARS ----------------------------------------------------------------------------------

LARS_OPTS = {"lr": 0.1, "momentum": 0.9, "trust_coefficient": 0.02, "eps": 1e-4}


def lars_update(wd_in_denominator=True, scale_without_wd=False):
    def update(group, ws, gs, state):
        wd, eta, eps = group["weight_decay"], LARS_OPTS["trust_coefficient"], LARS_OPTS["eps"]
        wn, gn = norm(ws), norm(gs)
        if (wd != 0 or scale_without_wd) and wn > 0 and gn > 0:
            trust = eta * wn / (gn + (wd * wn if wd_in_denominator else 0.0) + eps)
            d = [(g + wd * w) * trust for g, w in zip(gs, ws)]
        else:
            d = list(gs)
        buf = state.get("buf")
        buf = d if buf is None else [LARS_OPTS["momentum"] * b + x for b, x in zip(buf, d)]
        state["buf"] = buf
        for i, b in enumerate(buf):
            ws[i] -= LARS_OPTS["lr"] * b
    return update


@pytest.mark.task("11.10")
def test_lars_matches_the_formula(lb):
    got = run_optimizer(lambda groups: lb.LARS(groups, **LARS_OPTS))
    check_against(got, {
        "right": run_reference(lars_update()),
        "the trust ratio's denominator is ||g|| + wd*||w|| + eps (wd*||w|| left out)":
            run_reference(lars_update(wd_in_denominator=False)),
        "a group with weight_decay 0 takes plain g: no trust ratio there":
            run_reference(lars_update(scale_without_wd=True)),
    }, "LARS")


@pytest.mark.task("11.10")
def test_lars_leaves_params_without_grad_alone(lb):
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    opt = lb.LARS([a, b], lr=0.1, weight_decay=0.1)
    a.grad = torch.full((3,), 0.5)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(2)), "a parameter without .grad must not move"
    assert not torch.equal(a.detach(), torch.ones(3)), "a parameter with .grad must move"


# --- 11.11 LAMB ----------------------------------------------------------------------------------

def lamb_update(opts, bias_correction=True, trust_on_r=False, eps_inside=False):
    def update(group, ws, gs, state):
        b1, b2 = opts["betas"]
        wd, eps, cap = group["weight_decay"], opts["eps"], opts["max_weight_norm"]
        t = state["t"] = state.get("t", 0) + 1
        m = state["m"] = [b1 * mi + (1 - b1) * g for mi, g in zip(state.get("m", [0.0] * len(gs)), gs)]
        v = state["v"] = [b2 * vi + (1 - b2) * g * g
                          for vi, g in zip(state.get("v", [0.0] * len(gs)), gs)]
        c1, c2 = (1 - b1 ** t, 1 - b2 ** t) if bias_correction else (1.0, 1.0)
        if eps_inside:
            r = [(mi / c1) / math.sqrt(vi / c2 + eps) for mi, vi in zip(m, v)]
        else:
            r = [(mi / c1) / (math.sqrt(vi / c2) + eps) for mi, vi in zip(m, v)]
        u = [ri + wd * w for ri, w in zip(r, ws)]
        wn = norm(ws) if cap is None else min(norm(ws), cap)
        un = norm(r if trust_on_r else u)
        trust = wn / un if wn > 0 and un > 0 else 1.0
        for i, ui in enumerate(u):
            ws[i] -= opts["lr"] * trust * ui
    return update


LAMB_CASES = {
    "corrected-clamped": {"lr": 0.02, "betas": (0.9, 0.99), "eps": 1e-6,
                                "bias_correction": True, "max_weight_norm": 1.0},
    "raw-unclamped": {"lr": 0.02, "betas": (0.8, 0.9), "eps": 1e-6,
                                "bias_correction": False, "max_weight_norm": None},
}


@pytest.mark.task("11.11")
@pytest.mark.parametrize("case", list(LAMB_CASES))
def test_lamb_matches_the_formula(lb, case):
    opts = LAMB_CASES[case]
    got = run_optimizer(lambda groups: lb.LAMB(groups, **opts))
    bc = opts["bias_correction"]
    variants = {
        "right": run_reference(lamb_update(opts, bias_correction=bc)),
        "the trust ratio uses ||r + wd*w||, the norm of the whole update, not ||r||":
            run_reference(lamb_update(opts, bias_correction=bc, trust_on_r=True)),
        "eps goes outside the square root: r = m / (sqrt(v) + eps)":
            run_reference(lamb_update(opts, bias_correction=bc, eps_inside=True)),
    }
    if bc:
        variants["LAMB takes bias-corrected moments (m / (1 - beta1^t), v / (1 - beta2^t)) "
                 "when bias_correction is on"] = run_reference(lamb_update(opts, False))
    else:
        variants["bias_correction=False: the raw moments, no division by 1 - beta^t"] = \
            run_reference(lamb_update(opts, True))
    check_against(got, variants, f"LAMB ({case})")


# --- torch-optimizer, when installed (optional: the references above are the binding check) --

def test_lamb_matches_torch_optimizer(lb):
    topt = pytest.importorskip("torch_optimizer")
    try:
        theirs = run_optimizer(lambda groups: topt.Lamb(groups, lr=0.02, eps=1e-6,
                                                        debias=False, clamp_value=10))
    except TypeError as exc:  # its deprecated add_(scalar, tensor) calls, on a newer torch
        pytest.skip(f"torch_optimizer.Lamb does not run on torch {torch.__version__}: {exc}")
    ours = run_optimizer(lambda groups: lb.LAMB(groups, lr=0.02, eps=1e-6,
                                                bias_correction=False, max_weight_norm=10))
    assert diff(ours, theirs) <= TOL


def test_lars_matches_torch_optimizer(lb):
    topt = pytest.importorskip("torch_optimizer")
    their_lars = getattr(topt, "LARS", None)
    if their_lars is None:
        pytest.skip(f"torch_optimizer {getattr(topt, '__version__', '?')} has no LARS")
    theirs = run_optimizer(lambda groups: their_lars(groups, **LARS_OPTS))
    ours = run_optimizer(lambda groups: lb.LARS(groups, **LARS_OPTS))
    assert diff(ours, theirs) <= TOL


def test_optimizers_reject_bad_options(lb):
    p = [nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="lr"):
        lb.LARS(p, lr=-1.0)
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        lb.LAMB(p, betas=(0.9, 1.0))


def test_shard_of_pads_and_covers(lb):
    t = torch.arange(7.0)
    shards = [lb.shard_of(t, r, 3) for r in range(3)]
    assert [s.tolist() for s in shards] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="rank 3"):
        lb.shard_of(t, 3, 3)


# --- 11.12-11.14 on 2 and 3 ranks ------------------------------------------------------------------

TIMEOUT = 250


def launch(world):
    return ranks_or_fail(rf.sharded_checks, world, timeout=TIMEOUT, backend="gloo")


@pytest.fixture(scope="module", params=[2, 3], ids=["N2", "N3"])
def sharded(request):
    return request.param, launch(request.param)


@pytest.mark.task("11.12")
@pytest.mark.timeout(300)
def test_shard_square_norms_are_the_whole_tensors_norms(sharded, lb):
    world, ranks = sharded
    whole = [float(t.norm()) for t in rf.tensors(1)]
    for rank, out in enumerate(ranks):
        got = checked_part(out["norms"])
        if got["norms"] == pytest.approx(whole, rel=1e-12):
            assert got["calls"] == 1, (
                f"{got['calls']} all-reduces for {len(whole)} tensors: put every shard's sum "
                "of squares in one vector and all-reduce it once")
            continue
        parts = [[float(lb.shard_of(t, r, world).norm()) for t in rf.tensors(1)]
                 for r in range(world)]
        if got["norms"] == pytest.approx([sum(ns) for ns in zip(*parts)], rel=1e-9):
            why = "summed shard norms: all-reduce squares, then sqrt (norms do not add)"
        elif got["norms"] == pytest.approx(parts[rank], rel=1e-9):
            why = "this rank's shard norms only: all-reduce the squared sums over the ranks"
        elif got["norms"] == pytest.approx([n * n for n in whole], rel=1e-9):
            why = "the squared norms: take the square root after the all-reduce"
        else:
            why = "expected the norms of the whole tensors"
        pytest.fail(f"rank {rank} of {world}: norms {got['norms']}, the whole tensors' are "
                    f"{whole}: {why}", pytrace=False)


@pytest.mark.task("11.13")
@pytest.mark.timeout(300)
def test_sharded_lamb_equals_lamb(sharded):
    world, ranks = sharded
    for rank, out in enumerate(ranks):
        got = checked_part(out["lamb"])
        assert got["local_vs_plain"] > 100 * TOL  # the test can tell the mistake apart
        if got["diff"] > TOL and got["local_diff"] <= TOL:
            pytest.fail(f"rank {rank} of {world}: ShardedLAMB is {got['diff']:.3g} from LAMB "
                        f"after {rf.STEPS} steps: trust ratio from this shard's norms; it "
                        "must come from the whole tensor's (shard_square_norms)",
                        pytrace=False)
        assert got["diff"] <= TOL, (
            f"rank {rank} of {world}: ShardedLAMB's weights are {got['diff']:.3g} from LAMB's "
            f"after {rf.STEPS} steps (LAMB on this rank's shard of w and g, the whole "
            "tensor's trust ratio, then all shards gathered back into each parameter)")


@pytest.mark.task("11.13")
@pytest.mark.timeout(300)
def test_sharded_lamb_keeps_state_for_its_shard_only(sharded):
    world, ranks = sharded
    for rank, out in enumerate(ranks):
        got = checked_part(out["lamb"])
        assert got["state"] == got["shard_state"], (
            f"rank {rank} of {world}: {got['state']} elements of moments, expected "
            f"{got['shard_state']} (exp_avg and exp_avg_sq of this rank's shards only: that "
            "is the memory sharding saves)")


@pytest.mark.task("11.14")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["clip_down", "clip_up"])
def test_sharded_clip_equals_torch(sharded, lb, case):
    world, ranks = sharded
    factor = 1 / 3 if case == "clip_down" else 3.0
    grads = rf.tensors(2)
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    whole = float(torch.sqrt(sum((g ** 2).sum() for g in grads)))
    total = float(torch.nn.utils.clip_grad_norm_(params, factor * whole))
    for rank, out in enumerate(ranks):
        got = checked_part(out[case])
        assert got["total"] == pytest.approx(total, rel=1e-12), (
            f"rank {rank} of {world}: total norm {got['total']:.6g}, torch's "
            f"{total:.6g}: the square root of the all-reduced sum of every shard's squares")
        want = [lb.shard_of(p.grad, rank, world) for p in params]
        worst = max(float((a - b).abs().max()) for a, b in zip(got["shards"], want))
        if worst > 1e-12:
            unclipped = [lb.shard_of(g, rank, world) for g in grads]
            scale = float(got["shards"][0].norm() / unclipped[0].norm())
            why = ("clip_grad_norm_ never scales gradients up: the coefficient is "
                   "min(1, max_norm / (total + 1e-6))" if scale > 1 + 1e-9
                   else "the shards must be scaled in place by max_norm / (total + 1e-6)")
            pytest.fail(f"rank {rank} of {world}, max_norm {factor:.3g} x the norm: shards "
                        f"{worst:.3g} from torch's clipped gradients (scaled x{scale:.4g}): "
                        f"{why}", pytrace=False)
