"""Lesson 01: the Trainer's step and loop, evaluation, checkpoints, and the CLI."""

from __future__ import annotations

import copy
import io
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpt.checkpoint import CheckpointError
from dpt.data import TensorLoader
from dpt.models import MLP, ConvNet
from tests.helpers import (
    assert_a_missing_resume_is_an_error,
    assert_progress_reaches_the_epoch_loop,
    assert_resume_loads_into_the_moved_model,
    one_line_error,
    recording_moves,
    requires_data,
    run_script,
    run_script_cases,
    unsent_message,
)
from tests.l02_data_parallel.gpus import cpu_data_parallel, fake_one_gpu, tutorial_cell
from tests.lessons import load, script

LESSON = "01_single_device"

# The lesson's default dataset is MNIST (as in the tutorials it follows); the tests use
# Fashion-MNIST, which `make test` always provides (MNIST needs `make data`).
FASHION = ("--dataset", "fashion-mnist")


@pytest.fixture
def sd():
    return load(LESSON, "single_device")


def _batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


CPU = torch.device("cpu")


@pytest.mark.task("01.1")
def test_run_batch_matches_a_reference_sgd_step(sd):
    torch.manual_seed(0)
    model = ConvNet()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    trainer = sd.Trainer(model, None, opt, CPU)
    for seed in range(3):  # several steps: stale gradients would accumulate
        x, y = _batch(seed=seed)
        loss = trainer._run_batch(x, y)
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        assert isinstance(loss, float), "return the loss as a Python float (loss.item())"
        assert loss == pytest.approx(ref_loss.item(), rel=1e-5), (
            f"step {seed}: _run_batch returned the loss {loss}, a plain SGD step on the same "
            f"weights gives {ref_loss.item()}: the earlier steps did not update the weights as "
            "zero_grad(), cross_entropy, backward(), step() would")
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg="the weights differ from plain SGD steps: zero "
                                             "the gradients before each backward()")


class _Fixed(nn.Module):
    """Predicts class 0 for the first `k` samples it is ever shown, then class 1."""

    def __init__(self, answers):
        super().__init__()
        self.answers = answers
        self.seen = 0
        self.bn = nn.BatchNorm1d(1)

    def forward(self, x):
        out = torch.zeros(len(x), 10)
        out[torch.arange(len(x)), self.answers[self.seen:self.seen + len(x)]] = 1.0
        self.seen += len(x)
        self.mode_seen = self.training
        return out


@pytest.mark.task("01.2")
def test_evaluate_counts_every_sample_including_a_short_last_batch(sd):
    # 10 samples in batches of 4: 4 + 4 + 2. Averaging per-batch accuracies would give a
    # different answer from counting, which is what this data is built to expose.
    targets = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    answers = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 2, 2])  # 4 + 0 + 2 correct
    x = torch.zeros(10, 1)
    model = _Fixed(answers)
    correct, total = sd.evaluate(model, TensorLoader(x, targets, batch_size=4), CPU)
    assert (correct, total) == (6, 10)
    assert isinstance(correct, int) and isinstance(total, int), (
        f"evaluate returned ({correct!r}, {total!r}): return the counts as Python ints "
        "(int(... .sum())), not tensors")


@pytest.mark.task("01.2")
def test_evaluate_uses_eval_mode_and_restores_training_mode(sd):
    model = ConvNet()
    model.train()
    before = copy.deepcopy(model.state_dict())
    x, y = _batch(16)
    graphs = []  # whether each forward built an autograd graph
    model.register_forward_hook(lambda mod, args, out: graphs.append(out.requires_grad))
    sd.evaluate(model, TensorLoader(x, y, batch_size=8), CPU)
    assert graphs and not any(graphs), (
        "evaluate built an autograd graph for every batch (memory and time for nothing): "
        "predict under torch.no_grad() (keep the @torch.no_grad() decorator)")
    assert model.training, "evaluate must put the model back in training mode"
    for k, v in model.state_dict().items():  # eval mode: batch-norm statistics untouched
        torch.testing.assert_close(v, before[k], msg=f"{k} changed during evaluation")


