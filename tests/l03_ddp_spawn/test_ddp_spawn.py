"""Lesson 03: DDP with mp.spawn. Every multi-process test uses run_distributed (world size 2,
gloo, CPU, free port, hard timeout); the CLI tests start the script with a subprocess timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from dpt.checkpoint import CheckpointError
from dpt.data import load_tensors
from dpt.device import DeviceError
from dpt.dist import cpu_budget, find_free_port
from dpt.models import ConvNet
from dpt.testing import run_distributed
from tests.helpers import one_line_error, requires_data, run_script
from tests.l03_ddp_spawn import rank_fns
from tests.lessons import REPO, load, script

LESSON = "03_ddp_spawn"
WS = 2


@pytest.fixture
def mod():
    return load(LESSON, "ddp_spawn")


# ------------------------------------------------------------------ 03.1 ddp_setup / teardown


@pytest.mark.task("03.1")
@pytest.mark.timeout(60)
def test_ddp_setup_joins_a_gloo_group_splits_threads_and_tears_down():
    infos = run_distributed(rank_fns.setup_and_report, WS, backend=None, timeout=45)
    for rank, info in enumerate(infos):
        assert info["backend"] == "gloo", "the CPU needs gloo (NCCL is for CUDA)"
        assert info["device"] == "cpu"
        assert (info["rank"], info["world_size"]) == (rank, WS)
        assert info["sum"] == sum(range(1, WS + 1)), "the ranks are not in one group"
        assert info["threads"] * WS <= max(WS, cpu_budget()), (
            f"{info['threads']} threads on each of {WS} ranks oversubscribe "
            f"{cpu_budget()} cores")
        assert info["initialized_after"] is False, "ddp_teardown left the group alive"


@pytest.mark.task("03.1")
@pytest.mark.timeout(60)
def test_the_teardown_runs_when_training_raises():
    still_up = run_distributed(rank_fns.session_that_raises, WS, backend=None, timeout=45)
    assert still_up == [False] * WS, "the process group survived an exception"


@pytest.mark.task("03.1")
@pytest.mark.timeout(60)
def test_master_port_free_default_only_for_one_process():
    (alone,) = run_distributed(rank_fns.setup_without_port, 1, backend=None, timeout=30)
    assert "port" in alone and int(alone["port"]) > 0, (
        f"one process without MASTER_PORT should pick a free port: {alone}")
    both = run_distributed(rank_fns.setup_without_port, WS, backend=None, timeout=40)
    for result in both:
        assert "error" in result and "MASTER_PORT" in result["error"], (
            "two processes without a shared MASTER_PORT must fail clearly, not each pick "
            f"its own port: {result}")


@pytest.mark.task("03.1")
def test_ddp_setup_refuses_cuda_without_gpus(mod, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError):
        mod.ddp_setup(0, 1, device="cuda", timeout_s=5)


# ------------------------------------------------------------------ 03.2 ranks and launch


@pytest.mark.task("03.2")
@pytest.mark.parametrize("nodes,gpus", [(1, 2), (2, 1), (2, 3), (3, 4)])
def test_global_ranks_follow_seed_003_and_cover_the_world_once(mod, nodes, gpus):
    ranks = [mod.global_rank(nr, gpus, lr) for nr in range(nodes) for lr in range(gpus)]
    assert ranks == [nr * gpus + lr for nr in range(nodes) for lr in range(gpus)]
    assert sorted(ranks) == list(range(nodes * gpus))
    assert mod.check_launch(nodes, gpus, nodes - 1, "cpu") == nodes * gpus


@pytest.mark.task("03.2")
@pytest.mark.parametrize("nodes,gpus,nr", [(2, 1, 2), (1, 2, 1), (2, 2, -1), (0, 1, 0),
                                           (1, 0, 0)])
def test_check_launch_refuses_impossible_jobs(mod, nodes, gpus, nr):
    with pytest.raises(ValueError):
        mod.check_launch(nodes, gpus, nr, "cpu")


@pytest.mark.task("03.2")
def test_more_processes_than_gpus_is_refused(mod, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DeviceError, match="GPU"):
        mod.check_launch(1, 2, 0, "cuda")
    assert mod.check_launch(1, 1, 0, "cuda") == 1


# ------------------------------------------------------------------ 03.3 sampler and set_epoch


@pytest.mark.task("03.3")
@pytest.mark.timeout(60)
def test_train_loader_gives_each_rank_its_own_share():
    n = 40
    shards = run_distributed(rank_fns.loader_shards, WS, args=(n, 4), backend=None,
                             timeout=45)
    assert all(len(s) == n // WS for s in shards), [len(s) for s in shards]
    assert not set(shards[0]) & set(shards[1]), "the ranks see overlapping data"
    assert sorted(shards[0] + shards[1]) == list(range(n)), "some samples are never seen"
    assert shards[0] != sorted(shards[0]), "the training data is not shuffled"


@pytest.mark.task("03.3")
@pytest.mark.timeout(60)
def test_train_epoch_reshuffles_every_epoch_with_set_epoch():
    n, epochs = 48, 3
    results = run_distributed(rank_fns.epoch_orders, WS, args=(n, 8, epochs), timeout=45)
    for r in results:
        assert all(len(losses) == n // WS // 8 for losses in r["losses"])
        assert all(isinstance(v, float) for losses in r["losses"] for v in losses)
        orders = r["orders"]
        assert len({tuple(o) for o in orders}) == epochs, (
            "the data order is identical across epochs: call loader.set_epoch(epoch)")
    for e in range(epochs):
        a, b = results[0]["orders"][e], results[1]["orders"][e]
        assert sorted(a + b) == list(range(n)), f"epoch {e}: shards overlap or miss samples"


# ------------------------------------------------------------------ 03.4 DDP wrap, checkpoint


@pytest.mark.task("03.4")
@pytest.mark.timeout(60)
def test_wrap_gives_every_rank_rank0s_weights():
    results = run_distributed(rank_fns.wrap_from_different_seeds, WS, timeout=45)
    assert all(r["is_ddp"] for r in results), "wrap_model must return a DistributedDataParallel"
    torch.manual_seed(100)
    expected = ConvNet().state_dict()
    for r in results:
        for k, v in expected.items():
            torch.testing.assert_close(r["state"][k], v, msg=f"{k}: ranks start differently")


@pytest.mark.task("03.4")
@pytest.mark.timeout(60)
def test_ddp_with_batch_b_on_two_ranks_equals_one_process_with_batch_2b():
    per_rank, steps, lr = 8, 4, 0.05
    g = torch.Generator().manual_seed(1)
    x = torch.randn(per_rank * WS * steps, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (len(x),), generator=g)
    states = run_distributed(rank_fns.ddp_steps, WS, args=(x, y, per_rank, steps, lr),
                             timeout=45)
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


@pytest.mark.task("03.4")
@pytest.mark.timeout(60)
def test_only_rank0_saves_and_without_module_prefix(tmp_path):
    path = tmp_path / "ck.pt"
    results = run_distributed(rank_fns.save_on_ranks, WS, args=(str(path),), timeout=45)
    assert results[0]["saves"] >= 1, "rank 0 did not save"
    assert results[1]["saves"] == 0, "rank 1 saved too: only rank 0 may write the checkpoint"
    state = torch.load(path, weights_only=True)
    assert state["epoch"] == 2 and state["optimizer"]["state"], "epoch/optimizer missing"
    assert not any(k.startswith("module.") for k in state["model"]), (
        "keys start with 'module.': save model.module.state_dict()")
    fresh = ConvNet()
    fresh.load_state_dict(state["model"])  # strict: same keys as a plain model
    for k, v in results[0]["state"].items():
        torch.testing.assert_close(state["model"][k], v)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"], "temporary files left"


# ------------------------------------------------------------------ 03.5 evaluation


@pytest.mark.task("03.5")
@pytest.mark.timeout(60)
def test_accuracy_counts_the_whole_test_set_once():
    n = 101  # odd: DistributedSampler pads rank 1's shard with a repeat of sample 0
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 1, 28, 28, generator=g)
    torch.manual_seed(0)
    model = ConvNet().eval()
    with torch.no_grad():
        pred = model(x).argmax(1)
    # even samples right, odd ones wrong: one rank's shard alone would give 100% or 0%
    y = torch.where(torch.arange(n) % 2 == 0, pred, (pred + 1) % 10)
    expected = (int((pred == y).sum()), n)
    results = run_distributed(rank_fns.evaluate_counts, WS, args=(x, y), timeout=45)
    for rank, r in enumerate(results):
        counts = tuple(int(c) for c in r["counts"])
        assert counts[1] != n + 1, "the padded duplicate was counted"
        assert counts == expected, (
            f"rank {rank} reports {counts}, the whole test set gives {expected}")
        assert r["training_after"], "evaluate must restore training mode"


# ------------------------------------------------------------------ the whole job (ungraded)


def _args(mod, tmp_path, **over):
    args = mod.build_parser().parse_args(["--no-progress"])
    args.__dict__.update(dict(gpus=WS, epochs=2, batch_size=32, train_limit=256,
                              test_limit=101, checkpoint=str(tmp_path / "ck.pt"), timeout=30,
                              device="cpu"))
    args.__dict__.update(over)
    return args


@requires_data
@pytest.mark.timeout(120)
def test_run_training_end_to_end(mod, tmp_path):
    args = _args(mod, tmp_path)
    results = run_distributed(rank_fns.train_end_to_end, WS, args=(args,), backend=None,
                              timeout=100)
    r0, r1 = results
    for k, v in r0["state"].items():
        torch.testing.assert_close(r1["state"][k], v, msg=f"{k} differs between ranks")
    assert r0["first_indices"][0] != r0["first_indices"][1], "same order in both epochs"
    assert not set(r0["first_indices"][0]) & set(r1["first_indices"][0])
    assert (r0["correct"], r0["total"]) == (r1["correct"], r1["total"])
    # the reported accuracy is the whole (limited) test set's, for the saved weights
    state = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert state["epoch"] == 2 and not any(k.startswith("module.") for k in state["model"])
    model = ConvNet()
    model.load_state_dict(state["model"])
    model.eval()
    x, y = load_tensors("fashion-mnist", train=False, limit=101)
    with torch.no_grad():
        correct = int((model(x).argmax(1) == y).sum())
    assert (r0["correct"], r0["total"]) == (correct, 101)


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,words", [
    (("-n", "2", "-g", "1", "-nr", "2"), "node rank"),
    (("-n", "1", "-g", "2", "--device", "cuda"), "GPU"),
    (("-n", "2", "-g", "1", "-nr", "1"), "master-port"),
])
def test_cli_refuses_bad_launches_in_one_line(argv, words):
    proc = run_script(script(LESSON, "ddp_spawn.py"), *argv, timeout=45)
    assert words.lower() in one_line_error(proc).lower()


@requires_data
@pytest.mark.timeout(60)
def test_cli_corrupted_checkpoint_is_one_line(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint" * 10)
    proc = run_script(script(LESSON, "ddp_spawn.py"), "--resume", str(bad), *SMALL,
                      timeout=45)
    assert "corrupted" in one_line_error(proc)


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_cli_unreachable_master_fails_after_the_timeout_in_one_line():
    start = time.monotonic()
    proc = run_script(script(LESSON, "ddp_spawn.py"), "-n", "2", "-g", "1", "-nr", "1",
                      "--master-addr", "192.0.2.1", "--master-port", str(find_free_port()),
                      "--timeout", "3", *SMALL, timeout=75)
    line = one_line_error(proc)
    assert "192.0.2.1" in line, line
    assert time.monotonic() - start < 75


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_cli_a_failing_rank_stops_the_others_and_leaves_no_process():
    marker, env = _marker_env()
    proc = run_script(script(LESSON, "ddp_spawn.py"), "-g", "2", "--fail-rank", "1",
                      "--timeout", "20", *SMALL, timeout=75, env=env)
    assert "rank 1" in one_line_error(proc)
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
    base = [sys.executable, str(script(LESSON, "ddp_spawn.py")), "-n", "2", "-g", "1",
            "--master-port", port, "--threads", "1", "--checkpoint", str(ck), *SMALL]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1", **env)
    nodes = [subprocess.Popen([*base, "-nr", str(nr)], stdout=subprocess.PIPE,
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


@requires_data
@pytest.mark.timeout(60)
def test_resume_from_a_checkpoint_of_another_shape_is_one_line(mod, tmp_path):
    torch.save({"model": {"x": torch.zeros(1)}, "optimizer": {}, "epoch": 1},
               tmp_path / "other.pt")
    model = ConvNet()
    with pytest.raises(CheckpointError):
        mod.load_checkpoint(tmp_path / "other.pt", model)


def test_effective_batch_size(mod):
    assert mod.effective_batch_size(64, 4) == 256
