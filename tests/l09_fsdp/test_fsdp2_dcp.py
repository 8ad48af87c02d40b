"""Lesson 09: FSDP2 as practitioners use it (09.17-09.20), sharded checkpoints (09.21-09.23).

Five launches of ranks serve every distributed test here: one (2 ranks) runs the FSDP2
checks, one (2 ranks) the uninterrupted run that saves at step 3 and exports, three resume
from its checkpoint at 1, 2 and 4 ranks. Each check runs one task's code between reference
parts (tests/l09_fsdp/rank_fns_dcp.py), so a test fails with its own task's message.

Tolerances. Losses are compared with a plain run (the whole model, the whole global batch,
one process) or with the uninterrupted run. At fp32 the math is the same; only the order of
the sums differs (the ranks' gradients are summed by the reduce-scatter, the batch is split
into slices), which moves a loss by about 1e-7 per step: LOSS_TOL = 2e-5 leaves a hundred
times that, and a real mistake (a step skipped, a batch split differently, a state not
restored) moves it by 1e-3 or more. bf16 parameters round every weight to 8 bits of
mantissa: BF16_TOL = 2e-2 on a loss of about 5.5.

Time limits only stop hangs: they leave room for a loaded machine. Nothing here measures speed.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from dpt.checkpoint import dcp_problem
from dpt.models import TinyTransformer
from dpt.ranks import run_distributed
from tests.helpers import checked_part, one_line_error, run_script
from tests.l09_fsdp import rank_fns_dcp as rank_fns
from tests.lessons import load, script

LESSON = "09_fsdp"
STEPS, SAVE_AT, CHECK_STEPS, INIT_SEED = 6, 3, 3, 3
LOSS_TOL, BF16_TOL = 2e-5, 2e-2
ROOT = ["embed.weight", "pos.weight", "norm.weight", "norm.bias", "head.weight", "head.bias"]


@pytest.fixture(scope="module")
def fp():
    return load(LESSON, "fsdp2_practice")


def plain_losses(fp, steps: int) -> list[float]:
    """The reference: the whole model in this process, on the whole global batch (given code
    only: the init, the batches, the loss, the optimizer)."""
    model = fp.init_full(TinyTransformer(**fp.CONFIG), 0)
    optimizer = fp.make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = fp.global_batch(step, 0)
        optimizer.zero_grad()
        loss = fp.loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def plain(fp):
    return plain_losses(fp, STEPS)


@pytest.fixture(scope="module")
def checks():
    """Every FSDP2 check of 09.17-09.20, on 2 ranks, rank 0's view."""
    return run_distributed(rank_fns.practice_checks, world_size=2, timeout=150,
                           kwargs={"steps": CHECK_STEPS, "init_seed": INIT_SEED})[0]


part = checked_part


def assert_losses(got, want, tol, what, why):
    gap = max(abs(a - b) for a, b in zip(got, want))
    assert len(got) == len(want) and gap <= tol, (
        f"{what}: losses {[round(v, 6) for v in got]}, expected "
        f"{[round(v, 6) for v in want]} (largest gap {gap:.2g} > {tol:g}): {why}")


# --- 09.17 fully_shard with a policy ------------------------------------------------------

@pytest.mark.task("09.17")
@pytest.mark.timeout(240)
def test_every_block_and_the_root_are_units(checks):
    shard = part(checks["units"], "fully_shard each block, then the root (a root sharded "
                 "first has already taken every parameter, its blocks' too)")
    for raf in (True, False):
        units = shard[f"raf={raf}"]["units"]
        missing = [name for name, is_unit in units.items() if not is_unit]
        assert not missing, (
            f"{', '.join(missing)} {'is not an FSDP unit' if len(missing) == 1 else 'are not FSDP units'} "
            f"(reshard_after_forward={raf}): fully_shard each block, then the root, whose unit "
            "holds the embeddings, the final norm and the head")
        assert shard[f"raf={raf}"]["types"] == ["DTensor"], (
            f"parameters of types {shard[f'raf={raf}']['types']} after sharding: every "
            "parameter must be a DTensor shard, each block's and the root's")


