"""Lesson 03: DDP with mp.spawn. Every multi-process test uses run_distributed (world size 2,
gloo, CPU, free port, hard timeout); the CLI tests start the script with a subprocess timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DistributedSampler

from dpt import cli
from dpt import dist as dpt_dist
from dpt.data import TensorLoader, load_tensors
from dpt.device import DeviceError
from dpt.dist import LaunchError, cpu_budget, find_free_port, group_of_one
from dpt.models import ConvNet
from dpt.ranks import run_distributed
from tests.helpers import (
    CPU,
    TRAINING_ARGS,
    assert_a_missing_resume_is_an_error,
    assert_every_rank_left_the_group,
    assert_progress_reaches_the_epoch_loop,
    assert_resume_loads_into_the_moved_model,
    one_line_error,
    requires_data,
    run_script,
    run_script_cases,
)
from tests.l03_ddp_spawn import rank_fns
from tests.lessons import REPO, script

LESSON = "03_ddp_spawn"

# The lesson's default dataset is MNIST (as in the tutorials it follows); the tests use
# Fashion-MNIST, which `make test` always provides (MNIST needs `make data`).
FASHION = ("--dataset", "fashion-mnist")
WS = 2


# ------------------------------------------------------------------ 03.1 ddp_setup


def _rank_hint(got: tuple, nodes: int, gpus: int, local: int, nr: int) -> str:
    """The likely mistake behind a wrong (rank, world_size) for process ``local`` of node
    ``nr``, with ``nodes`` machines of ``gpus`` processes each."""
    got_rank, got_world = got
    if got_world != nodes * gpus:
        return ("world_size counts every process of every machine (nodes * gpus), not "
                f"{got_world}")
    if got_rank == nr * nodes + local:
        return ("the nodes before this one hold nr * gpus processes (gpus per node, not the "
                "number of nodes)")
    if got_rank == local:
        return ("that is the local rank: the global rank also counts the processes of the "
                "machines before this one, nr * gpus of them")
    return (f"the global rank is the {nr * gpus} processes of the machines before this one, "
            "plus this process's place on its own machine")


@pytest.mark.task("03.1")
@pytest.mark.timeout(120)
def test_every_process_finds_its_global_rank_and_joins_one_group():
    # First in this process, without joining, on layouts where nodes != processes per node:
    # with 2 x 2 alone, nr * nodes + local_rank (the two counts swapped) gives the right ranks.
    for nodes, gpus in ((3, 2), (2, 3)):
        for rank in range(nodes * gpus):
            want = (rank, nodes * gpus)
            info = rank_fns.setup_ranks_without_joining(rank, nodes * gpus, nodes, gpus)
            got = info["joined"] if info["joined"] not in (None, want) else info["returned"]
            assert got == want, (
                f"with {nodes} nodes of {gpus} processes, local process {rank % gpus} of node "
                f"{rank // gpus} gets (rank, world_size) {got}, not {want}: "
                + _rank_hint(got, nodes, gpus, rank % gpus, rank // gpus))
    nodes, gpus = 2, 2  # 4 processes: test rank r plays local process r % 2 of node r // 2
    # then each in its own process, still without joining: a wrong rank would otherwise show
    # as two processes claiming it
    dry = run_distributed(rank_fns.setup_ranks_without_joining, nodes * gpus,
                          args=(nodes, gpus), backend=None, timeout=60)
    for rank, info in enumerate(dry):  # (None: joined without join_group; checked below)
        assert info["joined"] in (None, (rank, nodes * gpus)), (
            f"local process {rank % gpus} of node {rank // gpus} joins as (rank, world_size) "
            f"{info['joined']}, not {(rank, nodes * gpus)}: the global rank counts the "
            "processes of the machines before this one (node 0's first, then node 1's)")
    infos = run_distributed(rank_fns.setup_as_node_process, nodes * gpus, args=(nodes, gpus),
                            backend=None, timeout=100)
    for rank, info in enumerate(infos):
        assert info["returned"] == (rank, nodes * gpus), (
            f"local process {rank % gpus} of node {rank // gpus} returned (rank, world_size) "
            f"{info['returned']}; the ranks of node 0 come first, then node 1's")
        assert info["group"] == (rank, nodes * gpus), "joined the group with another rank"
        assert info["backend"] == "gloo" and info["device"] == "cpu"
        assert info["sum"] == sum(range(1, nodes * gpus + 1)), "the ranks are not in one group"
        assert info["threads"] * gpus <= max(gpus, cpu_budget()), (
            f"{info['threads']} threads on each of {gpus} processes per machine "
            f"oversubscribe {cpu_budget()} cores")


@pytest.mark.task("03.1")
def test_ddp_setup_passes_this_machine_s_layout_to_join_group():
    nodes, gpus = 2, 3
    rank = 5  # local process 2 of node 1
    info = rank_fns.setup_ranks_without_joining(rank, nodes * gpus, nodes, gpus)
    call = info["call"]
    assert call is not None, "ddp_setup must join through join_group"
    assert (call["rank"], call["world_size"]) == (rank, nodes * gpus), (
        f"join_group got (rank, world_size) ({call['rank']}, {call['world_size']}), not "
        f"({rank}, {nodes * gpus})")
    assert call["local_rank"] == rank % gpus and call["local_world_size"] == gpus, call


# ------------------------------------------------------------------ 03.2 joining and leaving


def _join(mod, monkeypatch, local_rank=2, **flags):
    """``mod.join_group`` as rank 5 of 6, local process ``local_rank`` of 3, with its
    preflight and ``init_process_group`` replaced by recorders; returns (device, calls)."""
    calls = {}
    monkeypatch.setattr(mod, "preflight", lambda *a: calls.setdefault("preflight", a))
    monkeypatch.setattr(mod.dist, "init_process_group",
                        lambda *a, **k: calls.setdefault("init", (a, k)))
    args = SimpleNamespace(device="auto", timeout=37.0, threads=None, **flags)
    return mod.join_group(5, 6, local_rank, 3, args), calls


def _init_backend(calls) -> str:
    args, kwargs = calls["init"]
    return kwargs.get("backend", args[0] if args else None)


@pytest.mark.task("03.2")
def test_join_group_on_the_cpu_joins_with_gloo_as_this_rank(monkeypatch):
    mod = rank_fns._mod()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    device, calls = _join(mod, monkeypatch)
    assert device == torch.device("cpu"), f"without a GPU the device is the CPU, not {device}"
    assert "init" in calls, "join_group must call dist.init_process_group"
    args, kwargs = calls["init"]
    assert _init_backend(calls) == "gloo", "on the CPU the backend is gloo"
    assert kwargs.get("rank") == 5 and kwargs.get("world_size") == 6, (
        f"init_process_group got {kwargs}: pass rank= and world_size= (the whole job's)")
    assert kwargs.get("timeout") is not None and kwargs["timeout"].total_seconds() == 37.0, (
        "--timeout 37 must reach init_process_group as timeout=timedelta(seconds=37)")
    assert calls.get("preflight", (None,))[1:] == (5, 6, 2, 3, device, "gloo"), (
        "call preflight(args, rank, world_size, local_rank, local_world_size, device, backend) "
        f"before joining; it got {calls.get('preflight')}")


@pytest.mark.task("03.2")
@pytest.mark.parametrize("share", ["0", "1"])
def test_join_group_on_gpus_uses_gpu_local_rank(monkeypatch, share):
    mod = rank_fns._mod()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3 if share == "0" else 1)
    monkeypatch.setenv("DPT_SHARE_GPU", share)
    device, calls = _join(mod, monkeypatch)
    want = torch.device("cuda", 2 if share == "0" else 0)
    assert device == want, (f"local process 2 of a machine got {device}, not {want}: "
                            "process local_rank uses GPU local_rank (dpt.device.gpu_for)")
    want_backend = "nccl" if share == "0" else "gloo"
    assert _init_backend(calls) == want_backend, (
        f"on {device} the backend is {want_backend}"
        + (" (ranks sharing a GPU use gloo: NCCL refuses them)" if share == "1" else ""))


# ------------------------------------------------------------------ 03.3 the data loader


@pytest.mark.task("03.3")
@pytest.mark.timeout(90)
def test_each_rank_gets_its_own_shuffled_share():
    n = 40
    shards = run_distributed(rank_fns.loader_orders, WS, args=(n, 4, True, 0), timeout=60)
    first = [sum(orders[0], []) for orders in shards]
    assert all(len(s) == n // WS for s in first), (
        f"with {n} samples on {WS} ranks the ranks got {[len(s) for s in first]} samples each, "
        f"not {n // WS}: a DistributedSampler over every rank (its defaults read the rank and "
        "world size from the process group) gives each rank its own share")
    assert all(len(b) == 4 for orders in shards for b in orders[0]), "batch size ignored"
    assert not set(first[0]) & set(first[1]), "the ranks see overlapping data"
    assert sorted(first[0] + first[1]) == list(range(n)), "some samples are never seen"
    assert first[0] != sorted(first[0]), "the training data is not shuffled"
    assert shards[0][0] != shards[0][1], "the sampler's epoch does not change the order"
    odd = run_distributed(rank_fns.loader_orders, WS, args=(n + 1, 4, True, 0), timeout=60)
    seen = set().union(*(sum(orders[0], []) for orders in odd))
    assert seen == set(range(n + 1)), (
        f"with {n + 1} samples on {WS} ranks, samples {sorted(set(range(n + 1)) - seen)} are "
        f"never seen: leave drop_last off, so the sampler pads the last share instead")


@pytest.mark.task("03.3")
@pytest.mark.timeout(90)
def test_without_shuffle_the_shares_are_in_order_and_the_seed_counts():
    n = 10
    plain = run_distributed(rank_fns.loader_orders, WS, args=(n, 4, False, 0), timeout=60)
    assert [sum(o[0], []) for o in plain] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]], (
        "shuffle=False must keep the dataset's order (evaluation relies on it)")
    a = run_distributed(rank_fns.loader_orders, WS, args=(40, 4, True, 1), timeout=60)
    b = run_distributed(rank_fns.loader_orders, WS, args=(40, 4, True, 2), timeout=60)
    assert a[0][0] != b[0][0], "the seed is ignored"


# ------------------------------------------------------------------ 03.4 set_epoch


@pytest.mark.task("03.4")
@pytest.mark.timeout(120)
def test_every_epoch_has_its_own_order_the_same_on_every_rank():
    results = run_distributed(rank_fns.trainer_sampler_passes, WS, args=(0, 3), timeout=100)
    for r in results:
        epochs = [e for e, _ in r["passes"]]
        assert epochs == [0, 1, 2], (
            f"the sampler saw epochs {epochs}: call set_epoch(epoch) before each epoch")
        orders = [o for _, o in r["passes"]]
        assert len({tuple(o) for o in orders}) == 3, "the data order repeats across epochs"
        assert r["epochs_run"] == 3
        assert r["model_sent"], (
            "the Trainer never sent the model to its device: on a GPU the weights would stay "
            "on the CPU. Move it in __init__ (model.to(device)), before DDP wraps it")
        assert not r["unsent"], r["unsent"]
        # the epoch loop around the task is given code: 2 batches an epoch, in training mode
        assert len(r["modes"]) == 3 * 2, (
            f"train(3, limit_batches=2) ran {len(r['modes'])} training batches, not 6: pass "
            "limit_batches on to the epoch's batch loop")
        assert all(r["modes"]), (
            "a model left in eval mode (as evaluation leaves it) was trained in eval mode: "
            "call self.model.train() at the start of each epoch")
        assert len(r["history"]) == 6 and r["epoch_losses"] == pytest.approx(
            [sum(r["history"][i:i + 2]) / 2 for i in (0, 2, 4)]), (
            f"train() returned {r['epoch_losses']} and kept {r['history']} as the batch losses: "
            "each epoch's loss is the mean of its batches' losses, and every batch's loss is "
            "kept in history")
    for e in range(3):
        a, b = results[0]["passes"][e][1], results[1]["passes"][e][1]
        assert not set(a) & set(b), f"epoch {e}: the ranks' shares overlap"


@pytest.mark.task("03.4")
@pytest.mark.timeout(120)
def test_a_resumed_trainer_replays_the_missing_epochs_orders():
    results = run_distributed(rank_fns.trainer_sampler_passes, WS, args=(2, 4), timeout=100)
    for r in results:
        assert [e for e, _ in r["passes"]] == [2, 3], (
            "a run resumed at epoch 2 must train epochs 2 and 3, with their data order")


@pytest.mark.task("03.4")  # the epoch loop is given code, but task 03.4 opens it
@pytest.mark.timeout(60)
def test_the_progress_flag_reaches_the_epoch_loop(monkeypatch):
    mod = rank_fns._mod()
    x, y = rank_fns._data(16)

    def train_one_epoch(progress):
        model = ConvNet()
        loader = TensorLoader(x, y, batch_size=8, sampler=DistributedSampler(range(16)))
        trainer = mod.Trainer(model, loader, torch.optim.SGD(model.parameters(), lr=0.01), CPU,
                              progress=progress)
        trainer._run_batch = lambda source, targets: 0.0  # task 01.1 stood in for
        trainer.train(1)

    with group_of_one():  # this process alone is the job: DDP needs a group
        assert_progress_reaches_the_epoch_loop(mod, monkeypatch, train_one_epoch)


@pytest.mark.timeout(120)
def test_only_rank_0_draws_a_progress_bar():
    """The ranks share one terminal: two bars would overwrite each other on one line."""
    text = run_distributed(rank_fns.progress_bar_text, WS, timeout=100)
    assert "epoch 0" in text[0], f"rank 0 drew no progress bar with progress=True: {text[0]!r}"
    assert "epoch 0" not in text[1], (
        f"rank 1 drew a progress bar too: {text[1][:200]!r}; only rank 0 should (the README "
        "says only rank 0 prints): dpt.cli.batches hides it on the other ranks")


@pytest.mark.timeout(60)
def test_train_saves_every_save_every_epochs_and_prints_each_epoch_s_mean(tmp_path, capsys):
    # Trainer.train is given code: stand-ins for the epoch (03.4) and the save (03.5)
    mod = rank_fns._mod()
    model = ConvNet()
    saved = []
    with group_of_one():
        trainer = mod.Trainer(model, None, torch.optim.SGD(model.parameters(), lr=0.01), CPU,
                              save_every=2, checkpoint_path=tmp_path / "ck.pt")

        def epoch_stand_in(epoch, limit_batches=None):
            trainer.history.extend([float(epoch), epoch + 2.0])  # the batches' losses
            return epoch + 1.0  # their mean

        trainer._run_epoch = epoch_stand_in
        trainer._save_checkpoint = saved.append
        losses = trainer.train(5)
    assert losses == [1.0, 2.0, 3.0, 4.0, 5.0], losses
    assert saved == [2, 4], (
        f"train(5) with save_every=2 saved checkpoints after epochs {saved}, not [2, 4]: save "
        "only when epochs_run % save_every == 0 (--save-every), with the number of epochs "
        "finished")
    out = capsys.readouterr().out
    assert "epoch 4: mean train loss 5.0000" in out, (
        f"train() printed {out!r}: the line of each epoch must show that epoch's mean loss "
        "(losses[-1]), not its last batch's (history[-1])")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_prints_the_resume_and_epoch_lines(rank, monkeypatch, capsys):
    # Trainer.__init__ and train are given code: stand-ins for load_checkpoint (01.3), the
    # epoch (03.4) and the save (03.5); this process, a world of one, plays `rank`
    mod = rank_fns._mod()
    monkeypatch.setattr(mod, "load_checkpoint", lambda *args, **kwargs: {"epoch": 1})
    monkeypatch.setattr(dpt_dist, "get_rank", lambda: rank)  # what rank0_print asks
    model = ConvNet()
    with group_of_one():
        trainer = mod.Trainer(model, None, torch.optim.SGD(model.parameters(), lr=0.01), CPU,
                              resume_from="ck.pt")
        trainer._run_epoch = lambda epoch, limit_batches=None: 1.0
        trainer.train(3)
    out = capsys.readouterr().out
    if rank == 0:
        assert "resumed from ck.pt at epoch 1" in out and "epoch 2: mean train loss" in out, out
    else:
        assert out == "", (
            f"rank 1 printed {out!r}: only rank 0 prints the resume and the epoch lines "
            "(rank0_print, not print), or every line appears once per process")


@pytest.mark.timeout(60)
def test_a_resumed_trainer_loads_the_checkpoint_into_the_model_on_its_device(monkeypatch):
    # Trainer.__init__ is given code; load_checkpoint (01.3) is stood in for
    with group_of_one():
        assert_resume_loads_into_the_moved_model(rank_fns._mod(), ConvNet(), monkeypatch)


@pytest.mark.timeout(60)
def test_resuming_from_a_missing_checkpoint_is_an_error(tmp_path, monkeypatch):
    # Trainer.__init__ is given code; load_checkpoint (01.3) is stood in for
    with group_of_one():
        assert_a_missing_resume_is_an_error(rank_fns._mod(), ConvNet(), monkeypatch,
                                            tmp_path / "missing.pt")


# ------------------------------------------------------------------ 03.5 rank 0 checkpoints


@pytest.mark.task("03.5")
@pytest.mark.timeout(180)
def test_only_rank0_saves_without_module_prefix_and_everyone_waits(tmp_path):
    results = run_distributed(rank_fns.save_on_ranks, WS, args=(str(tmp_path),), timeout=100)
    assert (tmp_path / "own0.pt").is_file(), "rank 0 did not save"
    assert not (tmp_path / "own1.pt").exists(), (
        "rank 1 wrote a checkpoint too: only rank 0 may write it")
    state = torch.load(tmp_path / "own0.pt", weights_only=True)
    assert state["epoch"] == 2 and state["optimizer"]["state"], "epoch/optimizer missing"
    assert not any(k.startswith("module.") for k in state["model"]), (
        "keys start with 'module.': save the model inside the DDP wrapper")
    ConvNet().load_state_dict(state["model"])  # strict: same keys as a plain model
    for k, v in results[0]["state"].items():
        torch.testing.assert_close(state["model"][k], v)
    assert all(r["there_on_return"] for r in results), (
        "a rank went on before rank 0 had written the checkpoint: wait for it (a barrier)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["own0.pt", "shared.pt"]
    saved = list(state["optimizer"]["state"].values())
    resumed = run_distributed(rank_fns.resume_on_ranks, WS, args=(str(tmp_path / "own0.pt"),),
                              timeout=60)
    for rank, r in enumerate(resumed):
        assert r["epochs_run"] == 2, (
            f"rank {rank}: Trainer(resume_from=...) did not start at the checkpoint's epoch")
        assert len(r["momentum"]) == len(saved), (
            f"rank {rank}: a resumed Trainer restarted momentum from zero: pass the optimizer "
            "to load_checkpoint, so its state is restored with the weights")
        for got, want in zip(r["momentum"], saved):
            torch.testing.assert_close(got, want["momentum_buffer"], msg=(
                f"rank {rank}: the resumed optimizer's momentum is not the checkpoint's"))


# ------------------------------------------------------------------ 03.6 evaluation


@pytest.mark.task("03.6")
@pytest.mark.timeout(90)
def test_accuracy_counts_the_whole_test_set_once():
    # odd: DistributedSampler pads rank 1's share with a repeat of sample 0; and above 2048,
    # where float16 stops counting every integer (it holds 4096 and 4100, not 4099)
    n = 4099
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 1, 28, 28, generator=g)
    torch.manual_seed(0)
    model = ConvNet().eval()
    with torch.no_grad():
        pred = model(x).argmax(1)
    # even samples right, odd ones wrong: one rank's share alone would give 100% or 0%, and
    # the padded repeat of sample 0 (right) would add one correct answer too many
    y = torch.where(torch.arange(n) % 2 == 0, pred, (pred + 1) % 10)
    expected = (int((pred == y).sum()), n)
    results = run_distributed(rank_fns.evaluate_counts, WS, args=(x, y), timeout=60)
    for rank, r in enumerate(results):
        counts = tuple(int(c) for c in r["counts"])
        assert counts[1] != n + 1, "the padded duplicate was counted"
        rounded = counts != expected and all(abs(a - b) <= 4 for a, b in zip(counts, expected))
        assert counts == expected, (
            f"rank {rank} reports {counts}, the whole test set gives {expected}"
            + (": the counts were rounded on the way, so add them up in an integer (or "
               "float64) tensor; float16 and bfloat16 cannot hold every count above 2048 and "
               "256" if rounded else ""))
        assert r["graphs"] and not any(r["graphs"]), (
            f"rank {rank}: evaluate built an autograd graph for every batch (memory and time "
            "for nothing): predict under torch.no_grad() (keep the @torch.no_grad() decorator)")
        assert not r["unsent"], f"rank {rank}: {r['unsent']}"
        assert not r["collective_problems"], f"rank {rank}: {r['collective_problems'][0]}"
        assert r["training_after"], "evaluate must restore training mode"
        assert tuple(int(c) for c in r["again"]) == expected, (
            f"rank {rank}: a second evaluate gives {r['again']}, not {expected}")
        assert r["eval_after"], (
            "evaluate switched a model that was in eval mode to training mode: put back the "
            "mode it was in (model.train(was_training)), not model.train()")


@pytest.mark.task("03.6")
@pytest.mark.timeout(60)
def test_evaluate_returns_the_counts_as_python_ints():
    mod = rank_fns._mod()
    x, y = rank_fns._data(10)
    torch.manual_seed(0)
    with group_of_one():  # a world of one: the all-reduce adds nothing, the types stay
        loader = TensorLoader(x, y, batch_size=4,
                              sampler=DistributedSampler(range(10), shuffle=False))
        counts = mod.evaluate(ConvNet(), loader, CPU)
    assert [type(c).__name__ for c in counts] == ["int", "int"], (
        f"evaluate returned {counts!r}: return the all-reduced counts as plain ints "
        "(int(counts[0]), int(counts[1])), as lesson 01's evaluate does, not as tensors")
    assert counts[1] == 10, counts


def test_main_passes_the_checkpoint_and_resume_flags_on(monkeypatch):
    # main() is given code: joining and training are stood in for, only the wiring is tested
    mod = rank_fns._mod()
    seen = {}

    class Trainer:
        def __init__(self, model, *args, **kwargs):
            seen.update(args=args, kwargs=kwargs)
            self.model, self.history = model, [0.5]

        def train(self, *args):
            return [0.5]

    monkeypatch.setattr(mod, "ddp_setup", lambda local_rank, args: (0, 1, torch.device("cpu")))
    monkeypatch.setattr(mod.dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(mod, "Trainer", Trainer)
    monkeypatch.setattr(mod, "prepare_distributed", lambda *a, **k: None)
    monkeypatch.setattr(mod, "load_tensors", lambda *a, **k: (torch.zeros(8, 1, 28, 28),
                                                               torch.zeros(8, dtype=torch.long)))
    monkeypatch.setattr(mod, "prepare_dataloader", lambda *a, **k: None)
    monkeypatch.setattr(mod, "evaluate", lambda *a: (3, 4))
    got = mod.main(0, SimpleNamespace(checkpoint="ck.pt", resume="old.pt", **TRAINING_ARGS))
    assert "ck.pt" in seen["args"] and seen["kwargs"].get("resume_from") == "old.pt", seen
    assert got["accuracy"] == 0.75 and got["history"] == [0.5], got


@pytest.mark.timeout(30)
def test_a_process_that_cannot_join_reports_why(monkeypatch):
    # main() is given code: the join is stood in for by one that fails, as an unreachable
    # node 0 makes it fail
    mod = rank_fns._mod()

    def cannot_join(local_rank, args):
        raise RuntimeError("node 0 is unreachable (a failure the test injects)")

    monkeypatch.setattr(mod, "ddp_setup", cannot_join)
    with pytest.raises(Exception) as info:
        mod.main(0, SimpleNamespace(checkpoint=None, resume=None))
    assert "node 0 is unreachable" in str(info.value), (
        f"a process that could not join raised {type(info.value).__name__}: {info.value}, not "
        "the join's own error: call ddp_setup before the try, since the finally's "
        "destroy_process_group() fails when no group was ever made, and its error hides why "
        "the join failed")


# ------------------------------------------------------------------ 03.7 the launch


@pytest.mark.task("03.7")
def test_launch_sets_the_rendezvous_and_spawns_one_process_per_device(monkeypatch):
    mod = rank_fns._mod()
    seen = {}

    def spawn(fn, args=(), nprocs=1, **kwargs):
        seen.update(fn=fn, args=args, nprocs=nprocs, addr=os.environ.get("MASTER_ADDR"),
                    port=os.environ.get("MASTER_PORT"))

    monkeypatch.setattr(mod.mp, "spawn", spawn)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    port = find_free_port()
    args = SimpleNamespace(gpus=3, nodes=1, nr=0, master_addr="10.0.0.7", master_port=port)
    mod.launch(args)
    assert seen, "launch must start the processes with mp.spawn"
    assert seen["fn"] is mod.main and seen["nprocs"] == 3, (
        f"mp.spawn got {seen['fn']} and nprocs={seen['nprocs']}: start main, args.gpus times")
    assert tuple(seen["args"]) == (args,), "mp.spawn(main, args=(args,), ...): main gets args"
    assert (seen["addr"], seen["port"]) == ("10.0.0.7", str(port)), (
        "set MASTER_ADDR and MASTER_PORT (from args.master_addr, args.master_port) before "
        "mp.spawn: the processes read them to find rank 0")


# ------------------------------------------------------------------ DDP itself (not a task)


@pytest.mark.timeout(120)
def test_ddp_with_batch_b_on_two_ranks_equals_one_process_with_batch_2b():
    per_rank, steps, lr = 8, 4, 0.05
    g = torch.Generator().manual_seed(1)
    x = torch.randn(per_rank * WS * steps, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (len(x),), generator=g)
    states = run_distributed(rank_fns.ddp_steps, WS, args=(x, y, per_rank, steps, lr),
                             timeout=100)
    torch.manual_seed(0)
    model = ConvNet(batch_norm=False)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    big = per_rank * WS
    for s in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[s * big:(s + 1) * big]),
                                          y[s * big:(s + 1) * big]).backward()
        opt.step()
    for k, v in model.state_dict().items():
        for rank, state in enumerate(states):
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5,
                                       msg=f"rank {rank}, {k}: DDP differs from batch 2B")


@pytest.mark.timeout(120)
def test_every_rank_normalizes_with_rank_0_s_batch_norm_statistics():
    # the Trainer's DDP wrapper is given code: the steps are plain ones, not task 01.1's
    seen = run_distributed(rank_fns.norm_statistics_at_each_forward, WS, args=(3,), timeout=100)
    assert len(seen[0]) == len(seen[1]) == 3, [len(s) for s in seen]
    for step, (ours, theirs) in enumerate(zip(*seen)):
        torch.testing.assert_close(theirs, ours, msg=(
            f"step {step}: rank 1's batch norm started from running statistics other than rank "
            "0's: keep DDP's broadcast_buffers on (the default), or each rank drifts to its own "
            "statistics and evaluates a model other than the one rank 0 saves"))


@pytest.mark.task("03.2")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_each_process_leaves_the_group_when_main_ends(fail):
    results = run_distributed(rank_fns.run_leaves_the_group, WS, args=(fail,), backend=None,
                              timeout=100)
    assert_every_rank_left_the_group(results, fail, "process")


# ------------------------------------------------------------------ the launch checks


@pytest.mark.parametrize("nodes,gpus,nr", [(2, 1, 2), (1, 2, 1), (2, 2, -1), (0, 1, 0),
                                           (1, 0, 0)])
def test_check_launch_refuses_impossible_jobs(nodes, gpus, nr):
    with pytest.raises(LaunchError):
        cli.check_launch(nodes, gpus, nr, "cpu")


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_more_processes_than_gpus_is_refused_up_front(monkeypatch, device):
    monkeypatch.delenv("DPT_SHARE_GPU", raising=False)  # ranks not told to share a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DeviceError, match="one GPU per process"):
        cli.check_launch(1, 2, 0, device)  # the default -g 2 on a one-GPU machine
    assert cli.check_launch(1, 1, 0, device) == 1
    assert cli.check_launch(1, 2, 0, "cpu") == 2


@pytest.mark.parametrize("nodes", [2, 3])
def test_a_node_past_node_0_must_be_told_where_node_0_is(monkeypatch, nodes):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    port = find_free_port()

    def where(nr, addr=None):
        return cli.resolve_master(SimpleNamespace(nodes=nodes, nr=nr, master_addr=addr,
                                                  master_port=port))

    assert where(0) == ("127.0.0.1", port), "node 0 hosts the rendezvous: it may default"
    with pytest.raises(LaunchError) as err:
        where(nodes - 1)  # 127.0.0.1 would wait for a rendezvous on this machine itself
    message = str(err.value)
    assert "\n" not in message and "--master-addr" in message and "MASTER_ADDR" in message, (
        message)
    assert f"node {nodes - 1}" in message, message
    assert where(nodes - 1, "10.0.0.7") == ("10.0.0.7", port)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.8")
    assert where(nodes - 1) == ("10.0.0.8", port)


# ------------------------------------------------------------------ the CLI


def _marker_env():
    marker = uuid.uuid4().hex
    return marker, {"DPT_L03_MARKER": marker}


def _processes_with(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if f"DPT_L03_MARKER={marker}".encode() in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


SMALL = ("--train-limit", "128", "--test-limit", "51", "--batch-size", "32", "--no-progress",
         "--device", "cpu")


def _one_gpu_at_most() -> dict[str, str]:
    """The environment of a machine with one GPU, or none on a CPU-only one: the first
    device this machine shows (CUDA_VISIBLE_DEVICES), and the ranks not told to share it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {"CUDA_VISIBLE_DEVICES": "0" if visible is None else visible.split(",")[0],
            "DPT_SHARE_GPU": "0"}


