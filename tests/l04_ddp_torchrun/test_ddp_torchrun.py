"""Lesson 04, in-process and on 2 gloo ranks: torchrun's variables, the sampler, snapshots,
the Trainer's epoch loop, and the CLI's refusals. The torchrun launches are in
test_torchrun_launch.py."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from dpt.checkpoint import CheckpointError
from dpt.models import ConvNet
from dpt.testing import run_distributed
from tests.l04_ddp_torchrun import rank_fns
from tests.lessons import load

LESSON = "04_ddp_torchrun"


@pytest.fixture
def mod():
    return load(LESSON, "ddp_torchrun")


# ----------------------------------------------------------------------- 04.1 torchrun_env

ENV = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
       "TORCHELASTIC_RESTART_COUNT": "2"}


@pytest.mark.task("04.1")
def test_torchrun_env_reads_every_variable(mod):
    env = mod.torchrun_env(dict(ENV))
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size,
            env.restart_count) == (3, 1, 4, 2, 2)


@pytest.mark.task("04.1")
def test_torchrun_env_defaults_and_reads_os_environ(mod, monkeypatch):
    for key in ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    env = mod.torchrun_env()
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size,
            env.restart_count) == (1, 1, 2, 2, 0)


@pytest.mark.task("04.1")
@pytest.mark.parametrize("drop", ["RANK", "LOCAL_RANK", "WORLD_SIZE"])
def test_torchrun_env_without_torchrun_says_so(mod, drop):
    env = {k: v for k, v in ENV.items() if k != drop}
    with pytest.raises(mod.LaunchError, match="torchrun"):
        mod.torchrun_env(env)


@pytest.mark.task("04.1")
@pytest.mark.parametrize("change", [{"RANK": "4"}, {"RANK": "-1"}, {"LOCAL_RANK": "2"}])
def test_torchrun_env_rejects_ranks_out_of_range(mod, change):
    with pytest.raises(mod.LaunchError):
        mod.torchrun_env({**ENV, **change})


# --------------------------------------------------------------------- 04.2 the train loader


def _indices(loader):
    return [int(i) for _, y in loader for i in y]


@pytest.mark.task("04.2")
def test_train_loader_gives_each_rank_a_disjoint_share(mod):
    n, world = 96, 2
    x, idx = torch.zeros(n, 1, 28, 28), torch.arange(n)  # "labels" = sample index
    loaders = [mod.make_train_loader(x, idx, 8, r, world, seed=5) for r in range(world)]
    shares = [_indices(ld) for ld in loaders]
    assert all(len(s) == n // world for s in shares), "each rank must see 1/world of the data"
    assert not set(shares[0]) & set(shares[1]), "ranks see overlapping samples"
    assert set(shares[0]) | set(shares[1]) == set(range(n))
    assert shares[0] != sorted(shares[0]), "the training order is not shuffled"
    assert all(len(b[0]) == 8 for b in loaders[0])


@pytest.mark.task("04.2")
def test_train_loader_reshuffles_by_epoch_and_honours_the_seed(mod):
    n = 64
    x, idx = torch.zeros(n, 1, 28, 28), torch.arange(n)
    a = mod.make_train_loader(x, idx, 8, 0, 2, seed=1)
    b = mod.make_train_loader(x, idx, 8, 0, 2, seed=1)
    assert _indices(a) == _indices(b), "same seed and epoch must give the same order"
    a.sampler.set_epoch(1)
    assert _indices(a) != _indices(b), "set_epoch must change the order"
    c = mod.make_train_loader(x, idx, 8, 0, 2, seed=2)
    assert _indices(c) != _indices(b), "the seed is ignored"


# ------------------------------------------------------------------------ 04.3 save_snapshot


@pytest.mark.task("04.3")
@pytest.mark.timeout(120)
def test_only_rank_0_writes_a_snapshot_without_module_prefix(mod, tmp_path):
    out = run_distributed(rank_fns.save_snapshot_on_ranks, 2, args=(str(tmp_path),))
    assert (tmp_path / "snap0.pt").is_file()
    assert not (tmp_path / "snap1.pt").exists(), "rank 1 wrote a snapshot too"
    state = torch.load(tmp_path / "snap0.pt", weights_only=True)
    assert not [k for k in state["model"] if k.startswith("module.")], "keys have 'module.'"
    ConvNet().load_state_dict(state["model"])  # strict: loads into a plain model
    for k, v in out[0]["model"].items():
        torch.testing.assert_close(state["model"][k], v)
    assert state["optimizer"]["state"], "the optimizer's momentum buffers are missing"
    assert state["epoch"] == 3 and state["world_size"] == 2
    assert state["sampler"]["seed"] == 7
    assert len(state["rng"]) == 2
    for rank in range(2):
        assert torch.equal(state["rng"][rank]["torch"], out[rank]["rng"]), \
            f"the snapshot's rng[{rank}] is not rank {rank}'s RNG state"
        assert torch.equal(out[rank]["after"], out[rank]["rng"]), "saving drew random numbers"


@pytest.mark.task("04.3")
def test_save_snapshot_works_in_one_process(mod, tmp_path):
    model, opt = rank_fns._stepped_model(seed=0)
    mod.save_snapshot(tmp_path / "s.pt", model, opt, epoch=1, sampler_seed=0)
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    assert state["epoch"] == 1 and state["world_size"] == 1 and len(state["rng"]) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["s.pt"], "a temporary file was left"


@pytest.mark.task("04.3")
@pytest.mark.timeout(120)
def test_a_kill_during_a_snapshot_write_leaves_the_previous_snapshot(tmp_path):
    marker, error = tmp_path / "marker", tmp_path / "error"
    # forkserver, not fork: a forked copy of this process (whose torch thread pool has run)
    # can deadlock in its first parallel op.
    proc = mp.get_context("forkserver").Process(
        target=rank_fns.write_then_die_mid_snapshot, args=(str(tmp_path), str(marker), str(error)))
    proc.start()
    deadline = time.monotonic() + 60
    while not (marker.exists() or error.exists()) and proc.is_alive():
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the child never reached the second snapshot write")
        time.sleep(0.05)
    proc.kill()  # SIGKILL: no cleanup handlers run
    proc.join(10)
    if error.exists():
        pytest.fail(f"the child failed before being killed:\n{error.read_text()}")
    assert marker.exists(), "the child died before the second snapshot write"
    state = torch.load(tmp_path / "snapshot.pt", weights_only=True)  # not truncated
    assert state["epoch"] == 1, "the half-written snapshot replaced the previous one"


# ------------------------------------------------------------------------ 04.4 load_snapshot


def _reference_snapshot(path, world_size=2, epoch=4, seed=11):
    """A snapshot in the documented format, built without the lesson's save_snapshot."""
    model, opt = rank_fns._stepped_model(seed=123)
    rng = []
    for r in range(world_size):
        torch.manual_seed(9000 + r)
        rng.append({"torch": torch.get_rng_state(), "cuda": None})
    torch.save({"version": 1, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "epoch": epoch, "world_size": world_size, "rng": rng,
                "sampler": {"seed": seed}}, path)
    return model, opt, rng


