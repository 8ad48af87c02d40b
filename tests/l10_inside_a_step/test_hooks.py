"""Lesson 10: DDP communication hooks (tasks 10.8-10.10).

Everything runs on 2 gloo ranks on the CPU (the suite's backend on every machine); what only
an odd number of ranks shows (where the hook divides, the bytes counted) is tested at 3 ranks
in test_at_three_ranks.py. Results are compared bit for bit with torch's own hooks or with
references computed here from the ranks' inputs and the model's shapes; bytes are counted,
never timed. Time limits only stop hangs.
"""

from __future__ import annotations

import pytest
import torch

from dpt.models import MLP
from dpt.ranks import run_distributed
from tests.helpers import NO_GPU_ENV
from tests.l10_inside_a_step import rank_fns_hooks as rf
from tests.lessons import load

LESSON = "10_inside_a_step"
N = 2
TIMEOUT = 60


def ranks(fn, *args, **kwargs):
    """The CPU ranks see no GPU: torch's PowerSGD hook fails on CPU tensors where CUDA is
    available (tests.helpers.NO_GPU_ENV)."""
    return run_distributed(fn, world_size=N, args=args, kwargs=kwargs, timeout=TIMEOUT,
                           echo=False, env=NO_GPU_ENV)


def mlp_sizes():
    return [p.numel() for p in MLP().parameters()]


def powersgd_bytes(rank: int) -> int:
    """fp32 bytes of PowerSGD on the MLP: P (n x r) and Q (m x r) per weight matrix worth
    compressing, biases whole."""
    elements = 0
    for p in MLP().parameters():
        if p.dim() == 1:
            elements += p.numel()
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        elements += r * (n + m) if 2 * r * (n + m) < n * m else n * m
    return 4 * elements


def bf16_mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    """What a bf16 all-reduce of pre-divided shares gives: each rank's tensor rounded to bf16
    and divided by N in bf16, the shares summed in bf16 (two ranks: one rounding)."""
    shares = [t.to(torch.bfloat16).div_(len(tensors)) for t in tensors]
    total = shares[0]
    for s in shares[1:]:
        total = total + s
    return total.float()


def near(value: torch.Tensor, target: torch.Tensor, scale: torch.Tensor) -> bool:
    """``value`` is ``target`` to bf16 precision, relative to the size of the summands
    (``scale``), not of the result: opposite gradients cancel in the sum."""
    return bool(((value - target).abs() <= 2**-6 * scale + 1e-30).all())


# --- 10.8 a bf16 compression hook by hand ------------------------------------------------------

@pytest.mark.task("10.8")
@pytest.mark.timeout(90)
def test_hand_hook_returns_the_averaged_bucket_in_its_own_buffer():
    mine = ranks(rf.hook_on_a_bucket, "by_hand")
    theirs = ranks(rf.hook_on_a_bucket, "torch")
    inputs = [rf.bucket_values(r) for r in range(N)]
    want = bf16_mean(inputs)
    fp32_mean = sum(inputs) / N
    scale = sum(t.abs() for t in inputs) / N
    for r, (got, ref) in enumerate(zip(mine, theirs)):
        assert got["is_future"], (
            "bf16_hook_by_hand must return a torch.futures.Future (the one .then(...) gives), "
            "not a tensor: DDP waits on it")
        assert got["calls"], (
            "the hook never called dist.all_reduce: call it through the module "
            "(dist.all_reduce, async_op=True), as torch's hooks do")
        sent = got["calls"][0]
        assert sent["dtype"] == "torch.bfloat16", (
            f"the hook all-reduced a {sent['dtype']} tensor: send the bf16 copy of the bucket "
            "(half the bytes), not the fp32 buffer")
        assert all(c["async_op"] for c in got["calls"]), (
            "the all-reduce blocks (async_op=False, or .wait() inside the hook): start it with "
            "async_op=True and return its future chained with .then(...), so DDP can go on "
            "with backward while it runs")
        assert got["dtype"] == "torch.float32" and got["shape"] == tuple(inputs[0].shape), (
            f"the Future holds a {got['dtype']} tensor of shape {got['shape']}: it must hold "
            "the result decompressed into the bucket's fp32 buffer, not the bf16 tensor sent")
        value = got["value"]
        if not near(value, fp32_mean, scale):
            if near(value, N * fp32_mean, N * scale):
                pytest.fail(f"rank {r}: the Future holds the sum over ranks, not the mean: "
                            "missing divide by world size")
            pytest.fail(f"rank {r}: the result is not the mean of the ranks' buckets, even to "
                        f"bf16 precision (largest error {(value - fp32_mean).abs().max():.3g})")
        assert torch.equal(value, ref["value"]), (
            f"rank {r}: close to the mean but not bit for bit torch's bf16_compress_hook "
            f"({(value != ref['value']).sum()} elements differ): cast the buffer to bf16 first, "
            "then divide it by the world size in bf16, then all-reduce")
        assert torch.equal(value, want), f"rank {r}: not the bf16 mean computed here"
        assert got["is_the_bucket"], (
            "the Future's tensor is a new tensor: copy the result into bucket.buffer() and "
            "return that buffer (as torch's hooks do), no extra fp32 copy of the bucket")
        assert torch.equal(got["buffer_after"], want), (
            "bucket.buffer() does not hold the result after the Future is done")