@pytest.mark.task("01.2")
def test_evaluate_leaves_an_eval_mode_model_in_eval_mode(sd):
    model = ConvNet().eval()  # as a notebook cell or an earlier evaluate() leaves it
    x, y = _batch(8)
    sd.evaluate(model, TensorLoader(x, y, batch_size=4), CPU)
    assert not model.training, (
        "evaluate switched a model that was in eval mode to training mode: put back the mode "
        "it was in (was_training = model.training ... model.train(was_training)), not "
        "model.train()")


@pytest.mark.task("01.3")
def test_checkpoint_round_trip_into_a_fresh_model(sd, tmp_path):
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()  # a plain step, so the optimizer has momentum
    opt.step()
    path = sd.save_checkpoint(tmp_path / "ck.pt", model, opt, epoch=3, note="extra")
    assert Path(path).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"], "temporary files left behind"
    fresh = ConvNet()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    state = sd.load_checkpoint(tmp_path / "ck.pt", fresh, fresh_opt)
    assert state["epoch"] == 3 and state["note"] == "extra", "extra entries must be saved too"
    for (k, v), (k2, v2) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v, v2)
    assert fresh_opt.state_dict()["state"], "optimizer state (momentum) was not restored"


@pytest.mark.task("01.3")
def test_checkpoint_of_a_wrapped_model_has_no_module_prefix(sd, tmp_path, monkeypatch):
    fake_one_gpu(monkeypatch)  # nothing here may move to a GPU, on any machine
    model = cpu_data_parallel(ConvNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sd.save_checkpoint(tmp_path / "ck.pt", model, opt, epoch=1)
    keys = torch.load(tmp_path / "ck.pt", weights_only=True)["model"].keys()
    prefixed = [k for k in keys if k.startswith("module.")]
    assert not prefixed, (f"the checkpoint's keys start with 'module.' ({prefixed[0]}, ...): save "
                          f"the wrapped model's .module, so it loads into a plain model")
    sd.load_checkpoint(tmp_path / "ck.pt", ConvNet())  # loads into a plain model


@pytest.mark.task("01.3")
def test_checkpoint_loads_into_a_wrapped_model_s_module(sd, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = ConvNet()
    sd.save_checkpoint(tmp_path / "ck.pt", model, torch.optim.SGD(model.parameters(), lr=0.1), 1)
    # As on a machine with one GPU, faked: the weights compared below must all stay on the CPU
    # (a plain nn.DataParallel would send its module to cuda:0 there).
    fake_one_gpu(monkeypatch)
    wrapped = cpu_data_parallel(ConvNet())  # later lessons load into a DDP-wrapped model
    try:
        sd.load_checkpoint(tmp_path / "ck.pt", wrapped)
    except RuntimeError as exc:
        pytest.fail("load_checkpoint into a wrapped model (DataParallel, DDP) must load into its "
                    ".module: the checkpoint's keys have no 'module.' prefix, the wrapper's do "
                    f"({str(exc).splitlines()[0][:120]})")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(wrapped.module.state_dict()[k], v,
                                   msg=f"{k} was not loaded into the wrapper's .module")


@pytest.mark.task("01.3")
@pytest.mark.timeout(60)
def test_the_notebook_evaluates_the_reloaded_model_where_the_test_batches_go(sd, monkeypatch,
                                                                             capsys):
    # The notebook's reload cell, run here with a spy on evaluate(). Its fresh ConvNet is built
    # on the CPU, while evaluate() sends the test batches to `device`: on a GPU that is cuda,
    # so the fresh model must be sent there too before it predicts.
    from dpt.notebook import needs_tasks

    torch.manual_seed(0)
    model = ConvNet()
    x, y = _batch(20)
    evaluated = []  # for each model evaluate() was given: had it been sent to the device?
    real_evaluate = sd.evaluate

    def evaluate_spy(m, loader, device):
        evaluated.append(moves.module_sent(m, device))
        return real_evaluate(m, loader, device)

    monkeypatch.setattr(sd, "evaluate", evaluate_spy)
    cell = tutorial_cell(LESSON, "load_checkpoint(")
    names = {"sd": sd, "ConvNet": ConvNet, "model": model, "needs_tasks": needs_tasks,
             "optimizer": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
             "test": TensorLoader(x, y, batch_size=8), "total": len(y), "device": CPU}
    with recording_moves() as moves:
        exec(compile(cell, "tutorial.py (reload cell)", "exec"), names)
    out = capsys.readouterr().out
    assert "reloaded epoch 1" in out, f"the notebook's reload cell did not finish: {out!r}"
    assert evaluated and all(evaluated), (
        "the notebook's reload cell evaluates a fresh model it never sent to `device`: on a GPU "
        "the test batches go to cuda and the weights stay on the CPU ('Input type "
        "(torch.cuda.FloatTensor) and weight type (torch.FloatTensor) should be the same'). "
        "Build it with ConvNet().to(device), as the Trainer moves its model")


@pytest.mark.task("01.3")
def test_load_checkpoint_refuses_another_model_s_checkpoint(sd, tmp_path):
    mlp = MLP()
    sd.save_checkpoint(tmp_path / "ck.pt", mlp, torch.optim.SGD(mlp.parameters(), lr=0.1), 1)
    try:
        sd.load_checkpoint(tmp_path / "ck.pt", ConvNet())
    except NotImplementedError:
        raise
    except RuntimeError as exc:
        assert "Missing key" in str(exc) or "Unexpected key" in str(exc), str(exc)[:300]
    else:
        pytest.fail("load_checkpoint loaded an MLP's checkpoint into a ConvNet without an error: "
                    "keep load_state_dict strict (the default); strict=False silently skips "
                    "every key that does not match, and the model keeps its random weights")


@pytest.mark.task("01.3")
def test_load_checkpoint_puts_the_tensors_on_the_device_it_is_given(sd, tmp_path):
    model = ConvNet()
    sd.save_checkpoint(tmp_path / "ck.pt", model, torch.optim.SGD(model.parameters(), lr=0.1), 1)
    meta = torch.device("meta")  # a device other than the CPU that every machine has
    state = sd.load_checkpoint(tmp_path / "ck.pt", ConvNet().to(meta), None, meta)
    where = {str(v.device) for v in state["model"].values()}
    assert where == {"meta"}, (
        f"load_checkpoint(..., device=meta) returned tensors on {sorted(where)}: load with "
        "map_location=device, so the tensors land where the model is (a GPU's checkpoint "
        "onto this rank's GPU, or onto the CPU)")


@pytest.mark.task("01.3")
def test_checkpoint_errors_are_clear(sd, tmp_path):
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="does not exist"):
        sd.save_checkpoint(tmp_path / "nope" / "ck.pt", model, opt, 0)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupted"):
        sd.load_checkpoint(bad, model)


@pytest.mark.task("01.3")
def test_a_crash_mid_save_keeps_the_previous_checkpoint(sd, tmp_path, monkeypatch):
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sd.save_checkpoint(tmp_path / "ck.pt", model, opt, epoch=1)
    real_save = torch.save

    def half_then_crash(obj, f, *args, **kwargs):
        """What a crash leaves: half of the bytes written to wherever torch.save writes."""
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as out:
                out.write(data[: len(data) // 2])
        else:
            f.write(data[: len(data) // 2])
            f.flush()
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(torch, "save", half_then_crash)
    with pytest.raises(KeyboardInterrupt):
        sd.save_checkpoint(tmp_path / "ck.pt", model, opt, epoch=2)
    monkeypatch.undo()
    try:
        epoch, broken = torch.load(tmp_path / "ck.pt", weights_only=True)["epoch"], None
    except Exception as exc:  # noqa: BLE001 - a half-written file fails in many ways
        epoch, broken = None, type(exc).__name__
    assert broken is None, ("a crash mid-save broke the previous checkpoint (it no longer "
                            f"loads: {broken}): write elsewhere, then rename")
    assert epoch == 1, "a crash mid-save replaced the previous checkpoint: write elsewhere, then rename"
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"], "a temporary file was left"


def _separable(n=256, seed=0):
    """A task an MLP learns in a few epochs: the class is decided by one pixel's sign."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 28, 28, generator=g)
    return x, (x[:, 0, 0, 0] > 0).long()


@pytest.mark.task("01.1")
def test_trainer_learns_and_checkpoints_every_save_every_epochs(sd, tmp_path):
    torch.manual_seed(0)
    x, y = _separable()
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = sd.Trainer(model, sd.prepare_dataloader(x, y, 32), opt, CPU, save_every=2,
                         checkpoint_path=tmp_path / "ck.pt")
    losses = trainer.train(4)
    assert len(losses) == 4 and len(trainer.history) == 4 * 8 and trainer.epochs_run == 4
    first = trainer.history[:8]
    assert losses[0] == pytest.approx(sum(first) / len(first), rel=1e-9), (
        f"train()'s epoch loss {losses[0]} is not the mean of that epoch's batch losses: "
        "_run_epoch must return sum(losses) / len(losses), not one batch's loss")
    assert losses[-1] < 0.5 * losses[0], f"the loss did not fall: {losses}"
    assert sd.load_checkpoint(tmp_path / "ck.pt", MLP())["epoch"] == 4


def test_train_checkpoints_only_every_save_every_epochs(sd, tmp_path):
    # Trainer.train is given code: stand-ins for the step and the save test it alone.
    x, y = _separable(32)
    model = MLP()
    trainer = sd.Trainer(model, sd.prepare_dataloader(x, y, 16),
                         torch.optim.SGD(model.parameters(), lr=0.05), CPU, save_every=2,
                         checkpoint_path=tmp_path / "ck.pt")
    trainer._run_batch = lambda source, targets: 0.0
    saved = []
    trainer._save_checkpoint = saved.append
    trainer.train(5)
    assert saved == [2, 4], (
        f"train(5) with save_every=2 saved checkpoints after epochs {saved}, not [2, 4]: save "
        "only when epochs_run % save_every == 0, with the number of epochs finished")


def _stand_in_trainer(sd, n=80, **options):
    """A Trainer over ``n`` separable samples in batches of 16 whose step (task 01.1) is a
    stand-in returning the losses 1.0, 2.0, 3.0, ...: only the given loop around it is tested."""
    x, y = _separable(n)
    model = MLP()
    trainer = sd.Trainer(model, sd.prepare_dataloader(x, y, 16),
                         torch.optim.SGD(model.parameters(), lr=0.05), CPU, **options)
    steps = iter(range(1, 1000))
    trainer._run_batch = lambda source, targets: float(next(steps))
    return trainer


@pytest.mark.timeout(60)
def test_an_epoch_returns_and_prints_the_mean_of_the_batches_it_ran(sd, capsys):
    trainer = _stand_in_trainer(sd)  # 5 batches an epoch; limit_batches=2 runs the first 2
    losses = trainer.train(2, limit_batches=2)
    assert trainer.history == [1.0, 2.0, 3.0, 4.0], (
        f"after 2 epochs of 2 batches, history is {trainer.history}: it must keep the loss of "
        "every batch of every epoch (self.history.extend(losses)), for the loss curve")
    assert losses == [1.5, 3.5], (
        f"epochs with batch losses [1, 2] and [3, 4] returned {losses}, not [1.5, 3.5]: an "
        "epoch's loss is the mean over the batches it ran (sum(losses) / len(losses)), not "
        "divided by the loader's length when --limit-batches stops it early")
    out = capsys.readouterr().out
    assert "epoch 0: mean train loss 1.5000" in out and "epoch 1: mean train loss 3.5000" in out, (
        f"train() printed {out!r}: the line of each epoch must show that epoch's mean loss "
        "(losses[-1]), not its last batch's (history[-1])")


@pytest.mark.timeout(60)
def test_the_progress_flag_reaches_the_epoch_loop(sd, monkeypatch):
    assert_progress_reaches_the_epoch_loop(
        sd, monkeypatch, lambda progress: _stand_in_trainer(sd, 32, progress=progress).train(1))


@pytest.mark.task("01.1")
def test_trainer_resumes_where_the_checkpoint_left_off_in_training_mode(sd, tmp_path):
    torch.manual_seed(0)
    x, y = _separable()
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sd.Trainer(model, sd.prepare_dataloader(x, y, 32), opt,
               CPU, save_every=1, checkpoint_path=tmp_path / "ck.pt").train(2)
    fresh = MLP().eval()  # as a model comes back from evaluate() or a notebook cell
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    resumed = sd.Trainer(fresh, sd.prepare_dataloader(x, y, 32), fresh_opt, CPU,
                         resume_from=tmp_path / "ck.pt")
    assert resumed.epochs_run == 2, "a resumed Trainer starts at the checkpoint's epoch"
    for p, q in zip(fresh.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, msg="a resumed Trainer must load the checkpoint's weights")
    momentum = fresh_opt.state_dict()["state"]
    assert momentum, ("a resumed Trainer restarted momentum from zero: pass the optimizer to "
                      "load_checkpoint, so its state is restored with the weights")
    for i, buf in opt.state_dict()["state"].items():
        torch.testing.assert_close(momentum[i]["momentum_buffer"], buf["momentum_buffer"],
                                   msg="the resumed optimizer's momentum is not the saved one")
    modes = []
    run_batch = resumed._run_batch
    resumed._run_batch = lambda s, t: (modes.append(resumed.model.training), run_batch(s, t))[1]
    losses = resumed.train(3, limit_batches=3)
    assert len(losses) == 1, (f"train(3) after a checkpoint at epoch 2 ran {len(losses)} epochs: "
                              f"it must run only the epochs not finished yet")
    assert len(resumed.history) == 3, (
        f"train(3, limit_batches=3) took {len(resumed.history)} steps in its one epoch, not 3: "
        "pass limit_batches on to _run_epoch")
    assert modes and all(modes), "an epoch must train in training mode (model.train())"


@pytest.mark.timeout(30)
def test_a_resumed_trainer_loads_the_checkpoint_into_the_model_on_its_device(sd, monkeypatch):
    # Trainer.__init__ is given code; load_checkpoint (01.3) is stood in for
    assert_resume_loads_into_the_moved_model(sd, MLP(), monkeypatch)


@pytest.mark.timeout(30)
def test_resuming_from_a_missing_checkpoint_is_an_error(sd, tmp_path, monkeypatch):
    # Trainer.__init__ is given code; load_checkpoint (01.3) is stood in for
    assert_a_missing_resume_is_an_error(sd, MLP(), monkeypatch, tmp_path / "missing.pt")


@pytest.mark.task("01.1")
def test_the_trainer_sends_the_model_and_every_batch_to_its_device(sd):
    x, y = _separable(48)
    torch.manual_seed(0)
    model = MLP()
    with recording_moves() as moves:
        trainer = sd.Trainer(model, moves.loader(sd.prepare_dataloader(x, y, 16)),
                             torch.optim.SGD(model.parameters(), lr=0.05), CPU)
        trainer.train(1)
    assert moves.module_sent(model, CPU) or moves.module_sent(trainer.model, CPU), (
        "the Trainer never sent the model to its device: on a GPU the weights would stay on "
        "the CPU. Move it in __init__ (model.to(device))")
    problem = unsent_message(moves, CPU, "the training batches", "the Trainer's epoch loop")
    assert not problem, problem


@pytest.mark.task("01.2")
def test_evaluate_sends_every_batch_to_the_device(sd):
    x, y = _batch(20)
    torch.manual_seed(0)
    model = MLP()
    with recording_moves() as moves:
        sd.evaluate(model, moves.loader(TensorLoader(x, y, batch_size=8)), CPU)
    problem = unsent_message(moves, CPU, "the evaluation batches", "evaluate")
    assert not problem, problem

def test_prepare_dataloader_shuffles_by_its_seed_and_every_epoch_differently(sd):
    x = torch.arange(64).float()[:, None]
    y = torch.zeros(64, dtype=torch.long)

    def orders(loader, epochs=2):
        return [torch.cat([b[0][:, 0] for b in loader]).long().tolist() for _ in range(epochs)]

    seed0, again, seed1 = (orders(sd.prepare_dataloader(x, y, 8, seed=s)) for s in (0, 0, 1))
    assert sorted(seed0[0]) == list(range(64)), "every sample once per epoch"
    assert seed0[0] != list(range(64)), "prepare_dataloader(shuffle=True) must shuffle"
    assert seed0 == again, "the same seed must give the same orders (a reproducible run)"
    assert seed0[0] != seed1[0], ("seeds 0 and 1 gave the same order: the loader's generator "
                                  "must be seeded with `seed` (torch.Generator().manual_seed)")
    assert seed0[0] != seed0[1], "each epoch must have a new order"
    plain = orders(sd.prepare_dataloader(x, y, 8, shuffle=False), epochs=1)[0]
    assert plain == list(range(64)), "shuffle=False must keep the samples in order"


@pytest.mark.timeout(30)
def test_prepare_dataloader_shuffles_with_a_generator_of_its_own(sd):
    x = torch.arange(64).float()[:, None]
    y = torch.zeros(64, dtype=torch.long)

    def first_order(loader):
        return torch.cat([b[0][:, 0] for b in loader]).long().tolist()

    with torch.random.fork_rng():  # this test's draws leave the process's generator alone
        alone = first_order(sd.prepare_dataloader(x, y, 8, seed=0))
        loader = sd.prepare_dataloader(x, y, 8, seed=0)
        torch.rand(100)  # what the model's initialization or dropout draws in between
        in_between = first_order(loader)
        torch.manual_seed(1234)
        expected = torch.rand(3)
        torch.manual_seed(1234)
        sd.prepare_dataloader(x, y, 8, seed=0)
        after = torch.rand(3)
    assert in_between == alone, (
        "the same seed gave another order once something else had drawn random numbers: "
        "shuffle with the loader's own torch.Generator().manual_seed(seed), not through "
        "torch's global generator (torch.manual_seed)")
    assert torch.equal(after, expected), (
        "prepare_dataloader reseeded torch's global generator (torch.manual_seed): seed the "
        "loader's own torch.Generator instead, and leave the model's initialization alone")


@pytest.mark.timeout(30)
def test_prepare_dataloader_keeps_the_short_last_batch(sd):
    x = torch.arange(10).float()[:, None]
    y = torch.zeros(10, dtype=torch.long)
    for shuffle in (False, True):
        loader = sd.prepare_dataloader(x, y, 4, shuffle=shuffle)
        batches = [b[0][:, 0].long().tolist() for b in loader]
        sizes, seen = [len(b) for b in batches], sorted(sum(batches, []))
        assert sizes == [4, 4, 2] and seen == list(range(10)), (
            f"10 samples in batches of 4 (shuffle={shuffle}) came as {batches}: keep the short "
            "last batch (no drop_last), or its samples are never trained on, nor counted by "
            "the evaluation")


@requires_data
@pytest.mark.task("01.1")
@pytest.mark.timeout(900)  # correctness, not speed: a loaded 2-core machine is many times slower
def test_cli_trains_and_reports_test_accuracy(tmp_path):
    ck = tmp_path / "ck.pt"
    # 2,000 test images: the accuracy of 60 steps shows on them; the whole set is slow
    proc = run_script(script(LESSON, "single_device.py"), *FASHION, "--epochs", "1", "--limit-batches",
                      "60", "--batch-size", "64", "--test-limit", "2000", "--checkpoint", str(ck),
                      timeout=420)
    assert proc.returncode == 0, proc.stderr
    acc = float(proc.stdout.split("test accuracy:")[1].split()[0])
    assert acc > 0.6, proc.stdout  # 60 steps already beat chance (0.1) by far
    resumed = run_script(script(LESSON, "single_device.py"), *FASHION, "--epochs", "2", "--limit-batches",
                         "5", "--test-limit", "500", "--resume", str(ck), timeout=420)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "at epoch 1" in resumed.stdout


@pytest.mark.timeout(30)
def test_main_applies_threads_and_trains_on_the_device_asked_for(sd, monkeypatch):
    # main() is given code: the device lookup and the training are stood in for
    threads, asked, seen = [], [], {}
    result = {"accuracy": 0.5, "seconds": 1.0, "history": [2.0, 1.0]}
    monkeypatch.setattr(sd, "set_threads", threads.append)
    monkeypatch.setattr(sd, "pick_device", lambda requested, **kw: asked.append(requested) or CPU)
    monkeypatch.setattr(sd, "train_and_evaluate",
                        lambda args, device: seen.update(args=args, device=device) or result)
    args = sd.build_parser().parse_args([*FASHION, "--device", "cpu", "--threads", "3"])
    got = sd.main(args)
    assert threads == [3], (f"--threads 3 called set_threads with {threads}: main() must apply "
                            "--threads (set_threads(args.threads))")
    assert asked == ["cpu"] and seen.get("device") == CPU, (
        f"--device cpu asked pick_device for {asked} and trained on {seen.get('device')}: "
        "main() must pick the device --device names (pick_device(args.device)) and train on it")
    assert seen.get("args") is args and got is result, (
        f"main() returned {got!r}: return what train_and_evaluate(args, device) returns (the "
        "accuracy, the time and the loss history), the notebook and the tests read it")


@pytest.mark.timeout(30)
def test_train_and_evaluate_passes_the_flags_on_and_tests_on_the_test_set(sd, monkeypatch,
                                                                         tmp_path):
    # train_and_evaluate() is given code: data and training are stood in for, only the wiring
    # is tested
    seen, loaders = {}, []

    class Trainer:
        def __init__(self, model, train_data, optimizer, device, *args, **kwargs):
            seen.update(train_data=train_data, device=device, args=args, kwargs=kwargs)
            self.model, self.history = model, [0.5]

        def train(self, *args):
            seen.update(train=args)
            return [0.5]

    def prepare_dataloader(x, y, batch_size, shuffle=True, seed=0):
        loaders.append((len(x), shuffle))
        return loaders[-1]

    def evaluate(model, loader, device):
        seen.update(evaluated=loader)
        return 3, 4

    sizes = {True: 12, False: 8}  # train and test sets of different sizes tell them apart
    monkeypatch.setattr(sd, "prepare_distributed", lambda *a, **k: None)
    monkeypatch.setattr(sd, "load_tensors", lambda name, train, limit=None: (
        torch.zeros(sizes[train], 1, 28, 28), torch.zeros(sizes[train], dtype=torch.long)))
    monkeypatch.setattr(sd, "prepare_dataloader", prepare_dataloader)
    monkeypatch.setattr(sd, "Trainer", Trainer)
    monkeypatch.setattr(sd, "evaluate", evaluate)
    ck, old = str(tmp_path / "ck.pt"), str(tmp_path / "old.pt")
    args = sd.build_parser().parse_args([*FASHION, "--model", "mlp", "--epochs", "3",
                                         "--checkpoint", ck, "--resume", old])
    got = sd.train_and_evaluate(args, CPU)
    given = [*seen["args"], *seen["kwargs"].values()]
    assert ck in given and seen["kwargs"].get("resume_from") == old, (
        f"the Trainer got {seen['args']} and {seen['kwargs']}: pass --checkpoint and --resume "
        "on to it")
    assert seen["train_data"] == (12, True) and seen["train"][0] == 3, (
        f"the Trainer trained on {seen['train_data']} for {seen['train']}: the shuffled train "
        "set, for --epochs epochs")
    assert seen["evaluated"] == (8, False), (
        f"evaluate() got the loader {seen['evaluated']} (samples, shuffled): the accuracy is "
        "measured on the test set (load_tensors(train=False)), in order")
    assert got == {"accuracy": 0.75, "seconds": got["seconds"], "history": [0.5]}, got


BAD_INPUT = [
    (["--dataset", "cifar"], "invalid choice"),
    (["--batch-size", "0"], "batch size must be a positive integer"),
    (["--device", "cuda"], "no CUDA GPU"),
    (["--checkpoint", "/nonexistent-dir/ck.pt"], "does not exist"),
]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_cli_bad_input_gets_one_clear_line(args, message):
    if args == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cases = [c for c in BAD_INPUT if c[0] != ["--device", "cuda"] or not torch.cuda.is_available()]
    procs = run_script_cases(script(LESSON, "single_device.py"),
                             [[*FASHION, *a, "--limit-batches", "1"] for a, _ in cases])
    assert message in one_line_error(procs[cases.index((args, message))])


def test_cli_corrupted_checkpoint_gets_one_clear_line(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x00garbage")
    proc = run_script(script(LESSON, "single_device.py"), *FASHION, "--resume", str(bad),
                      "--limit-batches", "1")
    assert "corrupted" in one_line_error(proc)


def test_cli_missing_data_offline_says_how_to_get_it(tmp_path):
    proc = run_script(script(LESSON, "single_device.py"), *FASHION, "--limit-batches", "1",
                      env={"DPT_DATA": str(tmp_path), "DPT_OFFLINE": "1",
                           "DPT_DEBIAN_DIR": str(tmp_path / "no-debian")})
    line = one_line_error(proc)
    assert "missing" in line and "make data" in line


@requires_data
@pytest.mark.readme  # a README figure: `make check-readme` runs it, `make test` does not
@pytest.mark.slow
@pytest.mark.task("01.2")
@pytest.mark.timeout(1800)  # one full epoch: about 40 s idle, many minutes on a loaded machine
def test_convnet_reaches_85_percent_after_one_epoch(sd):
    """The README's figure: one epoch of the ConvNet on Fashion-MNIST, on the CPU. A full
    epoch is a minute of the suite: the README check runs it (marker ``readme``)."""
    args = sd.build_parser().parse_args([*FASHION, "--epochs", "1", "--no-progress"])
    result = sd.main(args)
    assert result["accuracy"] >= 0.85, result["accuracy"]
