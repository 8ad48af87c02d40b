"""Lesson 09: a step's peak memory, predicted and measured, and activation checkpointing."""

# Measurements here count the bytes of live tensors (dpt.memory.MemoryTracker): exact, the same
# on every machine (up to a few percent where an asynchronous collective frees its buffers
# earlier or later), so the checks compare them with predictions, never with numbers measured
# once. Time limits only stop hangs; nothing here measures speed.

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dpt.memory import MemoryTracker
from dpt.models import Block, TinyTransformer, token_batch
from dpt.ranks import run_distributed
from tests.l09_fsdp import rank_fns_memory
from tests.lessons import load

LESSON = "09_fsdp"
MiB = 2**20


@pytest.fixture
def mt(monkeypatch):
    """memory_table, with lesson 08's accounting (task 08.1) replaced by the reference, so
    task 09.13 is graded on its own."""
    mod = load(LESSON, "memory_table")
    monkeypatch.setattr(mod, "predict_bytes", reference_predict_bytes)
    return mod


@pytest.fixture
def ac():
    return load(LESSON, "activation_checkpointing")


def reference_predict_bytes(num_params, world_size, stage, param_bytes=4, grad_bytes=4,
                            state_bytes=8):
    k = ("ddp", "zero1", "zero2", "zero3").index(stage)
    n = world_size
    out = {"params": num_params * param_bytes / (n if k >= 3 else 1),
           "grads": num_params * grad_bytes / (n if k >= 2 else 1),
           "optimizer": num_params * state_bytes / (n if k >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def reference_block_bytes(batch, seq_len, dim, heads, mlp_ratio=4, bytes_per_element=4):
    return batch * seq_len * ((8 + 2 * mlp_ratio) * dim + 4 + heads) * bytes_per_element


# --- the measuring tool (given code) ---------------------------------------------------------

def test_the_tracker_counts_known_allocations_views_frees_and_resizes():
    with MemoryTracker() as mem:
        a = torch.empty(MiB)  # 4 MiB
        assert mem.current == 4 * MiB
        b = a * 2
        view = b[1:]  # shares b's memory: nothing new
        assert mem.current == 8 * MiB
        del b
        assert mem.current == 8 * MiB, "a view keeps its storage alive"
        del view
        assert (mem.current, mem.peak) == (4 * MiB, 8 * MiB)
        a.untyped_storage().resize_(0)  # how FSDP2 frees a gathered parameter
        assert mem.current == 0
        a.untyped_storage().resize_(2 * MiB)
        assert mem.current == 2 * MiB
        mem.reset_peak()
        assert mem.peak == 2 * MiB
        del a
        assert mem.current == 0


def test_the_tracker_counts_what_existed_only_when_told():
    outside = torch.zeros(1000)
    model = torch.nn.Linear(100, 10)
    with MemoryTracker() as mem:
        weight_t = model.weight.t()  # a view of an untracked tensor: no new memory
        del weight_t
        assert mem.current == 0
        assert mem.track(model, outside) == 4 * (1000 + 100 * 10 + 10)
        assert mem.track(model) == 4 * (1000 + 100 * 10 + 10), "counted twice"


def test_the_tracker_follows_the_activations_of_a_linear_layer():
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 512)
    x = torch.randn(64, 256)
    with MemoryTracker() as mem:
        mem.track(model, x)
        start = mem.reset_peak()
        loss = model(x).relu().sum()
        # relu keeps its output (64 x 512 fp32); the linear's output is freed
        assert mem.current - start == 64 * 512 * 4 + 4
        loss.backward()
        grads = 4 * (256 * 512 + 512)
        assert mem.current - start == grads + 4  # and the loss
        assert mem.peak - start >= grads + 64 * 512 * 4


# --- 09.13 the peak of one FSDP step -------------------------------------------------------------

UNITS = [1000, 3000, 5000, 2000]  # the root unit, then three blocks of different sizes


def _diagnose(got, want, units=UNITS):
    root, blocks = units[0], sorted(units[1:], reverse=True)
    hints = []
    if got["buffers"] != pytest.approx(want["buffers"]):
        hints.append(
            f"buffers {got['buffers']}, want {want['buffers']}: the units gathered at once are "
            f"the root ({root} parameters, kept gathered) and the largest block ({blocks[0]}), "
            f"plus the next largest ({blocks[1]}) when prefetching, at param_bytes each; and "
            "the full gradients of the root and of the block in backward, at grad_bytes each, "
            "before their reduce-scatter. Not every block: FSDP frees a block after use")
    if got["peak"] != pytest.approx(want["peak"]):
        hints.append(
            f"peak {got['peak']}, want {want['peak']}: parameter shards + optimizer state + "
            "buffers + activations. The sharded gradients are not counted: zero_grad freed "
            "them, and backward has not made them yet")
    return "; ".join(hints) or f"got {got}, want {want}"


@pytest.mark.task("09.13")
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("n", [2, 4])
def test_fsdp_peak_on_a_hand_computed_case(mt, prefetch, n):
    acts = 10_000
    got = mt.predict_peak("fsdp", UNITS, n, acts, prefetch=prefetch)
    total = sum(UNITS)
    gathered = 1000 + 5000 + (3000 if prefetch else 0)
    buffers = 4 * gathered + 4 * (1000 + 5000)
    want = {"params": 4 * total / n, "grads": 4 * total / n, "optimizer": 8 * total / n,
            "buffers": buffers, "activations": acts,
            "peak": 4 * total / n + 8 * total / n + buffers + acts}
    assert set(got) >= set(want), f"predict_peak returned {sorted(got)}; want keys {sorted(want)}"
    assert {k: got[k] for k in want} == pytest.approx(want), _diagnose(got, want)


@pytest.mark.task("09.13")
def test_fsdp_peak_prices_parameters_and_gradients_with_their_own_bytes(mt):
    """Mixed precision: 2-byte gathered parameters, 4-byte gradients, 12 bytes of state."""
    acts = 7_000
    got = mt.predict_peak("fsdp", UNITS, 2, acts, prefetch=True, param_bytes=2, grad_bytes=4,
                          state_bytes=12)
    total = sum(UNITS)
    buffers = 2 * (1000 + 5000 + 3000) + 4 * (1000 + 5000)
    want = {"buffers": buffers, "peak": 2 * total / 2 + 12 * total / 2 + buffers + acts}
    assert {k: got[k] for k in want} == pytest.approx(want), (
        _diagnose(got, {**got, **want}) + ": gathered parameters cost param_bytes each, the "
        "full gradients grad_bytes each")
    assert mt.predict_peak("fsdp2", UNITS, 2, acts, param_bytes=2, grad_bytes=4,
                           state_bytes=12) == pytest.approx(got), (
        "FSDP2 gathers and frees the same units as the FSDP by hand: the same prediction")


@pytest.mark.task("09.13")
def test_fsdp_peak_of_a_single_block_model(mt):
    """One block: nothing to prefetch."""
    got = mt.predict_peak("fsdp", [1000, 4000], 2, 0, prefetch=True)
    assert got["buffers"] == pytest.approx(4 * 5000 + 4 * 5000), (
        f"buffers {got['buffers']} for a root of 1000 and one block of 4000: with a single "
        "block there is no next block to prefetch")


@pytest.mark.task("09.13")
@pytest.mark.timeout(240)
def test_fsdp_prediction_is_near_the_measured_peak_of_fsdp2(mt):
    """torch's FSDP2 (fully_shard per block, then the root) on 2 ranks: one measured step."""
    ranks = run_distributed(rank_fns_memory.measure, world_size=2, args=("fsdp2",),
                            timeout=200)
    for r in ranks:
        pred = mt.predict_peak("fsdp2", r["units"], 2, r["activations"], prefetch=True)
        ratio = pred["peak"] / r["peak"]
        assert 0.88 <= ratio <= 1.12, (
            f"rank {r['rank']}: predicted peak {pred['peak'] / MiB:.3f} MiB, measured "
            f"{r['peak'] / MiB:.3f} MiB ({ratio:.2f}x; buffers predicted "
            f"{pred['buffers'] / MiB:.3f} MiB, activations {r['activations'] / MiB:.3f} MiB): "
            "too high means more is counted than FSDP holds at once (every block gathered? "
            "the sharded gradients, which zero_grad freed?), too low that something held is "
            "missing (the root unit, the prefetched block, the full gradients)")


# --- the table's other rows (given code): lesson 08's resting state, measured ---------------

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_method_keeps_what_lesson_08_predicts_and_peaks_near_the_prediction(mt):
    methods = ("ddp", "zero1", "zero2", "fsdp", "fsdp2")
    for method in methods:
        ranks = run_distributed(rank_fns_memory.measure, world_size=2, args=(method,),
                                timeout=120)
        units = ranks[0]["units"]
        largest = 4 * max(p.numel() for p in TinyTransformer().parameters())
        pred = mt.predict_peak(method, units, 2, ranks[0]["activations"])
        for key in ("params", "grads", "optimizer"):
            # ZeRO gives each rank whole tensors: a rank may hold one more than its share
            slack = 2 * largest if method.startswith("zero") else 0
            for r in ranks:
                assert abs(r[key] - pred[key]) <= slack, (method, key, r[key], pred[key])
            total = sum(r[key] for r in ranks)
            assert total == pytest.approx(2 * pred[key]), (method, key, "lost or duplicated")
        for r in ranks:
            assert 0.8 <= pred["peak"] / r["peak"] <= 1.2, (method, r["peak"], pred["peak"])
            assert r["peak"] > r["params"] + r["optimizer"] + r["activations"] / 2, (
                method, "the peak holds the model, its state and the activations")


# --- 09.14 what one block keeps for backward -----------------------------------------------------

@pytest.mark.task("09.14")
@pytest.mark.parametrize("batch,seq_len,dim,heads,ratio", [
    # the last case has heads != MLP ratio (in the others they coincide) and a small dim, so
    # that one term put in another's place (heads for the ratio) is a wrong answer
    (2, 8, 16, 4, 4), (3, 5, 32, 2, 2), (1, 64, 64, 4, 4), (2, 3, 8, 2, 6)])
def test_block_activations_on_hand_computed_cases(ac, batch, seq_len, dim, heads, ratio):
    got = ac.block_activation_bytes(batch, seq_len, dim, heads, ratio)
    want = reference_block_bytes(batch, seq_len, dim, heads, ratio)
    per_token = f"{(8 + 2 * ratio) * dim} + {4 + heads}"
    assert got == pytest.approx(want, rel=0.02), (
        f"batch {batch}, {seq_len} tokens, dim {dim}, {heads} heads, MLP ratio {ratio}: got "
        f"{got} bytes, want about {want} ({per_token} fp32 elements per token). Count each "
        "tensor once: the inputs of both norms and of the four linears, q, k and v (3 x dim), "
        "the attention output, and the MLP's two 'ratio x dim' tensors (fc1's output, which "
        "GELU keeps, and GELU's output, which fc2 keeps)")
    assert ac.block_activation_bytes(batch, seq_len, dim, heads, ratio,
                                     bytes_per_element=2) == pytest.approx(got / 2), (
        "bytes_per_element=2 (bf16 activations) halves every tensor")


@pytest.mark.task("09.14")
def test_block_activations_match_what_autograd_keeps(ac):
    """Measured: the bytes a real Block's forward leaves alive, its input included, not its
    output."""
    torch.manual_seed(0)
    b, t, d, h = 2, 32, 32, 4
    block = Block(d, h)
    with MemoryTracker() as mem:
        mem.track(block)
        x = torch.randn(b, t, d, requires_grad=True)
        start = mem.current
        out = block(x)
        measured = mem.current - start - out.numel() * 4 + x.numel() * 4
    got = ac.block_activation_bytes(b, t, d, h)
    assert got == pytest.approx(measured, rel=0.03), (
        f"a Block(dim={d}, heads={h}) on {b} x {t} tokens keeps {measured} bytes for backward "
        f"(measured, its input included); the prediction says {got}")


# --- 09.15 a stack of blocks, with and without checkpointing -------------------------------------

@pytest.mark.task("09.15")
@pytest.mark.parametrize("layers", [1, 3, 8])
def test_stack_without_checkpointing_keeps_every_block(ac, layers):
    assert ac.stack_activation_bytes(1000, 60, layers, checkpointed=False) == 1000 * layers, (
        "without checkpointing, every block's activations are alive when backward starts")


@pytest.mark.task("09.15")
@pytest.mark.parametrize("layers", [1, 3, 8])
def test_stack_with_checkpointing_keeps_inputs_and_rebuilds_one_block(ac, layers):
    got = ac.stack_activation_bytes(1000, 60, layers, checkpointed=True)
    want = 60 * layers + (1000 - 60)
    assert got == want, (
        f"{layers} checkpointed blocks of 1000 bytes, inputs of 60: got {got}, want {want}: "
        "each block keeps only its input (60 x layers); backward rebuilds one block at a time, "
        "the rest of its 1000 bytes (its input is already counted)")


# --- 09.16 checkpointing the blocks -----------------------------------------------------------

SMALL = {"vocab": 64, "dim": 32, "heads": 4, "layers": 4, "seq_len": 64}


def _loss_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.task("09.16")
@pytest.mark.parametrize("frozen_embeddings", [False, True])
def test_checkpointed_model_gives_the_same_loss_and_gradients(ac, frozen_embeddings):
    torch.manual_seed(0)
    plain = TinyTransformer(**SMALL)
    ckpt = ac.CheckpointedTransformer(**SMALL)
    ckpt.load_state_dict(plain.state_dict())
    for m in (plain, ckpt):  # frozen: the blocks' input needs no gradient
        m.embed.weight.requires_grad_(not frozen_embeddings)
        m.pos.weight.requires_grad_(not frozen_embeddings)
    x, y = token_batch(4, SMALL["seq_len"], SMALL["vocab"], seed=3)
    loss_p, grads_p = _loss_and_grads(plain, x, y)
    loss_c, grads_c = _loss_and_grads(ckpt, x, y)
    assert torch.equal(loss_p, loss_c), f"loss {loss_c.item()} against {loss_p.item()} without"
    missing = [n for n, g in grads_c.items() if g is None and grads_p[n] is not None]
    if any(not n.startswith("blocks.") for n in missing):
        why = ("nothing before the blocks gets one either: the blocks' outputs are not in "
               "autograd's graph (computed under torch.no_grad, or detached?)")
    else:
        why = ("with use_reentrant=True a checkpointed block whose input needs no gradient "
               "gives its parameters none; use use_reentrant=False")
    assert not missing, f"no gradient for {missing[:3]}...: {why}"
    wrong = [n for n, g in grads_c.items() if g is not None and not torch.equal(g, grads_p[n])]
    assert not wrong, (f"gradients differ from the plain model's for {wrong[:3]}: the recomputed "
                       "forward must be the block's own forward, on the same input")


@pytest.mark.task("09.16")
def test_each_block_runs_its_forward_again_in_backward(ac):
    torch.manual_seed(0)
    model = ac.CheckpointedTransformer(**SMALL)
    calls = [0] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, args, i=i: calls.__setitem__(i, calls[i] + 1))
    x, y = token_batch(2, SMALL["seq_len"], SMALL["vocab"], seed=1)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    after_forward = list(calls)
    loss.backward()
    assert after_forward == [1] * len(calls), (
        f"forward calls per block after the forward: {after_forward}, want one each")
    assert calls == [2] * len(calls), (
        f"forward calls per block after backward: {calls}, want two each: a checkpointed block "
        "runs its forward again in backward (torch.utils.checkpoint.checkpoint around each "
        "block)")


