"""Lesson 08: memory accounting, the hand-written sharded optimizer, FSDP2."""

# Time limits only stop hangs: they leave room for a loaded machine (a 2-core box under a
# CPU hog runs these several times slower). Nothing here measures speed.

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dpt.models import ConvNet, build_model
from dpt.ranks import RankFailure, run_distributed
from tests.helpers import checked_part, one_line_error, requires_data, run_script
from tests.l08_sharding import rank_fns
from tests.lessons import load, script

LESSON = "08_sharding"
P = sum(p.numel() for p in ConvNet().parameters())


@pytest.fixture
def acc():
    return load(LESSON, "zero_accounting")


@pytest.fixture
def zo():
    return load(LESSON, "zero_optimizer")


# --- 08.1 the accounting ------------------------------------------------------------------

@pytest.mark.task("08.1")
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_prediction_shards_one_more_thing_per_stage(acc, n):
    p = 1_000_003
    ddp, z1, z2, z3 = (acc.predict_bytes(p, n, s) for s in ("ddp", "zero1", "zero2", "zero3"))
    assert ddp == pytest.approx({"params": 4 * p, "grads": 4 * p, "optimizer": 8 * p,
                                 "total": 16 * p})
    assert z1 == pytest.approx({"params": 4 * p, "grads": 4 * p, "optimizer": 8 * p / n,
                                "total": 8 * p + 8 * p / n})
    assert z2 == pytest.approx({"params": 4 * p, "grads": 4 * p / n, "optimizer": 8 * p / n,
                                "total": 4 * p + 12 * p / n})
    assert z3 == pytest.approx({"params": 4 * p / n, "grads": 4 * p / n, "optimizer": 8 * p / n,
                                "total": 16 * p / n})


@pytest.mark.task("08.1")
def test_prediction_uses_the_bytes_per_parameter_it_is_given(acc):
    # the ZeRO paper's mixed-precision count: 2 + 2 + K=12 bytes per parameter
    assert acc.predict_bytes(10**9, 64, "zero3", 2, 2, 12)["total"] == pytest.approx(16e9 / 64)
    assert acc.predict_bytes(10**9, 64, "ddp", 2, 2, 12)["total"] == pytest.approx(16e9)
    assert acc.predict_bytes(100, 4, "zero1", 4, 4, 0)["optimizer"] == 0
    with pytest.raises(ValueError, match="stage"):
        acc.predict_bytes(100, 2, "zero4")


@pytest.mark.task("08.1")
def test_each_kind_is_priced_with_its_own_bytes_per_parameter(acc):
    """Three different byte counts, so none can stand in for another (the other tests give
    parameters and gradients the same size)."""
    n = 4
    for k, stage in enumerate(("ddp", "zero1", "zero2", "zero3")):
        got = acc.predict_bytes(1000, n, stage, param_bytes=2, grad_bytes=3, state_bytes=12)
        want = {"params": 2000 / (n if k >= 3 else 1), "grads": 3000 / (n if k >= 2 else 1),
                "optimizer": 12000 / (n if k >= 1 else 1)}
        want["total"] = sum(want.values())
        assert got == pytest.approx(want), (
            f"{stage} with param_bytes=2, grad_bytes=3, state_bytes=12: got {got}, not {want}: "
            "parameters cost param_bytes each, gradients grad_bytes, optimizer state "
            "state_bytes")


@pytest.mark.task("08.1")
def test_prediction_is_exact_when_the_ranks_do_not_divide_the_bytes(acc):
    """10 parameters on 3 ranks at 2, 4 and 8 bytes each: no share is a whole number of
    bytes, so a floor (//) or a rounding shows. (With a million parameters it hides under
    any relative tolerance: one byte in millions.)"""
    p, n = 10, 3
    for k, stage in enumerate(acc.STAGES):
        got = acc.predict_bytes(p, n, stage, param_bytes=2, grad_bytes=4, state_bytes=8)
        want = {"params": 20 / (n if k >= 3 else 1), "grads": 40 / (n if k >= 2 else 1),
                "optimizer": 80 / (n if k >= 1 else 1)}
        want["total"] = sum(want.values())
        assert got == pytest.approx(want, rel=1e-12, abs=0), (
            f"predict_bytes(10, 3, {stage!r}, 2, 4, 8) gave {got}, not {want}: a sharded "
            "kind costs P * bytes / N exactly (a float, as the table says: 8P/N), not a "
            "floor division (//) or a rounded number")


@pytest.mark.task("08.1")
def test_prediction_table_has_a_row_per_stage_and_world_size_in_mib(acc):
    rows = acc.prediction_table(1_000_003, world_sizes=(1, 4), param_bytes=2, grad_bytes=2,
                                state_bytes=12)
    assert [(r["stage"], r["world_size"]) for r in rows] == [
        (s, n) for s in acc.STAGES for n in (1, 4)]
    for r in rows:
        pred = acc.predict_bytes(1_000_003, r["world_size"], r["stage"], 2, 2, 12)
        assert {k: r[k] for k in pred} == pytest.approx({k: v / 2**20 for k, v in pred.items()})


@pytest.mark.slow
@pytest.mark.task("08.1")
@pytest.mark.timeout(300)
def test_prediction_matches_what_ddp_zero1_and_fsdp_really_allocate(acc):
    """Measured with torch's own DDP, ZeroRedundancyOptimizer and fully_shard, 2 ranks."""
    preds = {s: acc.predict_bytes(P, 2, s) for s in ("ddp", "zero1", "zero3")}
    ranks = run_distributed(rank_fns.reference_memory, world_size=2, timeout=250)
    largest = max(p.numel() for p in ConvNet().parameters())
    for stage, pred in preds.items():
        for key in ("params", "grads", "optimizer"):
            measured = [r[stage][key] for r in ranks]
            # summed over ranks, nothing is lost or duplicated beyond the prediction
            assert sum(measured) == pytest.approx(2 * pred[key], rel=1e-6), (stage, key)
            slack = 8 * largest if (stage == "zero1" and key == "optimizer") else 0
            for m in measured:  # ZeRO-1 shards whole tensors, so up to one tensor off
                assert abs(m - pred[key]) <= slack + 1e-6, (stage, key, m, pred[key])


