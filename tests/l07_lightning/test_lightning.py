"""Lesson 07: Lightning 2.x module and datamodule, strategies on 2 CPU processes, migrations.

Lightning's ``ddp`` strategy re-runs the script it was started from, so every multi-process
run here is a subprocess of a lesson script with a timeout, never a Trainer inside pytest.

Time limits: each run starts Python, torch and Lightning in two or three processes, 10-40 s on
an idle machine and several times that under a CPU hog. The limits only stop a hung run, so
they leave that room: these tests check what is trained, never how fast.
"""

from __future__ import annotations

import inspect
import io
import json
import re
import tokenize
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dpt.models import MLP
from dpt.ranks import run_distributed
from tests.helpers import one_line_error, requires_data, run_script, run_script_cases
from tests.l07_lightning import rank_fns
from tests.lessons import load, script

LESSON = "07_lightning"
# lit_train.py defaults to MNIST, as the Lightning notebook it follows; the tests use
# Fashion-MNIST, which `make test` always provides (MNIST needs `make data`).
FASHION = ("--dataset", "fashion-mnist")
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0)
# The shapes the strategy runs use: 512 train samples, 256 validation samples.
TRAIN_N, VAL_N, PER_RANK_BATCH, SEED = 512, 256, 32, 1


@pytest.fixture(scope="module")
def lf():
    return load(LESSON, "lit_fashion")


@pytest.fixture(scope="module")
def mig():
    return load(LESSON, "lit_migration")


def _synthetic(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def _trainer(**kwargs):
    import pytorch_lightning as pl

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pl.Trainer(**{**QUIET, "devices": 1, **kwargs})


def _whole_set(module, dataset):
    """Accuracy and mean loss of ``module`` over every sample, with plain torch."""
    x = torch.stack([dataset[i][0] for i in range(len(dataset))])
    y = torch.stack([dataset[i][1] for i in range(len(dataset))])
    module.eval()
    with torch.no_grad():
        logits = module(x)
    return (logits.argmax(1) == y).float().mean().item(), F.cross_entropy(logits, y).item(), \
        logits, y


# ------------------------------------------------------------------------ 07.1 / 07.2


@pytest.mark.task("07.1")
def test_training_step_returns_the_cross_entropy_and_logs_it(lf):
    torch.manual_seed(0)
    model = lf.LitClassifier()
    x, y = _synthetic(16)
    logged = {}
    model.log = lambda name, value, **kw: logged.__setitem__(name, (value, kw))
    loss = model.training_step((x, y), 0)
    assert torch.is_tensor(loss) and loss.requires_grad, "return the loss tensor, with its graph"
    torch.testing.assert_close(loss, F.cross_entropy(model(x), y))
    assert "train_loss" in logged, "log the training loss as 'train_loss'"
    assert not logged["train_loss"][1].get("sync_dist"), (
        "train_loss is logged with sync_dist=True: that is an all-reduce on every training "
        "step, only for a progress bar; log each rank's own loss per step")


@pytest.mark.task("07.1")
def test_a_short_fit_lowers_the_loss(lf):
    import pytorch_lightning as pl

    pl.seed_everything(0, verbose=False)
    model = lf.LitClassifier(learning_rate=1e-2)
    x, y = _synthetic(64)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    before = F.cross_entropy(model(x), y).item()
    trainer = _trainer(max_epochs=5)
    trainer.fit(model, loader)
    assert F.cross_entropy(model(x), y).item() < before
    (opt,) = trainer.optimizers
    lrs = {g["lr"] for g in opt.param_groups}
    assert lrs == {1e-2}, (
        f"LitClassifier(learning_rate=1e-2) trained with lr {sorted(lrs)}: configure_optimizers "
        "must read self.hparams.learning_rate, not a hard-coded number")
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    assert trained == {id(p) for p in model.parameters()}, (
        "configure_optimizers must give the optimizer every parameter of the module")


@pytest.mark.task("07.2")
def test_validation_logs_a_synced_loss_and_the_metric_object(lf):
    """The bug this catches: ``self.log("val_loss", loss)`` without ``sync_dist=True`` logs,
    under ddp, the mean of rank 0's batches only. The accuracy must be the torchmetrics
    object (synced by its compute) or a tensor logged with sync_dist=True."""
    from torchmetrics import Metric

    model = lf.LitClassifier()
    calls = {}
    model.log = lambda name, value, **kw: calls.__setitem__(name, (value, kw))
    model.validation_step(_synthetic(8), 0)
    assert {"val_acc", "val_loss"} <= set(calls), f"logged only {sorted(calls)}"
    value, kw = calls["val_loss"]
    assert kw.get("sync_dist") is True, "val_loss is a plain tensor: log it with sync_dist=True"
    value, kw = calls["val_acc"]
    assert isinstance(value, Metric) or kw.get("sync_dist") is True, (
        "log the Metric object itself (Lightning syncs it) or a synced tensor")


@pytest.mark.task("07.2")
def test_logged_validation_metrics_cover_the_whole_set_on_one_device(lf):
    model = lf.LitClassifier()
    x, y = _synthetic(96, seed=3)
    ds = TensorDataset(x, y)
    metrics = _trainer().validate(model, DataLoader(ds, batch_size=32), verbose=False)[0]
    missing = sorted({"val_acc", "val_loss"} - set(metrics))
    assert not missing, (
        f"Trainer.validate() reports no epoch value for {missing} (it got {sorted(metrics)}): "
        "log them per epoch (validation's default), not with on_step=True, on_epoch=False")
    acc, loss, _, _ = _whole_set(model, ds)
    assert metrics["val_acc"] == pytest.approx(acc, abs=1e-6)
    assert metrics["val_loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.timeout(120)
def test_test_accuracy_is_logged_once_per_epoch_over_every_rank(lf):
    """``test_step`` is given code, not a task: it logs the torchmetrics object, which
    Lightning computes once at the end of the epoch, summing the counts of every rank. On one
    device a per-batch value (``on_step=True``), or a plain tensor without ``sync_dist``,
    averages to the same number, so the test also looks at how each batch logs test_acc."""
    from torchmetrics import Metric

    model = lf.LitClassifier()
    real_log, calls = model.log, []

    def spy(*args, **kwargs):  # the log calls test_step makes, with Lightning's defaults
        bound = inspect.signature(real_log).bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append(dict(bound.arguments))
        return real_log(*args, **kwargs)

    model.log = spy
    x, y = _synthetic(96, seed=4)
    ds = TensorDataset(x, y)
    metrics = _trainer().test(model, DataLoader(ds, batch_size=32), verbose=False)[0]
    logged = [c for c in calls if c["name"] == "test_acc"]
    assert len(logged) == 3, (
        f"test_step logged 'test_acc' {len(logged)} times for 3 test batches: log it in every "
        "test_step, as the given code does")
    for call in logged:
        assert call["on_step"] is not True and call["on_epoch"] is not False, (
            f"test_acc is logged with on_step={call['on_step']}, on_epoch={call['on_epoch']}: "
            "that is a per-batch accuracy, and under ddp each rank reports its own batches. "
            "Log it once per epoch (test_step's default: no on_step/on_epoch), so Lightning "
            "computes it over the whole test set of every rank")
        assert isinstance(call["value"], Metric) or call["sync_dist"] is True, (
            f"test_acc is logged as a plain {type(call['value']).__name__} without "
            "sync_dist=True: under ddp each rank then reports the accuracy of its own share "
            "of the test set. Log the Metric object self.test_acc (its compute() sums every "
            "rank's counts), as the given code does, or the tensor with sync_dist=True")
    assert "test_acc" in metrics, (
        f"Trainer.test() reports no epoch value for test_acc (it got {metrics}): log it per "
        "epoch (test_step's default), not with on_step=True, on_epoch=False")
    acc, _, _, _ = _whole_set(model, ds)
    assert metrics["test_acc"] == pytest.approx(acc, abs=1e-6), (
        f"Trainer.test() reports test_acc {metrics['test_acc']:.4f}, not the whole test set's "
        f"accuracy {acc:.4f}: update self.test_acc with every batch and log the Metric object")


# ------------------------------------------------------------------ 07.3 prepare vs setup


@requires_data
@pytest.mark.task("07.3")
def test_setup_never_downloads_and_prepare_data_does(lf, monkeypatch):
    """The bug this catches: a DataModule that downloads in ``setup``, i.e. on every rank."""
    import dpt.data

    calls = []
    real = dpt.data.prepare
    monkeypatch.setattr(dpt.data, "prepare",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError(
                            "setup() called dpt.data.prepare: setup runs on EVERY rank, "
                            "download in prepare_data")))
    dm = lf.FashionDataModule(val_size=1000, verbose=False)
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) == 60000 and len(dm.val_set) == 1000
    monkeypatch.setattr(dpt.data, "prepare", lambda *a, **k: calls.append(a) or real(*a, **k))
    dm.prepare_data()
    assert len(calls) == 1, "prepare_data must make sure the files are there"