@pytest.mark.task("04.4")
@pytest.mark.timeout(120)
def test_every_rank_loads_the_snapshot_and_its_own_rng(mod, tmp_path):
    path = tmp_path / "snap.pt"
    model, opt, rng = _reference_snapshot(path)
    out = run_distributed(rank_fns.load_snapshot_on_ranks, 2, args=(str(path),))
    for rank, res in enumerate(out):
        assert res["info"]["epoch"] == 4 and res["info"]["sampler_seed"] == 11
        assert res["info"]["exact"] is True
        for k, v in model.state_dict().items():
            torch.testing.assert_close(res["model"][k], v,
                                       msg=f"rank {rank} did not load {k} from the snapshot")
        momentum = opt.state_dict()["state"][0]["momentum_buffer"]
        torch.testing.assert_close(res["optimizer"]["state"][0]["momentum_buffer"], momentum)
        gen = torch.Generator()
        gen.set_state(rng[rank]["torch"])
        assert torch.equal(res["draw"], torch.rand(4, generator=gen)), \
            f"rank {rank} did not restore its own RNG state"


@pytest.mark.task("04.4")
def test_a_snapshot_from_another_world_size_resumes_but_not_exactly(mod, tmp_path):
    path = tmp_path / "snap.pt"
    _reference_snapshot(path, world_size=4)
    res = rank_fns.load_snapshot_on_ranks(0, 1, str(path))  # one process, no group
    assert res["info"]["exact"] is False and res["info"]["epoch"] == 4


@pytest.mark.task("04.4")
@pytest.mark.parametrize("content", [b"not a checkpoint at all", b"PK\x03\x04broken"])
def test_a_corrupted_snapshot_is_a_checkpoint_error(mod, tmp_path, content):
    path = tmp_path / "snap.pt"
    path.write_bytes(content)
    model, opt = rank_fns._stepped_model(seed=0)
    with pytest.raises(CheckpointError, match="snap.pt"):
        mod.load_snapshot(path, model, opt)


# --------------------------------------------------------------------- 04.5 the epoch loop


@pytest.fixture(scope="module")
def epoch_passes():
    """Sampler passes of a fresh 3-epoch run and of a run resumed at epoch 2 of 4 (one launch
    for both: starting ranks is the slow part)."""
    return run_distributed(rank_fns.trainer_epochs, 2, args=([(3, 0), (4, 2)],), timeout=120)