@pytest.mark.task("09.17")
@pytest.mark.timeout(240)
def test_reshard_after_forward_frees_the_blocks_and_keeps_the_root(checks):
    shard = part(checks["units"])
    held = shard["raf=True"]["held"]
    blocks_held = sorted({n.split(".")[1] for n in held if n.startswith("blocks.")})
    assert not blocks_held, (
        f"with reshard_after_forward=True, blocks {blocks_held} were still gathered after the "
        "forward: pass the flag to each block's fully_shard, so each frees its parameters "
        "once its forward is done")
    assert sorted(held) == sorted(ROOT), (
        f"after the forward the root's parameters held whole were {sorted(held)}, not "
        f"{sorted(ROOT)}: keep the root gathered (reshard_after_forward=False on the root): "
        "backward starts with the head and needs them at once")
    held = shard["raf=False"]["held"]
    assert len(held) == len(ROOT) + 12 * 4, (
        f"with reshard_after_forward=False only {len(held)} parameters were held whole after "
        "the forward, not all of them: the blocks must keep their gathered parameters until "
        "backward when the flag is False")


@pytest.mark.task("09.17")
@pytest.mark.timeout(240)
def test_bf16_policy_computes_in_bf16_and_reduces_in_fp32(checks, plain):
    r = part(checks["bf16"])["bf16"]
    compute = r["compute"]
    wrong = {k: v for k, v in compute.items() if v != "torch.bfloat16"}
    assert compute and not wrong, (
        f"with bf16=True these blocks computed with weights in {wrong or 'no dtype'}: give "
        "every block, and the root, a MixedPrecisionPolicy with param_dtype=torch.bfloat16"
        + (f" (training then failed: {r['error']})" if r["error"] else ""))
    assert r["error"] is None, f"bf16 training failed: {r['error']}"
    assert r["reduce"] == ["torch.float32"], (
        f"with bf16=True the gradients were reduce-scattered in {r['reduce']}: set "
        "reduce_dtype=torch.float32, so that summing the ranks' gradients does not round them "
        "to bf16's 8 bits")
    assert r["master"] == ["torch.float32"], (
        f"the sharded parameters are {r['master']}: the policy casts for compute only; the "
        "shards the optimizer updates stay fp32")
    assert_losses(r["losses"], plain[:CHECK_STEPS], BF16_TOL, "bf16 FSDP2",
                  "bf16 compute should stay close to the fp32 run")


@pytest.mark.task("09.17")
@pytest.mark.timeout(240)
def test_fp32_sharded_training_gives_the_plain_losses(checks, plain):
    shard = part(checks["fp32"])
    assert_losses(shard["losses"], plain[:CHECK_STEPS], LOSS_TOL, "fp32 FSDP2 on 2 ranks",
                  "at fp32 sharding must not change the math: no policy casts, every "
                  "parameter in exactly one unit")


# --- 09.18 explicit prefetch ------------------------------------------------------------

class StandIn:
    """A block that records what set_prefetch asks of it."""

    def __init__(self, i):
        self.i, self.forward, self.backward = i, [], []

    def set_modules_to_forward_prefetch(self, modules):
        self.forward = [m.i for m in modules]

    def set_modules_to_backward_prefetch(self, modules):
        self.backward = [m.i for m in modules]


@pytest.mark.task("09.18")
@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_prefetch_lists_look_ahead_in_the_order_blocks_run(fp, ahead):
    blocks = [StandIn(i) for i in range(5)]
    fp.set_prefetch(blocks, ahead=ahead)
    for i, b in enumerate(blocks):
        want_fwd = list(range(i + 1, min(5, i + 1 + ahead)))
        want_bwd = list(range(i - 1, max(-1, i - 1 - ahead), -1))
        assert b.forward == want_fwd, (
            f"ahead={ahead}: block {i} prefetches {b.forward} in forward, not {want_fwd}: in "
            "forward the blocks after it run next, nearest first")
        assert b.backward == want_bwd, (
            f"ahead={ahead}: block {i} prefetches {b.backward} in backward, not {want_bwd}: "
            "backward runs the blocks in reverse, so the next ones are those before it, "
            "nearest first")