@requires_data
@pytest.mark.task("07.3")
def test_every_rank_builds_the_same_split_and_train_val_do_not_overlap(lf):
    a = lf.FashionDataModule(val_size=500, verbose=False)
    b = lf.FashionDataModule(val_size=500, verbose=False)  # "another rank"
    a.setup("fit")
    b.setup("fit")
    assert list(a.val_set.indices) == list(b.val_set.indices), "ranks split differently"
    assert not set(a.val_set.indices) & set(a.train_set.indices)


@requires_data
@pytest.mark.task("07.3")
def test_each_stage_gets_its_own_data_the_test_set_from_the_test_files(lf):
    """Trainer.validate() calls setup("validate") and Trainer.test() setup("test")."""
    from dpt.data import load_tensors

    dm = lf.FashionDataModule(val_size=500, verbose=False)
    dm.setup("validate")
    assert getattr(dm, "val_set", None) is not None and len(dm.val_set) == 500, (
        'setup("validate") (what Trainer.validate() calls) must build the validation split')
    dm = lf.FashionDataModule(val_size=500, verbose=False)
    dm.setup("test")
    x_test, _ = load_tensors(dm.dataset, train=False, root=dm.data_dir)
    assert getattr(dm, "test_set", None) is not None, 'setup("test") must build the test set'
    assert len(dm.test_set) == len(x_test), (
        f'setup("test") gives {len(dm.test_set)} samples, not the {len(x_test)} of the test '
        "files: load them with train=False")
    torch.testing.assert_close(dm.test_set[0][0], x_test[0], msg=lambda m: "the test set's first "
                               f"sample is not the test files' first\n{m}")


@pytest.mark.task("07.3")
def test_setup_without_a_stage_builds_every_split(lf, monkeypatch):
    """``dm.setup()`` (stage None, what a notebook or a script calls by hand) builds all."""
    _fake_files(monkeypatch)
    dm = lf.FashionDataModule(val_size=50, verbose=False)
    dm.setup()
    missing = [name for name in ("train_set", "val_set", "test_set")
               if getattr(dm, name, None) is None]
    assert not missing, (
        f"setup() with no stage left {missing} unbuilt: stage None means every stage, so test "
        f'"fit"/"validate" with None and "test" with None too (stage in ("test", None))')
    assert len(dm.test_set) == 50 and len(dm.train_set) + len(dm.val_set) == 200


def test_train_loader_order_follows_the_seed_alone(lf):
    """On one device (no sampler swapped in) the shuffle is drawn from the module's seed."""
    from torch.utils.data import TensorDataset

    def first_batch(seed):
        dm = lf.FashionDataModule(batch_size=8, seed=seed, verbose=False)
        dm.train_set = TensorDataset(torch.arange(64.0), torch.arange(64) % 10)
        return next(iter(dm.train_dataloader()))[0].tolist()

    assert first_batch(0) == first_batch(0), (
        "two loaders of the same seed shuffle differently: seed the DataLoader's generator "
        "with self.seed, or a rerun (or a resumed run) sees another order")
    assert first_batch(0) != first_batch(1), (
        "seed=0 and seed=1 shuffle the training data alike: the DataLoader's generator is not "
        "seeded with self.seed (torch.Generator() alone always starts from one fixed seed)")


def _fake_files(monkeypatch):
    """dpt.data.load_tensors replaced by small fake files whose every sample is numbered
    (x holds its id: 0.. for the training files, 1000.. for the test files); returns the
    list of calls, with the root each asked for."""
    import dpt.data

    calls = []

    def load_tensors(name="fashion-mnist", train=True, root=None, limit=None):
        calls.append({"train": train, "root": root})
        n, first = (200, 0) if train else (50, 1000)
        x = torch.arange(first, first + n, dtype=torch.float32).view(n, 1, 1, 1)
        return x, torch.arange(n) % 10

    monkeypatch.setattr(dpt.data, "load_tensors", load_tensors)
    return calls


