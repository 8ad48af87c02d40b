"""Lesson 02: DataParallel by hand, nn.DataParallel training and checkpoints, the timing study.

Every comparison is against a single model on the full batch, computed here with plain torch.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpt.checkpoint import CheckpointError
from dpt.data import TensorLoader
from dpt.device import DeviceError
from dpt.models import MLP, ConvNet
from tests.helpers import (
    one_line_error,
    recording_moves,
    requires_data,
    run_script,
    unsent_message,
)
from tests.l02_data_parallel import reference as ref
from tests.l02_data_parallel.gpus import (
    cpu_data_parallel,
    fake_one_gpu,
    full_fp32,
    tf32_allowed,
    tutorial_cell,
)
from tests.lessons import load, script

LESSON = "02_data_parallel"


@pytest.fixture
def dbh():
    return load(LESSON, "dp_by_hand")


@pytest.fixture
def dp_mod():
    return load(LESSON, "data_parallel")


@pytest.fixture
def timing():
    return load(LESSON, "dp_timing")


def _data(b, seed=0, image=True):
    g = torch.Generator().manual_seed(seed)
    shape = (b, 1, 28, 28) if image else (b, 784)
    return torch.randn(*shape, generator=g), torch.randint(0, 10, (b,), generator=g)


def _model(kind, seed=0):
    torch.manual_seed(seed)
    return {"mlp": MLP, "convnet": lambda: ConvNet(batch_norm=False)}[kind]()


def grad_cause(got: torch.Tensor, want: torch.Tensor) -> str:
    """The likely bug behind a root gradient that differs from the single model's."""
    g, w = got.double().norm().item(), want.double().norm().item()
    if g == 0:
        return "the root's gradient is zero: the replicas' weights are not wired to it"
    ratio = w / g
    if ratio > 1.5 and abs(ratio - round(ratio)) < 0.15:
        return (f"the gradient is {round(ratio)}x too small: the replicas' gradients are "
                "averaged (or only one replica's is kept); Broadcast.backward must SUM them")
    if ratio < 0.67 and abs(1 / ratio - round(1 / ratio)) < 0.15:
        return (f"the gradient is {round(1 / ratio)}x too large: a sample or a replica is "
                "counted more than once (check scatter's chunks and replicate's copies)")
    return ("the gradient differs in direction: a sample is lost or duplicated by scatter, or "
            "outputs come back out of order from parallel_apply/gather")


def _assert_same_grads(model, single):
    for (name, p), q in zip(model.named_parameters(), single.parameters()):
        assert p.grad is not None, f"{name}: no gradient reached the root model"
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-4, atol=1e-6,
            msg=lambda m, name=name, g=p.grad, w=q.grad: f"{name}: {grad_cause(g, w)}\n{m}")


def _patch(monkeypatch, dbh, **keep):
    """Reference versions of every primitive except those named in `keep`."""
    for name in ("scatter", "replicate", "parallel_apply", "gather"):
        if name not in keep:
            monkeypatch.setattr(dbh, name, getattr(ref, name))


# ------------------------------------------------------------------------------ 02.1 scatter


@pytest.mark.task("02.1")
@pytest.mark.parametrize("b,n,sizes", [(8, 2, [4, 4]), (7, 3, [3, 3, 1]), (10, 3, [4, 4, 2]),
                                       (2, 3, [1, 1]), (5, 1, [5])])
def test_scatter_splits_the_batch_dimension_and_keeps_every_sample(dbh, b, n, sizes):
    x = torch.arange(b * 6, dtype=torch.float32).reshape(b, 2, 3)
    chunks = dbh.scatter(x, n)
    assert [c.shape[0] for c in chunks] == sizes, "chunk sizes: ceil(B/n), last one shorter"
    for c in chunks:
        assert c.shape[1:] == x.shape[1:], "split along dimension 0 (the batch), not another"
    torch.testing.assert_close(torch.cat(chunks), x, msg="chunks must be in order, none lost")


def test_scatter_refuses_fewer_than_one_chunk(dbh):
    # given code, before the task: checked with no answer written
    for n in (0, -2):
        try:
            dbh.scatter(torch.zeros(4, 2), n)
        except ValueError as exc:
            assert "at least 1" in str(exc), str(exc)
        except Exception as exc:  # noqa: BLE001 - what a lost check lets through
            pytest.fail(f"scatter(x, {n}) raised {type(exc).__name__}: {exc}; keep the check "
                        "that n >= 1 (ValueError 'n must be at least 1') before dividing by n")
        else:
            pytest.fail(f"scatter(x, {n}) returned chunks: keep the check that n >= 1")


def test_data_parallel_by_hand_refuses_fewer_than_one_replica(dbh):
    # given code, before the task: checked with no answer written
    try:
        dbh.DataParallelByHand(nn.Linear(2, 2), n_replicas=-2)
    except ValueError as exc:
        assert "at least 1" in str(exc), str(exc)
    else:
        pytest.fail("DataParallelByHand(model, n_replicas=-2) was accepted: keep the check that "
                    "n_replicas >= 1 in __init__, or the mistake only shows at the first "
                    "forward, deep inside scatter")


# ---------------------------------------------------------------------------- 02.2 replicate


@pytest.mark.task("02.2")
@pytest.mark.parametrize("n", [2, 3])
def test_replicas_compute_what_the_root_computes_with_copies_of_its_weights(dbh, n):
    model = _model("mlp")
    x, _ = _data(5, image=False)
    replicas = dbh.replicate(model, n)
    assert len(replicas) == n
    expected = model(x)
    root_params = list(model.parameters())
    for r in replicas:
        assert r is not model and isinstance(r, type(model))
        torch.testing.assert_close(
            r(x), expected, msg=lambda m: "a replica computes something else than the root: its "
            f"parameters must be copies of the root's, every one of them\n{m}")
        rp = list(r.parameters())
        assert len(rp) == len(root_params)
        for p, q in zip(rp, root_params):
            assert p is not q, "a replica holds copies, not the root's parameter objects"
            assert p.grad_fn is not None, \
                "replica weights must be Broadcast outputs, or no gradient reaches the root"
            torch.testing.assert_close(
                p, q, msg=lambda m: f"a replica's parameter is not a copy of the root's\n{m}")
    with torch.no_grad():
        assert not dbh.replicate(model, n)[1](x).requires_grad