@pytest.mark.task("09.18")
@pytest.mark.timeout(240)
def test_prefetch_starts_the_next_all_gathers_before_a_block_computes(checks):
    """All-gathers issued when block i starts computing: the root's, blocks 0..i, and the
    ``ahead`` blocks prefetched after i."""
    layers = 4
    for ahead in (0, 1, 2):
        r = part(checks["prefetch"][ahead])
        assert r["enabled"], "set_prefetch returned False on a torch that has explicit prefetch"
        want = [min(1 + (i + 1) + ahead, 1 + layers) for i in range(layers)]
        assert r["counts"] == want, (
            f"ahead={ahead}: all-gathers issued when each block started computing: "
            f"{r['counts']}, expected {want} (the root's, the block's own, then {ahead} "
            "prefetched): each block must name the next ones as its forward prefetch")


# --- 09.19 meta-device initialisation ----------------------------------------------------

@pytest.mark.task("09.19")
@pytest.mark.timeout(240)
def test_sharded_init_equals_the_seeded_init_of_the_whole_model(fp, checks):
    init = part(checks["init"])
    assert init["types"] == ["DTensor"] and init["devices"] == ["cpu"], (
        f"after materialize the parameters are {init['types']} on {init['devices']}: "
        "to_empty keeps each parameter a DTensor shard, on the rank's device")
    want = fp.init_full(TinyTransformer(**fp.CONFIG), INIT_SEED)
    for name, p in want.named_parameters():
        got = init["full"][name]
        if torch.equal(got, p.detach()):
            continue
        rows = p.shape[0]
        half = (rows + 1) // 2
        hint = ("rank 1 drew the first rows again: fill each shard from its own first row, "
                "shard_rows(param)[0]" if p.dim() > 1 and torch.equal(got[half:], p[:rows - half])
                else f"with seed {INIT_SEED}, each shard must hold its rows of init_full's values")
        pytest.fail(f"parameter {name} after materialize differs from the seeded init of the "
                    f"whole model (largest gap {(got - p).abs().max():.3g}): {hint}")


@pytest.mark.task("09.19")
@pytest.mark.timeout(240)
def test_materialize_allocates_only_this_ranks_shards(checks):
    init = part(checks["init"])
    full = sum(p.numel() * 4 for p in TinyTransformer().parameters())
    assert init["peak"] < 0.75 * full, (
        f"materialize held {init['peak'] / 1024:.0f} KiB at its peak on rank 0; the whole "
        f"model is {full / 1024:.0f} KiB and this rank's shards {init['local'] / 1024:.0f} "
        "KiB: allocate the shards only (to_empty) and fill them in place; never build or "
        "initialise the whole model on a rank")


# --- 09.20 slices of the global batch -------------------------------------------------------

@pytest.mark.task("09.20")
@pytest.mark.parametrize("world_size, size", [(1, 8), (2, 8), (4, 8), (3, 12), (2, 6)])
def test_rank_slices_split_the_global_batch(fp, world_size, size):
    """Batches of other sizes than the lesson's 8 too: a slice's length comes from the batch
    it is given."""
    x, y = torch.arange(size).view(size, 1), torch.arange(100, 100 + size).view(size, 1)
    pieces = [fp.rank_slice(x, y, r, world_size) for r in range(world_size)]
    for r, (px, py) in enumerate(pieces):
        assert len(px) == size // world_size, (
            f"rank {r} of {world_size} got {len(px)} of the {size} sequences, not "
            f"{size // world_size}: the ranks share the global batch equally (its length is "
            "len(inputs), whatever the batch size)")
        assert torch.equal(py - 100, px), (
            f"rank {r} of {world_size}: its targets are not those of its inputs")
    got = torch.cat([px for px, _ in pieces]).flatten().tolist()
    assert got == list(range(size)), (
        f"the slices of ranks 0..{world_size - 1}, in order, hold {got}, not the global batch "
        f"0..{size - 1}: each rank takes its own piece, by rank, so that any number of ranks "
        "trains on the same batch")


@pytest.mark.task("09.20")
@pytest.mark.timeout(240)
def test_training_on_slices_gives_the_plain_losses(checks, plain):
    r = part(checks["slice"])
    assert_losses(r["losses"], plain[:CHECK_STEPS], LOSS_TOL, "2 ranks training on slices",
                  "the 2 ranks together must see the global batch, each its own half")


# --- the whole recipe (given code around the tasks) ------------------------------------------