@pytest.mark.task("04.5")
@pytest.mark.timeout(150)
def test_trainer_sets_the_sampler_epoch_every_epoch(epoch_passes):
    fresh = [ranks[0] for ranks in epoch_passes]
    for res in fresh:
        epochs = [e for e, _ in res["passes"]]
        assert epochs == [0, 1, 2], f"sampler epochs {epochs}: set_epoch(epoch) is missing"
        orders = [order for _, order in res["passes"]]
        assert orders[0] != orders[1] != orders[2], "the data order repeats across epochs"
        assert res["epochs_run"] == 3
    for e in range(3):
        assert not set(fresh[0]["passes"][e][1]) & set(fresh[1]["passes"][e][1])


@pytest.mark.task("04.5")
@pytest.mark.timeout(150)
def test_a_resumed_trainer_continues_at_the_snapshot_epoch(epoch_passes):
    for ranks in epoch_passes:
        res = ranks[1]
        assert [e for e, _ in res["passes"]] == [2, 3], \
            "a resumed run must redo exactly the missing epochs, with their data order"
        assert res["epochs_run"] == 4


@pytest.mark.task("04.5")
@pytest.mark.timeout(150)
def test_trainer_snapshots_every_save_every_epochs(tmp_path):
    path = str(tmp_path / "never_written.pt")
    out = run_distributed(rank_fns.trainer_save_schedule, 2,
                          args=([(5, 2, path), (3, 1, path), (3, 2, None)],), timeout=120)
    for ranks in out:
        every2, every1, no_path = ranks
        assert every2 == [2, 4] and every1 == [1, 2, 3], \
            f"snapshots at {every2} / {every1}: not every save_every epochs"
        assert no_path == [], "no snapshot path, no snapshot"


# ------------------------------------------------------------- the Trainer (not a task)


@pytest.mark.timeout(150)
def test_ranks_start_and_stay_identical_with_or_without_a_snapshot(tmp_path):
    path = tmp_path / "snap.pt"
    model, _, _ = _reference_snapshot(path, epoch=1)
    out = run_distributed(rank_fns.trainer_weights_agree, 2, args=([None, str(path)],),
                          timeout=120)
    fresh, resumed = [r[0] for r in out], [r[1] for r in out]
    for k in fresh[0]["start"]:  # built from different seeds: DDP's broadcast evens them
        torch.testing.assert_close(fresh[0]["start"][k], fresh[1]["start"][k], rtol=0, atol=0)
    for k in fresh[0]["end"]:  # parameters (batch-norm running stats stay per rank)
        torch.testing.assert_close(fresh[0]["end"][k], fresh[1]["end"][k])
        torch.testing.assert_close(resumed[0]["end"][k], resumed[1]["end"][k])
    for res in resumed:  # every rank starts from the snapshot, not from its own weights
        assert res["epochs_run"] == 2
        for k, v in model.state_dict().items():
            torch.testing.assert_close(res["start"][k], v)


# ------------------------------------------------------------------ the CLI (not a task)


def test_old_local_rank_argument_is_refused_with_the_fix(mod, capsys):
    assert mod.main(["--local_rank=0", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "LOCAL_RANK" in err[0]
    assert "torchrun" in err[0]


def test_without_torchrun_the_script_says_how_to_launch(mod, capsys, monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert mod.main(["--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torchrun" in err[0]


def test_bad_fail_at_is_one_clear_line(mod):
    with pytest.raises(ValueError, match="EPOCH:BATCH"):
        mod.Fault.parse("five")
    assert mod.Fault.parse(None) is None
    assert mod.Fault.parse("2:7", rank=0) == mod.Fault(2, 7, 0)


def test_the_fault_fires_only_on_the_first_attempt_and_chosen_rank(mod):
    fault = mod.Fault(1, 3, rank=1)
    for rank, restarts, epoch, batch in [(0, 0, 1, 3), (1, 1, 1, 3), (1, 0, 1, 2), (1, 0, 0, 3)]:
        fault.maybe_fire(rank, restarts, epoch, batch)  # must return, not exit
    proc = mp.get_context("fork").Process(target=fault.maybe_fire, args=(1, 0, 1, 3))
    proc.start()
    proc.join(30)
    assert proc.exitcode == mod.FAULT_EXIT_CODE


def test_snapshot_folder_must_exist(mod, tmp_path):
    args = mod.parse_args(["--snapshot", str(tmp_path / "missing" / "s.pt")])
    env = mod.TorchrunEnv(0, 0, 2, 2, 0)
    with pytest.raises(CheckpointError, match="does not exist"):
        mod.validate(args, env)
    with pytest.raises(ValueError, match="--fail-rank"):
        mod.validate(mod.parse_args(["--fail-at", "0:1", "--fail-rank", "2"]),
                     mod.TorchrunEnv(0, 0, 2, 2, 0))