@pytest.mark.task("09.16")
def test_checkpointing_lowers_the_peak_by_about_the_predicted_saving(ac):
    """Activations dominate here (a small model, long sequences): the peak of a forward +
    backward falls by about (layers - 1) x (a block's activations - its input)."""
    config = {**SMALL, "seq_len": 128}
    b, t, d, h, layers = 4, config["seq_len"], config["dim"], config["heads"], config["layers"]
    x, y = token_batch(b, t, config["vocab"], seed=0)
    peaks = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = (ac.CheckpointedTransformer if checkpointed else TinyTransformer)(**config)
        with MemoryTracker() as mem:
            mem.track(model, x, y)
            start = mem.reset_peak()
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            peaks[checkpointed] = mem.peak - start
    block, inp = reference_block_bytes(b, t, d, h), b * t * d * 4
    saving = (layers - 1) * (block - inp)
    measured = peaks[False] - peaks[True]
    assert 0.8 <= measured / saving <= 1.25, (
        f"peak without checkpointing {peaks[False] / MiB:.2f} MiB, with {peaks[True] / MiB:.2f} "
        f"MiB: it fell by {measured / MiB:.2f} MiB, the prediction says about "
        f"{saving / MiB:.2f}. Checkpoint each block on its own (all blocks in one checkpoint "
        "rebuild them all at once), and let torch.utils.checkpoint keep only the input")


@pytest.mark.task("09.16")
@pytest.mark.timeout(240)
def test_checkpointing_lowers_every_ranks_peak_under_ddp(ac):
    ranks = run_distributed(rank_fns_memory.checkpointing_per_rank, world_size=2,
                            kwargs={"batch": 2, "seq_len": 64, "layers": 4, "steps": 1},
                            timeout=200)
    for r in ranks:
        plain, ckpt = r["plain"]["peak"], r["checkpointed"]["peak"]
        assert ckpt < 0.6 * plain, (
            f"rank {r['rank']}: peak {ckpt / MiB:.2f} MiB with checkpointing against "
            f"{plain / MiB:.2f} MiB without: each rank keeps its own batch's activations, "
            "and checkpointing keeps only the blocks' inputs of them")
        assert r["plain"]["loss"] == r["checkpointed"]["loss"], (
            "the same weights and batch give the same loss with or without checkpointing")