@pytest.mark.timeout(240)
def test_the_recipe_trains_like_the_plain_model_and_never_holds_all_of_it(checks, plain):
    r = part(checks["recipe"])
    assert_losses(r["losses"], plain[:CHECK_STEPS], LOSS_TOL, "build_sharded + train_steps",
                  "the recipe must train the plain model's math")
    assert_losses(r["bf16_losses"], plain[:CHECK_STEPS], BF16_TOL, "the recipe in bf16",
                  "bf16 compute should stay close to the fp32 run")
    full = sum(p.numel() * 4 for p in TinyTransformer().parameters())
    assert r["build_peak"] < 0.75 * full, (
        f"build_sharded held {r['build_peak'] / 1024:.0f} KiB at its peak, the whole model is "
        f"{full / 1024:.0f} KiB: build on the meta device")
    root = sum(p.numel() * 4 for n, p in TinyTransformer().named_parameters() if n in ROOT)
    assert r["held_after_forward"] == root, (
        f"{r['held_after_forward']} bytes held whole after the forward, not the root's {root}")


@pytest.mark.timeout(240)
def test_the_by_hand_fsdp_in_the_same_loop_gives_the_same_losses(checks, plain):
    """fsdp2_practice.compare's other rows: the lesson's own FSDP, trained by the same loop."""
    r = part(checks["by_hand"])
    assert_losses(r["losses"], plain[:CHECK_STEPS], LOSS_TOL, "the hand-written FSDP, fp32",
                  "it must train the plain model's math, as FSDP2 does")
    assert_losses(r["bf16_losses"], plain[:CHECK_STEPS], BF16_TOL,
                  "the hand-written FSDP, bf16", "bf16 compute should stay close to fp32")


# --- 09.21-09.23: DCP ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dcp")


@pytest.fixture(scope="module")
def saved(ckpt_dir):
    """The uninterrupted run on 2 ranks: the lesson's checkpoint (``lesson``), torch's
    (``reference``, which the resume tests load) and the lesson's export."""
    paths = {"lesson": ckpt_dir / "lesson", "reference": ckpt_dir / "reference",
             "export": ckpt_dir / "full.pt"}
    ranks = run_distributed(rank_fns.dcp_save_run, world_size=2, timeout=150, kwargs={
        "folder": str(paths["lesson"]), "reference": str(paths["reference"]),
        "export": str(paths["export"]), "steps": STEPS, "save_at": SAVE_AT})
    return {**ranks[0], "paths": paths, "ranks": ranks}