class _Counting(nn.Module):
    """State changed inside forward: a Python counter and an in-place buffer counter."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.python_calls = 0
        self.register_buffer("buffer_calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.python_calls += 1  # rebinds an attribute of the replica object
        self.buffer_calls += 1  # in place on the replica's buffer tensor
        return self.lin(x)


@pytest.mark.task("02.2")
def test_caveat_state_changed_in_forward_on_replicas_is_lost(dbh):
    """DataParallel's caveat: only in-place updates on replica 0 (sharing the root's buffers) stay."""
    model = _Counting()
    x = torch.randn(6, 4)
    replicas = dbh.replicate(model, 3)
    for r, c in zip(replicas, ref.scatter(x, 3)):
        r(c)
    assert model.python_calls == 0, "the replicas' counter changes never reach the root"
    assert model.buffer_calls.item() == 1, \
        "replica 0 shares the root's buffers (counts 1 call); the other replicas' copies are lost"
    assert [r.buffer_calls.item() for r in replicas] == [1, 1, 1]


@pytest.mark.task("02.2")
def test_caveat_batch_norm_running_stats_come_from_replica_0_only(dbh):
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3).train()
    x = torch.randn(9, 3) * torch.tensor([1.0, 3.0, 0.5]) + torch.arange(9.0)[:, None]
    chunks = ref.scatter(x, 3)
    for r, c in zip(dbh.replicate(bn, 3), chunks):
        r(c)
    only_first, full = nn.BatchNorm1d(3).train(), nn.BatchNorm1d(3).train()
    only_first(chunks[0])
    full(x)
    why = ("the root's running statistics must come from replica 0's chunk only: replica 0 "
           "shares the root's buffers, the other replicas get clones")
    torch.testing.assert_close(bn.running_mean, only_first.running_mean,
                               msg=lambda m: f"{why}\n{m}")
    torch.testing.assert_close(bn.running_var, only_first.running_var,
                               msg=lambda m: f"{why}\n{m}")
    assert not torch.allclose(bn.running_mean, full.running_mean)
    assert bn.num_batches_tracked.item() == 1


@pytest.mark.task("02.2")
def test_tied_weights_stay_tied_in_each_replica(dbh):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = self.a

        def forward(self, x):
            return self.b(self.a(x))

    model = Tied()
    for r in dbh.replicate(model, 2):
        assert r.a.weight is r.b.weight
        assert len(list(r.parameters())) == 2


@pytest.mark.task("02.2")
def test_replicate_keeps_absent_parameters_and_buffers_absent(dbh):
    # bias=False and track_running_stats=False leave None in _parameters and _buffers
    model = nn.Sequential(nn.Linear(4, 3, bias=False),
                          nn.BatchNorm1d(3, track_running_stats=False))
    x = torch.randn(6, 4)
    try:
        replicas = dbh.replicate(model, 2)
    except (KeyError, AttributeError, TypeError) as exc:
        pytest.fail(f"replicate failed on a Linear without bias and a BatchNorm without running "
                    f"statistics ({type(exc).__name__}: {exc}): a module's _parameters and "
                    "_buffers may hold None; skip those entries")
    for r in replicas:
        assert r[0].bias is None and r[1].running_mean is None
        torch.testing.assert_close(r(x), model(x))


# -------------------------------------------------------------------- 02.3 gradients summed


@pytest.mark.task("02.3")
@pytest.mark.parametrize("n", [2, 3])
def test_broadcast_backward_sums_the_replicas_gradients_onto_the_root(dbh, n):
    w = torch.randn(3, requires_grad=True)
    b = torch.randn(2, requires_grad=True)
    copies = dbh.Broadcast.apply(n, w, b)
    assert len(copies) == 2 * n
    for r in range(n):
        torch.testing.assert_close(copies[2 * r], w.detach(), msg="Broadcast's forward "
                                   "returns the k tensors for replica 0, then for replica 1, ...")
        torch.testing.assert_close(copies[2 * r + 1], b.detach(), msg="Broadcast's forward "
                                   "returns the k tensors for replica 0, then for replica 1, ...")
    loss = sum((r + 1) * copies[2 * r].sum() + (r + 2) * copies[2 * r + 1].sum() for r in range(n))
    loss.backward()
    total_w = sum(r + 1 for r in range(n))
    torch.testing.assert_close(
        w.grad, torch.full((3,), float(total_w)),
        msg=lambda m: f"w.grad: {grad_cause(w.grad, torch.full((3,), float(total_w)))}\n{m}")
    total_b = float(sum(r + 2 for r in range(n)))
    torch.testing.assert_close(
        b.grad, torch.full((2,), total_b),
        msg=lambda m: f"b.grad: {grad_cause(b.grad, torch.full((2,), total_b))}; grads arrive "
                      f"replica by replica, k per replica\n{m}")


# ------------------------------------------------------------------------ 02.4 parallel apply


class _Meet(nn.Module):
    """Forward waits until every replica is inside forward: only passes if they run together."""

    def __init__(self, barrier, scale, delay=0.0):
        super().__init__()
        self.barrier, self.scale, self.delay = barrier, scale, delay

    def forward(self, x):
        self.thread = threading.get_ident()
        self.barrier.wait(timeout=10)
        self.grad_mode = torch.is_grad_enabled()
        time.sleep(self.delay)  # the later replicas finish first
        return x * self.scale


@pytest.mark.task("02.4")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_parallel_apply_runs_replicas_at_once_and_keeps_the_order(dbh, n):
    barrier = threading.Barrier(n)
    replicas = [_Meet(barrier, k + 1.0, delay=0.1 * (n - 1 - k)) for k in range(n)]
    inputs = [torch.full((2,), 10.0 * k) for k in range(n)]
    try:
        outs = dbh.parallel_apply(replicas, inputs)
    except threading.BrokenBarrierError:
        pytest.fail("replicas did not run concurrently (one thread per replica)")
    for k, o in enumerate(outs):
        torch.testing.assert_close(o, inputs[k] * (k + 1.0), msg="outputs must keep input "
                                   "order, not the order the replicas finish in")
    assert len({r.thread for r in replicas}) == n


@pytest.mark.task("02.4")
@pytest.mark.timeout(60)
def test_parallel_apply_carries_grad_mode_into_the_threads_and_raises_errors(dbh):
    lin = nn.Linear(3, 2)
    xs = [torch.randn(2, 3), torch.randn(1, 3)]
    assert all(o.requires_grad for o in dbh.parallel_apply([lin, lin], xs))
    with torch.no_grad():
        outs = dbh.parallel_apply([lin, lin], xs)
    assert not any(o.requires_grad for o in outs), "torch.no_grad() must hold in the threads"

    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("replica exploded")

    with pytest.raises(RuntimeError, match="replica exploded"):
        dbh.parallel_apply([lin, Boom()], xs)


def test_parallel_apply_refuses_replicas_and_inputs_of_different_counts(dbh):
    # given code, before the task: checked with no answer written
    lin = nn.Linear(3, 2)
    for replicas, inputs in (([lin] * 3, [torch.randn(2, 3)] * 2),
                             ([lin] * 2, [torch.randn(2, 3)] * 3)):
        try:
            dbh.parallel_apply(replicas, inputs)
        except ValueError as exc:
            assert "replicas but" in str(exc), str(exc)
        else:
            pytest.fail(f"parallel_apply with {len(replicas)} replicas and {len(inputs)} inputs "
                        "returned outputs: keep the check that the counts match (zip silently "
                        "drops a replica, or a chunk and its samples)")


def test_intra_op_threads_restores_the_count_even_when_the_block_raises(dbh):
    # given code: a replica that raises must not leave torch with a share of the cores
    before = torch.get_num_threads()
    try:
        with pytest.raises(KeyError), dbh.intra_op_threads(before + 1):
            assert torch.get_num_threads() == before + 1
            raise KeyError("a replica raised")
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)  # the other tests get their count back either way
    assert after == before, (
        f"after a block that raised, intra_op_threads left torch with {after} threads, not "
        f"{before}: restore the count in a finally:")


# -------------------------------------------------------------------------------- 02.5 gather


@pytest.mark.task("02.5")
def test_gather_concatenates_in_order_and_routes_gradients_back(dbh):
    parts = [torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True),
             torch.randn(1, 4, requires_grad=True)]
    out = dbh.gather(parts)
    torch.testing.assert_close(out, torch.cat([p.detach() for p in parts]),
                               msg="gather must concatenate the outputs along dim 0, in order")
    weights = torch.arange(7.0)[:, None].expand(7, 4)
    (out * weights).sum().backward()
    routed = ("in backward each output must get its own slice of the gradient: gather with a "
              "differentiable op (torch.cat), in order")
    torch.testing.assert_close(parts[2].grad, torch.full((1, 4), 6.0), msg=routed)
    torch.testing.assert_close(parts[0].grad, weights[:3], msg=routed)
    assert dbh.gather(parts, "cpu").shape == (7, 4)
    meta = torch.device("meta")  # a device other than the CPU that every machine has
    moved = dbh.gather([p.detach() for p in parts], meta)
    assert moved.device == meta and moved.shape == (7, 4), (
        f"gather(outputs, device=meta) returned a tensor on {moved.device}: the outputs must "
        "end up on `device` (the root, where the loss is computed); only None leaves them")


# ---------------------------------------------------------------- 02.6 the whole DP forward


@pytest.mark.task("02.6")
@pytest.mark.parametrize("n,b", [(2, 7), (3, 7)])
def test_forward_composes_the_four_steps(dbh, monkeypatch, n, b):
    _patch(monkeypatch, dbh)
    seen = []
    monkeypatch.setattr(dbh, "parallel_apply",
                        lambda reps, xs, devices=None: seen.append([len(x) for x in xs])
                        or ref.parallel_apply(reps, xs))
    model = _model("mlp")
    single = copy.deepcopy(model)
    x, y = _data(b, image=False)
    out = dbh.DataParallelByHand(model, n_replicas=n)(x)
    assert seen and len(seen[0]) == n and sum(seen[0]) == b, "forward must scatter into n chunks"
    F.cross_entropy(out, y).backward()
    F.cross_entropy(single(x), y).backward()
    torch.testing.assert_close(out, single(x), msg=lambda m: "forward must return the gathered "
                               f"outputs of every chunk, in order\n{m}")
    _assert_same_grads(model, single)


class _CountThreads(nn.Module):
    """Records torch's intra-op thread count every time it runs (replicas share the list)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.threads_seen = []

    def forward(self, x):
        self.threads_seen.append(torch.get_num_threads())
        return self.lin(x)