@pytest.mark.task("08.1")
def test_measure_bytes_counts_a_plain_model_and_adam(acc):
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    opt.step()
    measured = acc.measure_bytes(model, opt)
    assert measured == {"params": 4 * P, "grads": 4 * P, "optimizer": 8 * P, "total": 16 * P}, (
        f"measure_bytes of a ConvNet ({P} fp32 parameters) after one Adam step: {measured}; "
        "want 4 bytes per parameter for the weights and the gradients, and 8 for Adam's two "
        "moments, without the 0-dim step counters (include_scalars defaults to False)")
    # A sharded parameter (a DTensor, as under FSDP2) counts only the shard this rank stores.
    class DTensorLike:  # what measure_bytes may use of a DTensor: 10 elements, 5 stored here
        grad = None

        def numel(self):
            return 10

        def element_size(self):
            return 4

        def to_local(self):
            return torch.zeros(5)

    class Sharded(torch.nn.Module):
        def parameters(self, recurse=True):
            return iter([DTensorLike()])

    sharded = acc.measure_bytes(Sharded(), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    assert sharded["params"] == 4 * 5, (
        f"measure_bytes counted {sharded['params']} bytes for a parameter whose local shard "
        "holds 5 fp32 elements (20 bytes): count t.to_local() for a DTensor, not its full size")
    # Adam's per-tensor `step` counters are 0-dim tensors: counted only when asked for
    steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())
    assert acc.optimizer_state_bytes(opt, include_scalars=True) == 8 * P + steps, (
        "optimizer_state_bytes(opt, include_scalars=True) must add Adam's 0-dim step counters")
    # each tensor is priced at its own element size, not at fp32's 4 bytes
    mixed = [torch.zeros(3, dtype=torch.float16), torch.zeros(2, dtype=torch.float64),
             torch.zeros(5, dtype=torch.int8)]
    assert acc.tensor_bytes(mixed) == 3 * 2 + 2 * 8 + 5 * 1, (
        "tensor_bytes must price each tensor at its own element_size() (2 bytes for fp16)")
    # and it agrees with the prediction for N = 1
    assert acc.predict_bytes(P, 1, "zero3")["total"] == 16 * P


# --- 08.2 the balanced assignment ----------------------------------------------------------

@pytest.mark.task("08.2")
@pytest.mark.parametrize("sizes,n", [
    ([p.numel() for p in ConvNet().parameters()], 2),
    ([p.numel() for p in ConvNet().parameters()], 3),
    ([1] * 10, 4),
    ([100, 1, 1, 1, 50, 50, 2, 30, 20, 10], 3),
    (list(range(1, 40)), 5),
])
def test_partition_is_balanced_by_size_and_covers_everything(zo, sizes, n):
    owners = zo.partition_params(sizes, n)
    assert len(owners) == len(sizes)
    assert all(isinstance(o, int) and 0 <= o < n for o in owners)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(n)]
    assert sum(loads) == sum(sizes)
    # no rank above the others by more than one parameter: all on rank 0 fails here
    assert max(loads) - min(loads) <= max(sizes), (
        f"unbalanced: the ranks own {loads} elements; no rank may own more than another by "
        f"more than the largest parameter ({max(sizes)})")
    assert zo.partition_params(sizes, n) == owners  # every rank computes the same answer


@pytest.mark.task("08.2")
def test_partition_uses_every_rank_and_keeps_big_tensors_apart(zo):
    owners = zo.partition_params([1000, 1000, 10, 10], 2)
    assert owners[0] != owners[1]
    assert owners[2] != owners[3]
    assert sorted(set(zo.partition_params([5] * 8, 4))) == [0, 1, 2, 3]
    assert zo.partition_params([3, 4], 1) == [0, 0]
    try:
        zo.partition_params([3, 4], 0)
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    assert "world_size" in error, (
        f"partition_params(sizes, 0) gave {error!r}: refuse a world_size below 1 with a "
        f"ValueError that names it")
    # biggest first: the 4 goes to one rank, the four 1s to the other. Smallest first (or in
    # the given order) ends 1+1+4 against 1+1, within the bound above but not balanced.
    sizes = [1, 1, 1, 1, 4]
    owners = zo.partition_params(sizes, 2)
    loads = sorted(sum(s for s, o in zip(sizes, owners) if o == r) for r in range(2))
    assert loads == [4, 4], (
        f"{sizes} over 2 ranks gave loads {loads}, not [4, 4]: hand out the parameters "
        "biggest first, each to the rank with the fewest elements so far")


@pytest.mark.task("08.2")
@pytest.mark.timeout(300)
def test_the_optimizer_uses_the_balanced_assignment(zo):
    """The default ShardedOptimizer: each rank holds about 1/N of Adam's state."""
    ranks = run_distributed(rank_fns.sharded_vs_plain, world_size=2, timeout=250,
                            kwargs={"opt_name": "adam", "steps": 2, "own_partition": True})
    whole = ranks[0]["plain_state_bytes"]
    largest = 8 * max(ranks[0]["sizes"])
    held = [r["state_bytes"] for r in ranks]
    assert sum(held) == whole
    for h in held:
        assert abs(h - whole / 2) <= largest / 2 + 1e-6, held


# --- 08.3 the sharded optimizer's step -----------------------------------------------------

def _close(a, b, atol=1e-5):
    return all(torch.allclose(x, y, atol=atol, rtol=1e-4) for x, y in zip(a, b))


def _ranks_agree(ranks) -> bool:
    """Whether every rank ends with the same weights under the sharded optimizer."""
    return all(torch.equal(a, b) for a, b in zip(ranks[0]["params"][1], ranks[1]["params"][1]))


