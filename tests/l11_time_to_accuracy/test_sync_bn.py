"""Lesson 11, tasks 11.3-11.5: SyncBatchNorm by hand equals one process on the global batch.

torch's ``nn.SyncBatchNorm`` refuses CPU tensors ("expected input tensor to be on GPU"), so
the reference here is what it stands for: ONE process running plain ``nn.BatchNorm1d``/``2d``
on the concatenation of every rank's input (``tests/gpu/test_l11_sync_bn_gpu.py`` compares
the hand layer with torch's on GPUs). Three gloo ranks hold 2, 3 and 5 rows (float64), so a
mean of means, a local count, an unbiased variance and a local n/(n − 1) each show, to 1e-10.
One launch (``rank_fns_sync_bn.sync_bn_checks``) runs every part; 11.5's structure is checked
here, in this process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import checked_part, ranks_or_fail
from tests.l11_time_to_accuracy import rank_fns_sync_bn as rf
from tests.lessons import load

LESSON = rf.LESSON
N = rf.N
TIMEOUT = 250
TOL = 1e-10  # float64, sums in another order
CONV_TOL = 1e-8  # float64 ConvNet, 3 SGD steps


@pytest.fixture(scope="module")
def runs():
    return ranks_or_fail(rf.sync_bn_checks, N, timeout=TIMEOUT)


def close(a, b, tol=TOL) -> bool:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return a.shape == b.shape and bool(((a - b).abs() <= tol * (1 + b.abs())).all())


def dims(x: torch.Tensor) -> list[int]:
    return [d for d in range(x.dim()) if d != 1]


def rows(rank: int) -> slice:
    start = sum(rf.ROWS[:rank])
    return slice(start, start + rf.ROWS[rank])


def per_channel(x: torch.Tensor) -> int:
    return x.numel() // x.shape[1]


# --- 11.3 the global moments ---------------------------------------------------------------------

def moments_reference(kind: str) -> dict:
    """One process: the moments of the whole batch; the input gradient of every rank's loss
    (the sum over ranks), and of each rank's own loss only (what a plain all-reduce gives)."""
    xs = [rf.inputs(kind, r) for r in range(N)]
    x = torch.cat(xs).requires_grad_(True)
    mean, var = x.mean(dims(x)), x.var(dims(x), unbiased=False)
    losses = [(mean * a).sum() + (var * b).sum()
              for a, b in (rf.stat_weights(kind, r) for r in range(N))]
    grad, = torch.autograd.grad(sum(losses), x, retain_graph=True)
    own = [torch.autograd.grad(losses[r], x, retain_graph=True)[0][rows(r)] for r in range(N)]
    return {"mean": mean.detach(), "var": var.detach(), "count": per_channel(x),
            "unbiased": x.var(dims(x), unbiased=True).detach(), "grad": grad, "own": own,
            "mean_of_means": sum(t.mean(dims(t)) for t in xs) / N,
            "local_count": [per_channel(t) for t in xs]}


@pytest.mark.task("11.3")
@pytest.mark.timeout(TIMEOUT + 50)
def test_global_moments_are_the_whole_batchs(runs):
    for kind in rf.SHAPES:
        ref = moments_reference(kind)
        for r, res in enumerate(runs):
            got = checked_part(res["moments"])[kind]
            who = f"rank {r} of {N} ({rf.ROWS[r]} of {sum(rf.ROWS)} rows, input {kind})"
            if not close(got["mean"], ref["mean"]):
                if close(got["mean"], ref["mean_of_means"]):
                    pytest.fail(f"{who}: the mean is the mean of the ranks' means, which is "
                                "not the mean of uneven batches: all-reduce the sums Σx, Σx² "
                                "and n, then divide", pytrace=False)
                if got["count"] == ref["local_count"][r]:
                    pytest.fail(f"{who}: count not all-reduced: uneven batches need the "
                                f"global n ({ref['count']}, not this rank's "
                                f"{ref['local_count'][r]}): put n in the tensor you "
                                "all-reduce", pytrace=False)
                pytest.fail(f"{who}: mean {got['mean'].tolist()}, not the global batch's "
                            f"{ref['mean'].tolist()}", pytrace=False)
            assert got["count"] == ref["count"], (
                f"{who}: count {got['count']}, not the global {ref['count']} values per "
                "channel (rows x the other dims, summed over the ranks)")
            if not close(got["var"], ref["var"]):
                if close(got["var"], ref["unbiased"]):
                    pytest.fail(f"{who}: the unbiased variance (divide by n − 1): BatchNorm "
                                "normalises with the biased variance (divide by n), "
                                "Σx²/n − mean²", pytrace=False)
                pytest.fail(f"{who}: var {got['var'].tolist()}, not the global batch's "
                            f"biased {ref['var'].tolist()}", pytrace=False)