def _ids(ds):
    return [int(ds[i][0].item()) for i in range(len(ds))]


@pytest.mark.task("07.3")
def test_setup_keeps_each_limit_for_its_own_split_and_reads_from_data_dir(lf, monkeypatch):
    """train_limit keeps the first samples of the TRAINING split, val_limit those of the
    validation split; and a data_dir given to the DataModule is where setup reads."""
    calls = _fake_files(monkeypatch)
    where = "/not/the/default/data"
    whole = lf.FashionDataModule(data_dir=where, val_size=40, verbose=False)
    whole.setup("fit")
    dm = lf.FashionDataModule(data_dir=where, val_size=40, train_limit=24, val_limit=8,
                              verbose=False)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (24, 8), (
        f"train_limit=24, val_limit=8 gave {len(dm.train_set)} training and {len(dm.val_set)} "
        "validation samples: each limit keeps the head of its own split (limits swapped?)")
    assert _ids(dm.train_set) == _ids(whole.train_set)[:24], (
        "the limited training set is not the head of the training split")
    assert _ids(dm.val_set) == _ids(whole.val_set)[:8], (
        "the limited validation set is not the head of the validation split")
    dm.setup("test")
    assert _ids(dm.test_set) == list(range(1000, 1050)), "the test set is not the test files"
    roots = sorted({str(c["root"]) for c in calls})
    assert roots == [where], (
        f"setup read from {roots}, not from the DataModule's data_dir {where!r}: pass "
        "root=self.data_dir to dpt_data.load_tensors in every stage")


@requires_data
def test_the_datamodule_makes_no_distributed_sampler_of_its_own(lf):
    dm = lf.FashionDataModule(train_limit=64, val_limit=32, verbose=False)
    dm.setup("fit")
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        assert not isinstance(loader.sampler, DistributedSampler), "Lightning adds it"


# ------------------------------------------------------------------ 07.4 portable habits


@pytest.mark.task("07.4")
def test_new_tensors_follow_the_module_device_and_input_dtype(lf):
    model = lf.LitClassifier(noise_std=0.5).train()
    x = torch.zeros(4, 1, 28, 28, dtype=torch.float64)
    torch.manual_seed(0)
    out = model.double().add_noise(x)
    assert out.dtype == torch.float64 and out.std() > 0.1
    # 3136 draws: the sample std of N(0, 0.5^2) is 0.5 +- 0.02 (one sigma: 0.5 / sqrt(2 n))
    assert 0.4 < out.std().item() < 0.6, (
        f"noise_std=0.5 gave noise of std {out.std().item():.3f}: scale the unit noise by "
        "self.hparams.noise_std (it is a standard deviation, not a variance)")
    # float64 + float32 noise is float64 anyway; a bf16 batch shows a noise made in float32
    out = model.add_noise(torch.zeros(4, 1, 28, 28, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16, (
        f"a bf16 batch came out {out.dtype}: make the noise in the input's dtype, or it "
        f"promotes the batch (and the rest of forward) to float32")
    # The meta device stands in for a GPU: a tensor made without device= lands on the CPU,
    # and adding it to a meta tensor fails or leaves the CPU device behind.
    model = lf.LitClassifier(noise_std=0.5).train().to("meta")
    assert model.device.type == "meta"
    out = model.add_noise(torch.zeros(4, 1, 28, 28, device="meta"))
    assert out.device.type == "meta"
    model.eval()
    x = torch.ones(2, 3)
    assert model.add_noise(x) is x, "no noise in evaluation"


def _code_without_text(source: str) -> str:
    """``source``'s code tokens, one space apart: no comments, strings or docstrings (a stub's
    hint may well say "never .cuda()")."""
    text = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", None)}
    return " ".join(t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                    if t.type not in text)


def test_no_cuda_or_to_calls_inside_the_module(lf):
    code = _code_without_text(inspect.getsource(lf.LitClassifier))
    found = re.findall(r"\.\s*(cuda|to)\s*\(", code)
    assert not found, (
        f"LitClassifier calls {', '.join(f'.{name}()' for name in found)}: let Lightning move "
        "the module and the batches, and make new tensors where they belong "
        "(device=self.device, or torch.randn_like(x))")


# ------------------------------------------------------------------ 07.5 Fabric


@pytest.mark.task("07.5")
def test_fabric_loader_and_epoch_match_the_raw_loop_on_one_device():
    from lightning_fabric import Fabric

    fd = load(LESSON, "fabric_ddp")

    fabric = Fabric(accelerator="cpu", devices=1)
    x, y = _synthetic(48)
    loader = fd.fabric_loader(fabric, TensorDataset(x, y), 16)
    torch.manual_seed(0)
    batches = list(loader)
    assert [len(b[1]) for b in batches] == [16, 16, 16]
    assert sorted(torch.cat([b[1] for b in batches]).tolist()) == sorted(y.tolist())
    assert not torch.equal(torch.cat([b[0] for b in batches]), x), (
        "the loader gives the 48 samples in the dataset's order: a training loader shuffles "
        "(DataLoader(..., shuffle=True)); under ddp Fabric's DistributedSampler keeps that "
        "choice, so without it no rank ever sees a new order")
    torch.manual_seed(0)
    model = MLP(16)
    ref = MLP(16)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model_f, opt_f = fabric.setup(model, opt)
    backward_calls = []
    fabric_backward = fabric.backward
    fabric.backward = lambda loss, *a, **kw: (backward_calls.append(1),
                                              fabric_backward(loss, *a, **kw))[1]
    losses = fd.fabric_epoch(fabric, model_f, opt_f, batches)
    assert len(backward_calls) == len(batches), (
        f"fabric.backward was called {len(backward_calls)} times for {len(batches)} batches: "
        f"call fabric.backward(loss), not loss.backward(); Fabric scales the loss there under "
        f"fp16 and lets its strategy (DDP, FSDP) see the backward")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for bx, by in batches:
        ref_opt.zero_grad()
        F.cross_entropy(ref(bx), by).backward()
        ref_opt.step()
    assert len(losses) == 3
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.timeout(150)
def test_the_raw_loop_gives_each_rank_its_own_share_in_a_new_order_each_epoch():
    """``raw_ddp_epoch`` is lesson 03's loop, the one Fabric's version is set against (the
    lesson's benchmark times the two side by side), so it must be a correct DDP epoch."""
    n, batch_size = 48, 4
    ranks = run_distributed(rank_fns.raw_epochs, world_size=2, timeout=120,
                            kwargs={"n": n, "batch_size": batch_size})
    for epoch in (0, 1):
        shares = [r["orders"][epoch] for r in ranks]
        assert [len(s) for s in shares] == [n // 2, n // 2], (
            f"in epoch {epoch} the ranks read {[len(s) for s in shares]} samples of {n}: each "
            f"rank reads its own half (a DistributedSampler in the DataLoader)")
        assert sorted(shares[0] + shares[1]) == list(range(n)), (
            f"in epoch {epoch} the ranks' shares overlap or leave samples out: the "
            f"DistributedSampler gives each rank a disjoint share of the whole set")
    first, second = ranks[0]["orders"]
    assert first != sorted(first), (
        "rank 0 reads its share in index order: a training loop shuffles "
        "(DistributedSampler(..., shuffle=True))")
    assert first != second, (
        "epoch 1 reads the same order as epoch 0: call sampler.set_epoch(epoch) before "
        "iterating, or every epoch repeats the first one's shuffle")
    for r in ranks:
        assert [len(e) for e in r["losses"]] == [n // 2 // batch_size] * 2, (
            f"rank {r['rank']} returned "
            f"{[len(e) for e in r['losses']]} losses per epoch, not one per batch")
        assert len(r["short"]) == 2, (
            f"with max_batches=2 the loop took {len(r['short'])} steps, not 2")
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-6), (
        "after the same steps the two ranks' models differ")
    # the same steps by hand: each step averages the two ranks' batch gradients, as DDP does
    data = rank_fns.RecordingDataset(n)
    torch.manual_seed(0)
    ref = MLP(16)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    shares = [list(zip(*(r["orders"][e] for r in ranks))) for e in (0, 1)]
    shares.append(list(zip(*(r["short_order"] for r in ranks))))
    for share in shares:
        for b in range(0, len(share), batch_size):
            opt.zero_grad()
            per_rank = [list(idx) for idx in zip(*share[b:b + batch_size])]
            loss = sum(F.cross_entropy(ref(data.x[i]), data.y[i]) for i in per_rank) / 2
            loss.backward()
            opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][k], v, rtol=1e-4, atol=1e-5, msg=lambda m: (
            "after the raw loop the weights differ from plain SGD on the same batches (each "
            "step the mean of the two ranks' gradients): zero the gradients before each "
            f"backward (optimizer.zero_grad()), or they pile up from step to step\n{m}"))