def _step_cause(sharded, plain, agree: bool) -> str:
    """The likely bug when a sharded optimizer's parameters differ from the plain one's."""
    if not agree:
        return ("the ranks' copies disagree: the owners' updates do not reach every rank. "
                "Broadcast after step missing (each owner broadcasts its updated parameters to "
                "all ranks, from its global rank)")
    same = [torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(sharded, plain)]
    return (f"the ranks agree, but {same.count(False)} of {len(same)} parameters differ: step "
            "the inner optimizer once per step, with the outer param_groups' options (the lr "
            "and the weight decay change mid-run) copied to it first: every option, not only "
            "lr; and one inner group per outer group, an empty one too, or zip(outer, inner) "
            "gives a group another group's options")


@pytest.mark.task("08.3")
@pytest.mark.timeout(375)
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_sharded_optimizer_matches_plain_and_torch_zero(opt_name):
    ranks = run_distributed(rank_fns.sharded_vs_plain, world_size=2, timeout=300,
                            kwargs={"opt_name": opt_name, "steps": 4})
    for r in ranks:
        plain, sharded, torch_zero = r["params"]
        # every rank, also the one that does not own a parameter, ends with the update:
        # shards never broadcast back leave the other rank's copy behind
        assert _close(sharded, plain), (f"rank {ranks.index(r)} differs from the plain "
                                        f"optimizer: {_step_cause(sharded, plain, _ranks_agree(ranks))}")
        assert _close(sharded, torch_zero), ("differs from torch's ZeroRedundancyOptimizer: "
                                             f"{_step_cause(sharded, torch_zero, _ranks_agree(ranks))}")
        assert not _close(sharded, [p * 0 + p.mean() for p in plain], atol=0)
    for a, b in zip(ranks[0]["params"][1], ranks[1]["params"][1]):
        torch.testing.assert_close(  # the ranks agree exactly
            a, b, rtol=0, atol=0, msg=lambda m: "the ranks' weights disagree: broadcast after "
            f"step missing (every owner must broadcast what it updated)\n{m}")


@pytest.mark.task("08.3")
@pytest.mark.timeout(375)
def test_each_rank_keeps_state_only_for_the_params_it_owns():
    ranks = run_distributed(rank_fns.sharded_vs_plain, world_size=2, timeout=300,
                            kwargs={"opt_name": "adam", "steps": 2})
    owners = ranks[0]["owners"]
    seen = []
    for rank, r in enumerate(ranks):
        mine = [i for i, o in enumerate(owners) if o == rank]
        # a rank stepping parameters it does not own builds state for them
        assert r["with_state"] == mine, (
            f"rank {rank} keeps optimizer state for parameters {r['with_state']} but owns "
            f"{mine}: a rank steps (and keeps state for) only the parameters it owns")
        assert r["outer_state"] == 0
        seen += r["with_state"]
    assert sorted(seen) == list(range(len(owners)))
    whole = ranks[0]["plain_state_bytes"]
    assert sum(r["state_bytes"] for r in ranks) == whole
    assert all(r["state_bytes"] < 0.75 * whole for r in ranks)  # about 1/N, not all of it


@pytest.mark.task("08.3")
@pytest.mark.timeout(375)
def test_adamw_with_param_groups_matches():
    ranks = run_distributed(rank_fns.sharded_vs_plain, world_size=2, timeout=300,
                            kwargs={"opt_name": "adamw", "steps": 3})
    for r in ranks:
        plain, sharded, _ = r["params"]
        assert _close(sharded, plain), ("AdamW with two parameter groups: "
                                        f"{_step_cause(sharded, plain, _ranks_agree(ranks))}")


@pytest.mark.task("08.3")
@pytest.mark.timeout(375)
def test_zero2_reduce_gradients_then_step_matches_ddp():
    ranks = run_distributed(rank_fns.zero2_vs_plain, world_size=2, timeout=300)
    for rank, r in enumerate(ranks):
        assert r["diff"] < 1e-5, (
            f"rank {rank}: after reduce_gradients() and step() the weights differ from DDP's by "
            f"{r['diff']:.2g}: each owner must end with the MEAN of the ranks' gradients (the "
            f"reduce sums them; divide by the world size)")
        # after reduce_gradients a rank keeps gradients only for what it owns (4P/N-ish)
        assert all(g == r["owned_bytes"] for g in r["grad_bytes"]), (
            f"rank {rank} holds {r['grad_bytes']} bytes of gradients after reduce_gradients(), "
            f"but owns {r['owned_bytes']}: free (set to None) the gradients of parameters "
            f"another rank owns, or ZeRO-2 saves no memory")
        assert r["owned_bytes"] < 0.75 * 4 * P