@pytest.mark.task("02.6")
def test_forward_runs_the_replicas_with_threads_per_replica_threads(dbh, monkeypatch):
    _patch(monkeypatch, dbh)  # the reference primitives run the replicas in this thread
    model = _CountThreads()
    monkeypatch.setattr(dbh, "cpu_budget", lambda: 8)  # an 8-core machine
    defaults = {n: dbh.DataParallelByHand(model, n_replicas=n).threads_per_replica
                for n in (1, 2, 3)}
    assert defaults == {1: 8, 2: 4, 3: 2}, (
        f"on 8 cores, 1, 2 and 3 replicas get {defaults} threads each by default: the cores "
        "must be split among the replicas (cpu_budget() // n_replicas, at least 1)")
    before = torch.get_num_threads()
    want = before + 1  # any count but the current one
    dbh.DataParallelByHand(model, n_replicas=2, threads_per_replica=want)(torch.randn(4, 4))
    assert model.threads_seen, "forward never ran the model"
    assert set(model.threads_seen) == {want}, (
        f"the replicas ran with {sorted(set(model.threads_seen))} intra-op thread(s), not "
        f"threads_per_replica={want}: run parallel_apply inside "
        "intra_op_threads(self.threads_per_replica), or N replicas oversubscribe the cores")
    assert torch.get_num_threads() == before, (
        "forward left torch's thread count changed: set it only inside the block "
        "(intra_op_threads restores it)")


@pytest.mark.task("02.6")
@pytest.mark.parametrize("kind", ["mlp", "convnet"])
@pytest.mark.parametrize("n,b", [(2, 8), (2, 7), (3, 7), (3, 10), (3, 2)])
def test_outputs_and_gradients_equal_a_single_model_on_the_full_batch(dbh, kind, n, b):
    model = _model(kind)
    single = copy.deepcopy(model)
    x, y = _data(b, image=kind == "convnet")
    dp = dbh.DataParallelByHand(model, n_replicas=n)
    assert dp.module is model
    out = dp(x)
    expected = single(x)
    assert out.shape == expected.shape, "every sample's output, including the short last chunk"
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5, msg=lambda m: "outputs "
                               "differ from one model on the full batch: a chunk lost, "
                               f"duplicated or out of order\n{m}")
    F.cross_entropy(out, y).backward()
    F.cross_entropy(expected, y).backward()
    _assert_same_grads(model, single)