@requires_data
@pytest.mark.timeout(330)
@pytest.mark.task("07.5")
def test_fabric_trains_on_two_cpu_processes():
    proc = run_script(script(LESSON, "fabric_ddp.py"), "--devices", "2", "--limit", "512",
                      "--batch-size", "64", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(ln[7:]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert r["world_size"] == 2, f"rank {r['rank']} sees a world of {r['world_size']}, not 2"
        assert r["steps"] == 512 // 2 // 64, (
            f"rank {r['rank']} took {r['steps']} steps, not {512 // 2 // 64}: each rank must get "
            f"half of the 512 samples (let fabric.setup_dataloaders give it its share)")
    assert results[0]["param_checksum"] == pytest.approx(results[1]["param_checksum"], abs=1e-6), \
        "the two ranks' models differ: gradients were not all-reduced"
    assert results[0]["first_loss"] != results[1]["first_loss"], "both ranks saw the same data"
    means = [r["mean_last_loss"] for r in results]
    assert means[0] == pytest.approx(means[1], abs=1e-6), f"the ranks report {means}"
    assert means[0] < 1.5 * max(r["first_loss"] for r in results), (
        f"the reported mean of the last losses, {means[0]:.3f}, is about twice a single loss: "
        f"the ranks' means were summed (fabric.all_reduce(..., reduce_op='mean'), not 'sum')")


FABRIC_BAD = [(["--devices", "0"], "--devices"), (["--batch-size", "0"], "batch")]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("args, words", FABRIC_BAD)
def test_fabric_script_bad_input_is_one_line(args, words):
    procs = run_script_cases(script(LESSON, "fabric_ddp.py"), [a for a, _ in FABRIC_BAD],
                             timeout=150)
    line = one_line_error(procs[FABRIC_BAD.index((args, words))])
    assert words in line, (
        f"{args}: the error does not name the bad flag ({words!r}); check it before Fabric "
        f"starts: {line}")


def _reference_fabric_parts(fd, monkeypatch, seen):
    """Tasks 07.5 replaced by the reference loader and epoch, so a test of the given script
    code grades that code alone; ``seen`` collects the batch sizes, epochs and losses."""
    from torch.utils.data import DataLoader as Loader

    def fabric_loader(fabric, dataset, batch_size):
        seen["batch_size"].append(batch_size)
        return fabric.setup_dataloaders(Loader(dataset, batch_size=batch_size, shuffle=True))

    def fabric_epoch(fabric, model, optimizer, loader, max_batches=None):
        losses = []
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.item())
        seen["epochs"].append(losses)
        return losses

    monkeypatch.setattr(fd, "fabric_loader", fabric_loader)
    monkeypatch.setattr(fd, "fabric_epoch", fabric_epoch)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("epochs, limit, lr", [(2, 48, 0.0), (3, 64, 0.05)])
