"""Lesson 10 at three ranks: the mistakes two ranks cannot see (tasks 10.6, 10.8, 10.10, 10.12,
10.13).

At 2 ranks dividing by the world size is a power of two, exact in bf16 as in fp32: a bf16 hook
that divides by 2 hard-coded, after the sum, or in fp32 before the cast gives torch's bits, and
so does a bucket hook that averages by 2. The bytes a ring all-reduce puts on each rank's link,
2 (N - 1) / N of the payload, are the payload. The hang clinic's evaluation set gives rank 0
the most samples at 2 ranks and at 3, so "pad to rank 0's length" works there, and its float32
predictions hide a padding that turns class ids into floats. Here 3 gloo ranks (on the CPU, on
every machine), chosen lengths and int64 values tell them apart; and the fix of the rank-0
case is run with every rank's output captured: the mean is printed once, by rank 0.

Three runs: one for the hooks and the bucket recorder (each part comes back on its own, so a
task is graded on its own), one for each hang-clinic fix, whose mistakes can hang or crash a
run. Results are compared bit for bit with torch's own hooks, or with references computed here
from the ranks' inputs. Time limits only stop hangs.
"""

from __future__ import annotations

import pytest
import torch

from dpt.ranks import RankFailure, run_distributed
from tests.helpers import checked_part
from tests.l10_inside_a_step import rank_fns_hooks as rf
from tests.l10_inside_a_step import rank_fns_three as rf3
from tests.lessons import load

LESSON = "10_inside_a_step"
N = 3  # odd: dividing by it rounds, in bf16 and in fp32
TIMEOUT = 120
HANG_TIMEOUT = 60  # a hang-clinic fix that still hangs: gloo's own timeout is 30 min
# (the clinic runs on gloo with CPU tensors on every machine, and so do its runs here)
REL = 1e-5  # the bucket recorder's average against DDP's: fp32 sums in another order


def launch(fn, timeout=TIMEOUT, backend="auto"):
    try:
        return run_distributed(fn, world_size=N, timeout=timeout, backend=backend, echo=False)
    except RankFailure as exc:
        pytest.fail(f"a rank of the {N}-rank run failed:\n{exc}", pytrace=False)


@pytest.fixture(scope="module")
def hooks_run():
    return launch(rf3.hook_checks)


part = checked_part


def near(value, target, scale) -> bool:
    """``value`` is ``target`` to bf16 precision, relative to the summands' size."""
    return bool(((value - target).abs() <= 2**-6 * scale + 1e-30).all())


def close(value, target, rel=REL) -> bool:
    return bool(((value - target).abs() <= rel * target.abs().max() + 1e-12).all())


# --- 10.8 the bf16 hook by hand ---------------------------------------------------------------

def divide_diagnosis(value, inputs) -> str | None:
    """What a result far from the mean is, named (sum, or shares divided by 2), or None."""
    fp32_mean = sum(inputs) / N
    scale = sum(t.abs() for t in inputs) / N
    if near(value, fp32_mean, scale):
        return None
    if near(value, N * fp32_mean, N * scale):
        return "the sum over ranks, not the mean: missing divide by world size"
    if near(value, N / 2 * fp32_mean, N / 2 * scale):
        return (f"{N / 2:g} times the mean: it divides by 2, not by the world size "
                "(dist.get_world_size(group)), which only 2 ranks hide")
    return (f"not the mean of the ranks' buckets, even to bf16 precision (largest error "
            f"{(value - fp32_mean).abs().max():.3g})")


@pytest.mark.task("10.8")
@pytest.mark.timeout(TIMEOUT + 30)
def test_hand_hook_gives_torchs_bits_at_three_ranks(hooks_run):
    inputs = [rf.bucket_values(r) for r in range(N)]
    for r, res in enumerate(hooks_run):
        got, ref = part(res["bucket_mine"]), res["bucket_torch"]
        value = got["value"]
        wrong = divide_diagnosis(value, inputs)
        if wrong:
            pytest.fail(f"rank {r} of {N}: the hook's result is {wrong}", pytrace=False)
        assert torch.equal(value, ref["value"]), (
            f"rank {r} of {N}: close to the mean but not bit for bit torch's "
            f"bf16_compress_hook ({(value != ref['value']).sum()} of {value.numel()} elements "
            "differ). At 3 ranks dividing by 3 rounds, so where and in which precision you "
            "divide shows (at 2 ranks it cannot): cast the buffer to bf16 first, divide it by "
            "the world size in bf16, then all-reduce; not in fp32 before the cast, nor after "
            "the sum")
        assert torch.equal(got["buffer_after"], ref["value"]), (
            f"rank {r} of {N}: bucket.buffer() does not hold the result after the Future is done")


@pytest.mark.task("10.8")
@pytest.mark.timeout(TIMEOUT + 30)
def test_ddp_gradients_with_the_hand_hook_are_torchs_at_three_ranks(hooks_run):
    local = [part(res["ddp_mine"])["local"] for res in hooks_run]
    for r, res in enumerate(hooks_run):
        mine, theirs = part(res["ddp_mine"])["grads"], res["ddp_torch"]["grads"]
        for i, (got, want) in enumerate(zip(mine, theirs)):
            wrong = divide_diagnosis(got, [grads[i] for grads in local])
            if wrong:
                pytest.fail(f"rank {r} of {N}, parameter {i}: DDP's gradient after the hand "
                            f"hook is {wrong}", pytrace=False)
            assert torch.equal(got, want), (
                f"rank {r} of {N}, parameter {i}: DDP's gradient after the hand hook differs "
                f"from torch's bf16_compress_hook in {(got != want).sum()} elements: cast to "
                "bf16, divide by the world size in bf16, then all-reduce")