def broken_copies(reference, root):
    """Four ways a checkpoint is unusable, made from a good one."""
    out = {}
    out["partial"] = root / "partial"
    shutil.copytree(reference, out["partial"])
    (out["partial"] / ".metadata").unlink()
    out["truncated"] = root / "truncated"
    shutil.copytree(reference, out["truncated"])
    shard = sorted(out["truncated"].glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    out["missing shard"] = root / "missing"
    shutil.copytree(reference, out["missing shard"])
    sorted(out["missing shard"].glob("*.distcp"))[0].unlink()
    out["no folder"] = root / "never_saved"
    return out


def resume(saved, n: int, **kwargs) -> list[dict]:
    """Every rank's view of a resume from the reference checkpoint at ``n`` ranks."""
    return run_distributed(rank_fns.dcp_resume_run, world_size=n, timeout=150, kwargs={
        "folder": str(saved["paths"]["reference"]), "steps": STEPS, **kwargs})


@pytest.fixture(scope="module")
def resumed1(saved):
    """At 1 rank; then torch's own load of the lesson's checkpoint (09.21's read-back)."""
    return resume(saved, 1, lesson_saved=str(saved["paths"]["lesson"]))


@pytest.fixture(scope="module")
def resumed2(saved, ckpt_dir):
    """At 2 ranks; then the lesson's load of four broken copies."""
    broken = broken_copies(saved["paths"]["reference"], ckpt_dir / "broken")
    ranks = resume(saved, 2, broken=[str(p) for p in broken.values()])
    return {"ranks": ranks, "broken": broken}


@pytest.fixture(scope="module")
def resumed4(saved):
    return resume(saved, 4)


@pytest.mark.task("09.21")
@pytest.mark.timeout(300)
def test_save_writes_a_checkpoint_any_world_size_can_load(saved, resumed1):
    part(saved["save"])
    folder = saved["paths"]["lesson"]
    assert (folder / ".metadata").is_file(), (
        f"no {folder}/.metadata after save_checkpoint: save with "
        "torch.distributed.checkpoint.save (dcp.save) on every rank")
    files = sorted(p.name for p in folder.glob("*.distcp"))
    assert len(files) == 2, (
        f"the checkpoint holds {files}: with 2 ranks each rank writes its own shard file "
        "(a rank-0-only save of a gathered state is not a sharded checkpoint)")
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    assert "step" in keys, f"no 'step' in the checkpoint (keys: {sorted(keys)[:5]}...)"
    assert any(k.startswith("optim.state.blocks.0.qkv.weight") for k in keys), (
        "the checkpoint has no optimizer state by parameter name under 'optim' (keys like "
        f"'optim.state.blocks.0.qkv.weight.exp_avg'; found {sorted(keys)[:4]}...): save "
        "get_state_dict's optimizer state, which names each parameter, so that an optimizer "
        "on any number of ranks can find its own")
    back = part(resumed1[0]["read_back"])
    assert back["start"] == SAVE_AT, (
        f"the checkpoint's step is {back['start']}, not {SAVE_AT}: save the step it was taken at")
    for kind in ("params", "adam"):
        for name, want in saved["saved"][kind].items():
            assert torch.equal(back[kind][name], want), (
                f"{'weights' if kind == 'params' else 'Adam state'} of {name} read back from "
                "the lesson's checkpoint differ from those at the save: save the model's and "
                "the optimizer's state dicts as get_state_dict returns them")


@pytest.mark.task("09.22")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_resume_at_1_2_and_4_ranks_gives_the_uninterrupted_losses(request, saved, n):
    ranks = request.getfixturevalue(f"resumed{n}")
    r = part((ranks["ranks"] if n == 2 else ranks)[0]["resume"])
    assert r["start"] == SAVE_AT, (
        f"load_checkpoint returned step {r['start']}, not the saved {SAVE_AT}: return the "
        "step read from the checkpoint")
    loaded = r["loaded"]
    for name, want in saved["saved"]["params"].items():
        assert torch.equal(loaded["params"][name], want), (
            f"at {n} rank(s), the weights of {name} after load_checkpoint are not those saved: "
            "read the model's state dict too (the checkpoint's \"model\"), and give what "
            "dcp.load read to the model (set_state_dict)")
    for name, want in saved["saved"]["adam"].items():
        got = loaded["adam"].get(name)
        assert got is not None and torch.equal(got, want), (
            f"at {n} rank(s), Adam's state of {name} after load_checkpoint is not the saved "
            "one: load the optimizer's state too, or the first steps after resuming differ")
    assert_losses(r["losses"], saved["losses"][SAVE_AT:], LOSS_TOL,
                  f"resumed at {n} rank(s)", "a resume must continue the uninterrupted run")


@pytest.mark.task("09.23")
@pytest.mark.timeout(300)
def test_export_is_the_whole_model_for_a_plain_transformer(fp, saved):
    exported = part(saved["exported"])
    path = saved["paths"]["export"]
    assert exported["exists"], f"export_full wrote nothing at {path}"
    assert exported["types"] == ["Tensor"], (
        f"the exported file holds {exported['types']}: model.state_dict() of a sharded model "
        "holds each rank's DTensor shards; gather whole tensors (full_state_dict=True)")
    assert exported["devices"] == ["cpu"], (
        f"the exported tensors are on {exported['devices']}: offload them to the CPU, so "
        "that a machine without this GPU can load them")
    plain = TinyTransformer(**fp.CONFIG)
    want = {k: tuple(v.shape) for k, v in plain.state_dict().items()}
    assert exported["shapes"] == want, (
        "the exported tensors' shapes are not the whole model's: "
        f"{ {k: v for k, v in exported['shapes'].items() if want.get(k) != v} }")
    model = load(LESSON, "dcp_checkpoint").load_for_inference(path)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved["final"][name]), (
            f"{name} in the export differs from the trained model's weights")


# --- a broken checkpoint is one clear line (given code) --------------------------------------

@pytest.mark.timeout(300)
def test_a_broken_checkpoint_is_one_line_on_every_rank(resumed2):
    errors = [r["broken"] for r in resumed2["ranks"]]
    words = {"partial": "no .metadata", "truncated": "truncated",
             "missing shard": "is missing", "no folder": "does not exist"}
    for kind, folder in resumed2["broken"].items():
        for rank, errs in enumerate(errors):
            e = errs[str(folder)]
            assert e is not None, f"rank {rank} loaded the {kind} checkpoint without an error"
            assert e["type"] == "CheckpointError", (rank, kind, e)
            assert "\n" not in e["message"] and str(folder) in e["message"], e["message"]
            assert words[kind] in e["message"], (kind, e["message"])