@pytest.mark.task("11.3")
@pytest.mark.timeout(TIMEOUT + 50)
def test_global_moments_gradients_reach_every_rank(runs):
    for kind in rf.SHAPES:
        ref = moments_reference(kind)
        for r, res in enumerate(runs):
            got = checked_part(res["moments"])[kind]["grad"]
            who = f"rank {r} of {N} (input {kind})"
            assert got is not None, (
                f"{who}: no gradient reached the input: mean and var must be computed from x "
                "with differentiable operations (all_reduce_sum, not a detached copy)")
            if close(got, ref["grad"][rows(r)]):
                continue
            if close(got, ref["own"][r]):
                pytest.fail(f"{who}: input gradients differ: they hold only this rank's own "
                            "loss; the statistics' all-reduce must be part of autograd "
                            "(all_reduce_sum, whose backward all-reduces the gradients; "
                            "dist.all_reduce is invisible to autograd)", pytrace=False)
            pytest.fail(f"{who}: the input gradients are not those of one process on the "
                        f"whole batch (largest gap "
                        f"{(got - ref['grad'][rows(r)]).abs().max():.3g})", pytrace=False)


# --- 11.4 the layer ---------------------------------------------------------------------------------

def running_var(kind: str, factor) -> torch.Tensor:
    """running_var after FORWARDS batches, momentum 0.1, each batch's biased var times
    ``factor(global n)``."""
    rv = torch.ones(rf.SHAPES[kind][0], dtype=torch.float64)
    for step in range(rf.FORWARDS):
        x = torch.cat([rf.inputs(kind, r, step) for r in range(N)])
        rv = 0.9 * rv + 0.1 * x.var(dims(x), unbiased=False) * factor(per_channel(x))
    return rv


def module_reference(kind: str) -> dict:
    bn, cumulative = rf.bn_layer(kind), rf.bn_layer(kind, momentum=None)
    outputs = []
    for step in range(rf.FORWARDS):
        x = torch.cat([rf.inputs(kind, r, step) for r in range(N)]).requires_grad_(True)
        y = bn(x)
        outputs.append(y.detach())
        cumulative(x.detach())
    loss = sum((y[rows(r)] * rf.out_weights(kind, r)).sum() for r in range(N))
    loss.backward()
    bn.eval()
    return {"outputs": outputs, "grad": x.grad, "weight_grad": bn.weight.grad,
            "bias_grad": bn.bias.grad, "running_mean": bn.running_mean,
            "running_var": bn.running_var, "cumulative_mean": cumulative.running_mean,
            "cumulative_var": cumulative.running_var,
            "eval": bn(torch.cat([rf.inputs(kind, r, rf.EVAL_STEP) for r in range(N)])).detach()}


@pytest.mark.task("11.4")
@pytest.mark.timeout(TIMEOUT + 50)
def test_sync_bn_by_hand_trains_as_one_process(runs):
    for kind in rf.SHAPES:
        ref = module_reference(kind)
        got = [checked_part(res["module"])[kind] for res in runs]
        for r, g in enumerate(got):
            who = f"rank {r} of {N} ({rf.ROWS[r]} rows, input {kind})"
            for step, (mine, want) in enumerate(zip(g["outputs"], ref["outputs"])):
                assert close(mine, want[rows(r)]), (
                    f"{who}, training forward {step}: the output is not batch norm over the "
                    "global batch (normalise with global_moments' mean and biased var, then "
                    f"weight and bias); largest gap {(mine - want[rows(r)]).abs().max():.3g}")
            assert g["grad"] is not None and close(g["grad"], ref["grad"][rows(r)]), (
                f"{who}: input gradients differ from one process's: compute the output from "
                "x and global_moments' tensors with autograd on (no .detach(), no no_grad)")
        for name in ("weight_grad", "bias_grad"):
            total = sum(g[name] for g in got)
            assert close(total, ref[name]), (
                f"input {kind}: the {name.split('_')[0]} gradients summed over the ranks are "
                f"{total.tolist()}, not one process's {ref[name].tolist()}")


@pytest.mark.task("11.4")
@pytest.mark.timeout(TIMEOUT + 50)
def test_sync_bn_by_hand_running_statistics_and_eval(runs):
    for kind in rf.SHAPES:
        ref = module_reference(kind)
        for r, res in enumerate(runs):
            g = checked_part(res["module"])[kind]
            who = f"rank {r} of {N} ({rf.ROWS[r]} rows, input {kind})"
            assert g["num_batches_tracked"] == rf.FORWARDS, (
                f"{who}: num_batches_tracked is {g['num_batches_tracked']} after "
                f"{rf.FORWARDS} training forwards: add 1 per training forward")
            assert close(g["running_mean"], ref["running_mean"]), (
                f"{who}: running_mean {g['running_mean'].tolist()}, not "
                f"{ref['running_mean'].tolist()}: (1 − momentum)·running + momentum·mean")
            if not close(g["running_var"], ref["running_var"]):
                local_n = per_channel(rf.inputs(kind, r))
                if close(g["running_var"], running_var(kind, lambda n: 1.0)):
                    pytest.fail(f"{who}: running_var takes var·n/(n−1), the unbiased "
                                "variance, not the biased one used to normalise",
                                pytrace=False)
                if close(g["running_var"],
                         running_var(kind, lambda n, k=local_n: k / (k - 1))):
                    pytest.fail(f"{who}: running_var uses n/(n−1) with this rank's n "
                                f"({local_n}): use the global count", pytrace=False)
                pytest.fail(f"{who}: running_var {g['running_var'].tolist()}, not "
                            f"{ref['running_var'].tolist()}", pytrace=False)
            assert close(g["cumulative_mean"], ref["cumulative_mean"]) and close(
                g["cumulative_var"], ref["cumulative_var"]), (
                f"{who}: with momentum=None the running statistics are the cumulative average "
                "(factor 1/num_batches_tracked, counted this batch included)")
            assert close(g["eval"], ref["eval"][rows(r)]), (
                f"{who}: in eval mode the output must use the running statistics, not the "
                "batch's")