# --- 10.10 the counter ---------------------------------------------------------------------------

@pytest.mark.task("10.10")
@pytest.mark.timeout(TIMEOUT + 30)
def test_counter_counts_the_payload_at_three_ranks(hooks_run):
    sizes = (100 * 4, 50 * 2, 3 * 8)  # the calls of counter_on_known_calls, in bytes
    want = sum(sizes)
    on_the_link = {sum(2 * (N - 1) * b // N for b in sizes),
                   int(sum(2 * (N - 1) / N * b for b in sizes))}
    for r, res in enumerate(hooks_run):
        got = part(res["counter"])
        assert got["sums"] == [N] * 3, (
            f"rank {r}: the all-reduces under the counter gave {got['sums']}, not sums over "
            f"{N} ranks: call the real all_reduce with every argument")
        if got["bytes"] in on_the_link or got["bytes"] == pytest.approx(2 * (N - 1) / N * want):
            pytest.fail(f"rank {r}: counted {got['bytes']} bytes, the bytes a ring all-reduce "
                        f"puts on each link (2 (N - 1) / N of the {want} sent; the same at 2 "
                        "ranks only): count the payload, each tensor's elements times their "
                        "size, whatever the world size", pytrace=False)
        assert got["bytes"] == want, (
            f"rank {r} of {N}: counted {got['bytes']} bytes for 100 fp32 + 50 bf16 + 3 int64 "
            f"elements; want {want}, whatever the number of ranks")
        assert got["calls"] == 3, f"rank {r}: {got['calls']} calls counted; 3 were made"


# --- 10.6 the bucket recorder's average -----------------------------------------------------------

@pytest.mark.task("10.6")
@pytest.mark.timeout(TIMEOUT + 30)
def test_bucket_recorder_averages_over_three_ranks(hooks_run):
    local = [part(res["bucket_recorder"])["local"] for res in hooks_run]
    for r, res in enumerate(hooks_run):
        got = part(res["bucket_recorder"])
        for i, (mine, want) in enumerate(zip(got["hooked"], got["plain"])):
            if close(mine, want):
                continue
            mean = sum(grads[i] for grads in local) / N
            if close(mine, N / 2 * mean):
                pytest.fail(f"rank {r} of {N}, parameter {i}: the gradients after the "
                            f"bucket hook are {N / 2:g} times DDP's: it divides by 2, not by "
                            "the world size (return allreduce_hook(state, bucket), which "
                            "divides by the group's size)", pytrace=False)
            if close(mine, local[r][i]):
                pytest.fail(f"rank {r} of {N}, parameter {i}: the gradients after the "
                            "bucket hook are this rank's own: the hook must still average "
                            "the bucket over the ranks", pytrace=False)
            pytest.fail(f"rank {r} of {N}, parameter {i}: the gradients after the bucket hook "
                        f"are not DDP's average over {N} ranks (largest gap "
                        f"{(mine - want).abs().max():.3g})", pytrace=False)


# --- 10.13 gathering predictions of any length and dtype --------------------------------------------

@pytest.mark.task("10.13")
@pytest.mark.timeout(HANG_TIMEOUT + 30)
def test_gather_predictions_whatever_rank_is_longest_and_whatever_dtype():
    results = launch(rf3.gather_checks, HANG_TIMEOUT, "gloo")
    lengths = rf3.GATHER_LENGTHS
    for dtype in rf3.GATHER_DTYPES:
        want = torch.cat([rf3.gather_values(r, dtype) for r in range(N)])
        for r, res in enumerate(results):
            got = part(res[str(dtype)])
            assert got.dtype == dtype, (
                f"rank {r}: gathering {dtype} predictions gave {got.dtype}: pad with the "
                "predictions' own dtype (F.pad, or torch.zeros(..., dtype=preds.dtype)); a "
                "float32 buffer turns class ids into floats")
            assert torch.equal(got, want), (
                f"rank {r}, ranks holding {list(lengths)} {dtype} predictions: gathered "
                f"{got.tolist()}, not {want.tolist()}: pad to the longest of every rank's "
                "length (max of the lengths gathered, here rank 1's, not rank 0's), and cut "
                "each rank's part at its own length")


# --- 10.12 the mean is printed once ---------------------------------------------------------------

@pytest.mark.task("10.12")
@pytest.mark.timeout(HANG_TIMEOUT + 30)
def test_rank0_fix_prints_the_mean_once_on_rank_0():
    results = launch(rf3.rank0_prints, HANG_TIMEOUT, "gloo")
    hc = load(LESSON, "hang_clinic")
    mean = torch.cat([hc.epoch_losses(r) for r in range(N)]).mean().item()
    for res in results:
        part(res["result"])
    lines = {r: [ln for ln in res["printed"].splitlines() if ln.strip()]
             for r, res in enumerate(results)}
    others = {r: text for r, text in lines.items() if r != 0 and text}
    assert not others, (
        f"ranks {sorted(others)} of {N} printed {others}: the log line is written once, by "
        "rank 0 (every rank computes the mean, only rank 0 prints it)")
    assert len(lines[0]) == 1 and f"{mean:.4f}" in lines[0][0], (
        f"rank 0 printed {lines[0]}: one line with the mean over every rank's losses, "
        f"{mean:.4f}")

