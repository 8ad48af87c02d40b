"""Lesson 09: FSDP by hand (fsdp_by_hand.py) and the picture of its schedule (schedule.py).

Each task's tests run the lesson's FSDP with that task's code and the test's reference for the
others (rank_fns_fsdp.py), and compare it step by step with one process training the same
model on the whole batch: losses, every gradient and every parameter after each AdamW step.
With a compute dtype the single process computes each rank's micro-batch in that dtype and
adds the gradients in fp32, which is what FSDP with fp32 master weights and an fp32
reduce-scatter computes. Time limits only stop hangs: nothing here measures speed.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from dpt.models import TinyTransformer
from dpt.ranks import RankFailure, run_distributed
from tests import references as refs
from tests.helpers import one_line_error, run_script
from tests.l09_fsdp import rank_fns_fsdp as rf
from tests.lessons import load, script

LESSON = "09_fsdp"
DTYPES = {"None": None, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}


@pytest.fixture
def fbh():
    return load(LESSON, "fsdp_by_hand")


# --- running the ranks, once per scenario ------------------------------------------------------

_RUNS: dict = {}


def _first_difference(orders):
    first = orders[0]
    for rank, order in enumerate(orders[1:], start=1):
        for i, (a, b) in enumerate(zip(first, order)):
            if a != b:
                return i, rank, a, b
        if len(first) != len(order):
            return min(len(first), len(order)), rank, first[len(order):][:1], order[len(first):][:1]
    return None


def fsdp_run(keep, world_size=2, **kwargs) -> list[dict]:
    """The ranks' results of rank_fns_fsdp.scenario, run once per test module and arguments."""
    keep = (keep,) if isinstance(keep, str) else tuple(keep)
    key = (keep, world_size, tuple(sorted(kwargs.items())))
    if key not in _RUNS:
        try:
            _RUNS[key] = run_distributed(rf.scenario, world_size=world_size, timeout=150,
                                         kwargs={"keep": keep, **kwargs})
        except RankFailure as exc:
            _RUNS[key] = exc
    result = _RUNS[key]
    if isinstance(result, RankFailure):
        text = str(result)
        if "storage of size 0" in text:
            pytest.fail("autograd used a unit's parameters after they were freed (a tensor "
                        "with 0 bytes of storage): backward needs each unit gathered again "
                        "before its gradients are computed\n" + text, pytrace=False)
        raise result
    if result[0]["mismatch"]:
        orders = next(o for o in result[0]["orders"] if any(x != o[0] for x in o))
        i, rank, a, b = _first_difference(orders)
        pytest.fail(f"the ranks issued their collectives in different orders: collective #{i} "
                    f"is {a} on rank 0 and {b} on rank {rank}. Every rank must gather and "
                    "reduce-scatter the same units in the same order, whatever it decides "
                    "locally: otherwise one rank's all-gather meets another's reduce-scatter, "
                    "and the job hangs or mixes up the units' weights", pytrace=False)
    return result


# --- one process, the whole batch --------------------------------------------------------------