@pytest.mark.task("08.3")
@pytest.mark.timeout(300)
def test_the_optimizer_works_on_a_process_group_that_is_not_the_world():
    """Ranks 1 and 2 of three share the optimizer; group rank r is global rank r + 1."""
    ranks = run_distributed(rank_fns.sharded_on_a_subgroup, world_size=3, timeout=240)
    assert ranks[0] == {"in_group": False}
    for rank, r in ((1, ranks[1]), (2, ranks[2])):
        plain, stage1, stage2 = r["params"]
        hint = ("torch.distributed's src= and dst= take GLOBAL ranks: map the group's rank r "
                "with dist.get_global_rank(process_group, r)")
        assert _close(stage1, plain), f"rank {rank}, step() on a subgroup: {hint}"
        assert _close(stage2, plain), f"rank {rank}, reduce_gradients() on a subgroup: {hint}"
    for a, b in zip(ranks[1]["params"][1], ranks[2]["params"][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: "the group's two ranks "
                                   f"disagree after step(): broadcast to the group\n{m}")


# --- 08.4 / 08.5 FSDP2 ---------------------------------------------------------------------

@pytest.mark.task("08.4")
@pytest.mark.timeout(375)
def test_fsdp2_shards_every_parameter_and_trains_like_ddp():
    ranks = run_distributed(rank_fns.fsdp_vs_ddp, world_size=2, timeout=300,
                            kwargs={"steps": 4})
    for rank, r in enumerate(ranks):
        assert r["is_unit"] == {"root": True, "layer1": True, "layer2": True, "fc": True}
        whole = [name for name, kind, numel, local in r["after_forward"]
                 if kind != "DTensor" or local > -(-numel // 2)]
        assert not whole, (
            f"between forward and backward {whole} are whole on rank {rank}: each block "
            "must be freed back to its shard right after its forward (fully_shard's default, "
            "reshard_after_forward=True); keeping blocks whole until backward costs ZeRO-2's "
            "memory, not ZeRO-3's")
        assert r["losses"]["fsdp"] == pytest.approx(r["losses"]["ddp"], rel=1e-4, abs=1e-5), \
            "FSDP2's losses differ from DDP's: shard every block and then the root"
        assert r["diff"] < 1e-5, (f"FSDP2's weights differ from DDP's by {r['diff']:.2g} after "
                                  "training: shard every block and then the root")
    for i, (name, kind, numel, _) in enumerate(ranks[0]["shards"]):
        assert kind == "DTensor", name
        local = [r["shards"][i][3] for r in ranks]
        assert sum(local) == numel, name  # 1/N of every parameter on each rank
        assert max(local) <= -(-numel // 2), name


@pytest.mark.task("08.4")
@pytest.mark.timeout(300)
def test_fsdp2_options_reach_every_block():
    """shard_model's keyword arguments (mesh, mp_policy, ...) go to every fully_shard call."""
    ranks = run_distributed(rank_fns.fsdp_options_reach_every_block, world_size=2, timeout=240)
    for rank, r in enumerate(ranks):
        assert r["error"] is None and set(r["seen"].values()) == {"torch.float64"}, (
            f"rank {rank}: with mp_policy(param_dtype=float64) the blocks computed in "
            f"{r['seen']} ({r['error']}): pass shard_model's **fsdp_kwargs to fully_shard for "
            "every block, not only for the root")
        other = sorted(name for name, dims in r["meshes"].items() if dims != ("mine",))
        assert not other, (
            f"rank {rank}: shard_model(model, mesh=...) sharded {other} on another mesh than "
            "the one it was given: a mesh passed in must be kept (setdefault), only a missing "
            "one replaced by device_mesh()")


@pytest.mark.task("08.5")
@pytest.mark.timeout(375)
def test_full_state_dict_on_rank0_equals_ddps():
    ranks = run_distributed(rank_fns.fsdp_vs_ddp, world_size=2, timeout=300,
                            kwargs={"steps": 3, "state_dict": True, "own_shard": False})
    fsdp_sd, ddp_sd = ranks[0]["fsdp_sd"], ranks[0]["ddp_sd"]
    assert set(fsdp_sd) == set(ddp_sd)
    for k, (kind, v) in fsdp_sd.items():
        assert kind == "Tensor", f"{k} is a {kind}, not a plain full tensor"
        assert v.device.type == "cpu"
        torch.testing.assert_close(v, ddp_sd[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: "
                                   "the full state dict differs from DDP's weights: gather "
                                   f"every shard (full_state_dict=True)\n{m}")
    assert ranks[1]["fsdp_sd"] == {}, (  # cpu_offload: only rank 0 keeps the full copy
        f"rank 1 holds {len(ranks[1]['fsdp_sd'])} full tensors too: with cpu_offload=True only "
        "rank 0 keeps the gathered state dict (on the CPU); the other ranks get an empty one")


# --- the scripts (not graded) --------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_fsdp_explains_itself_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_script(script(LESSON, "fsdp2_train.py"), "--lightning", timeout=250)
    assert proc.returncode == 2
    assert "GPU" in one_line_error(proc) and "fully_shard" in one_line_error(proc)


@pytest.mark.timeout(150)
def test_train_worker_reports_the_loss_averaged_over_the_ranks():
    """train_worker is given code: its losses are the mean over the ranks, as one logs them.
    FSDP2 and DDP report through the same all_reduce, so comparing them cannot see a sum; the
    first step's loss can be computed apart: the same seeded weights, each rank's own batch
    (batch norm normalizes each rank's batch alone), the mean of the three ranks' losses.
    The model and every batch must also have been sent to the rank's device."""
    ft = load(LESSON, "fsdp2_train")
    world_size, batch_size, seed = 3, 8, 0
    ranks = run_distributed(rank_fns.train_worker_losses, world_size=world_size, timeout=120,
                            kwargs={"steps": 2, "batch_size": batch_size, "seed": seed})
    per_rank = []
    for rank in range(world_size):  # the first step happens before any update
        torch.manual_seed(seed)
        model = build_model("convnet").train()
        x, y = ft.synthetic_batch(rank, 0, batch_size, seed)
        with torch.no_grad():
            per_rank.append(F.cross_entropy(model(x), y).item())
    mean = sum(per_rank) / world_size
    for rank, r in enumerate(ranks):
        assert len(r["losses"]) == 2, f"rank {rank} reported {len(r['losses'])} losses, not 2"
        first = r["losses"][0]
        ratio = first / mean
        cause = ("the sum of the ranks' losses: divide the all_reduce'd losses by the world "
                 "size" if ratio == pytest.approx(world_size, rel=1e-4) else
                 "divided by 2, not by the world size 3" if ratio == pytest.approx(1.5, rel=1e-4)
                 else "not the mean of the ranks' losses")
        assert first == pytest.approx(mean, rel=1e-5), (
            f"rank {rank}: train_worker on {world_size} ranks reported a first loss of "
            f"{first:.4f}, not {mean:.4f}, the mean of the ranks' losses {per_rank}: {cause}")
        assert r["losses"] == ranks[0]["losses"], "the ranks report different losses"
        assert r["model_sent"], (
            f"rank {rank}: train_worker never sent the model to the rank's device before "
            "wrapping it (build_model(...).to(device))")
        assert not r["unsent"], f"rank {rank}: {r['unsent']}"


@pytest.mark.timeout(150)
def test_bad_arguments_give_one_line():
    proc = run_script(script(LESSON, "fsdp2_train.py"), "--nproc", "0", timeout=125)
    assert proc.returncode == 2
    line = one_line_error(proc)
    assert "at least 1" in line and "--nproc" in line, (
        f"--nproc 0 gave {line!r}: the error should name the flag the user typed")


@pytest.mark.timeout(200)
def test_train_worker_trains_the_same_model_under_fsdp2_and_ddp(tmp_path):
    """The script's worker, given code: FSDP2 and DDP from one seed give the same losses,
    Adam gets the worker's options, the report shows each rank's shard, only rank 0 saves,
    and with Fashion-MNIST each rank asks for its own share."""
    ranks = run_distributed(rank_fns.train_worker_both_modes, world_size=2, timeout=150,
                            kwargs={"save_dir": str(tmp_path), "lr": 4e-3, "weight_decay": 0.01})
    for r in ranks:
        rank, losses = r["rank"], r["losses"]
        assert losses["fsdp2"] == pytest.approx(losses["ddp"], rel=1e-4, abs=1e-5), (
            f"rank {rank}: from one seed train_worker's FSDP2 run reports {losses['fsdp2']} and "
            f"its DDP run {losses['ddp']}: every rank must build the model from the same seed "
            f"(torch.manual_seed(seed)). DDP copies rank 0's weights to every rank, but FSDP2 "
            f"keeps each rank's slice of its own: different seeds make a patchwork model")
        assert r["adams"] == [{"lr": 4e-3, "weight_decay": 0.01}] * 2, (
            f"rank {rank}: Adam was built with {r['adams']}, not lr=0.004 and "
            f"weight_decay=0.01: pass train_worker's lr and weight_decay on")
        assert r["saves"] == ([r["keys"]] * 2 if rank == 0 else []), (
            f"rank {rank} saved {len(r['saves'])} state dict(s) with keys {r['saves']}: only "
            f"rank 0 writes the file, with every key of the model (the others hold an empty "
            f"dict, and several writers of one path race)")
        assert r["fashion_asked"] == [(rank, 2)], (
            f"rank {rank}: with --data fashion-mnist train_worker asked fashion_batches for "
            f"{r['fashion_asked']}, not (rank, world_size) = ({rank}, 2): each rank reads "
            f"its own share")
    for i, row in enumerate(ranks[0]["shards"]):
        local = [r["shards"][i]["local_numel"] for r in ranks]
        assert sum(local) == row["numel"], (
            f"shard_report gives {row['name']} local sizes {local} on the two ranks, which do "
            f"not add up to its {row['numel']} elements: report p.to_local(), the shard this "
            f"rank stores, not the full DTensor")
    files = {mode: torch.load(tmp_path / f"{mode}.pt", weights_only=True)
             for mode in ("ddp", "fsdp2")}
    assert sorted(files["fsdp2"]) == ranks[0]["keys"]
    for k, v in files["ddp"].items():
        torch.testing.assert_close(files["fsdp2"][k], v, atol=1e-5, rtol=1e-4)


@pytest.mark.task("08.3")
@pytest.mark.timeout(150)
def test_the_notebooks_demo_compares_like_with_like():
    """demo_worker (given code) trains DDP + Adam against DDP + ShardedOptimizer(Adam):
    the weights agree, the shards of Adam's state add up to the whole, and owned_fraction is
    this rank's own share."""
    ranks = run_distributed(rank_fns.demo_with_reference_partition, world_size=2, timeout=120)
    plain = ranks[0]["plain_state"]
    assert sum(r["sharded_state"] for r in ranks) == plain, (
        f"the ranks' shards of Adam's state hold {[r['sharded_state'] for r in ranks]} bytes, "
        f"which must add up to the plain optimizer's {plain}")
    for r in ranks:
        assert r["max_diff"] < 1e-5, (
            f"rank {r['rank']}: after the demo the sharded model differs from the plain one "
            f"by {r['max_diff']:.2g}: each optimizer must step its own model's parameters")
        assert r["owned"] == pytest.approx(r["sharded_state"] / plain, rel=1e-9), (
            f"rank {r['rank']}: owned_fraction is {r['owned']:.4f}, but this rank holds "
            f"{r['sharded_state'] / plain:.4f} of Adam's state: count the parameters this "
            f"rank owns (params_of[rank]), not rank 0's")


def test_the_blocks_to_shard_are_the_children_that_hold_parameters():
    ft = load(LESSON, "fsdp2_train")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Dropout(), torch.nn.Linear(4, 2)),
                                torch.nn.Flatten())
    blocks = ft.default_blocks(model)
    assert blocks == [model[0], model[2]], (
        f"default_blocks gave {[type(b).__name__ for b in blocks]}: a block is a unit of "
        f"all-gather, so only the children that hold parameters are sharded")


def test_the_script_passes_its_flags_to_every_rank(monkeypatch, capsys):
    """main() turns its flags into train_worker's arguments (the ranks are faked here)."""
    import dpt.ranks

    ft = load(LESSON, "fsdp2_train")
    seen = {}

    def fake_run_distributed(fn, world_size, **kwargs):
        seen.update(kwargs["kwargs"], fn=fn, world_size=world_size)
        memory = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
        return [{"rank": r, "losses": [2.0, 1.0], "memory": memory, "state_dict": {}}
                for r in range(world_size)]

    monkeypatch.setattr(dpt.ranks, "run_distributed", fake_run_distributed)
    assert ft.main(["--nproc", "3", "--mode", "ddp", "--steps", "7", "--batch-size", "5",
                    "--lr", "0.25", "--data", "synthetic"]) == 0
    got = {k: seen.get(k) for k in ("world_size", "mode", "steps", "batch_size", "lr", "data")}
    assert got == {"world_size": 3, "mode": "ddp", "steps": 7, "batch_size": 5, "lr": 0.25,
                   "data": "synthetic"}, f"the ranks were started with {got}"
    assert seen["fn"] is ft.train_worker
    assert "ddp on 3 rank(s)" in capsys.readouterr().out


@requires_data
@pytest.mark.timeout(120)
def test_fashion_batches_give_each_rank_its_half_in_a_new_order_each_epoch():
    from dpt.data import load_tensors

    ft = load(LESSON, "fsdp2_train")
    x_all, _ = load_tensors("fashion-mnist", train=True)
    half = len(x_all) // 2  # one batch per epoch: the rank's whole share
    streams = [ft.fashion_batches(rank, 2, half, seed=0) for rank in (0, 1)]
    (x0, _), (x1, _) = next(streams[0]), next(streams[1])
    assert len(x0) == len(x1) == half, "each of 2 ranks reads half of the training set"

    def key(x):  # one number per image, to compare the shares as multisets
        return x.flatten(1).double().sum(1).sort().values

    torch.testing.assert_close(key(torch.cat([x0, x1])), key(x_all), msg=lambda m: (
        "the two ranks' shares overlap instead of splitting the set: each rank reads its "
        f"own DistributedSampler shard (num_replicas=world_size, rank=rank)\n{m}"))
    x0_next, _ = next(streams[0])
    assert not torch.equal(x0_next, x0), (
        "epoch 1 reads the same order as epoch 0: call set_epoch(epoch) on the loader")
    del x_all, x0, x1, x0_next


@pytest.mark.task("08.3")
@pytest.mark.timeout(150)
def test_zero2_reduce_gradients_averages_over_three_ranks():
    """Ranks hold gradients 1, 2 and 3: each owner must end with the mean 2 (the other tests
    run two ranks, where a divide by a hard-coded 2 looks right); the step after it leaves
    the three ranks with the same weights."""
    ranks = run_distributed(rank_fns.zero2_mean_of_known_gradients, world_size=3, timeout=120)
    owners = ranks[0]["owners"]
    for rank, r in enumerate(ranks):
        assert r["collectives"] == ["reduce"], (
            f"rank {rank}'s reduce_gradients() used {r['collectives']}: ZeRO-2 sends each "
            f"gradient to its owner only (dist.reduce with dst=); an all_reduce gives every "
            f"rank sums it then throws away")
        for i, (owner, grad) in enumerate(zip(owners, r["grads"])):
            if owner != rank:
                assert grad is None, (f"rank {rank} kept the gradient of parameter {i}, which "
                                      f"rank {owner} owns: free it (ZeRO-2)")
                continue
            assert grad == [2.0], (
                f"rank {rank} owns parameter {i}; after reduce_gradients() its gradient is "
                f"{grad}, not the mean [2.0] of 1, 2, 3: "
                + ("divided by 2, not by the world size 3" if grad == [3.0] else
                   "the sum, not divided by the world size" if grad == [6.0] else
                   "not the mean over the ranks"))
    for rank, r in enumerate(ranks[1:], 1):
        for a, b in zip(ranks[0]["params"], r["params"]):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m, rank=rank: (
                f"rank {rank}'s weights differ from rank 0's after reduce_gradients() and "
                f"step(): every owner must broadcast what it updated\n{m}"))


@pytest.mark.timeout(120)
def test_zero2_reduce_agrees_when_a_gradient_is_on_some_ranks_only():
    """Given code: a parameter with a gradient on rank 0 but not on rank 1 (a branch only rank
    0's data took). Ranks that decide from their own gradients which reduces to enter enter
    different ones, and wait for each other forever: the short timeout turns that into a
    failure. The ranks must agree on the parameters with a gradient anywhere and count a
    missing one as zeros (as DDP does); a parameter without any gradient keeps none."""
    try:
        ranks = run_distributed(rank_fns.zero2_gradient_on_some_ranks, world_size=2,
                                timeout=30)
    except RankFailure as exc:
        pytest.fail("reduce_gradients() hung or failed when rank 1 had no gradient for "
                    "parameters rank 0 had one for: each rank decided from its own gradients "
                    "which reduces to enter. Agree first on which parameters have a gradient "
                    "on any rank (an all_reduce of flags), and reduce zeros for a missing one"
                    f"\n{str(exc)[:2000]}")
    owners = ranks[0]["owners"]
    # rank 0 holds 1 and rank 1 holds 2, except on layer 2 (1 and nothing) and layer 3 (none)
    want = [[1.5], [1.5], [0.5], [0.5], None, None]
    for rank, r in enumerate(ranks):
        for i, (owner, grad) in enumerate(zip(owners, r["grads"])):
            expected = want[i] if owner == rank else None
            assert grad == expected, (
                f"rank {rank}, parameter {i} (owner: rank {owner}): after reduce_gradients() "
                f"its gradient is {grad}, not {expected}: "
                + ("a parameter that has no gradient on any rank keeps none"
                   if want[i] is None else
                   "the owner gets the mean over the ranks, a missing gradient counting as 0"
                   if owner == rank else "a rank frees the gradients it does not own"))
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: (
            f"the ranks' weights differ after reduce_gradients() and step()\n{m}"))


@pytest.mark.task("08.3")
@pytest.mark.timeout(150)
def test_a_rank_resumes_from_its_own_shard_of_the_state():
    """state_dict() holds this rank's shard; load_state_dict() puts it back into the inner
    optimizer, so a resumed run steps exactly as the original, and refuses another rank's."""
    ranks = run_distributed(rank_fns.sharded_state_dict_round_trip, world_size=2, timeout=120)
    for rank, r in enumerate(ranks):
        assert r["diff"] == 0, (
            f"rank {rank}: one step after load_state_dict() the weights differ by "
            f"{r['diff']:.2g} from the run that saved it: the saved shard (Adam's moments) "
            f"never reached the inner optimizer")
        assert r["other"] != "accepted", (
            f"rank {rank} loaded the other rank's shard without complaint: each rank must "
            f"load the shard it saved")
        assert r["closure_called"] == 1 and r["closure_returned"], (
            f"rank {rank}: step(closure) called the closure {r['closure_called']} time(s) and "
            f"did not return its loss: a torch optimizer calls it once, under enable_grad, "
            f"and returns what it returned (LBFGS and Lightning rely on it)")


# --- the accounting's given code -------------------------------------------------------------

def test_predict_bytes_refuses_a_world_of_no_ranks(acc):
    for stage in acc.STAGES:
        try:
            got = acc.predict_bytes(1000, 0, stage)
        except ValueError as exc:
            assert "world_size" in str(exc), str(exc)
        except Exception as exc:  # noqa: BLE001 (the wrong error is the finding)
            pytest.fail(f"predict_bytes(1000, 0, {stage!r}) raised {type(exc).__name__}: "
                        f"{exc}: refuse world_size < 1 up front with a ValueError naming it")
        else:
            pytest.fail(f"predict_bytes(1000, 0, {stage!r}) returned {got}: a world of 0 ranks "
                        "must be refused (ValueError naming world_size), not priced")


def test_optimizer_state_bytes_reads_the_local_optimizer_and_skips_non_tensors(acc):
    """A sharded optimizer keeps its state in ``local_optimizer`` (None on a rank that owns
    nothing); an optimizer's state may hold ints, floats and lists next to its tensors."""
    from types import SimpleNamespace

    def count(optimizer):  # (bytes, None) or (None, the error), failed on outside `except`
        try:
            return acc.optimizer_state_bytes(optimizer), None
        except AttributeError as exc:
            return None, exc

    nothing, error = count(SimpleNamespace(local_optimizer=None))
    assert error is None, (f"a rank that owns no parameter (local_optimizer is None) crashed "
                           f"the count ({error}): its optimizer state is 0 bytes")
    assert nothing == 0
    p = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.Adam([p], lr=0.1)
    p.sum().backward()
    adam.step()

    class Sharded:  # like ShardedOptimizer: the wrapper's own state is empty
        state: dict = {}
        local_optimizer = adam

    assert acc.optimizer_state_bytes(Sharded()) == 2 * 3 * 4, (
        "a sharded optimizer's state lives in its local_optimizer (exp_avg and exp_avg_sq, "
        "2 x 3 fp32 here): read optimizer.local_optimizer.state when there is one")
    lbfgs = torch.optim.LBFGS([p], max_iter=2)

    def closure():
        lbfgs.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    lbfgs.step(closure)
    kinds = {type(v).__name__ for v in lbfgs.state[p].values()}
    assert {"int", "float", "list"} <= kinds, kinds  # the setup: LBFGS keeps all of these
    want = sum(v.numel() * v.element_size() for v in lbfgs.state[p].values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)
    got, error = count(lbfgs)
    assert error is None, (
        f"LBFGS's state (ints, floats, lists and tensors) crashed the count ({error}): count "
        "only the values that are tensors (isinstance(v, torch.Tensor))")
    assert got == want, f"LBFGS's state tensors hold {want} bytes, the count says {got}"


# --- three ranks: uneven shares, three dtypes, who writes -------------------------------------
# One 3-rank run for the sharded optimizer and one for FSDP2, each checked by several tests.
# At 2 ranks every ConvNet row count splits evenly, a hard-coded "other rank" is right and
# every rank owns something; in fp32 alone a buffer in the wrong dtype loses nothing.

_part = checked_part


@pytest.fixture(scope="module")
def zero3():
    return run_distributed(rank_fns.zero_at_three, world_size=3, timeout=240)


@pytest.fixture(scope="module")
def fsdp3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp3")
    return run_distributed(rank_fns.fsdp_at_three, world_size=3, timeout=240,
                           kwargs={"save_dir": str(folder)})


def _how_it_was_rounded(got: torch.Tensor, owner: torch.Tensor) -> str:
    for dtype in (torch.bfloat16, torch.float32):
        if dtype != owner.dtype and torch.equal(got, owner.to(dtype).to(owner.dtype)):
            return (f"it is the owner's value rounded to {str(dtype)[6:]}: the buffer that "
                    "carries an owner's parameters must keep each one's dtype (torch.cat of "
                    "the parameters themselves; no .float(), no buffer made in the first "
                    "parameter's dtype)")
    return ("every rank must copy in every other owner's broadcast (at 3 ranks there is more "
            "than one 'other rank')")


@pytest.mark.task("08.3")
@pytest.mark.timeout(300)
def test_sharded_step_on_three_ranks_with_parameters_of_three_dtypes(zero3):
    """bf16, fp32 and fp64 parameters owned unevenly by 3 ranks (rank 2 owns a bf16 one, then
    two fp64 ones); after two Adam steps every rank holds, bit for bit, what each owner
    computed, in the parameter's own dtype, and that is what a plain Adam computes."""
    ranks = [_part(r["mixed"]) for r in zero3]
    owners = ranks[0]["owners"]
    for i, owner in enumerate(owners):
        mine = ranks[owner]["params"][i]
        for rank, r in enumerate(ranks):
            got = r["params"][i]
            assert got.dtype == mine.dtype, (
                f"rank {rank}'s parameter {i} became {got.dtype}, not {mine.dtype}: a step "
                "keeps every parameter's dtype")
            assert torch.equal(got, mine), (
                f"rank {rank}'s copy of parameter {i} ({str(mine.dtype)[6:]}, owned by rank "
                f"{owner}) differs from the owner's by "
                f"{(got.double() - mine.double()).abs().max().item():.3g}: "
                + _how_it_was_rounded(got, mine))
        torch.testing.assert_close(mine, ranks[owner]["plain"][i], msg=lambda m, i=i, t=mine: (
            f"parameter {i} ({str(t.dtype)[6:]}) after the sharded step differs from a "
            f"plain Adam's: the owner steps it with the inner optimizer\n{m}"))


@pytest.mark.task("08.3")
@pytest.mark.timeout(300)
def test_a_rank_that_owns_nothing_still_takes_part_in_every_broadcast(zero3):
    """Two parameters on 3 ranks: rank 2 owns none (its inner optimizer is None), yet the
    owners' broadcasts need it, and it must end with their updates."""
    hint = ("a rank that owns nothing has nothing to step, but must still enter every "
            "owner's broadcast and copy it in (do not return early)")
    # the owners wait in a broadcast rank 2 never entered: they time out, or see it leave
    stuck = {rank: r["idle"]["error"] for rank, r in enumerate(zero3) if "error" in r["idle"]}
    assert not stuck or "error" in zero3[2]["idle"], (
        f"step() failed on ranks {sorted(stuck)} ({next(iter(stuck.values()))}) but not on "
        f"rank 2, which owns nothing: they waited in a broadcast rank 2 never entered: {hint}")
    ranks = [_part(r["idle"]) for r in zero3]
    assert ranks[2]["owns"] == 0  # the setup
    for rank, r in enumerate(ranks):
        assert r["values"] == [[0.0], [-1.0]], (
            f"rank {rank} ends with {r['values']}, not the owners' updates [[0.0], [-1.0]]: "
            + hint)


@pytest.mark.task("08.4")
@pytest.mark.timeout(300)
def test_fsdp2_on_three_ranks_shards_uneven_rows_and_trains_like_ddp(fsdp3):
    """At 3 ranks ConvNet's rows (16, 32, 10) do not divide: shards of 6, 6, 4 and so on."""
    ranks = [_part(r["fp32"]) for r in fsdp3]
    n = len(ranks)
    rows = {name: p.shape[0] for name, p in ConvNet().named_parameters()}

    def most(name, numel):  # elements of the largest shard: dim 0 split in ceil(rows / 3)s
        return -(-rows[name] // n) * (numel // rows[name])

    for rank, r in enumerate(ranks):
        assert r["is_unit"] == {"root": True, "layer1": True, "layer2": True, "fc": True}, (
            f"rank {rank}: FSDP units {r['is_unit']}: shard every block, then the root")
        whole = [name for name, kind, numel, local in r["after_forward"]
                 if kind != "DTensor" or local > most(name, numel)]
        assert not whole, (f"rank {rank}: {whole} stay whole between forward and backward "
                           "at 3 ranks: each block is freed back to its shard after forward")
        assert r["losses"]["fsdp"] == pytest.approx(r["losses"]["ddp"], rel=1e-4, abs=1e-5), (
            f"rank {rank}: at 3 ranks FSDP2's losses {r['losses']['fsdp']} differ from DDP's "
            f"{r['losses']['ddp']}")
        assert r["diff"] < 1e-5, f"rank {rank}: the weights differ from DDP's by {r['diff']:.2g}"
    for i, (name, kind, numel, _) in enumerate(ranks[0]["shards"]):
        local = [r["shards"][i][3] for r in ranks]
        assert kind == "DTensor" and sum(local) == numel and max(local) <= most(name, numel), (
            f"{name} ({numel} elements) is held as {kind} shards of {local} on the 3 ranks: "
            "every parameter is split over the ranks, no element twice")


@pytest.mark.task("08.4")
@pytest.mark.timeout(300)
def test_fsdp2_with_a_bf16_policy_computes_in_bf16_and_keeps_fp32_masters(fsdp3):
    """shard_model(model, mp_policy=MixedPrecisionPolicy(param_dtype=bfloat16)): the blocks
    compute in bf16 while the sharded parameters, which Adam steps, stay fp32."""
    for rank, r in enumerate(_part(r["bf16"]) for r in fsdp3):
        assert set(r["seen"].values()) == {"torch.bfloat16"}, (
            f"rank {rank}: with a bf16 mp_policy the blocks computed in {r['seen']}: pass "
            "shard_model's **fsdp_kwargs to every fully_shard call")
        assert r["masters"] == r["local"] == r["state"] == ["torch.float32"], (
            f"rank {rank}: the sharded parameters are {r['masters']} (local shards "
            f"{r['local']}) and Adam's state {r['state']}, not float32: the policy makes the "
            "bf16 copies for compute; the model itself must not be cast (no model.to(bf16)),"
            " or the fp32 master weights are gone")


@pytest.mark.task("08.5")
@pytest.mark.timeout(300)
def test_full_state_dict_gathers_uneven_shards_of_fp32_masters_on_rank_0(fsdp3):
    """Three ranks, shards of unequal rows, a bf16 compute policy: rank 0 gets every parameter
    whole, as the fp32 plain CPU tensors the sharded masters hold; ranks 1 and 2 nothing."""
    ranks = [_part(r["state"]) for r in fsdp3]
    r0 = ranks[0]
    assert r0["keys"] == r0["want"], (
        f"rank 0's full state dict has the keys {r0['keys']}, not {r0['want']}")
    for k, (kind, dtype, device, shape) in r0["got"].items():
        want = r0["want_shapes"][k]
        assert (kind, dtype, device, shape) == ("Tensor", "torch.float32", "cpu", want), (
            f"{k} in rank 0's full state dict is a {kind} of {dtype} on {device} with shape "
            f"{shape}: want a plain fp32 CPU Tensor of the full shape {want} (gathered with "
            "full_state_dict=True, cpu_offload=True; the fp32 masters, not bf16 compute copies)")
    assert r0["equal"] == r0["want"], (
        f"rank 0's full state dict differs from the sharded masters in "
        f"{sorted(set(r0['want']) - set(r0['equal']))}: gather every rank's shard")
    for rank, r in enumerate(ranks[1:], 1):
        assert r["keys"] == [], (
            f"rank {rank} holds {len(r['keys'])} full tensors too: with cpu_offload=True only "
            "rank 0 keeps the gathered state dict")


@pytest.mark.timeout(300)
def test_on_three_ranks_only_rank_0_draws_a_bar_and_writes_the_file(fsdp3):
    """train_worker (given code) with progress=True and save=: one bar and one file for the
    job, both rank 0's (the other ranks' bars overwrite it on the same line; several writers
    of one path race)."""
    ranks = [_part(r["worker"]) for r in fsdp3]
    bars = [rank for r in ranks for rank in r["bars"]]
    assert bars == [0], (
        f"train_worker(progress=True) on 3 ranks drew bars on ranks {bars}: only rank 0 "
        "draws the progress bar")
    saves = [len(r["saves"]) for r in ranks]
    assert saves == [1, 0, 0] and ranks[0]["saves"][0] > 0, (
        f"the ranks wrote the state dict {saves} time(s) ({ranks[0]['saves']} tensors on "
        "rank 0): only rank 0 writes the file, with every tensor")