def test_fabric_script_passes_its_flags_on_and_reports_the_last_ten_losses(
        epochs, limit, lr, monkeypatch, capsys):
    """``main`` and ``run`` are given code. One process in pytest: a Fabric of one CPU device
    stands in for the launch it asked for (written down), and synthetic data for the files.
    With ``--lr 0`` Adam leaves every weight where the seeded init put it."""
    import lightning_fabric

    import dpt.dist

    fd = load(LESSON, "fabric_ddp")
    seen = {"fabric": [], "limit": [], "threads": [], "batch_size": [], "epochs": []}
    _reference_fabric_parts(fd, monkeypatch, seen)

    class OneDevice(lightning_fabric.Fabric):
        def __init__(self, **kwargs):
            seen["fabric"].append(kwargs)
            super().__init__(accelerator="cpu", devices=1)

    def train_set(limit=None, name="fashion-mnist"):
        seen["limit"].append(limit)
        return TensorDataset(*_synthetic(limit or 1000, seed=9))

    monkeypatch.setattr(lightning_fabric, "Fabric", OneDevice)
    monkeypatch.setattr(fd, "fashion_train_set", train_set)
    monkeypatch.setattr(fd, "prepare", lambda *a, **kw: None)
    monkeypatch.setattr(dpt.dist, "set_threads", seen["threads"].append)
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # seed_everything writes it; put it back after
    seed, hidden, batch = 5, 32, 16
    code = fd.main(["--devices", "3", "--strategy", "ddp_spawn", "--accelerator", "cpu",
                    "--epochs", str(epochs),
                    "--batch-size", str(batch), "--limit", str(limit), "--lr", str(lr),
                    "--hidden-dim", str(hidden), "--seed", str(seed)])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert seen["fabric"] == [dict(accelerator="cpu", devices=3, strategy="ddp_spawn")], (
        f"main() built Fabric{seen['fabric']} for --devices 3 --strategy ddp_spawn "
        "--accelerator cpu: pass the flags on")
    assert seen["threads"] == [dpt.dist.threads_per_rank(3)], (
        f"set_threads got {seen['threads']}: split the cores among the 3 ranks")
    assert seen["limit"] == [limit] and seen["batch_size"] == [batch], (
        f"run() loaded limit={seen['limit']} and batched by {seen['batch_size']}, not "
        f"--limit {limit} and --batch-size {batch}")
    assert len(seen["epochs"]) == epochs, (
        f"--epochs {epochs} ran {len(seen['epochs'])} epoch(s)")
    losses = [loss for epoch in seen["epochs"] for loss in epoch]
    (line,) = [ln for ln in out.out.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line[7:])
    assert result["steps"] == len(losses) == epochs * (limit // batch)
    assert result["first_loss"] == losses[0]
    last = losses[-10:]
    assert result["mean_last_loss"] == pytest.approx(sum(last) / len(last), rel=1e-6), (
        f"mean_last_loss is {result['mean_last_loss']:.5f}, not the mean of the last "
        f"{len(last)} of {len(losses)} losses ({sum(last) / len(last):.5f}): divide their sum "
        f"by how many there are")
    if lr == 0:
        lightning_fabric.seed_everything(seed)
        init = MLP(hidden)
        checksum = sum(p.detach().double().sum().item() for p in init.parameters())
        assert result["param_checksum"] == pytest.approx(checksum, abs=1e-9), (
            "with --lr 0 the weights are not the seeded init of MLP(--hidden-dim): seed "
            "every rank alike (fabric.seed_everything(args.seed)) before building the model, "
            "and give Adam lr=args.lr")


class _Stop(Exception):
    """Raised by the recording Fabric: the test has seen what main() asked for."""


def _fabric_asked_for(monkeypatch, flags, cuda_count, mps) -> tuple[int | None, dict, str]:
    """``fabric_ddp.main(flags)`` on a machine with ``cuda_count`` GPUs and MPS or not
    (faked), up to the Fabric it builds. Returns (exit code, or None when it reached
    Fabric; Fabric's keyword arguments; what it wrote to stderr)."""
    import contextlib

    import lightning_fabric

    import dpt.dist

    fd = load(LESSON, "fabric_ddp")
    seen = {}

    def recording_fabric(**kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_count)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_count > 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    monkeypatch.setattr(lightning_fabric, "Fabric", recording_fabric)
    monkeypatch.setattr(fd, "prepare", lambda *a, **kw: None)
    monkeypatch.setattr(dpt.dist, "set_threads", lambda n: n)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    err = io.StringIO()
    code = None
    with contextlib.redirect_stderr(err):
        try:
            code = fd.main(flags)
        except _Stop:
            pass
        except SystemExit as exc:  # argparse: a flag it does not know
            code = exc.code
    return code, seen, err.getvalue()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags, cuda_count, mps, expected", [
    ([], 0, False, "cpu"),
    ([], 4, False, "cuda"),
    (["--accelerator", "auto"], 1, False, "cpu"),  # 3 processes, 1 GPU: NCCL would refuse
    (["--accelerator", "cpu"], 4, False, "cpu"),
    (["--accelerator", "cuda"], 4, False, "cuda"),
    (["--accelerator", "gpu"], 3, False, "gpu"),
    ([], 0, True, "cpu"),  # MPS serves one process only
    (["--devices", "1"], 0, True, "mps"),
])
def test_fabric_script_takes_an_accelerator_flag(monkeypatch, flags, cuda_count, mps, expected):
    """Given code: ``--accelerator`` (default auto) reaches Fabric, resolved for the machine:
    a GPU per process when there are enough, else the CPU; a hard-coded accelerator='cpu'
    leaves every GPU idle."""
    flags = flags if "--devices" in flags else ["--devices", "3", *flags]
    code, seen, err = _fabric_asked_for(monkeypatch, flags, cuda_count, mps)
    assert code is None, f"fabric_ddp.py {' '.join(flags)} stopped with {code}: {err}"
    assert seen.get("accelerator") == expected, (
        f"fabric_ddp.py {' '.join(flags)} on a machine with {cuda_count} GPU(s)"
        f"{' and MPS' if mps else ''} built Fabric(accelerator={seen.get('accelerator')!r}), "
        f"not {expected!r}: take --accelerator (default auto) and pass it on, resolved as "
        "lit_train.py does")
    if expected == "cpu" and cuda_count and "cpu" not in flags:
        assert "GPU" in err, f"falling back to the CPU with {cuda_count} GPU(s) says nothing"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags, cuda_count, mps, words", [
    (["--accelerator", "cuda"], 0, False, "--accelerator cuda"),
    (["--accelerator", "gpu", "--devices", "3"], 2, False, "--devices 2"),
    (["--accelerator", "mps", "--devices", "2"], 0, True, "MPS"),
])
def test_fabric_script_refuses_an_accelerator_the_machine_lacks(monkeypatch, flags, cuda_count,
                                                                mps, words):
    code, seen, err = _fabric_asked_for(monkeypatch, flags, cuda_count, mps)
    assert code == 2 and not seen, (
        f"fabric_ddp.py {' '.join(flags)} on {cuda_count} GPU(s) got to Fabric{seen} (exit "
        f"{code}) instead of refusing with one line")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], err


# ------------------------------------------------------------------ strategies, 2 processes