BAD_LAUNCHES = [
    (("-n", "2", "-g", "1", "-nr", "2"), "node rank"),
    # 2 processes on (at most) one GPU: no GPU per process, or no GPU at all
    (("-n", "1", "-g", "2", "--device", "cuda"), "GPU"),
    (("-g", "2", "--batch-size", "0"), "batch size"),
    (("-n", "2", "-g", "1", "-nr", "1"), "master-port"),
    (("-n", "2", "-g", "1", "-nr", "1", "--master-port", "{port}"), "master-addr"),
]
_LAUNCH_PORT = []  # one free port for this test process's run of the cases


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv,words", BAD_LAUNCHES)
def test_cli_refuses_bad_launches_in_one_line(argv, words, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    _LAUNCH_PORT[:] = _LAUNCH_PORT or [find_free_port()]
    cases = [[*FASHION, *(a.format(port=_LAUNCH_PORT[0]) for a in args)]
             for args, _ in BAD_LAUNCHES]
    procs = run_script_cases(script(LESSON, "ddp_spawn.py"), cases, timeout=90,
                             env=_one_gpu_at_most())
    line = one_line_error(procs[BAD_LAUNCHES.index((argv, words))])
    assert words.lower() in line.lower()


@requires_data
@pytest.mark.timeout(150)
def test_cli_corrupted_checkpoint_is_one_line(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint" * 10)
    proc = run_script(script(LESSON, "ddp_spawn.py"), *FASHION, "--resume", str(bad), *SMALL,
                      timeout=120)
    assert "corrupted" in one_line_error(proc)
    assert proc.returncode == 2


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_script_trains_saves_and_reports_the_accuracy_of_the_whole_test_set(tmp_path):
    ck = tmp_path / "ck.pt"
    proc = run_script(script(LESSON, "ddp_spawn.py"), *FASHION, "-g", "2", "--epochs", "2",
                      "--checkpoint", str(ck), *SMALL, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reported = proc.stdout.split("test accuracy:")[1].split("(")[1].split(")")[0]
    state = torch.load(ck, weights_only=True)
    assert state["epoch"] == 2 and not any(k.startswith("module.") for k in state["model"])
    model = ConvNet()
    model.load_state_dict(state["model"])
    model.eval()
    x, y = load_tensors("fashion-mnist", train=False, limit=51)  # odd: a padded share
    with torch.no_grad():
        correct = int((model(x).argmax(1) == y).sum())
    assert reported == f"{correct}/51", (
        f"the script reports {reported}; the saved weights score {correct}/51")


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_cli_unreachable_master_fails_after_the_timeout_in_one_line():
    start = time.monotonic()
    proc = run_script(script(LESSON, "ddp_spawn.py"), *FASHION, "-n", "2", "-g", "1", "-nr", "1",
                      "--master-addr", "192.0.2.1", "--master-port", str(find_free_port()),
                      "--timeout", "3", *SMALL, timeout=75)
    line = one_line_error(proc)
    assert "192.0.2.1" in line, line
    assert time.monotonic() - start < 75


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_cli_a_failing_rank_stops_the_others_and_leaves_no_process():
    marker, env = _marker_env()
    # the lesson's script with a fault injected by the test (rank 1 raises in its 1st epoch)
    proc = run_script(Path(__file__).with_name("failing_rank.py"), *FASHION, "-g", "2",
                      "--timeout", "60", *SMALL, timeout=120, env=env)
    assert "rank 1 fails on purpose" in one_line_error(proc)
    deadline = time.monotonic() + 5
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_with(marker), "rank processes outlived the failed job"


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_nodes_on_one_machine_train_together(tmp_path):
    port = str(find_free_port())
    marker, env = _marker_env()
    ck = tmp_path / "ck.pt"
    base = [sys.executable, str(script(LESSON, "ddp_spawn.py")), *FASHION, "-n", "2", "-g", "1",
            "--master-port", port, "--threads", "1", "--checkpoint", str(ck), *SMALL]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1", **env)
    # node 1 is told where node 0 is (here, on this machine); node 0 defaults to itself
    nodes = [subprocess.Popen([*base, "-nr", str(nr), *(["--master-addr", "127.0.0.1"] * nr)],
                              stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=full_env, cwd=REPO)
             for nr in (0, 1)]
    try:
        outs = [p.communicate(timeout=150) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    for nr, (p, (out, err)) in enumerate(zip(nodes, outs)):
        assert p.returncode == 0, f"node {nr} failed:\n{out}\n{err}"
    out0, out1 = outs[0][0], outs[1][0]
    assert "world size 2" in out0 and "test accuracy" in out0, out0
    assert "test accuracy" not in out1, "only global rank 0 prints results"
    assert "global ranks 1..1 of 2" in out1, out1
    state = torch.load(ck, weights_only=True)
    assert not any(k.startswith("module.") for k in state["model"])
    assert not _processes_with(marker)