@pytest.mark.task("10.8")
@pytest.mark.timeout(90)
def test_first_ddp_step_with_the_hand_hook_gives_bf16_averaged_gradients():
    results = ranks(rf.train_steps, "bf16_by_hand", steps=1)
    local = [res["local_grads"] for res in results]
    for r, res in enumerate(results):
        for i, (got, *own) in enumerate(zip(res["grads"], *local)):
            want = bf16_mean(list(own))
            scale = sum(t.abs() for t in own) / N
            if not near(got, want, scale) and near(got, N * want, N * scale):
                pytest.fail("DDP's gradients are the sum over ranks: missing divide by "
                            "world size")
            assert torch.equal(got, want), (
                f"rank {r}, parameter {i}: DDP's gradient after the hand hook is not the bf16 "
                "mean of the ranks' gradients (each rounded to bf16, divided by the world size, "
                "summed)")


@pytest.mark.task("10.8")
@pytest.mark.timeout(120)
def test_ddp_trains_with_the_hand_hook_exactly_as_with_torchs_bf16_hook():
    mine = ranks(rf.train_steps, "bf16_by_hand", steps=3)
    theirs = ranks(rf.train_steps, "bf16", steps=3)
    fp32 = ranks(rf.train_steps, "allreduce", steps=3)
    for r in range(N):
        for i, (a, b, c) in enumerate(zip(mine[r]["params"], theirs[r]["params"],
                                          fp32[r]["params"])):
            assert torch.allclose(a, c, rtol=0, atol=1e-2), (
                f"rank {r}, parameter {i}: after 3 steps far from fp32 DDP: the averaged "
                "gradients are wrong (missing divide by world size?)")
            assert torch.equal(a, b), (
                f"rank {r}, parameter {i}: after 3 steps the hand hook and torch's "
                "bf16_compress_hook give different weights")
        assert mine[r]["bytes"] == [2 * sum(mlp_sizes())] * 3, (
            f"the hand hook all-reduced {mine[r]['bytes']} bytes per step; bf16 is 2 bytes "
            f"for each of the {sum(mlp_sizes())} gradients")


# --- 10.9 attaching a hook by name ---------------------------------------------------------------

def test_attach_hook_rejects_unknown_names_and_options_in_one_line():
    ch = load(LESSON, "comm_hooks")
    for name, opts in (("int8", {}), ("fp16", {"rank": 2}), ("powersgd", {"rnak": 2})):
        with pytest.raises(ValueError) as info:
            ch.attach_hook(None, name, **opts)
        assert "\n" not in str(info.value)


@pytest.mark.task("10.9")
@pytest.mark.timeout(120)
def test_attach_hook_registers_the_named_hook():
    ch = load(LESSON, "comm_hooks")
    names = ["none", "fp16", "bf16_by_hand"] + (["bf16"] if ch.torch_bf16_registers() else [])
    want = {"fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook",
            "bf16_by_hand": "bf16_hook_by_hand"}
    half = 2 * sum(mlp_sizes())
    for res in ranks(rf.attach_each, names):
        assert res["none"]["registered"] == [], (
            f"attach_hook('none') registered {res['none']['registered']}: 'none' is DDP's own "
            "all-reduce, register nothing")
        for name in names[1:]:
            got = res[name]
            assert got["registered"] == [want[name]], (
                f"attach_hook({name!r}) registered {got['registered'] or 'nothing'}; want "
                f"{want[name]}")
            if name == "bf16_by_hand":
                continue  # no steps: they would grade task 10.8
            assert got["bytes"] == [half, half], (
                f"under {name!r} a step all-reduced {got['bytes']} bytes; want {half}")


@pytest.mark.task("10.9")
@pytest.mark.timeout(120)
def test_attach_hook_builds_powersgd_state_from_the_options():
    steps, start, rank = 8, 3, 2
    res = ranks(rf.train_steps, "powersgd", steps=steps, attach="lesson",
                opts={"rank": rank, "start_iter": start, "error_feedback": False}, lr=0.05)
    default = ranks(rf.train_steps, "powersgd", steps=1, attach="lesson")
    ch = load(LESSON, "comm_hooks")
    for r in range(N):
        got = res[r]
        assert got["registered"] == ["powerSGD_hook"], (
            f"attach_hook('powersgd') registered {got['registered'] or 'nothing'}; want "
            "torch's powerSGD_hook with a PowerSGDState")
        assert got["powersgd"] == {"rank": rank, "start_iter": start, "error_feedback": False}, (
            f"PowerSGDState {got['powersgd']}: build it from the options (rank -> "
            "matrix_approximation_rank, start_iter -> start_powerSGD_iter, error_feedback -> "
            "use_error_feedback)")
        assert default[r]["powersgd"] == ch.POWERSGD_DEFAULTS, (
            f"without options the state is {default[r]['powersgd']}; want POWERSGD_DEFAULTS "
            f"{ch.POWERSGD_DEFAULTS}")
        full, small = 4 * sum(mlp_sizes()), powersgd_bytes(rank)
        assert got["bytes"] == [full] * start + [small] * (steps - start), (
            f"bytes per step {got['bytes']}: want {full} (plain fp32 all-reduce) for the first "
            f"{start} steps, then {small} (P and Q of rank {rank}, biases whole)")
        # the same four batches twice (steps 0-3, then 4-7): the second pass is lower
        first, second = sum(got["losses"][:4]) / 4, sum(got["losses"][4:8]) / 4
        assert second < first, (
            f"PowerSGD does not train: mean loss over the same 4 batches {first:.3f} -> "
            f"{second:.3f}")
    assert res[0]["params"][0].equal(res[1]["params"][0]), "the ranks' weights diverged"