def _reference_single_device(lf, dm_kwargs):
    """The single-device run over the same samples in the same order.

    Lightning's injected DistributedSampler ALWAYS shuffles training data (seeded by
    PL_GLOBAL_SEED), whatever the DataLoader says. With one replica it yields the whole
    permutation; two ranks take its even and odd positions. So one process with a batch of
    2 x 32 sees, at every step, exactly the union of what the two ranks see.
    """
    import pytorch_lightning as pl

    class SameOrder(lf.FashionDataModule):
        def train_dataloader(self):
            sampler = DistributedSampler(self.train_set, num_replicas=1, rank=0,
                                         shuffle=True, seed=SEED)
            return DataLoader(self.train_set, batch_size=2 * PER_RANK_BATCH, sampler=sampler)

    pl.seed_everything(SEED, verbose=False)
    dm = SameOrder(batch_size=2 * PER_RANK_BATCH, verbose=False, **dm_kwargs)
    model = lf.LitClassifier()
    _trainer(max_epochs=1).fit(model, datamodule=dm)
    return model, dm


@pytest.fixture(scope="module")
def reference(lf):
    return _reference_single_device(lf, dict(train_limit=TRAIN_N, val_limit=VAL_N, seed=SEED))


def _run_strategy(strategy, ckpt):
    proc = run_script(script(LESSON, "lit_train.py"), *FASHION, "--devices", "2", "--strategy", strategy,
                      "--batch-size", str(PER_RANK_BATCH), "--train-limit", str(TRAIN_N),
                      "--val-limit", str(VAL_N), "--seed", str(SEED), "--ckpt", str(ckpt),
                      timeout=360)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, "rank 0 alone prints the result"
    return json.loads(lines[0][7:]), proc.stdout


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.task("07.2")
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "ddp_notebook"])
def test_strategy_matches_single_device_and_logs_whole_set_metrics(lf, reference, strategy,
                                                                    tmp_path):
    ckpt = tmp_path / "last.ckpt"
    result, stdout = _run_strategy(strategy, ckpt)
    assert result["world_size"] == 2

    # Lightning gave each rank a DistributedSampler over half of the 512 samples.
    samplers = re.findall(r"\[rank (\d)\] train sampler=(\w+) samples=(\d+)", stdout)
    assert sorted(samplers) == [("0", "DistributedSampler", str(TRAIN_N // 2)),
                                ("1", "DistributedSampler", str(TRAIN_N // 2))]
    # prepare_data ran once (local rank 0); setup ran on both ranks.
    assert stdout.count("] prepare_data") == 1, stdout
    assert len(re.findall(r"\] setup\(fit\)", stdout)) == 2, stdout

    # The checkpoint reloads into a fresh module ...
    fresh = lf.LitClassifier.load_from_checkpoint(ckpt, map_location="cpu")
    ref_model, dm = reference
    # ... and holds the same weights as the single-device run over the same data.
    for (name, p), q in zip(fresh.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=f"{name} differs")
    train_x = torch.stack([dm.train_set[i][0] for i in range(len(dm.train_set))])
    train_y = torch.stack([dm.train_set[i][1] for i in range(len(dm.train_set))])
    with torch.no_grad():
        loss = F.cross_entropy(fresh(train_x), train_y).item()
        ref_loss = F.cross_entropy(ref_model(train_x), train_y).item()
    assert loss == pytest.approx(ref_loss, rel=1e-4)

    # Logged validation metrics are the whole validation set's, not rank 0's half.
    acc, vloss, logits, y = _whole_set(fresh, dm.val_set)
    rank0 = torch.arange(0, VAL_N, 2)  # DistributedSampler(shuffle=False): even positions
    acc0 = (logits[rank0].argmax(1) == y[rank0]).float().mean().item()
    loss0 = F.cross_entropy(logits[rank0], y[rank0]).item()
    assert acc0 != pytest.approx(acc, abs=1e-6) and loss0 != pytest.approx(vloss, rel=1e-4), \
        "test data cannot tell the halves apart"
    assert result["val_acc"] == pytest.approx(acc, abs=1e-6), "val_acc is one rank's, not all"
    assert result["val_loss"] == pytest.approx(vloss, rel=1e-4), "val_loss is one rank's"


GPU_ONLY = [
    (["--strategy", "fsdp", "--devices", "2"], "GPU-only"),
    (["--strategy", "deepspeed"], "GPU-only"),
    (["--precision", "16-mixed"], "16-mixed"),
    (["--accelerator", "gpu"], "no"),
    (["--devices", "0"], "at least 1"),
]


@pytest.mark.parametrize("args,needle", GPU_ONLY)
@pytest.mark.timeout(240)
def test_gpu_only_choices_stop_on_cpu_with_one_clear_line(args, needle):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    procs = run_script_cases(script(LESSON, "lit_train.py"),
                             [[*FASHION, *a] for a, _ in GPU_ONLY], timeout=210)
    assert needle in one_line_error(procs[GPU_ONLY.index((args, needle))])


class _RecordingTrainer:
    """Stands in for ``pl.Trainer`` in ``lit_train.main``: writes down what it is asked."""

    made: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []
        self.callback_metrics = {"val_loss": torch.tensor(0.5)}
        self.is_global_zero, self.world_size = True, kwargs.get("devices", 1)
        _RecordingTrainer.made.append(self)

    def fit(self, model, datamodule=None, **kwargs):
        self.calls.append(("fit", model, datamodule))

    def validate(self, model=None, datamodule=None, **kwargs):
        self.calls.append(("validate", model, datamodule))
        return [{"val_acc": 0.0}]

    def test(self, model=None, datamodule=None, **kwargs):
        self.calls.append(("test", model, datamodule))
        return [{"test_acc": 0.25}]


@pytest.fixture
def lit_train(monkeypatch):
    """``lit_train`` with a recording Trainer, no thread change and no seed left behind;
    returns the module and the thread counts it asked for."""
    import pytorch_lightning as pl

    lt = load(LESSON, "lit_train")
    _RecordingTrainer.made = []
    threads = []
    monkeypatch.setattr(pl, "Trainer", _RecordingTrainer)
    monkeypatch.setattr(lt, "set_threads", threads.append)
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # seed_everything writes it; put it back after
    return lt, threads


def test_lit_train_passes_every_flag_on(lit_train, capsys):
    """``main`` is given code: each flag must reach the Trainer, the module or the data."""
    from dpt.dist import threads_per_rank

    lt, threads = lit_train
    code = lt.main(["--dataset", "fashion-mnist", "--devices", "2", "--strategy", "ddp_spawn",
                    "--precision", "bf16-mixed", "--epochs", "3", "--lr", "0.01",
                    "--batch-size", "8", "--hidden-dim", "32", "--train-limit", "100",
                    "--val-limit", "20", "--limit-train-batches", "0.5", "--seed", "7",
                    "--test"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    (trainer,) = _RecordingTrainer.made
    asked = {k: trainer.kwargs.get(k) for k in ("accelerator", "devices", "strategy",
                                                 "precision", "max_epochs",
                                                 "limit_train_batches")}
    assert asked == dict(accelerator="cpu", devices=2, strategy="ddp_spawn",
                         precision="bf16-mixed", max_epochs=3, limit_train_batches=0.5), (
        f"the Trainer was built with {asked}: pass --accelerator, --devices, --strategy, "
        "--precision, --epochs (max_epochs) and --limit-train-batches on")
    assert threads == [threads_per_rank(2)]
    kind, model, dm = trainer.calls[0]
    assert kind == "fit"
    assert model.hparams.learning_rate == 0.01 and model.hparams.hidden_dim == 32, (
        f"LitClassifier got {dict(model.hparams)}: pass --lr and --hidden-dim on")
    assert (dm.dataset, dm.batch_size, dm.train_limit, dm.val_limit, dm.seed) == \
        ("fashion-mnist", 8, 100, 20, 7), "the DataModule did not get the data flags"
    assert [c[0] for c in trainer.calls] == ["fit", "test"], (
        f"--test made the Trainer call {[c[0] for c in trainer.calls][1:]}: it asks for the "
        "test set's accuracy, Trainer.test(), not another validation")
    (line,) = [ln for ln in out.out.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line[7:])
    assert result["test_acc"] == 0.25 and result["val_loss"] == 0.5
    assert (result["strategy"], result["devices"], result["precision"]) == \
        ("ddp_spawn", 2, "bf16-mixed")


@pytest.mark.parametrize("flag, value", [("--epochs", "0"), ("--batch-size", "0")])
def test_lit_train_refuses_nothing_to_train_before_the_trainer(lit_train, capsys, flag, value):
    code = lit_train[0].main(["--dataset", "fashion-mnist", flag, value])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not _RecordingTrainer.made, (
        f"{flag} {value} went on to build a Trainer: refuse it first, with one line")
    assert len(err.splitlines()) == 1 and flag.lstrip("-").split("-")[0] in err, err


def _must_refuse(call, needle, why):
    """``call()`` must raise lit_train's UsageError (a ValueError) whose text has ``needle``."""
    try:
        call()
    except ValueError as exc:
        assert needle in str(exc), f"{why}; the error says: {exc}"
    else:
        pytest.fail(why)


def test_mps_serves_one_process_and_auto_falls_back_to_cpu(capsys):
    lt = load(LESSON, "lit_train")
    _must_refuse(lambda: lt.resolve_accelerator("mps", 2, cuda_available=False,
                                                mps_available=True), "--devices 2",
                 "--accelerator mps --devices 2 was accepted: MPS serves one process, and no "
                 "distributed backend runs on it; refuse it, naming --devices")
    _must_refuse(lambda: lt.resolve_accelerator("mps", 1, cuda_available=False,
                                                mps_available=False), "MPS",
                 "--accelerator mps was accepted on a machine without MPS: refuse it here, "
                 "in one line, before Lightning fails deep inside")
    assert lt.resolve_accelerator("mps", 1, cuda_available=False, mps_available=True) == "mps"
    assert lt.resolve_accelerator("auto", 2, cuda_available=False, mps_available=True) == "cpu", (
        "auto with 2 devices on a Mac (MPS, no CUDA) must run 2 CPU processes: MPS serves one")
    assert "CPU processes" in capsys.readouterr().err, "the switch to the CPU is not announced"
    assert lt.resolve_accelerator("auto", 1, cuda_available=False, mps_available=True) == "auto"
    assert lt.resolve_accelerator("auto", 2, cuda_available=True, mps_available=True) == "auto"
    assert lt.resolve_accelerator("cpu", 2, cuda_available=False, mps_available=True) == "cpu"


def test_deepspeed_on_a_gpu_still_needs_the_package():
    lt = load(LESSON, "lit_train")
    _must_refuse(lambda: lt.check_choices("gpu", "deepspeed", "32-true", 1, cuda_available=True,
                                          deepspeed_installed=False), "pip install deepspeed",
                 "--strategy deepspeed was accepted without the deepspeed package: say how to "
                 "install it, before Lightning fails on every rank")
    lt.check_choices("gpu", "deepspeed", "32-true", 1, cuda_available=True,
                     deepspeed_installed=True)
    lt.check_choices("gpu", "fsdp", "16-mixed", 2, cuda_available=True, deepspeed_installed=False)


def test_the_datamodule_keeps_the_order_when_asked_and_refuses_batch_zero(lf):
    dm = lf.FashionDataModule(batch_size=8, shuffle=False, verbose=False)
    dm.train_set = TensorDataset(torch.arange(64.0), torch.arange(64) % 10)
    assert next(iter(dm.train_dataloader()))[0].tolist() == list(range(8)), (
        "shuffle=False still shuffles: pass self.shuffle to the train DataLoader")
    _must_refuse(lambda: lf.FashionDataModule(batch_size=0, verbose=False), "batch size",
                 "FashionDataModule(batch_size=0) was accepted: check it in __init__ "
                 "(dpt.data.check_batch_size), or every rank fails later in its DataLoader")


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(270)
def test_bf16_mixed_precision_trains_on_cpu():
    proc = run_script(script(LESSON, "lit_train.py"), *FASHION, "--precision", "bf16-mixed",
                      "--train-limit", "256", "--val-limit", "64", "--batch-size", "32",
                      timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(next(ln for ln in proc.stdout.splitlines()
                             if ln.startswith("RESULT "))[7:])
    assert result["precision"] == "bf16-mixed" and 0 < result["val_loss"] < 3


# ------------------------------------------------------------------ 07.6 migrations


@pytest.mark.task("07.6")
@pytest.mark.parametrize("old,new", [
    ({"gpus": 2}, {"accelerator": "gpu", "devices": 2}),
    ({"gpus": 2, "accelerator": "dp"}, {"accelerator": "gpu", "devices": 2, "strategy": "ddp"}),
    ({"distributed_backend": "ddp", "gpus": 8, "num_nodes": 4},
     {"accelerator": "gpu", "devices": 8, "strategy": "ddp", "num_nodes": 4}),
    ({"strategy": "dp"}, {"strategy": "ddp"}),
    ({"strategy": "ddp2"}, {"strategy": "ddp"}),
    ({"weights_summary": None, "max_epochs": 1}, {"enable_model_summary": False, "max_epochs": 1}),
    ({"gpus": 0, "max_epochs": 1}, {"max_epochs": 1}),  # gpus=0 was 1.x's way to say CPU
    # 1.x also took a strategy name as accelerator=, with or without gpus: it must move
    # to strategy= and leave no accelerator="ddp" behind (2.x has no such accelerator)
    ({"accelerator": "ddp"}, {"strategy": "ddp"}),
    ({"gpus": 2, "accelerator": "ddp_spawn"},
     {"accelerator": "gpu", "devices": 2, "strategy": "ddp_spawn"}),
    ({"weights_summary": "top"}, {"enable_model_summary": True}),  # only None turned it off
])
def test_migrate_trainer_kwargs(mig, old, new):
    given = dict(old)
    got = mig.migrate_trainer_kwargs(old, cuda=True)
    assert got == new, f"Lightning 1.x's Trainer({given}) becomes {got}, not {new}"
    assert old == given, (
        f"migrate_trainer_kwargs changed the caller's dict to {old}: build a new dict "
        "(new = dict(old)) and pop from that")


@pytest.mark.task("07.6")
def test_ddp_sharded_becomes_fsdp_on_gpus_and_ddp_on_cpu(mig, monkeypatch):
    assert mig.migrate_trainer_kwargs({"strategy": "ddp_sharded"}, cuda=True) == {"strategy": "fsdp"}
    assert mig.migrate_trainer_kwargs({"strategy": "ddp_sharded"}, cuda=False) == {"strategy": "ddp"}
    # without cuda=, the machine decides
    for available, strategy in ((True, "fsdp"), (False, "ddp")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        got = mig.migrate_trainer_kwargs({"strategy": "ddp_sharded"})
        assert got == {"strategy": strategy}, (
            f"with no cuda= on a machine {'with' if available else 'without'} CUDA, "
            f"ddp_sharded became {got}, not {{'strategy': {strategy!r}}}: cuda=None means "
            "ask torch.cuda.is_available()")


def _readme_row(old_api):
    readme = script(LESSON, "README.md").read_text()
    rows = [ln for ln in readme.splitlines() if ln.startswith(f"| `{old_api}` |")]
    assert len(rows) == 1, f"README has no single migration row for {old_api}"
    return rows[0]


def _check_row(mig, index):
    row = mig.ROWS[index]
    outcome, new_result = mig.run_row(row)
    assert not outcome.startswith("runs:") or "called 0 times" in outcome, outcome
    # The README quotes what this Lightning install says today.
    assert mig.first_sentence(outcome) in _readme_row(row.old_api), (
        f"README row is stale; Lightning 2.x now says: {outcome}")
    assert new_result is not None
    return outcome, new_result


MIGRATING = [i for i, name in enumerate(["gpus", "dp-acc", "dp", "backend", "ddp2",
                                         "sharded", "step_end", "epoch_end", "summary", "acc"])
             if name not in ("step_end", "epoch_end", "acc")]


@pytest.mark.task("07.6")
@pytest.mark.parametrize("index", MIGRATING)
def test_migration_row_old_call_fails_and_new_call_works(mig, index):
    import pytorch_lightning as pl

    outcome, trainer = _check_row(mig, index)
    assert isinstance(trainer, pl.Trainer)
    assert outcome.split(":")[0] in ("TypeError", "ValueError")
    if "strategy" in mig.ROWS[index].new_api:
        assert type(trainer.strategy).__name__ == "DDPStrategy"


def test_migration_training_step_end_is_silently_ignored(mig):
    outcome, calls = _check_row(mig, 6)
    assert outcome == "runs: training_step_end called 0 times"
    assert calls == {"training_step": 2}


def test_migration_training_epoch_end_raises(mig):
    outcome, calls = _check_row(mig, 7)
    assert outcome.startswith("NotImplementedError: Support for `training_epoch_end`")
    assert calls == {"on_train_epoch_end": 1}


def test_migration_accuracy_needs_a_task(mig):
    outcome, value = _check_row(mig, 8 + 1)
    assert "task" in outcome
    assert value.item() == pytest.approx(2 / 3)


def test_every_old_api_of_the_issue_has_a_row(mig):
    olds = " ".join(r.old_api for r in mig.ROWS)
    for needle in ["gpus=", 'accelerator="dp"', 'strategy="dp"', "distributed_backend=",
                   "ddp2", "ddp_sharded", "training_step_end", "training_epoch_end",
                   "weights_summary", "Accuracy(num_classes="]:
        assert needle in olds, needle


def test_the_readme_table_is_what_the_script_prints(mig, monkeypatch):
    """``python lit_migration.py`` prints the table the README shows: every row, with its
    note and the first sentence of what this Lightning install says. The table reads only
    the old calls, so task 07.6 is stood in for (every new call gets no extra arguments)."""
    monkeypatch.setattr(mig, "migrate_trainer_kwargs", lambda old, cuda=None: {})
    readme = set(script(LESSON, "README.md").read_text().splitlines())
    table = mig.markdown_table().splitlines()
    assert len(table) == 2 + len(mig.ROWS), "one table row per migration row, under a header"
    missing = [ln for ln in table if ln not in readme]
    assert not missing, (
        "the README's migration table is not what `python lit_migration.py` prints (a row's "
        "note dropped, or its error cut at the wrong place?); these lines differ:\n"
        + "\n".join(missing))


def test_the_new_hooks_keep_what_the_old_ones_were_handed(mig):
    """The 2.x rows' modules: the epoch's losses kept as an attribute and averaged at its end,
    and every rank's outputs gathered in training_step (one device: a single batch)."""
    module = mig._fit(mig.NewEpochEnd(), max_steps=3)
    assert len(module.step_losses) == 3
    assert module.epoch_mean.item() == pytest.approx(
        sum(v.item() for v in module.step_losses) / 3), (
        "on_train_epoch_end's epoch_mean is not the mean of the epoch's step losses")
    module = mig._fit(mig.NewStepEnd(), max_steps=1)
    assert module.gathered_shape == (8, 10), (
        f"all_gather of one device's (8, 10) logits gave {module.gathered_shape}")