@functools.cache
def reference(dtype_name: str, world_size: int, steps: int = 3, micro: int = 1):
    """Per step: the loss, the gradients (averaged over ranks' micro-batches) and the
    parameters after AdamW's step, of one process training on the whole global batch."""
    dtype = DTYPES[dtype_name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same kernels, the same sums
    try:
        torch.manual_seed(0)
        model = TinyTransformer(**rf.MODEL)
        optimizer = torch.optim.AdamW(model.parameters(), **rf.OPTIM)
        losses, grads, params = [], [], []
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            step_losses = []
            for m in range(micro):
                parts = [rf.batch(step, m, r, world_size) for r in range(world_size)]
                if dtype is None:
                    inputs = torch.cat([x for x, _ in parts])
                    targets = torch.cat([y for _, y in parts])
                    loss = rf.loss_of(model(inputs), targets)
                    loss.backward()
                    step_losses.append(loss.item())
                    continue
                low = copy.deepcopy(model).to(dtype)  # the compute copy; model keeps fp32
                rank_losses = []
                for inputs, targets in parts:
                    low.zero_grad(set_to_none=True)
                    loss = rf.loss_of(low(inputs), targets)
                    loss.backward()
                    rank_losses.append(loss.item())
                    for p, q in zip(model.parameters(), low.parameters()):
                        p.grad += q.grad.float() / world_size
                step_losses.append(sum(rank_losses) / world_size)
            losses.append(step_losses)
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            optimizer.step()
            params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return losses, grads, params
    finally:
        torch.set_num_threads(threads)


def assemble(ranks, dtype_name, what, step) -> dict[str, torch.Tensor]:
    """The full tensors by name, from every rank's flat shards (``grads`` or ``shards``)."""
    run0 = ranks[0]["runs"][dtype_name]
    out = {}
    for unit, lay in run0["layout"].items():
        flat = torch.cat([r["runs"][dtype_name][what][step][unit] for r in ranks])
        assert flat.numel() == lay["padded"], (
            f"unit {unit}: the shards of all ranks hold {flat.numel()} numbers, not the padded "
            f"size {lay['padded']}")
        pieces = flat[:sum(lay["numels"])].split(lay["numels"])
        for name, piece, shape in zip(lay["names"], pieces, lay["shapes"]):
            out[name] = piece.view(shape)
    return out


def padding_of(ranks, dtype_name, what, step) -> dict[str, torch.Tensor]:
    run0 = ranks[0]["runs"][dtype_name]
    return {unit: torch.cat([r["runs"][dtype_name][what][step][unit] for r in ranks])
            [sum(lay["numels"]):] for unit, lay in run0["layout"].items()}


def _worst(got: dict, want: dict):
    name = max(want, key=lambda n: (got[n] - want[n]).abs().max().item())
    return name, (got[name] - want[name]).abs().max().item()


def check_gradients(got: dict, want: dict, world_size: int, step: int, where: str) -> None:
    def close(a, b):
        return all(torch.allclose(a[n], b[n], rtol=1e-4, atol=1e-6) for n in b)

    if close(got, want):
        return
    if close(got, {n: g * world_size for n, g in want.items()}):
        pytest.fail(f"step {step}: every gradient is {world_size} times the single process's, "
                    f"the SUM over the {world_size} ranks: average them ({where})",
                    pytrace=False)
    if close(got, {n: g / world_size for n, g in want.items()}):
        pytest.fail(f"step {step}: every gradient is 1/{world_size} of the single process's: "
                    f"divided by the world size twice? ({where})", pytrace=False)
    name, diff = _worst(got, want)
    pytest.fail(f"step {step}: the gradient of {name} differs from the single process's by "
                f"{diff:.3g} ({where})", pytrace=False)


def check_matches_one_process(ranks, dtype_name="None", where="", steps=3, micro=1) -> None:
    """Losses, gradients and parameters of every step equal one process's, to float
    tolerance."""
    world_size = len(ranks)
    losses, grads, params = reference(dtype_name, world_size, steps, micro)
    for step in range(steps):
        got = [sum(r["runs"][dtype_name]["losses"][step][m] for r in ranks) / world_size
               for m in range(micro)]
        assert got == pytest.approx(losses[step], abs=1e-5), (
            f"step {step}: the loss averaged over ranks is {got}, one process computes "
            f"{losses[step]} ({where})")
        check_gradients(assemble(ranks, dtype_name, "grads", step), grads[step], world_size,
                        step, where)
        got_params = assemble(ranks, dtype_name, "shards", step)
        name, diff = _worst(got_params, params[step])
        assert diff < 1e-5, (f"after AdamW step {step}, {name} differs from the single "
                             f"process's by {diff:.3g} ({where})")


def events_of(ranks, dtype_name="None", key="events"):
    return [r["runs"][dtype_name][key] for r in ranks]


def _first(events, kind, unit, phase):
    found = [e for e in events if e["kind"] == kind and e["unit"] == unit and e["phase"] == phase]
    assert found, f"no {kind} of {unit} was logged in {phase}"
    return found[0]


# --- 09.1 shard_flat -------------------------------------------------------------------------

@pytest.mark.task("09.1")
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_flat_pads_with_zeros_and_keeps_this_ranks_chunk(fbh, world_size):
    torch.manual_seed(0)
    # 31 numbers: a multiple of none of 2, 3 and 4, so every world size but 1 pads, by a
    # different amount (1, 2, 1): a wrong rounding rule cannot match them all by chance
    tensors = [torch.randn(3, 5), torch.randn(8), torch.randn(2, 2, 2)]
    flat = torch.cat([t.flatten() for t in tensors])
    padded = -(-31 // world_size) * world_size
    shards = []
    for rank in range(world_size):
        shard, got_padded = fbh.shard_flat(tensors, rank, world_size)
        assert got_padded == padded, (
            f"31 numbers over {world_size} ranks: padded is {got_padded}, want {padded}, the "
            f"smallest multiple of {world_size} that holds them")
        assert shard.shape == (padded // world_size,), (
            f"rank {rank}'s shard has shape {tuple(shard.shape)}, want ({padded // world_size},)")
        shards.append(shard)
    together = torch.cat(shards)
    assert torch.equal(together[:31], flat), (
        "the ranks' shards put together must start with the tensors flattened one after the "
        "other, in the order given (the padding goes at the end)")
    assert torch.equal(together[31:], torch.zeros(padded - 31)), (
        f"the padding (the last {padded - 31} numbers) must be zeros: {together[31:].tolist()}")


@pytest.mark.task("09.1")
def test_shard_flat_keeps_an_fp32_copy_of_its_own(fbh):
    weights = [torch.randn(4, 4, dtype=torch.bfloat16), torch.randn(4, dtype=torch.bfloat16)]
    shard, padded = fbh.shard_flat(weights, 1, 2)
    assert shard.dtype == torch.float32, (
        f"the shard is {shard.dtype}: the shards are the fp32 master weights, whatever the "
        "dtype of the tensors")
    held = shard.untyped_storage().nbytes()
    assert held == 4 * shard.numel(), (
        f"the shard's memory holds {held} bytes for its {shard.numel()} fp32 numbers: it is a "
        "view of a bigger tensor, and keeps the whole flat vector alive on every rank; keep a "
        "copy of the chunk alone")
    assert not shard.requires_grad and shard.grad_fn is None, (
        "the shard must not be part of an autograd graph: use the tensors' values (detach)")
    before = shard.clone()
    fp32 = [torch.randn(6), torch.randn(2)]
    own, _ = fbh.shard_flat(fp32, 0, 2)
    snapshot = own.clone()
    with torch.no_grad():
        for t in fp32:
            t.add_(1.0)
    assert torch.equal(own, snapshot), (
        "the shard changed when the original tensor changed: it must be a copy of its own, "
        "not a view of the tensors (clone it)")
    assert torch.equal(shard, before)


@pytest.mark.task("09.1")
@pytest.mark.timeout(300)
def test_three_ranks_with_padding_train_like_one_process():
    """At 3 ranks both kinds of unit are padded: the padding must stay zero and out of the
    numbers."""
    ranks = fsdp_run("09.1", world_size=3)
    layout = ranks[0]["runs"]["None"]["layout"]
    assert all(lay["padded"] % 3 == 0 for lay in layout.values())
    assert any(lay["padded"] > sum(lay["numels"]) for lay in layout.values()), (
        "this test's model needs padding at 3 ranks: change rank_fns_fsdp.MODEL")
    check_matches_one_process(ranks, where="shard_flat at 3 ranks, with padding")
    for what in ("shards", "grads"):
        for unit, pad in padding_of(ranks, "None", what, 2).items():
            assert torch.count_nonzero(pad) == 0, (
                f"the padding of unit {unit}'s {what} is not zero after 3 steps: {pad.tolist()}")


# --- 09.2 gather -----------------------------------------------------------------------------

@pytest.mark.task("09.2")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype_name", ["None", "torch.bfloat16"])
def test_gather_gives_each_unit_its_parameters_in_the_compute_dtype(dtype_name):
    ranks = fsdp_run("09.2", world_size=3, dtypes=(None, torch.bfloat16))
    run = ranks[0]["runs"][dtype_name]
    want = "torch.float32" if dtype_name == "None" else dtype_name
    assert run["compute_dtypes"] == [want], (
        f"with compute_dtype={DTYPES[dtype_name]} the blocks computed with parameters in "
        f"{run['compute_dtypes']}, not {want}: cast the shard before gathering")
    assert set(run["shard_dtypes"]) == {"torch.float32"}, (
        f"the shards (the optimizer's parameters) are {run['shard_dtypes']}: they must stay "
        "fp32, the master weights; cast a copy for the gather")
    for r in ranks:
        sent = r["runs"][dtype_name]["gather_dtypes"]
        assert sent == [want], (
            f"rank {r['rank']}: with compute_dtype={DTYPES[dtype_name]} the all-gathers sent "
            f"tensors in {sent}, not {want}: cast the shard to the compute dtype BEFORE "
            "gathering; gathering the fp32 masters and casting afterwards gives the same "
            "numbers but moves twice the bytes over the network")
    check_matches_one_process(ranks, dtype_name, where="gather at 3 ranks")


# --- 09.3 use --------------------------------------------------------------------------------

@pytest.mark.task("09.3")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype_name", ["None", "torch.bfloat16"])
def test_use_points_every_parameter_at_its_piece_of_the_gathered_unit(dtype_name):
    """At 3 ranks with padding; the probes check that the slots hold views of unit.full."""
    ranks = fsdp_run("09.3", world_size=3, dtypes=(None, torch.bfloat16))
    check_each_gradient_sent_before_the_next_backward(ranks, dtype_name, where="use")
    check_matches_one_process(ranks, dtype_name, where="use at 3 ranks, with padding")


# --- 09.4 free -------------------------------------------------------------------------------

@pytest.mark.task("09.4")
@pytest.mark.timeout(300)
def test_free_leaves_each_rank_only_its_shards():
    ranks = fsdp_run("09.4")  # the probes check each unit is freed after its forward
    for r in ranks:
        run = r["runs"]["None"]
        assert run["memory"]["gathered"] == 0, (
            f"rank {r['rank']}: {run['memory']['gathered']} bytes of gathered parameters are "
            "still allocated after the step: free() must give back the storage's memory")
        assert run["full_grads_left"] == [], (
            f"rank {r['rank']}: units {run['full_grads_left']} still hold their full "
            "gradient after the step: free() must drop it too")
        total = sum(lay["padded"] for lay in run["layout"].values()) // len(ranks)
        assert run["memory"]["shards"] == 4 * total, (
            f"rank {r['rank']} holds {run['memory']['shards']} bytes of shards, want "
            f"{4 * total}: 1/{len(ranks)} of the padded model, in fp32")
    check_matches_one_process(ranks, where="free")


# --- 09.5 reduce_scatter ---------------------------------------------------------------------

@pytest.mark.task("09.5")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype_name", ["None", "torch.bfloat16"])
def test_reduce_scatter_leaves_each_rank_the_average_of_its_chunk(dtype_name):
    ranks = fsdp_run("09.5", world_size=3, dtypes=(None, torch.bfloat16))
    check_matches_one_process(ranks, dtype_name, where="reduce_scatter at 3 ranks")


# --- 09.6 the hooks --------------------------------------------------------------------------

@pytest.mark.task("09.6")
@pytest.mark.timeout(300)
def test_hooks_run_every_unit_s_schedule_once_per_step():
    ranks = fsdp_run("09.6")
    run = ranks[0]["runs"]["None"]
    units = list(run["layout"])
    assert run["post_backward_calls"] == {u: 1 for u in units}, (
        f"post-backward ran {run['post_backward_calls']} times per unit in the last step, want "
        "once for each unit, the root included: hook each unit's flat full tensor, whose "
        "gradient is accumulated once all of the unit's gradients are in")
    for unit in units[1:]:
        for phase in ("forward", "backward"):
            _first(run["events"], "compute", unit, phase)
    check_matches_one_process(ranks, where="the hooks")


# --- 09.7 pre-forward ------------------------------------------------------------------------

def _blocks(run):
    return sorted((u for u, lay in run["layout"].items() if lay["index"] >= 0),
                  key=lambda u: run["layout"][u]["index"])


def check_each_gradient_sent_before_the_next_backward(ranks, dtype_name="None", where=""):
    """Each block's reduce-scatter starts after its backward, before the previous block's."""
    run = ranks[0]["runs"][dtype_name]
    blocks = _blocks(run)
    for events in events_of(ranks, dtype_name):
        for this, previous in zip(blocks[::-1], blocks[::-1][1:]):
            sent = _first(events, "reduce_scatter", this, "backward")
            assert sent["start"] >= _first(events, "compute", this, "backward")["end"], (
                f"the reduce-scatter of {this} started before its backward ended ({where})")
            assert sent["start"] <= _first(events, "compute", previous, "backward")["start"], (
                f"the reduce-scatter of {this} started only after {previous}'s backward had "
                "begun: start it as soon as the unit's gradient is accumulated, so it overlaps "
                "the rest of backward; and make a unit's views (use) just before it computes: "
                "autograd runs what was made earlier later, and views made early (at the "
                f"prefetch) deliver the unit's gradient late ({where})")


@pytest.mark.task("09.7")
@pytest.mark.timeout(300)
def test_pre_forward_gathers_the_next_unit_while_this_one_computes():
    ranks = fsdp_run("09.7", no_prefetch_step=True)
    run = ranks[0]["runs"]["None"]
    blocks = _blocks(run)
    for events in events_of(ranks):
        for unit in blocks:
            gathers = [e for e in events if e["kind"] == "gather" and e["unit"] == unit
                       and e["phase"] == "forward"]
            assert len(gathers) == 1, (
                f"{unit} was gathered {len(gathers)} times in forward, want once: a unit "
                "whose gather was prefetched (unit.handle is set) must not be gathered again")
        for this, following in zip(blocks, blocks[1:]):
            compute = _first(events, "compute", this, "forward")
            gather = _first(events, "gather", following, "forward")
            assert gather["start"] < compute["end"], (
                f"with prefetch=True the gather of {following} was issued after {this}'s "
                "forward had ended: issue the next unit's gather before this one computes, so "
                "that it travels meanwhile")
    for events in events_of(ranks, key="events_no_prefetch"):
        for this, following in zip(blocks, blocks[1:]):
            compute = _first(events, "compute", this, "forward")
            gather = _first(events, "gather", following, "forward")
            assert gather["start"] >= compute["end"], (
                f"with prefetch=False the gather of {following} was issued before {this}'s "
                "forward ended: prefetch only when self.prefetch is True")
    check_each_gradient_sent_before_the_next_backward(ranks, where="pre-forward")
    check_matches_one_process(ranks, where="pre-forward")


# --- 09.8 post-forward -----------------------------------------------------------------------

@pytest.mark.task("09.8")
@pytest.mark.timeout(300)
def test_post_forward_frees_the_unit_and_prepares_its_backward():
    ranks = fsdp_run("09.8", eval_forward=True)  # the probes check the freeing and re-gather
    for r in ranks:
        run = r["runs"]["None"]
        assert run["gathered_after_eval"] == 0, (
            f"after a forward under torch.no_grad, {run['gathered_after_eval']} bytes are "
            "still gathered: free the unit after its forward in evaluation too")
        alive = run["alive_in_forward"]
        assert all(len(names) <= 3 for names in alive), (
            f"units gathered at once when each block starts: {alive}; want at most the root, "
            "this block and the next one")
    check_matches_one_process(ranks, where="post-forward")


# --- 09.9 pre-backward -----------------------------------------------------------------------

@pytest.mark.task("09.9")
@pytest.mark.timeout(300)
def test_pre_backward_gathers_again_and_prefetches_the_previous_unit():
    ranks = fsdp_run("09.9", no_prefetch_step=True)  # the probes check the re-gather
    run = ranks[0]["runs"]["None"]
    blocks = _blocks(run)
    for events in events_of(ranks):
        for unit in blocks:
            gathers = [e for e in events if e["kind"] == "gather" and e["unit"] == unit
                       and e["phase"] == "backward"]
            assert len(gathers) == 1, (
                f"{unit} was gathered {len(gathers)} times in backward, want once")
        for this, previous in zip(blocks[::-1], blocks[::-1][1:]):
            compute = _first(events, "compute", this, "backward")
            gather = _first(events, "gather", previous, "backward")
            assert gather["start"] < compute["end"], (
                f"with prefetch=True the backward gather of {previous} was issued after "
                f"{this}'s backward had ended: backward runs the units in reverse, so prefetch "
                "the previous unit")
    for events in events_of(ranks, key="events_no_prefetch"):
        for this, previous in zip(blocks[::-1], blocks[::-1][1:]):
            compute = _first(events, "compute", this, "backward")
            gather = _first(events, "gather", previous, "backward")
            assert gather["start"] >= compute["end"], (
                f"with prefetch=False the backward gather of {previous} was issued before "
                f"{this}'s backward ended: prefetch only when self.prefetch is True")
    check_matches_one_process(ranks, where="pre-backward")


# --- 09.10 post-backward ---------------------------------------------------------------------

@pytest.mark.task("09.10")
@pytest.mark.timeout(300)
def test_post_backward_sends_each_gradient_as_soon_as_it_is_ready():
    ranks = fsdp_run("09.10")  # the probes check it was sent, then freed
    check_each_gradient_sent_before_the_next_backward(ranks, where="post-backward")
    check_matches_one_process(ranks, where="post-backward")


# --- 09.11 finish_grad_sync ------------------------------------------------------------------

@pytest.mark.task("09.11")
@pytest.mark.timeout(300)
def test_finish_grad_sync_waits_and_adds_to_the_shards_grads():
    """Two micro-batches per step (gradient accumulation): the shards' gradients add up."""
    ranks = fsdp_run("09.11", micro=2)
    check_matches_one_process(ranks, where="finish_grad_sync, two micro-batches per step "
                                           "whose gradients add up", micro=2)


# --- 09.12 gather_full_params ----------------------------------------------------------------

@pytest.mark.task("09.12")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype_name", ["None", "torch.bfloat16"])
def test_gather_full_params_gives_every_rank_the_whole_model_by_name(dtype_name):
    """At 3 ranks (both units padded), computing in fp32 and in bf16: the whole model is the
    fp32 master weights, whatever the compute dtype."""
    ranks = fsdp_run("09.12", world_size=3, full_params=True, dtypes=(None, torch.bfloat16))
    names = [n for n, _ in TinyTransformer(**rf.MODEL).named_parameters()]
    want = assemble(ranks, dtype_name, "shards", 2)
    for r in ranks:
        got = r["runs"][dtype_name]["full_params"]
        assert list(got) == names, (
            f"rank {r['rank']}: gather_full_params() has keys {list(got)[:4]}..., want the "
            f"model's parameter names {names[:4]}...")
        for name in names:
            assert got[name].dtype == torch.float32 and got[name].shape == want[name].shape, (
                f"{name}: {got[name].dtype} {tuple(got[name].shape)}, want fp32 "
                f"{tuple(want[name].shape)} (the padding cut off), with compute_dtype="
                f"{DTYPES[dtype_name]}: gather the fp32 shards, the master weights, never "
                "the compute dtype's copy")
            assert torch.equal(got[name], want[name]), (
                f"rank {r['rank']}: {name} differs from the shards' values put together "
                f"(compute_dtype={DTYPES[dtype_name]}: gather the fp32 shards themselves, "
                "uncast)")
        reloaded = r["runs"][dtype_name]["reloaded"]
        assert all(torch.equal(reloaded[n], got[n] + 1) for n in names), (
            "load_full_params() then gather_full_params() did not give back what was loaded")


# --- the whole of it -------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype_name", ["None", "torch.bfloat16", "torch.float16"])
def test_the_whole_fsdp_trains_like_one_process(dtype_name):
    """Every task's own code together, 2 ranks, fp32 and bf16/fp16 compute."""
    ranks = fsdp_run(rf.TASKS, world_size=2, dtypes=(None, torch.bfloat16, torch.float16),
                     eval_forward=True, full_params=True)
    check_matches_one_process(ranks, dtype_name, where="your whole FSDP")


def test_schedule_draws_a_recorded_step(tmp_path):
    """schedule.draw puts every logged event on the picture; summary adds them up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schedule = load(LESSON, "schedule")
    events = [
        {"unit": "root", "kind": "gather", "phase": "forward", "start": 0.0, "end": 0.002},
        {"unit": "root", "kind": "wait", "phase": "forward", "start": 0.0, "end": 0.002},
        {"unit": "blocks.0", "kind": "compute", "phase": "forward", "start": 0.002,
         "end": 0.005},
        {"unit": "blocks.0", "kind": "free", "phase": "forward", "start": 0.005, "end": 0.005},
        {"unit": "blocks.0", "kind": "reduce_scatter", "phase": "backward", "start": 0.006,
         "end": None},
    ]
    ax = schedule.draw([events, events])
    assert len(ax.patches) == 2 * 4 and len(ax.lines) == 2
    assert schedule.summary(events)["waiting"] == pytest.approx(0.002)
    ax.figure.savefig(tmp_path / "schedule.png")
    plt.close(ax.figure)
    with pytest.raises(ValueError, match="no events"):
        schedule.draw([])


def test_the_script_refuses_bad_arguments_in_one_line():
    proc = run_script(script(LESSON, "fsdp_by_hand.py"), "--nproc", "0", timeout=60)
    assert "at least 1" in one_line_error(proc)


def test_the_lesson_s_methods_are_recorded_from_outside(fbh):
    """schedule.py records an FSDP object by wrapping it (schedule.record), so the methods of
    fsdp_by_hand's classes stay as written, with no recording wrapper: the tests' references
    put in their place and the student's code are recorded alike."""
    for task in rf.TASKS:
        for stem, dotted in refs.places(LESSON, task):
            owner, attr = refs.owner(LESSON, stem, dotted)
            assert not hasattr(getattr(owner, attr), "__wrapped__"), (
                f"{dotted} (task {task}) is wrapped in fsdp_by_hand.py: recording belongs "
                "to schedule.record, which wraps an FSDP object from outside")