def test_dcp_problem_is_none_for_a_whole_checkpoint(saved):
    assert dcp_problem(saved["paths"]["reference"]) is None


@pytest.mark.timeout(120)
def test_the_script_refuses_a_partial_checkpoint_in_one_line(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"half a save")
    proc = run_script(script(LESSON, "dcp_checkpoint.py"), "--resume", str(tmp_path),
                      timeout=100)
    line = one_line_error(proc)
    assert "partial" in line and str(tmp_path) in line, line


@pytest.mark.parametrize("gpus, labels", [
    (0, ["gloo (CPU)"] * 4),
    # 2 GPUs: saved on NCCL, resumed at 4 ranks sharing the GPUs, and each row says so
    (2, ["nccl, a GPU per rank"] * 3 + ["gloo, 4 rank(s) sharing 2 GPU(s)"]),
])
def test_resume_demo_says_where_each_runs_ranks_computed(monkeypatch, gpus, labels):
    import dpt.ranks

    dc = load(LESSON, "dcp_checkpoint")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.delenv("DPT_TEST_BACKEND", raising=False)
    monkeypatch.delenv("DPT_SHARE_GPU", raising=False)

    def fake_run(fn, world_size=2, **kw):  # the losses do not matter here, the rows' words do
        resumed = kw["kwargs"].get("resume") is not None
        return [{"rank": r, "start": 3 if resumed else 0,
                 "losses": [1.0, 0.9, 0.8] if resumed else [1.2, 1.1, 1.0, 1.0, 0.9, 0.8]}
                for r in range(world_size)]

    monkeypatch.setattr(dpt.ranks, "run_distributed", fake_run)
    rows = dc.resume_demo(world_sizes=(1, 2, 4), steps=6, save_at=3)
    assert [row.get("ranks") for row in rows] == labels, (
        "every row of the resume table must say where its ranks computed: with fewer GPUs "
        "than ranks they share the GPUs (gloo), and the table mixes that with NCCL runs")


# --- at 3 ranks, and the checkpoint's layout -------------------------------------------------
#
# 64 rows over 3 ranks are 22, 22 and 20 (fully_shard splits dim 0 as torch.chunk does): a
# formula for a shard's rows that holds at 1, 2 and 4 ranks can be wrong here. One launch at 3
# ranks checks materialize, the layout of a save, a load and who writes the export.

def chunks_of(shape, world_size) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of each rank's piece of a tensor of ``shape`` sharded on dim 0."""
    out, start = [], 0
    for rows in (len(c) for c in torch.arange(shape[0]).chunk(world_size)):
        out.append(((start, *[0] * (len(shape) - 1)), (rows, *shape[1:])))
        start += rows
    return out


def check_sharded_layout(folder, world_size: int) -> None:
    """Every parameter, and Adam's two moments of it, in the checkpoint at ``folder`` are
    stored as one piece per rank, each rank's own rows: read from DCP's metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    shapes = {n: tuple(p.shape) for n, p in TinyTransformer(**load(
        LESSON, "fsdp2_practice").CONFIG).named_parameters()}
    keys = {f"model.{n}": shape for n, shape in shapes.items()}
    keys.update({f"optim.state.{n}.{m}": shape for n, shape in shapes.items()
                 for m in ("exp_avg", "exp_avg_sq")})
    for key, shape in keys.items():
        entry = meta.get(key)
        assert isinstance(entry, TensorStorageMetadata), (
            f"{key} is not a tensor in the checkpoint at {world_size} ranks "
            f"({type(entry).__name__}): save get_state_dict's model and optimizer state")
        got = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
        want = chunks_of(shape, world_size)
        if got == [((0,) * len(shape), shape)]:
            pytest.fail(f"{key} is stored whole, in one piece, at {world_size} ranks: the "
                        "checkpoint holds gathered, unsharded tensors. Save the sharded "
                        "state dicts get_state_dict gives by default (no full_state_dict): "
                        "each rank writes its own shard, and nobody gathers the model",
                        pytrace=False)
        assert got == want, (
            f"{key} of shape {shape} is stored in pieces {got} (offsets, sizes) at "
            f"{world_size} ranks, not one per rank, {want}: each rank must save its own "
            "shard, as sharded")


@pytest.fixture(scope="module")
def three(saved, ckpt_dir):
    """Every rank's view of the 3-rank launch (it loads the 2-rank reference checkpoint)."""
    return run_distributed(rank_fns.three_rank_checks, world_size=3, timeout=200, kwargs={
        "folder": str(ckpt_dir / "lesson3"), "reference": str(saved["paths"]["reference"]),
        "export": str(ckpt_dir / "full3.pt"), "init_seed": INIT_SEED})