@pytest.mark.task("02.6")
@pytest.mark.parametrize("n", [2, 3])
def test_training_steps_equal_single_device_training(dbh, n):
    model = _model("convnet", seed=1)
    single = copy.deepcopy(model)
    dp = dbh.DataParallelByHand(model, n_replicas=n)
    opt = torch.optim.SGD(dp.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(single.parameters(), lr=0.05, momentum=0.9)
    for step, b in enumerate([16, 16, 11, 16, 5]):  # uneven batches too
        x, y = _data(b, seed=step)
        for m, o in ((dp, opt), (single, ref_opt)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    for (name, p), q in zip(model.named_parameters(), single.parameters()):
        torch.testing.assert_close(
            p, q, rtol=1e-4, atol=1e-5,
            msg=lambda m, n=name: f"{n}: weights drift from single-device training; a gradient "
                                  f"averaged instead of summed gives N times smaller steps\n{m}")


@pytest.mark.task("02.6")
def test_eval_mode_batch_norm_model_matches_and_no_grad_builds_no_graph(dbh):
    torch.manual_seed(0)
    model = ConvNet().eval()
    x, _ = _data(9)
    with torch.no_grad():
        out = dbh.DataParallelByHand(model, n_replicas=3)(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5, msg=lambda m: "eval mode: "
                               f"replicas must use the root's running statistics\n{m}")


@pytest.mark.task("02.6")
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs")
def test_by_hand_on_two_cuda_gpus_computes_what_one_gpu_computes(dbh):
    root = torch.device("cuda", 0)
    model = _model("convnet").to(root)
    single = copy.deepcopy(model)
    x, y = (t.to(root) for t in _data(7))  # chunks of 4 and 3
    dp = dbh.DataParallelByHand(model, device_ids=[0, 1])
    with full_fp32():  # TF32 convolutions would differ in the third digit
        out, expected = dp(x), single(x)
        assert out.device == root, f"the outputs were gathered on {out.device}, not on {root}"
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5, msg=lambda m: "outputs "
                                   f"over GPUs 0 and 1 differ from one GPU's\n{m}")
        F.cross_entropy(out, y).backward()
        F.cross_entropy(expected, y).backward()
    _assert_same_grads(model, single)


# ------------------------------------------------------- 02.7 / 02.8 nn.DataParallel training


@pytest.mark.task("02.7")
def test_wrap_puts_the_model_on_the_root_and_trains_like_one_device(dp_mod):
    model = _model("convnet")
    single = copy.deepcopy(model)
    with recording_moves() as moves:
        dp, root = dp_mod.wrap(model)
    assert isinstance(dp, nn.DataParallel) and dp.module is model
    expected_root = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() else "cpu"
    assert root.type == expected_root
    assert next(model.parameters()).device.type == expected_root
    assert moves.module_sent(model, root), (
        "wrap never sent the model to the root device: nn.DataParallel needs the weights on "
        "device_ids[0] before it wraps them. Move it first (model.to(root))")
    # The plain model trains on the root as well, and in full fp32: a GPU's kernels differ
    # from the CPU's in the last digits, and by default Ampere+ GPUs convolve in TF32.
    single.to(root)
    opt = torch.optim.SGD(dp.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(single.parameters(), lr=0.05)
    with full_fp32():
        for step in range(3):
            x, y = _data(6, seed=step)
            with recording_moves() as moves:
                moves.watch(x, y)
                dp_mod.train_step(dp, (x, y), opt, root)
            problem = unsent_message(moves, root, "the batch", "train_step")
            assert not problem, problem
            ref_opt.zero_grad()
            F.cross_entropy(single(x.to(root)), y.to(root)).backward()
            ref_opt.step()
    for p, q in zip(model.parameters(), single.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=lambda m: "the wrapped "
                                   f"model must train exactly like the plain one\n{m}")


def test_full_fp32_turns_tf32_off_inside_the_block_and_back_after():
    # the helper the GPU comparisons above rely on (TF32 is a CUDA matter, its switches exist
    # in every torch build)
    before = tf32_allowed()
    for raises in (False, True):
        try:
            with full_fp32():
                assert not tf32_allowed(), "full_fp32() left TF32 convolutions allowed"
                if raises:
                    raise KeyError("inside")
        except KeyError:
            pass
        assert tf32_allowed() == before, "full_fp32() did not put the TF32 switch back"


@pytest.mark.task("02.7")
def test_wrap_makes_the_first_device_id_the_root(dp_mod, monkeypatch):
    # a 2-GPU machine, faked: nothing is moved or wrapped for real
    monkeypatch.setattr(dp_mod, "gpu_count", lambda: 2)
    sent = []
    monkeypatch.setattr(nn.Module, "to", lambda self, *a, **k: sent.append(
        torch.device(a[0] if a else k["device"])) or self)
    monkeypatch.setattr(nn, "DataParallel", lambda module, device_ids=None, **k:
                        SimpleNamespace(module=module, device_ids=device_ids))
    for ids, root in (([1, 0], torch.device("cuda", 1)), (None, torch.device("cuda", 0))):
        sent.clear()
        dp, got = dp_mod.wrap(_model("mlp"), ids)
        assert got == root and root in sent, (
            f"wrap(model, device_ids={ids}) made {got} the root and sent the model to {sent}: "
            f"the root is device_ids[0] ({root}; cuda:0 when no ids are given), where "
            "nn.DataParallel wants the weights and gathers the outputs")
        assert dp.device_ids == ids, "pass device_ids on to nn.DataParallel"


@pytest.mark.task("02.7")
@pytest.mark.timeout(60)
def test_training_run_limits_its_batches_reloads_and_is_reproducible(dp_mod, monkeypatch,
                                                                      tmp_path):
    x, y = _data(48)
    monkeypatch.setattr(dp_mod, "prepare", lambda *a, **k: None)  # no dataset: 48 samples
    monkeypatch.setattr(dp_mod, "make_loader",
                        lambda *a, batch_size=4, **k: TensorLoader(x, y, batch_size=4))
    built = []  # the trained model, then the plain one the checkpoint is reloaded into
    real_build = dp_mod.build_model
    monkeypatch.setattr(dp_mod, "build_model", lambda name: built.append(real_build(name))
                        or built[-1])
    args = dp_mod.build_parser().parse_args(
        ["--model", "mlp", "--epochs", "2", "--limit-batches", "3", "--no-progress",
         "--checkpoint", str(tmp_path / "dp.pt")])
    result = dp_mod.run(args)
    assert len(result["losses"]) == 2 * 3, (
        f"--epochs 2 --limit-batches 3 took {len(result['losses'])} steps, not 6: each epoch "
        "stops after exactly --limit-batches batches")
    assert 0.0 <= result["accuracy"] <= 1.0 and len(built) == 2
    for (k, v), w in zip(built[0].state_dict().items(), built[1].state_dict().values()):
        torch.testing.assert_close(w, v.cpu(), msg=f"{k}: --checkpoint's plain model is not the "
                                   "trained one: reload the saved file into it (load_plain) "
                                   "before reporting its accuracy")
    saved = torch.load(tmp_path / "dp.pt", weights_only=True)
    assert saved.get("epoch") == 2, (
        f"--epochs 2 --checkpoint saved epoch={saved.get('epoch')!r}: record the epochs trained "
        "with the weights (save_plain(..., epoch=args.epochs))")
    again = dp_mod.run(args)
    # approx: on GPUs a sum may come in another order from one run to the next
    assert again["losses"] == pytest.approx(result["losses"], rel=1e-5, abs=1e-7), (
        "two runs with the same --seed gave different losses: seed torch "
        "(torch.manual_seed(args.seed)) before the model is built")


@pytest.mark.task("02.7")
@pytest.mark.timeout(60)
def test_training_run_passes_its_flags_on(dp_mod, monkeypatch):
    x, y = _data(16)
    monkeypatch.setattr(dp_mod, "prepare", lambda *a, **k: None)  # no dataset: 16 samples
    loaders, made = [], []  # make_loader's keywords, and the loader each call returned
    monkeypatch.setattr(dp_mod, "make_loader", lambda *a, **k: loaders.append(k)
                        or made.append(TensorLoader(x, y, batch_size=4)) or made[-1])
    measured = []  # the loader each accuracy() call was given
    real_accuracy = dp_mod.accuracy
    monkeypatch.setattr(dp_mod, "accuracy", lambda model, loader, device: measured.append(loader)
                        or real_accuracy(model, loader, device))
    rates = []
    real_sgd = torch.optim.SGD
    monkeypatch.setattr(torch.optim, "SGD", lambda params, lr, **k: rates.append(lr)
                        or real_sgd(params, lr=lr, **k))
    args = dp_mod.build_parser().parse_args(
        ["--model", "mlp", "--limit-batches", "2", "--no-progress", "--seed", "5",
         "--lr", "0.125", "--batch-size", "4"])
    dp_mod.run(args)
    assert rates == [0.125], f"--lr 0.125 built SGD with lr {rates}: pass lr=args.lr"
    train = [k for k in loaders if k.get("train")]
    test = [k for k in loaders if not k.get("train")]
    assert len(train) == 1 and len(test) == 1, (
        f"make_loader was called with train={[k.get('train') for k in loaders]}: the accuracy "
        "must be measured on the test set (train=False), not on the training data")
    assert train[0].get("seed") == 5 and train[0].get("batch_size") == 4, (
        f"the training loader got {train[0]}: pass --seed and --batch-size on "
        "(seed=args.seed, batch_size=args.batch_size), or every seed shuffles the same way")
    test_loader = next(m for k, m in zip(loaders, made) if not k.get("train"))
    assert measured and all(m is test_loader for m in measured), (
        "the reported accuracy was measured on the training loader: the test loader "
        "(make_loader(train=False)) is built, so pass it to accuracy(dp_model, test, root); "
        "accuracy on the training data hides overfitting")


def test_training_run_hands_its_device_ids_to_wrap_and_uses_momentum(dp_mod, monkeypatch):
    # given code: wrap (task 02.7) is stood in for, so only run()'s wiring is graded
    x, y = _data(8)
    monkeypatch.setattr(dp_mod, "prepare", lambda *a, **k: None)  # no dataset: 8 samples
    monkeypatch.setattr(dp_mod, "make_loader", lambda *a, **k: TensorLoader(x, y, batch_size=4))
    monkeypatch.setattr(dp_mod, "parse_ids", lambda text: [1, 0])  # as on a 2-GPU machine
    asked = []
    monkeypatch.setattr(dp_mod, "wrap", lambda model, device_ids=None: asked.append(device_ids)
                        or (model, torch.device("cpu")))
    made = []
    real_sgd = torch.optim.SGD
    monkeypatch.setattr(torch.optim, "SGD", lambda params, **k: made.append(k)
                        or real_sgd(params, **k))
    dp_mod.run(dp_mod.build_parser().parse_args(
        ["--model", "mlp", "--device-ids", "1,0", "--limit-batches", "1", "--no-progress"]))
    assert asked == [[1, 0]], (
        f"--device-ids 1,0 reached wrap as device_ids={asked}: pass the parsed ids on "
        "(wrap(model, ids)), or nn.DataParallel uses every visible GPU")
    assert [k.get("momentum") for k in made] == [0.9], (
        f"run() built SGD with {made}: lesson 01's optimizer is SGD with momentum=0.9")


def test_accuracy_puts_back_the_mode_the_model_was_in(dp_mod):
    x, y = _data(8)
    model = _model("convnet")
    for training in (True, False):
        model.train(training)
        acc = dp_mod.accuracy(model, TensorLoader(x, y, batch_size=4), torch.device("cpu"))
        assert 0.0 <= acc <= 1.0
        assert model.training == training, (
            f"accuracy() left a model that was in {'training' if training else 'eval'} mode in "
            f"{'training' if model.training else 'eval'} mode: put back the mode it was in "
            "(model.train(was))")


def test_accuracy_predicts_in_eval_mode_on_batches_sent_to_the_device(dp_mod):
    x, y = _data(8)
    model = _model("convnet").train()
    modes = []
    model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    with recording_moves() as moves:
        acc = dp_mod.accuracy(model, moves.loader(TensorLoader(x, y, batch_size=4)),
                              torch.device("cpu"))
    assert 0.0 <= acc <= 1.0 and modes, "accuracy() never ran the model"
    assert not any(modes), (
        "accuracy() ran the model in training mode: call model.eval() before predicting "
        "(dropout stays on, batch norm uses and updates the batch's statistics)")
    problem = unsent_message(moves, "cpu", "the test batches", "accuracy()")
    assert not problem, problem


def test_train_step_returns_the_loss_as_a_python_float(dp_mod):
    # given code; any module will do (nn.DataParallel's forward just calls it on the CPU)
    model = _model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss = dp_mod.train_step(model, _data(6, image=False), opt, torch.device("cpu"))
    assert type(loss) is float, (
        f"train_step returned a {type(loss).__name__}, not a float: return loss.item(). A list "
        "of loss tensors keeps every step's autograd graph alive, and memory grows each step")


class _SaysZero(nn.Module):
    """Predicts class 0 for every sample, and says whether autograd recorded it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(10))
        self.graphs = []

    def forward(self, x):
        out = (self.w + torch.eye(10)[0]).expand(len(x), 10)  # class 0 wins
        self.graphs.append(out.requires_grad)
        return out


def test_accuracy_counts_a_short_last_batch_and_builds_no_graph(dp_mod):
    # given code: 10 samples in batches of 4, 4 and 2; the first 5 are class 0
    x, _ = _data(10)
    y = torch.tensor([0] * 5 + [1] * 5)
    model = _SaysZero()
    acc = dp_mod.accuracy(model, TensorLoader(x, y, batch_size=4), torch.device("cpu"))
    assert acc == pytest.approx(0.5), (
        f"5 right out of 10 gave an accuracy of {acc:.4f}, not 0.5: count the samples of each "
        "batch (y.numel()); the last batch is short, not batch_size")
    assert model.graphs and not any(model.graphs), (
        "accuracy() built an autograd graph for every test batch: keep @torch.no_grad() on it "
        "(memory and time for nothing)")


def test_parse_ids_refuses_every_gpu_the_machine_lacks(dp_mod, monkeypatch):
    monkeypatch.setattr(dp_mod, "gpu_count", lambda: 2)  # a 2-GPU machine: ids 0 and 1
    assert dp_mod.parse_ids("0,1") == [0, 1] and dp_mod.parse_ids(None) is None
    for text in ("2", "0,2", "-1"):
        try:
            dp_mod.parse_ids(text)
        except DeviceError as exc:
            assert "do not exist" in str(exc)
        else:
            pytest.fail(f"--device-ids {text} was accepted on a machine with GPUs 0 and 1: "
                        "an id is valid when 0 <= id < gpu_count() (id == gpu_count() is one "
                        "too many)")


def test_explain_devices_says_what_dataparallel_does_here(dp_mod):
    text = dp_mod.explain_devices()
    if dp_mod.gpu_count() == 0:
        assert "just calls" in text
    assert len(text) > 40


def test_explain_devices_describes_the_device_ids_it_is_given(dp_mod, monkeypatch):
    monkeypatch.setattr(dp_mod, "gpu_count", lambda: 4)  # a 4-GPU machine, faked
    text = dp_mod.explain_devices([2, 3])
    assert "[2, 3]" in text and "2 chunks" in text and "cuda:2" in text, (
        f"explain_devices([2, 3]) on a 4-GPU machine says {text!r}: describe the --device-ids "
        "given (2 chunks, gathered on cuda:2), not every GPU of the machine")
    assert "[0, 1, 2, 3]" in dp_mod.explain_devices(), "no ids means every visible GPU"


@pytest.mark.task("02.8")
def test_checkpoint_saved_through_module_loads_into_a_plain_model(dp_mod, tmp_path,
                                                                  monkeypatch):
    model = _model("convnet")
    # As on a machine with one GPU, faked: every weight compared here stays on the CPU (a
    # plain nn.DataParallel(model) would send the model to cuda:0 there).
    fake_one_gpu(monkeypatch)
    dp = cpu_data_parallel(model)
    path = dp_mod.save_plain(dp, tmp_path / "dp.pt", epoch=3)
    raw = torch.load(path, weights_only=True)
    assert raw["epoch"] == 3
    assert not any(k.startswith("module.") for k in raw["model"]), "save dp.module's weights"
    plain = ConvNet(batch_norm=False)
    state = dp_mod.load_plain(path, plain)
    assert state["epoch"] == 3
    for p, q in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, msg="load_plain must load the saved weights into the "
                                   "plain model")
    wrapped = cpu_data_parallel(ConvNet(batch_norm=False))
    dp_mod.load_plain(path, wrapped)
    torch.testing.assert_close(wrapped.module.fc.weight, model.fc.weight, msg="load_plain into "
                               "a wrapper must load into its .module")
    with pytest.raises(CheckpointError):
        dp_mod.load_plain(tmp_path / "missing.pt", plain)


@pytest.mark.task("02.8")
def test_load_plain_loads_onto_its_map_location(dp_mod, tmp_path):
    path = dp_mod.save_plain(_model("convnet"), tmp_path / "dp.pt", epoch=1)
    meta = torch.device("meta")  # a device other than the CPU that every machine has
    state = dp_mod.load_plain(path, ConvNet(batch_norm=False).to(meta), map_location=meta)
    where = {str(v.device) for v in state["model"].values()}
    assert where == {"meta"}, (
        f"load_plain(..., map_location=meta) returned tensors on {sorted(where)}: pass "
        "map_location on to the load, so a GPU's checkpoint can be read where it is wanted")


@requires_data
@pytest.mark.slow
@pytest.mark.task("02.7")
@pytest.mark.timeout(120)
def test_training_script_runs_explains_itself_and_reloads(tmp_path):
    proc = run_script(script(LESSON, "data_parallel.py"), "--model", "convnet",
                      "--limit-batches", "15", "--no-progress", "--checkpoint",
                      str(tmp_path / "dp.pt"), timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if not torch.cuda.is_available():
        assert "just calls the wrapped module" in proc.stdout
    assert "reloaded into a plain convnet" in proc.stdout
    assert (tmp_path / "dp.pt").is_file()


def test_training_script_bad_input_is_one_clear_line():
    # the first id past this machine's last GPU (a "7" is a real GPU on an 8-GPU machine)
    past_the_last = str(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    proc = run_script(script(LESSON, "data_parallel.py"), "--device-ids", past_the_last,
                      timeout=60)
    assert "GPU" in one_line_error(proc)


@pytest.mark.parametrize("gpus", [0, 1, 2, 8])
def test_training_cli_refuses_the_id_past_the_last_gpu(dp_mod, monkeypatch, capsys, gpus):
    monkeypatch.setattr(dp_mod, "gpu_count", lambda: gpus)  # a machine with `gpus` GPUs, faked
    monkeypatch.setattr(dp_mod, "prepare", lambda *a, **k: pytest.fail(
        f"--device-ids {gpus} on a {gpus}-GPU machine got past run()'s checks"))
    assert dp_mod.main(["--device-ids", str(gpus)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "GPU" in err[0], err


@pytest.mark.parametrize("args,needle", [(["--batch-size", "0"], "batch"),
                                         (["--device-ids", "a,b"], "device-ids"),
                                         (["--checkpoint", "/no/such/dir/x.pt"], "folder"),
                                         (["--epochs", "0"], "epochs")])
def test_training_cli_rejects_bad_input_with_one_line(dp_mod, monkeypatch, capsys, args, needle):
    monkeypatch.setattr(dp_mod, "prepare", lambda *a, **k: pytest.fail(
        f"data_parallel.py {' '.join(args)} got past run()'s checks and started on the data: "
        "check every flag up front (cli.validate(args)), not after the training"))
    assert dp_mod.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]


# -------------------------------------------------------------------------- 02.9 the timing


class _AsyncDevice:
    """Forward only queues work (like a GPU); synchronize() is when it is paid for.

    Time is virtual: the clocks the timing code may read (``time.perf_counter``,
    ``time.monotonic``, ``time.time``) advance only when queued work is paid for, so the
    result is exact whatever the machine's load.
    """

    def __init__(self, costs):
        self.costs, self.calls, self.pending, self.now = costs, 0, 0.0, 1000.0
        self.grad_modes = []

    def model(self, x):
        self.grad_modes.append(torch.is_grad_enabled())
        self.pending += self.costs[self.calls] if self.calls < len(self.costs) else 0.02
        self.calls += 1
        return x

    def synchronize(self, device):
        self.now += self.pending
        self.pending = 0.0

    def clock(self):
        return self.now


@pytest.mark.task("02.9")
@pytest.mark.timeout(60)
def test_timing_warms_up_synchronizes_and_takes_the_median(timing, monkeypatch):
    # 3 slow warm-up calls, then 5 timed ones of 20 ms, one of them a 500 ms outlier.
    fake = _AsyncDevice([0.2, 0.2, 0.2, 0.02, 0.02, 0.5, 0.02, 0.02])
    monkeypatch.setattr(timing, "synchronize", fake.synchronize)
    for name in ("perf_counter", "monotonic", "time"):
        monkeypatch.setattr(time, name, fake.clock)
    secs = timing.time_forward(fake.model, torch.zeros(1), "cpu", warmup=3, repeats=5)
    monkeypatch.undo()
    assert fake.calls == 8, "warmup + repeats calls of the model"
    assert secs > 0, "the clock was read before synchronize(device): queued work missed"
    assert secs == pytest.approx(0.02), (
        f"median {secs:.3f} s, expected 0.020: warm-up calls were timed, the mean was taken "
        "instead of the median, or the clock was read before synchronize(device)")
    assert not any(fake.grad_modes), "inference is timed under torch.no_grad()"


@pytest.mark.task("02.9")
@pytest.mark.timeout(60)
def test_timing_synchronizes_before_starting_the_clock_and_reports_the_middle_time(
        timing, monkeypatch):
    for name in ("perf_counter", "monotonic", "time"):
        monkeypatch.setattr(time, name, lambda: fake.clock())
    # two slow warm-up calls still queued when the one timed call (20 ms) starts
    fake = _AsyncDevice([0.2, 0.2, 0.02])
    monkeypatch.setattr(timing, "synchronize", fake.synchronize)
    secs = timing.time_forward(fake.model, torch.zeros(1), "cpu", warmup=2, repeats=1)
    assert secs == pytest.approx(0.02), (
        f"one 20 ms call timed as {1000 * secs:.0f} ms: the clock was started before "
        "synchronize(device), so work still queued (here the warm-up's) was timed too; "
        "synchronize before reading the clock as well as after")
    # no warm-up; five calls of 30, 10, 500, 20 and 20 ms: the median is 20 ms
    fake = _AsyncDevice([0.03, 0.01, 0.5, 0.02, 0.02])
    monkeypatch.setattr(timing, "synchronize", fake.synchronize)
    secs = timing.time_forward(fake.model, torch.zeros(1), "cpu", warmup=0, repeats=5)
    monkeypatch.undo()
    assert secs == pytest.approx(0.02), (
        f"{1000 * secs:.0f} ms for calls of 30, 10, 500, 20 and 20 ms: return the median "
        "(20 ms), not the fastest call or the mean")


@pytest.mark.parametrize("warmup,repeats", [(-1, 5), (3, 0)])
def test_time_forward_refuses_impossible_counts(timing, warmup, repeats):
    # given code, before the task: checked with no answer written
    try:
        timing.time_forward(lambda x: x, torch.zeros(1), "cpu", warmup=warmup, repeats=repeats)
    except ValueError as exc:
        assert "need repeats >= 1 and warmup >= 0" in str(exc), str(exc)
    except Exception as exc:  # noqa: BLE001 - what a lost check lets through
        pytest.fail(f"time_forward(warmup={warmup}, repeats={repeats}) raised "
                    f"{type(exc).__name__}: keep the check of both counts up front")
    else:
        pytest.fail(f"time_forward(warmup={warmup}, repeats={repeats}) was accepted: keep the "
                    "check that repeats >= 1 and warmup >= 0 (a negative warm-up runs none)")


@pytest.mark.slow
@pytest.mark.task("02.9")
@pytest.mark.timeout(120)
def test_timing_script_writes_json_and_plot(tmp_path):
    out = tmp_path / "t"
    proc = run_script(script(LESSON, "dp_timing.py"), "--batch-sizes", "2,8", "--devices", "2",
                      "--repeats", "2", "--warmup", "1", "--model", "mlp", "--out", str(out),
                      timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["batch_sizes"] == [2, 8] and len(result["lines"]) >= 2
    for secs in result["lines"].values():
        assert len(secs) == 2 and all(s > 0 for s in secs)
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(60)
def test_sweep_times_each_line_with_its_own_threads(timing, monkeypatch):
    monkeypatch.setattr(timing, "gpu_count", lambda: 0)  # the CPU study, on any machine
    seen = []

    counts = set()

    def fake_time_forward(model, x, device, warmup=3, repeats=10):
        seen.append((model, len(x), torch.get_num_threads()))
        counts.add((warmup, repeats))
        return 0.001

    monkeypatch.setattr(timing, "time_forward", fake_time_forward)
    before = torch.get_num_threads()
    result = timing.sweep([2, 8], 2, "mlp", warmup=0, repeats=1, threads_per_device=1)
    assert counts == {(0, 1)}, (
        f"sweep(warmup=0, repeats=1) called time_forward with (warmup, repeats) {counts}: "
        "pass them in time_forward's order (model, x, device, warmup, repeats), by keyword "
        "to be safe")
    names = list(result["lines"])
    assert len(names) == 3 and all(v == [0.001, 0.001] for v in result["lines"].values())
    assert [b for _, b, _ in seen] == [2, 2, 2, 8, 8, 8], "every line, batch size by batch size"
    one, dp, wide = seen[:3]
    assert one[2] == 1, f"{names[0]!r} ran with {one[2]} intra-op threads, not 1"
    assert isinstance(dp[0], timing.DataParallelByHand) and dp[0].threads_per_replica == 1, (
        "the DP-by-hand line must run 2 replicas of threads_per_device=1 thread each")
    assert wide[2] == 2, (
        f"{names[2]!r} ran with {wide[2]} intra-op threads: the comparison line gives ONE "
        "device all n_devices * threads_per_device threads (2 here), the cores DP uses")
    assert not any(m.training for m in (one[0], dp[0].module, wide[0])), (
        "sweep timed the model in training mode: inference latency is measured in eval mode "
        "(model.eval(): no dropout, batch norm's running statistics)")
    assert torch.get_num_threads() == before, "sweep left torch's thread count changed"


@pytest.mark.timeout(60)
def test_sweep_splits_the_cores_among_the_devices_and_records_what_it_ran(timing, monkeypatch):
    monkeypatch.setattr(timing, "gpu_count", lambda: 0)  # the CPU study, on any machine
    monkeypatch.setattr(timing, "cpu_budget", lambda: 8)  # ... of an 8-core machine

    def fake_time_forward(model, x, device, warmup=3, repeats=10):
        threads.append(getattr(model, "threads_per_replica", None) or torch.get_num_threads())
        return 0.001

    monkeypatch.setattr(timing, "time_forward", fake_time_forward)
    for per_device, want in ((None, 4), (3, 3)):
        threads, lines = [], []
        result = timing.sweep([2], 2, "mlp", warmup=2, repeats=5, threads_per_device=per_device,
                              progress=lines.append)
        assert threads == [want, want, 2 * want], (
            f"sweep(n_devices=2, threads_per_device={per_device}) on 8 cores timed its three "
            f"lines with {threads} threads, not {[want, want, 2 * want]}: each device gets "
            "--threads-per-device threads, by default the cores split among the devices "
            "(cpu_budget() // n_devices)")
        recorded = {k: result.get(k) for k in ("threads_per_device", "warmup", "repeats")}
        assert recorded == {"threads_per_device": want, "warmup": 2, "repeats": 5}, (
            f"the result records {recorded}: record the threads each device really got and "
            "the counts really used (warmup=2, repeats=5), or the JSON misdescribes the run")
        assert len(lines) == 3, (
            f"progress got {len(lines)} lines for 1 batch size x 3 lines: report every "
            "timing as it is taken")


CPU = torch.device("cpu")


def _fake_gpu_sweep(timing, monkeypatch, gpus: int, cores: int = 4):
    """sweep() as on a machine with ``gpus`` GPUs and ``cores`` cores, faked: nothing runs on
    a GPU. Returns the device ids wrap() got (one list per call) and the models timed."""
    monkeypatch.setattr(timing, "gpu_count", lambda: gpus)
    monkeypatch.setattr(timing, "cpu_budget", lambda: cores)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "a faked GPU")
    wrapped, timed = [], []
    monkeypatch.setattr(timing, "wrap", lambda model, device_ids=None: wrapped.append(device_ids)
                        or (SimpleNamespace(module=model, device_ids=device_ids), CPU))
    monkeypatch.setattr(timing, "time_forward", lambda model, x, device, warmup=3, repeats=10:
                        timed.append(model) or 0.001)
    return wrapped, timed


@pytest.mark.parametrize("gpus", [2, 8])
def test_sweep_refuses_more_devices_than_gpus_as_main_does(timing, monkeypatch, gpus):
    wrapped, timed = _fake_gpu_sweep(timing, monkeypatch, gpus)
    try:
        timing.sweep([2], gpus + 1, "mlp", warmup=0, repeats=1)
    except ValueError as exc:
        assert "GPU" in str(exc), str(exc)
    else:
        pytest.fail(f"sweep(n_devices={gpus + 1}) on a {gpus}-GPU machine went on to time "
                    f"nn.DataParallel over device ids {wrapped}, past the last GPU: refuse it "
                    "with the rule main() applies to --devices (resolve_devices)")
    assert not wrapped and not timed, "nothing is timed before the devices are checked"
    timing.sweep([2], None, "mlp", warmup=0, repeats=1)
    assert wrapped == [list(range(gpus))], (
        f"sweep(n_devices=None) on a {gpus}-GPU machine wrapped device ids {wrapped}: "
        "by default N is every GPU")


def test_sweep_on_gpus_times_the_hand_written_data_parallel_too(timing, monkeypatch):
    wrapped, timed = _fake_gpu_sweep(timing, monkeypatch, gpus=4)
    result = timing.sweep([2, 8], 2, "mlp", warmup=0, repeats=1)
    by_hand = [m for m in timed if isinstance(m, timing.DataParallelByHand)]
    assert by_hand and all(m.device_ids == [0, 1] for m in by_hand), (
        f"sweep(n_devices=2) on a 4-GPU machine timed {[type(m).__name__ for m in timed]}: "
        "the hand-written DataParallelByHand over GPUs 0 and 1 must be timed beside "
        "nn.DataParallel, or it never runs on GPUs")
    assert wrapped == [[0, 1]] and len(result["lines"]) == 3, result["lines"]
    assert any("by hand" in name for name in result["lines"]), list(result["lines"])


@pytest.mark.parametrize("gpus,cores", [(0, 2), (1, 2), (0, 1), (2, 16), (8, 4)])
def test_the_notebook_s_timing_cell_asks_for_devices_the_machine_has(timing, monkeypatch,
                                                                     capsys, gpus, cores):
    from dpt.notebook import needs_tasks

    monkeypatch.setattr(timing, "gpu_count", lambda: gpus)  # the machine, faked
    monkeypatch.setattr(timing, "cpu_budget", lambda: cores)
    asked = []

    def sweep_spy(batch_sizes, n_devices=None, *args, **kwargs):
        asked.append(n_devices)
        return _fake_sweep_result(batch_sizes, n_devices)

    monkeypatch.setattr(timing, "sweep", sweep_spy)
    monkeypatch.setattr(timing, "plot", lambda result, path=None: None)
    names = {"dp_timing": timing, "needs_tasks": needs_tasks, "cpu_budget": lambda: cores,
             "plt": SimpleNamespace(show=lambda: None)}
    exec(compile(tutorial_cell(LESSON, "dp_timing.sweep("), "tutorial.py (timing cell)", "exec"),
         names)
    assert len(asked) == 1, "the notebook's timing cell did not run the sweep"
    n = asked[0]
    assert n is None or (n >= 1 and (gpus < 2 or n <= gpus)), (
        f"the notebook's timing cell asked sweep() for {n} devices on a machine with {gpus} "
        f"GPUs and {cores} cores: nn.DataParallel gets device ids past the last GPU. Ask "
        "dp_timing.resolve_devices() for N")
    capsys.readouterr()


def test_timing_script_bad_input_is_one_clear_line():
    proc = run_script(script(LESSON, "dp_timing.py"), "--devices", "0", timeout=60)
    assert "devices" in one_line_error(proc)


@pytest.mark.parametrize("args,needle", [(["--batch-sizes", "x"], "batch-sizes"),
                                         (["--batch-sizes", "0,4"], "positive"),
                                         (["--repeats", "0"], "repeats"),
                                         (["--warmup", "-1"], "warmup")])
def test_timing_cli_rejects_bad_input_with_one_line(timing, monkeypatch, capsys, args, needle):
    monkeypatch.setattr(timing, "sweep", lambda *a, **k: pytest.fail(
        f"dp_timing.py {' '.join(args)} got past main()'s checks and started the sweep: "
        "refuse it up front with one 'error:' line (check every count: --repeats >= 1 and "
        "--warmup >= 0), not with a traceback from inside the timing"))
    assert timing.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]


def _fake_sweep_result(batch_sizes, n_devices, model_name="fashioncnn", *args, **kwargs):
    return {"model": model_name, "n_devices": n_devices, "batch_sizes": batch_sizes,
            "label": "fake", "lines": {"a": [0.002] * len(batch_sizes),
                                       "b": [0.001] * len(batch_sizes)}}


def test_timing_script_passes_its_flags_to_the_sweep(timing, monkeypatch, tmp_path):
    calls = []

    def fake_sweep(batch_sizes, n_devices, model_name="fashioncnn", warmup=3, repeats=10,
                   threads_per_device=None, progress=None):
        calls.append(dict(batch_sizes=batch_sizes, n_devices=n_devices, model_name=model_name,
                          warmup=warmup, repeats=repeats, threads_per_device=threads_per_device))
        return _fake_sweep_result(batch_sizes, n_devices, model_name)

    monkeypatch.setattr(timing, "sweep", fake_sweep)
    monkeypatch.setattr(timing, "plot", lambda result, path=None: None)
    assert timing.main(["--batch-sizes", "2,8", "--devices", "2", "--model", "mlp",
                        "--warmup", "4", "--repeats", "6", "--threads-per-device", "3",
                        "--out", str(tmp_path / "t")]) == 0
    want = dict(batch_sizes=[2, 8], n_devices=2, model_name="mlp", warmup=4, repeats=6,
                threads_per_device=3)
    assert len(calls) == 1, f"main() ran the sweep {len(calls)} times"
    wrong = {k: (calls[0][k], v) for k, v in want.items() if calls[0][k] != v}
    assert not wrong, (
        f"main() ignored flags: sweep() got {{name: (got, asked)}} = {wrong}: pass every "
        "flag on (args.model, args.warmup, args.repeats, args.threads_per_device)")


def test_timing_script_creates_the_out_folder(timing, monkeypatch, tmp_path):
    monkeypatch.setattr(timing, "sweep", _fake_sweep_result)
    monkeypatch.setattr(timing, "plot", lambda result, path=None: None)
    out = tmp_path / "runs" / "new" / "t"  # a folder that does not exist yet
    try:
        code = timing.main(["--batch-sizes", "2", "--devices", "2", "--out", str(out)])
    except FileNotFoundError as exc:
        pytest.fail(f"--out {out} failed with {exc}: create its folder first "
                    "(out.parent.mkdir(parents=True, exist_ok=True))")
    assert code == 0 and out.with_suffix(".json").is_file()


def test_timing_cli_refuses_more_devices_than_gpus(timing, monkeypatch, capsys):
    monkeypatch.setattr(timing, "gpu_count", lambda: 2)  # a 2-GPU machine, faked
    monkeypatch.setattr(timing, "sweep", lambda *a, **k: pytest.fail(
        "dp_timing.py --devices 4 on a 2-GPU machine got past main()'s checks and started the "
        "sweep: refuse more devices than GPUs up front with one 'error:' line"))
    assert timing.main(["--devices", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "GPU" in err[0]


def test_speedup_panel_plots_one_device_time_over_each_line_time(timing, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    import matplotlib.pyplot as plt

    result = {"model": "mlp", "n_devices": 2, "batch_sizes": [2, 8], "label": "fake",
              "lines": {"1 device": [0.004, 0.008], "DP": [0.008, 0.002]}}
    fig = timing.plot(result)
    try:
        dp = [ln for ln in fig.axes[1].get_lines() if ln.get_label() == "DP"]
        assert len(dp) == 1, "the speedup panel must have one line per N-device variant"
        speedup = [float(v) for v in dp[0].get_ydata()]
        assert speedup == pytest.approx([0.5, 4.0]), (
            f"1 device takes 4 and 8 ms, DP 8 and 2 ms, and the speedup panel shows {speedup}, "
            "not [0.5, 4.0]: speedup is t(1 device) / t(N devices), so > 1 means faster; "
            "t(N) / t(1) is the slowdown")
    finally:
        plt.close(fig)