# --- 10.10 counting the bytes ------------------------------------------------------------------------

@pytest.mark.task("10.10")
@pytest.mark.timeout(90)
def test_counter_counts_the_bytes_of_every_all_reduce_and_puts_it_back():
    for res in ranks(rf.counter_on_known_calls):
        assert res["inside_is_wrapped"], (
            "inside the with block dist.all_reduce is still the real one: replace the "
            "attribute on the torch.distributed module")
        assert res["sums"] == [N, N, N], (
            f"the all-reduces under the counter gave {res['sums']}, not sums over {N} ranks: "
            "call the real all_reduce with every argument")
        assert res["async_returns_work"], (
            "with async_op=True the wrapper must return what the real all_reduce returns "
            "(the work handle hooks call .get_future() on)")
        assert res["calls"] == 3, f"{res['calls']} calls counted; 3 were made"
        want = 100 * 4 + 50 * 2 + 3 * 8
        if res["bytes"] == 153:
            pytest.fail("the counter adds elements, not bytes: multiply by element_size()")
        assert res["bytes"] == want, (
            f"counted {res['bytes']} bytes for 100 fp32 + 50 bf16 + 3 int64 elements; "
            f"want {want}")
        assert res["restored"], "after the with block dist.all_reduce is still the wrapper"
        assert res["restored_after_error"], (
            "an exception inside the with block leaves the wrapper in place: restore the real "
            "all_reduce in __exit__, which runs on errors too")


@pytest.mark.task("10.10")
@pytest.mark.timeout(120)
def test_counter_sees_what_each_hook_sends_per_step():
    configs = [("allreduce", None), ("fp16", None), ("bf16", None),
               ("powersgd", {"rank": 1, "start_iter": 2}),
               ("powersgd", {"rank": 4, "start_iter": 2})]
    full = 4 * sum(mlp_sizes())
    want = [[full] * 4, [full // 2] * 4, [full // 2] * 4,
            [full, full, powersgd_bytes(1), powersgd_bytes(1)],
            [full, full, powersgd_bytes(4), powersgd_bytes(4)]]
    for r, res in enumerate(ranks(rf.counted_steps, configs)):
        for (hook, opts), seen, expected in zip(configs, res, want):
            got = [b for b, _ in seen]
            assert got == expected, (
                f"rank {r}, {hook} {opts or ''}: counted {got} bytes per step, want {expected}"
                + (" (PowerSGD's P and Q are all-reduced from callbacks, in other threads: "
                   "count in the wrapper itself, not in thread-local state)"
                   if hook == "powersgd" else ""))
        psgd_calls = [c for _, c in res[3]]
        assert psgd_calls[2:] == [3, 3], (
            f"PowerSGD made {psgd_calls} all-reduces per step; after its start: 3 (biases, P, Q)")


# --- given: the prediction the table prints beside the measurement ---------------------------------

def test_the_step_time_interval_over_seeds_never_goes_below_zero():
    """`comm_hooks.py --seeds 2` printed `5.192 [-27.843, 38.226]` ms: a plain t-interval
    over two widely spread times. The table's step times are positive, always."""
    ch = load(LESSON, "comm_hooks")

    def run(seed, step_s):
        return [{"steps": 10, "bytes_per_step": 1000, "predicted_bytes": 1000,
                 "step_s": step_s * (1 + 0.01 * rank), "accuracy": 0.8 + 0.01 * seed,
                 "test_loss": 0.5} for rank in range(2)]

    rows = ch.summarize({"none": [run(0, 0.0026), run(1, 0.0078)]})
    step = rows[0]["step_ms"]
    assert 0 < step["lo"] < min(step["values"]) <= max(step["values"]) < step["hi"], step
    cell = ch.format_rows(rows).splitlines()[1]
    assert "-" not in cell, f"a negative time in the table: {cell}"


def test_predicted_bytes_matches_the_model_shapes():
    ch = load(LESSON, "comm_hooks")
    model = MLP()
    full = 4 * sum(mlp_sizes())
    assert ch.predicted_bytes(model, "none") == full
    assert ch.predicted_bytes(model, "bf16") == ch.predicted_bytes(model, "fp16") == full // 2
    assert ch.predicted_bytes(model, "powersgd", rank=4) == powersgd_bytes(4)
    assert ch.predicted_bytes(model, "powersgd", compressed=False) == full