@pytest.mark.task("09.19")
@pytest.mark.timeout(300)
def test_sharded_init_at_3_ranks_with_uneven_shards(fp, three):
    init = part(three[0]["init"])
    want = fp.init_full(TinyTransformer(**fp.CONFIG), INIT_SEED)
    for name, p in want.named_parameters():
        got = init["full"][name]
        if torch.equal(got, p.detach()):
            continue
        starts = [start for (start, *_), _ in chunks_of(tuple(p.shape), 3)]
        bad = [r for r, start in enumerate(starts) if p.dim() > 1 and not torch.equal(
            got[start:start + 1], p[start:start + 1].detach())]
        pytest.fail(
            f"at 3 ranks, {name} (shape {tuple(p.shape)}) after materialize differs from the "
            f"seeded init of the whole model (largest gap {(got - p).abs().max():.3g}); the "
            f"shards start at rows {starts}" + (f", and rank(s) {bad} filled the wrong rows" if
                                               bad else "") + ": the rows split as torch.chunk "
            "splits them (ceil(rows / N) each, the last fewer), so rank r's first row is not "
            "r x its own length: take it from shard_rows(param)")


@pytest.mark.task("09.21")
@pytest.mark.timeout(300)
def test_the_checkpoint_holds_one_piece_per_rank_of_every_tensor(saved, three, ckpt_dir):
    """Read from DCP's metadata, at 2 ranks and at 3 (uneven shards): counting the files would
    not tell a sharded save from one of gathered, whole tensors."""
    part(saved["save"])
    check_sharded_layout(saved["paths"]["lesson"], 2)
    part(three[0]["save"])
    check_sharded_layout(ckpt_dir / "lesson3", 3)


@pytest.mark.task("09.22")
@pytest.mark.timeout(300)
def test_resume_at_3_ranks_loads_the_saved_state_into_uneven_shards(saved, three):
    r = part(three[0]["resume"])
    assert r["start"] == SAVE_AT, (
        f"load_checkpoint returned step {r['start']} at 3 ranks, not the saved {SAVE_AT}")
    for kind in ("params", "adam"):
        for name, want in saved["saved"][kind].items():
            got = r["loaded"][kind].get(name)
            assert got is not None and torch.equal(got, want), (
                f"at 3 ranks (shards of 22, 22 and 20 rows), "
                f"{'the weights' if kind == 'params' else 'Adam state'} of {name} after "
                "load_checkpoint are not those saved at 2 ranks: let DCP read each rank's "
                "rows into state dicts shaped like this run's shards (get_state_dict), then "
                "set_state_dict")


@pytest.mark.task("09.23")
@pytest.mark.timeout(300)
def test_the_export_is_written_by_rank_0_alone(fp, three):
    """Counted with a spy on torch.save in every rank: a file meant to be written once must
    not be written by every rank (N writers race to the same path)."""
    for rank, r in enumerate(three):
        export = r["export"]
        if export["error"]:
            pytest.fail(f"export_full failed at 3 ranks on rank {rank}: {export['error']}\n\n"
                        f"{export['trace']}", pytrace=False)
        if rank == 0:
            assert export["writes"], (
                "rank 0 wrote nothing in export_full at 3 ranks: rank 0 writes the file")
        else:
            assert not export["writes"], (
                f"rank {rank} also wrote in export_full ({len(export['writes'])} torch.save): "
                "every rank takes part in gathering the whole tensors, but one rank, rank 0, "
                "writes the file (if get_rank() == 0)")
    want = {k: tuple(v.shape) for k, v in TinyTransformer(**fp.CONFIG).state_dict().items()}
    assert three[0]["export"].get("shapes") == want, (
        "the file exported at 3 ranks does not hold the whole model's tensors in their shapes")