# --- 11.5 the conversion -------------------------------------------------------------------------

def model_with_norms() -> nn.Module:
    """Batch norms at several depths, with running statistics that are not the defaults."""
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3),
        nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 4),
                      nn.BatchNorm1d(4, eps=1e-3, momentum=None)),
        nn.BatchNorm1d(4, affine=False, momentum=0.3))
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for i, m in enumerate(norms):
        m.running_mean.uniform_(-1, 1)
        m.running_var.uniform_(0.5, 2)
        m.num_batches_tracked.fill_(5 + i)
    model[2].eval()
    return model


@pytest.mark.task("11.5")
def test_convert_keeps_weights_and_statistics():
    sb = load(LESSON, "sync_bn")
    model = model_with_norms()
    before = {name: m for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    group = object()  # a stand-in: only passed on
    converted = sb.convert_sync_by_hand(model, group)
    after = dict(converted.named_modules())
    assert sorted(after) == sorted(before), (
        f"the converted model's modules are {sorted(after)}, not {sorted(before)}: replace "
        "each batch norm where it is, keep everything else")
    for name, old in before.items():
        new = after[name]
        if not isinstance(old, nn.modules.batchnorm._BatchNorm):
            if name:
                assert new is old, (f"{name}: {type(old).__name__} was replaced; only the "
                                    "batch norms are")
            continue
        assert isinstance(new, sb.SyncBatchNormByHand), (
            f"{name}: still a {type(new).__name__}: every batch norm, at any depth, becomes "
            "a SyncBatchNormByHand (recurse into the children)")
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats",
                     "training"):
            assert getattr(new, attr) == getattr(old, attr), (
                f"{name}: {attr} is {getattr(new, attr)}, not {getattr(old, attr)} as before")
        assert new.group is group, f"{name}: group is {new.group!r}, not the one given"
        if old.affine:
            assert new.weight is old.weight and new.bias is old.bias, (
                f"{name}: weight and bias must be the very same parameters (an optimizer "
                "built on the model keeps stepping them), not copies")
    got = converted.state_dict()
    for key, want in state.items():
        assert key in got, f"the converted model's state dict lacks {key}"
        assert torch.equal(got[key], want), (
            f"the converted model's {key.rsplit('.', 1)[-1]} differs ({key}): copy "
            "running_mean, running_var and num_batches_tracked too")
    top = sb.convert_sync_by_hand(nn.BatchNorm1d(2))
    assert isinstance(top, sb.SyncBatchNormByHand), (
        "converting a batch norm itself must return its replacement")


@pytest.fixture(scope="module")
def conv_reference() -> dict:
    """One process, plain BatchNorm, on every rank's images at once."""
    return rf.train_conv(rf.conv_model(), rf.conv_batches(N), 0, 1)


def state_gap(got: dict, want: dict) -> tuple[float, str]:
    gaps = [((got[k].double() - want[k].double()).abs().max().item(), k)
            for k in want if want[k].is_floating_point()]
    return max(gaps)


@pytest.mark.task("11.5")
@pytest.mark.timeout(TIMEOUT + 50)
def test_converted_convnet_trains_as_one_process(runs, conv_reference):
    want = conv_reference
    for r, res in enumerate(runs):
        got = checked_part(res["converted"])
        gap, key = state_gap(got, want)
        assert gap <= CONV_TOL, (
            f"rank {r} of {N}: the converted ConvNet under DDP, {rf.CONV_PER_RANK} images per "
            f"rank, differs from one process on {rf.CONV_PER_RANK * N} after "
            f"{rf.CONV_STEPS} SGD steps by {gap:.3g} (in {key}): every batch norm must be "
            "replaced, keeping its weights and statistics")


@pytest.mark.timeout(TIMEOUT + 50)
def test_per_rank_batch_norm_is_not_one_process(runs, conv_reference):
    """The lesson's point, on given code: DDP with per-rank BatchNorm trains another model."""
    want = conv_reference
    gap, key = state_gap(runs[0]["per_rank"], want)
    assert gap > 1e-3, (
        f"per-rank BatchNorm under DDP came within {gap:.3g} of one process on the whole "
        "batch: the statistics of 4 images should differ from those of 12")
