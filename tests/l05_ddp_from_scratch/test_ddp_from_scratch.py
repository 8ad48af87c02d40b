"""Lesson 05: collectives, a ring all-reduce, and three hand-written DDPs against the truth.

The truth is a single process trained on the whole global batch, and torch's own DDP trained
the same way. Ranks start from *different* weights and buffers (seeded by rank), so a wrapper
that skips the initial broadcast cannot pass. Graded tests replace every other task of the
variant with a reference part (see rank_fns.py); the ungraded ones at the end run the lesson
code as it is. A mismatch is explained from the first step's gradients: twice the truth is a
missing divide by the world size, this rank's own gradients a missing wait().
"""

from __future__ import annotations

import contextlib
import signal
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpt.dist import group_of_one
from dpt.ranks import RankFailure, run_distributed
from tests.helpers import one_line_error, run_script
from tests.lessons import load, script

from . import rank_fns as rf

LESSON = "05_ddp_from_scratch"
STEPS = 3
WORLD = 2
TINY_MB = 1e-9        # smaller than any parameter: one parameter per bucket
HUGE_MB = 1000.0      # larger than the model: one bucket
PARTIAL_MB = 600 / 2**20  # ToyNet in float64: several buckets, the last one not full


def _close(a, b) -> bool:
    return a.keys() == b.keys() and all(
        torch.allclose(a[k], b[k], rtol=1e-9, atol=1e-12) for k in a)


def _scaled(grads, factor):
    return {k: v * factor for k, v in grads.items()}


def _wrong_start(out: dict, model_name: str, rank: int) -> str | None:
    start = rf._cpu_state(rf.build(model_name, seed=0))
    off = [k for k, v in start.items() if not torch.equal(out["init_state"][k], v)]
    if off:
        return (f"rank {rank} did not start from rank 0's weights and buffers ({off}): "
                f"missing broadcast of the initial parameters and buffers?")
    return None


def _wrong_gradients(out: dict, ref: dict, rank: int) -> str | None:
    """Name the classic bug behind wrong gradients at step(), from the first step's."""
    got = out.get("first_grads")
    if got is None or _close(got, ref):
        return None
    extra = sorted(got.keys() - ref.keys())
    if extra:
        return (f"rank {rank}: parameters that need no gradient have one ({extra}): frozen "
                f"parameters must be neither reduced nor given a gradient")
    if _close(got, _scaled(ref, WORLD)):
        return (f"rank {rank}'s gradients at step() are {WORLD}.0x (world size) the single "
                f"process's: missing divide by world size (or a divide done before wait(), "
                f"which the arriving sum then overwrites)?")
    if _close(got, _scaled(ref, 1 / WORLD)):
        return f"rank {rank}'s gradients are 1/{WORLD} of the truth: divided twice?"
    local = out["local_first_grads"]
    if _close(got, local) or _close(got, _scaled(local, 1 / WORLD)):
        return (f"rank {rank}'s gradients at step() are its own, unreduced: a missing wait() "
                f"(the sum had not arrived), or the reduced values never reached .grad?")
    keys = [k for k in ref if k not in got or not torch.allclose(got[k], ref[k])]
    return f"rank {rank}'s gradients at step() differ from the single process's in {keys}"


def _check_against_truth(results, model_name="toy"):
    truth = rf.train_single(model_name, STEPS)
    for rank, out in enumerate(results):  # a wrong start explains everything after it
        cause = _wrong_start(out, model_name, rank)
        assert cause is None, cause
    for rank, out in enumerate(results):
        cause = _wrong_gradients(out, truth["first_grads"], rank)
        assert cause is None, cause
    for rank, out in enumerate(results):
        # Under the slow network a kept handle delivers the same sum again, so the numbers
        # can come out right; on a real network it divides a finished gradient twice.
        assert not any(out.get("leftover_after_sync", ())), (
            f"rank {rank}: after finish_gradient_synchronization() returned, self.pending (or "
            f"self.ready) still held this step's work: clear them, or the next step waits on "
            f"and divides these gradients again")
    for rank, out in enumerate(results):
        assert out["state"].keys() == truth["state"].keys()
        for key, value in truth["state"].items():
            torch.testing.assert_close(out["state"][key], value, rtol=1e-9, atol=1e-10,
                                       msg=lambda m, k=key, r=rank: f"rank {r}, {k}: {m}")
            if "torch_state" in out:
                torch.testing.assert_close(out["state"][key], out["torch_state"][key],
                                           rtol=1e-9, atol=1e-10,
                                           msg=lambda m, k=key, r=rank: f"vs torch DDP, rank {r}, {k}: {m}")


def _train(variant, task, **kw):
    return run_distributed(rf.train_rank, world_size=WORLD, args=(variant,),
                           kwargs=dict(task=task, **kw), timeout=60)


def _no_collectives_in_no_sync(results, what):
    for rank, out in enumerate(results):
        n = out["collectives_in_no_sync"]
        assert n == 0, (f"rank {rank} issued {n} collective(s) inside no_sync(): {what} must "
                        f"not communicate there (the numbers can still come out right, since "
                        f"summing twice and dividing twice averages the same gradients)")


# --------------------------------------------------------------------------- collectives
def test_each_collective_returns_what_it_must():
    results = run_distributed(rf.collectives_rank, world_size=2, timeout=30)
    for out in results:
        assert out.pop("devices") == [str(rf.device())], "a collective input off rank_device()"
        problems = out.pop("problems")
        assert not problems, problems[0]
    for key in ("broadcast", "all_reduce", "all_gather"):
        assert results[0][key] == results[1][key], key
    assert [r["reduce_scatter"] for r in results] == [[1.0], [3.0]]
    assert results[0]["all_gather"] == [[0.0, 0.0], [1.0, 10.0]]


@pytest.mark.task("05.1")
@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_all_reduce_equals_dist_all_reduce(world_size):
    shapes = [(1,), (2,), (7,), (3, 5), (1000,), (4, 4, 4)]
    for rank_result in run_distributed(rf.ring_rank, world_size=world_size, args=(shapes,),
                                       timeout=40):
        for shape, (value_ok, in_place_ok, same_tensor) in zip(shapes + ["view"], rank_result):
            assert value_ok, f"ring all-reduce of {shape} differs from dist.all_reduce"
            assert in_place_ok and same_tensor, f"{shape}: the input tensor must hold the sum"


@pytest.mark.timeout(60)
def test_the_timing_gives_every_collective_a_tensor_on_the_rank_device():
    """The timing's own bookkeeping (the slowest rank's median, agreed by an all-reduce) is
    a collective too: under NCCL its tensor must be on the GPU."""
    for rank, out in enumerate(run_distributed(rf.timing_rank, world_size=2, timeout=40)):
        assert not out["problems"], f"rank {rank}: {out['problems'][0]}"
        assert [r["bytes"] for r in out["rows"]] == [64, 256]
        assert all(r["ring_s"] > 0 and r["torch_s"] > 0 for r in out["rows"]), out["rows"]


def test_ring_model_fit_recovers_a_known_bandwidth():
    col = load(LESSON, "collectives")
    sizes = [2**k for k in range(10, 27, 2)]
    times = [5e-5 + 2 * (4 - 1) / 4 * s / 3e9 for s in sizes]
    fit = col.fit_ring_model(sizes, times, 4)
    assert fit["bandwidth_Bps"] == pytest.approx(3e9, rel=1e-6)
    assert fit["alpha_s"] == pytest.approx(5e-5, rel=1e-6)
    model = [col.ring_model_seconds(fit, s, 4) for s in sizes]
    assert model == pytest.approx(times, rel=1e-6), (
        "ring_model_seconds does not give back the times the fit came from: the model is "
        "alpha + 2 (N-1)/N * bytes / bandwidth (each rank sends 2 (N-1)/N of the message); "
        "is the /N missing?")


def test_noisy_timings_give_no_fit_and_still_plot(monkeypatch):
    """On a busy machine a small message can take longer than a large one: say so, don't crash."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    col = load(LESSON, "collectives")
    sizes = [1024, 4096, 16384, 65536]
    noisy = [7.5e-3, 9.2e-3, 1.1e-3, 0.9e-3]  # shrinking with size, as seen under load
    assert col.try_fit_ring_model(sizes, noisy, 2) is None
    with pytest.raises(ValueError, match="does not grow"):
        col.fit_ring_model(sizes, noisy, 2)
    rows = [{"bytes": b, "ring_s": t, "torch_s": 1e-4 + b / 1e9} for b, t in zip(sizes, noisy)]
    fig = col.plot_timings({"world_size": 2, "rows": rows})
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("no fit" in t for t in labels) and any("GB/s" in t for t in labels)


def test_timing_script_refuses_bad_input_in_one_line():
    proc = run_script(script(LESSON, "collectives.py"), "--world-size", "1", timeout=60)
    assert "world-size" in one_line_error(proc)


@pytest.mark.timeout(60)
def test_the_timing_waits_for_every_rank_and_reports_the_slowest_median(monkeypatch):
    """One rank, in this process, with a fake clock: the ring takes 10 ms a call, torch's
    all-reduce 30 ms, and the other rank's medians are half of this rank's."""
    col = load(LESSON, "collectives")
    clock, events = [1000.0], []

    def ring(t):
        events.append("ring")
        clock[0] += 0.010
        return t

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if t.dtype == torch.float64:  # the ranks' medians, agreed on
            other = t / 2
            t.copy_(torch.maximum(t, other) if op == dist.ReduceOp.MAX else t + other)
        else:  # the timed torch all-reduce
            events.append("torch")
            clock[0] += 0.030

    monkeypatch.setattr(col, "ring_all_reduce", ring)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "barrier", lambda group=None, **k: events.append("barrier"))
    with monkeypatch.context() as m:
        for name in ("perf_counter", "monotonic", "time"):
            m.setattr(col.time, name, lambda: clock[0])
        rows = col.time_all_reduce(0, 2, [64], repeats=3)["rows"]
    timed = [i for i, e in enumerate(events) if e != "barrier"][1:]  # after the warm-up call
    assert all(events[i - 1] == "barrier" for i in timed), (
        f"calls in order {events}: each timed call must start right after dist.barrier(), or "
        "the ranks start it at different moments and a rank's clock includes waiting for the "
        "others")
    ring_s, torch_s = rows[0]["ring_s"], rows[0]["torch_s"]
    assert (ring_s, torch_s) != pytest.approx((0.030, 0.010)), (
        "the ring's time is in the torch_s column and torch's in ring_s: time "
        "ring_all_reduce for 'ring_s' and dist.all_reduce for 'torch_s'")
    assert (ring_s, torch_s) == pytest.approx((0.010, 0.030)), (
        f"this rank's medians are 10 and 30 ms, the other rank's half that, and the table says "
        f"{1e3 * ring_s:.0f} and {1e3 * torch_s:.0f} ms: the slowest rank decides when a "
        "collective is done, so all-reduce the medians with op=dist.ReduceOp.MAX (the default "
        "op, SUM, adds the ranks' times)")


@contextlib.contextmanager
def _cpu_seconds_limit(seconds, message):
    """Fail with ``message`` once this process has used ``seconds`` of CPU time (not wall
    time: a loaded machine does not trip it): an endless loop ends as a clear failure."""
    def stop(signum, frame):
        raise AssertionError(message)

    previous = signal.signal(signal.SIGVTALRM, stop)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,needle", [(["--min-kb", "0"], "min-kb"),
                                         (["--min-kb", "-4"], "min-kb"),
                                         (["--min-kb", "8", "--max-mb", "0.001"], "min-kb"),
                                         (["--repeats", "0"], "repeats")],
                         ids=["min_kb_zero", "min_kb_negative", "min_over_max", "repeats"])
def test_timing_cli_rejects_bad_input_with_one_line(monkeypatch, capsys, args, needle):
    import dpt.ranks

    col = load(LESSON, "collectives")
    monkeypatch.setattr(dpt.ranks, "run_distributed", lambda *a, **k: pytest.fail(
        f"collectives.py {' '.join(args)} got past main()'s checks and started ranks: refuse "
        "it up front with one 'error:' line"))
    with _cpu_seconds_limit(2.0, f"collectives.py {' '.join(args)} passed main()'s checks and "
                            "its size loop (s *= 4, from --min-kb) never ended: a size of 0 or "
                            "less never grows; refuse it up front (0 < --min-kb <= --max-mb)"):
        code = col.main(args)
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


@pytest.mark.timeout(60)
def test_timing_script_passes_its_flags_to_the_ranks(monkeypatch, tmp_path):
    import dpt.ranks

    col = load(LESSON, "collectives")
    calls = []

    def fake_run_distributed(fn, world_size, args=(), kwargs=None, **options):
        calls.append((fn.__name__, world_size, args))
        if fn.__name__ != "time_all_reduce":
            return [None] * world_size
        rows = [{"bytes": b, "ring_s": 1e-4 + b / 1e9, "torch_s": 5e-5 + b / 2e9}
                for b in args[0]]
        return [{"world_size": world_size, "rows": rows}] * world_size

    monkeypatch.setattr(dpt.ranks, "run_distributed", fake_run_distributed)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    assert col.main(["--world-size", "3", "--min-kb", "1", "--max-mb", "0.004",
                     "--repeats", "7", "--out", str(tmp_path / "t.json"),
                     "--plot", str(tmp_path / "t.png")]) == 0
    timed = [c for c in calls if c[0] == "time_all_reduce"]
    assert timed, f"main() never timed anything: {calls}"
    assert timed[0][1:] == (3, ([1024, 4096], 7)), (
        f"main() started the timing as (world_size, args) = {timed[0][1:]}, not "
        "(3, ([1024, 4096], 7)): pass --world-size and --repeats on "
        "(args=(sizes, args.repeats))")


# --------------------------------------------------------------------------- naive DDP
@pytest.mark.task("05.2")
@pytest.mark.parametrize("model_name", ["toy", "tied_emb"])
def test_naive_broadcasts_rank0_parameters_and_buffers(model_name):
    results = _train("naive", "05.2", model_name=model_name)
    _check_against_truth(results, model_name)


@pytest.mark.task("05.2")
def test_broadcast_state_sends_the_state_of_the_rank_it_is_given():
    results = run_distributed(rf.broadcast_from_rank_1, world_size=2, kwargs={"task": "05.2"},
                              timeout=30)
    expected = rf._cpu_state(rf.build("toy", seed=1))
    for rank, state in enumerate(results):
        for key, value in expected.items():
            assert torch.equal(state[key], value), (
                f"rank {rank}, {key}: broadcast_state(module, src=1) must give every rank "
                f"rank 1's values (is src passed on to dist.broadcast?)")


@pytest.mark.task("05.3")
@pytest.mark.parametrize("model_name", ["toy", "tied_emb"])
def test_naive_matches_single_process_and_torch_ddp(model_name):
    _check_against_truth(_train("naive", "05.3", model_name=model_name,
                                with_torch=model_name == "toy"), model_name)


@pytest.mark.task("05.3")
def test_naive_reduces_each_trainable_gradient_once():
    """Frozen parameters are not sent; a tied parameter is sent once."""
    results = _train("naive", "05.3", with_torch=False, steps=1)
    assert results[0]["reduced_numel_per_step"] == rf.trainable_numel("toy"), (
        "elements all-reduced per step differ from the trainable ones: a frozen parameter "
        "reduced, or a tied one twice?")


@pytest.mark.task("05.3")
def test_naive_with_an_unused_parameter_works_or_raises_clearly():
    for status, detail, _ in run_distributed(rf.unused_rank, world_size=2,
                                             args=("naive", "05.3"), timeout=30):
        assert status == "ok" or "unused" in detail.lower() or "gradient" in detail.lower()
        if status == "ok":
            assert detail, "an unused parameter changed"


@pytest.mark.task("05.3")
def test_naive_a_parameter_only_one_rank_used_is_averaged_with_zeros():
    """A rank whose forward skipped a layer has no .grad for it, but must still take part in
    its all-reduce (with zeros): skipping it leaves the other rank waiting in a collective
    nobody else makes, or pairs it with the next parameter's."""
    try:
        results = run_distributed(rf.unused_on_one_rank, world_size=2, args=("naive", "05.3"),
                                  timeout=30)
    except RankFailure as exc:
        if "NotImplementedError" in str(exc):  # a task not done yet: its own message says so
            raise
        raise AssertionError(
            "a rank with no gradient for a parameter skipped its all-reduce, so the ranks' "
            "collectives no longer pair up (a hang or a size mismatch): reduce a missing "
            f"gradient as zeros\n{exc}") from None
    (local0, _), (local1, _) = results
    assert local0 is not None and local1 is None, "the setup: only rank 0 uses the layer"
    for rank, (_, synced) in enumerate(results):
        assert synced is not None, (f"rank {rank} has no gradient after the sync: a rank that "
                                    f"skipped its all-reduce (count a missing one as zeros)")
        torch.testing.assert_close(synced, local0 / 2, rtol=1e-9, atol=1e-12, msg=lambda m, r=rank: (
            f"rank {r}: the gradient must be the mean of rank 0's and zeros: {m}"))


@pytest.mark.task("05.9")
def test_no_sync_accumulation_equals_one_big_batch():
    _check_against_truth(_train("naive", "05.9", accumulate=2))


@pytest.mark.task("05.9")
def test_no_sync_skips_communication():
    """Numbers alone cannot tell: a no_sync() that syncs anyway also averages correctly."""
    results = _train("naive", "05.9", accumulate=3, steps=2)
    _no_collectives_in_no_sync(results, "NaiveDDP inside no_sync()")
    assert results[0]["reduced_numel_per_step"] == rf.trainable_numel("toy")


@pytest.mark.task("05.9")
def test_no_sync_restores_the_flag_after_an_error_and_when_nested():
    no_sync = load(LESSON, "ddp_base").DDPBase.no_sync
    model = SimpleNamespace(require_sync=True)
    with pytest.raises(KeyError), no_sync(model):
        assert model.require_sync is False, "inside no_sync(), require_sync must be False"
        raise KeyError("raised inside the block")
    assert model.require_sync is True, (
        "after a block that raised, no_sync() left syncing off: restore it in a finally:")
    with no_sync(model):
        with no_sync(model):
            pass
        assert model.require_sync is False, (
            "leaving an inner no_sync() turned syncing back on inside the outer one: restore "
            "the value saved on entry, not True")
    assert model.require_sync is True


# --------------------------------------------------------------------------- overlap DDP
@pytest.mark.task("05.4")
@pytest.mark.parametrize("model_name", ["toy", "tied_emb"])
def test_overlap_matches_single_process_and_torch_ddp(model_name):
    _check_against_truth(_train("overlap", "05.4", model_name=model_name,
                                with_torch=model_name == "toy"), model_name)


@pytest.mark.task("05.4")
def test_overlap_hooks_reduce_each_trainable_gradient_once():
    results = _train("overlap", "05.4", with_torch=False, steps=1)
    assert results[0]["reduced_numel_per_step"] == rf.trainable_numel("toy"), (
        "elements all-reduced per step differ from the trainable ones: a tied parameter "
        "reduced twice?")


@pytest.mark.task("05.4")
def test_overlap_hooks_respect_no_sync():
    results = _train("overlap", "05.4", accumulate=2)
    _no_collectives_in_no_sync(results, "the hooks")
    _check_against_truth(results)


@pytest.mark.task("05.4")
def test_overlap_hooks_launch_from_the_accumulated_gradient_on_a_slow_network():
    """Hooks that launch on the wrong event (before accumulation) send the wrong tensor."""
    _check_against_truth(_train("overlap", "05.4", lazy=True, accumulate=2, model_name="tied_emb"),
                         "tied_emb")


@pytest.mark.task("05.5")
def test_overlap_waits_before_the_step_on_a_slow_network():
    """All-reduces that only complete at wait(): a finish that does not wait cannot pass."""
    _check_against_truth(_train("overlap", "05.5", lazy=True))


@pytest.mark.task("05.5")
def test_overlap_matches_single_process_with_its_own_finish():
    _check_against_truth(_train("overlap", "05.5", model_name="tied_emb"), "tied_emb")


@pytest.mark.task("05.5")
def test_overlap_unused_parameter_raises_clearly_not_hangs():
    for status, detail, after in run_distributed(rf.unused_rank, world_size=2,
                                                 args=("overlap", "05.5"), timeout=30):
        assert status == "error", "an unused parameter must raise (or be reduced), not pass silently"
        assert "unused" in detail.lower() or "no gradient" in detail.lower(), detail
        assert after is None, (
            f"after the error for the unused parameter, {after}: clear self.pending before "
            f"raising, or later steps see stale work")


# --------------------------------------------------------------------------- bucketed DDP
def _params(*numels, dtype=torch.float32):
    return [torch.zeros(n, dtype=dtype) for n in numels]


@pytest.mark.task("05.6")
def test_buckets_one_when_the_cap_exceeds_the_model():
    bd = load(LESSON, "bucketed_ddp")
    assert bd.assign_buckets(_params(10, 20, 30, 40), bucket_cap_mb=1.0) == [[3, 2, 1, 0]]


@pytest.mark.task("05.6")
def test_buckets_two_in_reverse_registration_order():
    bd = load(LESSON, "bucketed_ddp")
    cap = 8 * 4 / 2**20  # exactly two 4-element float32 tensors
    assert bd.assign_buckets(_params(4, 4, 4, 4), cap) == [[3, 2], [1, 0]]


@pytest.mark.task("05.6")
def test_buckets_several_with_a_partial_last_one():
    bd = load(LESSON, "bucketed_ddp")
    cap = 3 * 4 * 4 / 2**20  # three 4-element float32 tensors
    assert bd.assign_buckets(_params(4, 4, 4, 4, 4, 4, 4), cap) == [[6, 5, 4], [3, 2, 1], [0]], (
        "the last, partial bucket is missing or the boundaries are off")
    # a tensor larger than the cap gets a bucket of its own, and sizes are in bytes
    assert bd.assign_buckets(_params(2, 100, 2, 2), 16 / 2**20) == [[3, 2], [1], [0]]
    assert bd.assign_buckets(_params(2, 2, dtype=torch.float64), 16 / 2**20) == [[1], [0]]


@pytest.mark.task("05.6")
def test_buckets_one_parameter_each_when_the_cap_is_tiny():
    bd = load(LESSON, "bucketed_ddp")
    assert bd.assign_buckets(_params(3, 1, 2), TINY_MB) == [[2], [1], [0]]


@pytest.mark.task("05.6")
def test_bucketed_wrapper_buckets_hold_trainable_parameters_once():
    results = _train("bucketed", "05.6", bucket_cap_mb=HUGE_MB, with_torch=False, steps=1)
    trainable = [n for n, p in rf.ToyNet().named_parameters() if p.requires_grad]
    assert results[0]["buckets"] == [trainable[::-1]]
    tiny = _train("bucketed", "05.6", bucket_cap_mb=TINY_MB, with_torch=False, steps=1)
    assert tiny[0]["buckets"] == [[n] for n in trainable[::-1]]


@pytest.mark.task("05.7")
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "view"])
@pytest.mark.parametrize("cap", [TINY_MB, PARTIAL_MB, HUGE_MB], ids=["tiny", "partial", "huge"])
def test_bucketed_matches_single_process_and_torch_ddp(cap, as_view):
    # On the slow network (the all-reduce reads its bucket at launch, delivers at wait()), a
    # bucket launched before its last gradient is in sends a partial sum, on every run.
    _check_against_truth(_train("bucketed", "05.7", bucket_cap_mb=cap, as_view=as_view,
                                lazy=True, with_torch=cap == PARTIAL_MB))


@pytest.mark.task("05.7")
def test_bucketed_tied_embedding_model():
    _check_against_truth(_train("bucketed", "05.7", model_name="tied_emb",
                                bucket_cap_mb=PARTIAL_MB, lazy=True), "tied_emb")


@pytest.mark.task("05.7")
@pytest.mark.parametrize("cap", [TINY_MB, PARTIAL_MB, HUGE_MB], ids=["tiny", "partial", "huge"])
def test_bucketed_reduces_every_trainable_gradient_once(cap):
    results = _train("bucketed", "05.7", bucket_cap_mb=cap, with_torch=False, steps=1)
    assert results[0]["reduced_numel_per_step"] == rf.trainable_numel("toy"), (
        "elements all-reduced per step differ from the trainable ones: a bucket reduced "
        "twice, or one never reduced?")


@pytest.mark.task("05.7")
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "view"])
def test_bucketed_hooks_respect_no_sync(as_view):
    results = _train("bucketed", "05.7", accumulate=2, bucket_cap_mb=PARTIAL_MB, as_view=as_view)
    _no_collectives_in_no_sync(results, "the bucket hooks")
    _check_against_truth(results)


@pytest.mark.task("05.7")
@pytest.mark.parametrize("set_to_none", [False, True])
def test_gradients_as_bucket_views_stay_correct_after_zero_grad(set_to_none):
    """zero_grad(set_to_none=False) zeroes the views in place; True drops them, and the next
    backward's fresh .grad must be copied in and pointed back at its view."""
    results = run_distributed(rf.view_bucket_rank, world_size=2, args=(set_to_none,),
                              kwargs={"task": "05.7"}, timeout=60)
    truth = rf.train_single("toy", STEPS)
    for rank, out in enumerate(results):
        assert all(out["views_ok"]), f"rank {rank}: a .grad is not its bucket's view after the sync"
        assert all(out["same_buffers"]), f"rank {rank}: the bucket buffers were replaced"
        for key, value in truth["state"].items():
            torch.testing.assert_close(out["state"][key], value, rtol=1e-9, atol=1e-10,
                                       msg=lambda m, k=key, r=rank: f"rank {r}, {k}: {m}")


@pytest.mark.task("05.8")
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "view"])
@pytest.mark.parametrize("cap", [TINY_MB, PARTIAL_MB, HUGE_MB], ids=["tiny", "partial", "huge"])
def test_bucketed_waits_and_unflattens_on_a_slow_network(cap, as_view):
    _check_against_truth(_train("bucketed", "05.8", bucket_cap_mb=cap, lazy=True,
                                as_view=as_view))


@pytest.mark.task("05.8")
def test_bucketed_unused_parameter_raises_clearly_not_hangs():
    for status, detail, after in run_distributed(rf.unused_rank, world_size=2,
                                                 args=("bucketed", "05.8"), timeout=30):
        assert status == "error", "an unused parameter must raise (or be reduced), not pass silently"
        assert "unused" in detail.lower() or "no gradient" in detail.lower(), detail
        assert after is None, (
            f"after the error for the unused parameter, {after}: reset self.ready (and "
            f"self.pending) before raising too, or the "
            f"failed step's counts carry over, pass the bucket size, and it never launches")


def _check_unused_error(variant, task, **kw):
    """The error for an unused parameter names it, and every launched handle was waited on."""
    for rank, (message, launched, never_waited) in enumerate(run_distributed(
            rf.unused_error_handles, world_size=2, args=(variant, task), kwargs=kw, timeout=30)):
        assert message is not None, f"rank {rank}: an unused parameter must raise a RuntimeError"
        assert "unused.weight" in message, (
            f"rank {rank}'s error does not name the parameter that got no gradient "
            f"('unused.weight'): put the parameters' names (self.names) in the message, "
            f"or the student cannot find the layer: {message!r}")
        assert launched > 0, "the setup: the used parameters launch their all-reduces"
        assert never_waited == 0, (
            f"rank {rank}: {never_waited} of the {launched} all-reduces the step launched were "
            f"dropped without wait() before raising: a collective is then still writing into "
            f"a .grad (or bucket) the next step reuses; wait() on each pending handle, then "
            f"clear self.pending, then raise")


@pytest.mark.task("05.5")
@pytest.mark.timeout(60)
def test_overlap_unused_parameter_error_names_it_and_waits_for_what_was_launched():
    _check_unused_error("overlap", "05.5")


@pytest.mark.task("05.8")
@pytest.mark.timeout(60)
def test_bucketed_unused_parameter_error_names_it_and_waits_for_what_was_launched():
    # a cap below every parameter's size: one bucket each, so the used ones do launch
    _check_unused_error("bucketed", "05.8", bucket_cap_mb=1e-6)


@pytest.mark.task("05.8")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("as_view", [False, True])
def test_bucketed_grads_are_bucket_views_only_with_gradient_as_bucket_view(as_view):
    trainable = sorted(n for n, p in rf.ToyNet().named_parameters()
                       if p.requires_grad)
    for rank, aliased in enumerate(run_distributed(
            rf.grads_alias_buckets, world_size=2, args=(as_view,), kwargs={"task": "05.8"},
            timeout=30)):
        for step, names in enumerate(aliased):
            if as_view:
                assert names == trainable, (
                    f"rank {rank}, step {step}: with gradient_as_bucket_view=True every .grad "
                    f"must be its view into the bucket; these are not: "
                    f"{sorted(set(trainable) - set(names))}")
            else:
                assert not names, (
                    f"rank {rank}, step {step}: with gradient_as_bucket_view=False the .grad of "
                    f"{names} became a view into the bucket buffer: copy the averaged view "
                    f"back into .grad (p.grad.copy_(view)) instead of p.grad = view, or the "
                    f"next step's bucket traffic rewrites gradients the caller still holds")


# --------------------------------------------------------------------------- the lesson as is
@pytest.mark.slow
@pytest.mark.parametrize("variant,kw", [
    ("naive", {}), ("overlap", {"lazy": True}), ("bucketed", {"bucket_cap_mb": PARTIAL_MB}),
    ("bucketed", {"bucket_cap_mb": PARTIAL_MB, "accumulate": 2, "as_view": True})])
def test_unpatched_lesson_code_matches_single_process_and_torch_ddp(variant, kw):
    results = run_distributed(rf.train_rank, world_size=2, args=(variant,),
                              kwargs=dict(kw, with_torch=True), timeout=60)
    _check_against_truth(results)
    for out in results:
        assert out["devices"] == [str(rf.device())], f"a tensor off rank_device(): {out['devices']}"


def test_forward_passes_keyword_arguments_on():
    forward = load(LESSON, "ddp_base").DDPBase.forward
    wrapper = SimpleNamespace(module=lambda *args, **kwargs: (args, kwargs))
    assert forward(wrapper, 1, 2, mask=3) == ((1, 2), {"mask": 3}), (
        "model(x, mask=m) lost its keyword arguments on the way to the wrapped module: "
        "forward must return self.module(*args, **kwargs)")


@pytest.fixture
def one_process_bucketed(monkeypatch):
    """The lesson's bucketed_ddp, built in this process as a world of one (the shared
    group_of_one), with the reference parts for tasks 05.2 and 05.6-05.7: only given code is
    graded."""
    rf.apply_patches(["05.2", "05.6", "05.7"], set_attr=monkeypatch.setattr)
    bucketed = load(LESSON, "bucketed_ddp")
    with group_of_one():
        yield bucketed


def test_gradients_as_bucket_views_keep_a_gradient_the_model_already_had(one_process_bucketed):
    module = rf.build("toy", seed=0)
    torch.manual_seed(1)
    before = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
            before[name] = p.grad.clone()
    one_process_bucketed.BucketedDDP(module, bucket_cap_mb=PARTIAL_MB, gradient_as_bucket_view=True)
    lost = [n for n, p in module.named_parameters() if n in before
            and not torch.equal(p.grad, before[n])]
    assert not lost, (
        f"with gradient_as_bucket_view=True, the gradients the model held before wrapping "
        f"({lost}) were replaced by the empty bucket views: copy each into its view "
        f"(view.copy_(p.grad)) before pointing .grad at the view")


def test_a_bucket_mixing_dtypes_is_refused(one_process_bucketed):
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2).double())
    try:
        one_process_bucketed.BucketedDDP(module, bucket_cap_mb=HUGE_MB)  # one bucket for both
    except ValueError as exc:
        assert "mix" in str(exc), str(exc)
    else:
        pytest.fail("a bucket holding float32 and float64 parameters was built: its buffer "
                    "has one dtype, so the others' gradients would be silently cast; keep the "
                    "check that every parameter of a bucket has the same dtype and device")


def test_wrappers_mirror_torch_ddp_interface():
    for mod, cls in (("naive_ddp", "NaiveDDP"), ("overlap_ddp", "OverlapDDP"),
                     ("bucketed_ddp", "BucketedDDP")):
        klass = getattr(load(LESSON, mod), cls)
        assert issubclass(klass, load(LESSON, "ddp_base").DDPBase), cls
        for attr in ("forward", "no_sync", "finish_gradient_synchronization"):
            assert callable(getattr(klass, attr)), f"{cls}.{attr}"


class _FakeWork:
    def wait(self, timeout=None):
        return True


def _fake_ring_peers(monkeypatch, record) -> None:
    """Rank 0 of WORLD, its point-to-point ops done at once: ``record`` gets the tensors each
    ``batch_isend_irecv`` posts."""
    def batch_isend_irecv(ops):
        record([op.tensor for op in ops])
        return [_FakeWork() for _ in ops]

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: WORLD)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer=None, group=None, tag=0,
                        group_peer=None: SimpleNamespace(op=op, tensor=tensor, peer=peer))


@pytest.mark.parametrize("variant,kw", [("naive", {}), ("overlap", {}),
                                        ("bucketed", {"bucket_cap_mb": PARTIAL_MB}),
                                        ("bucketed", {"bucket_cap_mb": PARTIAL_MB, "as_view": True})])
def test_everything_a_rank_makes_is_on_rank_device(monkeypatch, variant, kw):
    """With rank_device() patched to 'meta', no tensor may land anywhere else: a model, batch,
    bucket or collective input built on a hard-coded CPU would show up here (on a GPU machine
    it would meet NCCL, which takes only CUDA tensors)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import dpt.dist

    meta = torch.device("meta")
    monkeypatch.setattr(dpt.dist, "rank_device", lambda: meta)
    seen = []

    def record(tensors):
        seen.extend(str(t.device) for t in tensors)

    def all_reduce(t, op=None, group=None, async_op=False):
        record([t])
        return _FakeWork() if async_op else None

    _fake_ring_peers(monkeypatch, record)
    monkeypatch.setattr(dist, "broadcast", lambda t, src=0, group=None, async_op=False: record([t]))
    monkeypatch.setattr(dist, "all_reduce", all_reduce)

    module = rf.build("toy", seed=1)
    model = rf.wrap(variant, module, kw.get("bucket_cap_mb", 25.0), kw.get("as_view", False))
    opt = rf.SGD(model.parameters(), lr=0.1)
    x, y = rf._slice("toy", 0, 0, WORLD)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        model.finish_gradient_synchronization()
        opt.step()
    load(LESSON, "collectives").ring_all_reduce(torch.ones(10, device=meta))
    tensors = [*module.parameters(), *module.buffers(), *getattr(model, "bucket_buffers", [])]
    off = sorted({str(t.device) for t in tensors} | set(seen))
    assert seen and off == ["meta"], f"tensors off rank_device(): {off}"


def test_the_ring_posts_host_memory_when_ranks_share_a_gpu_through_gloo(monkeypatch):
    """gloo's send and receive read host memory only: ranks sharing one GPU (DPT_SHARE_GPU=1,
    gloo) that post a CUDA tensor fail with "writev: Bad address" (seen on an H200). There the
    ring must post only CPU tensors and leave the sum in the caller's CUDA tensor. A CUDA
    tensor is faked (FakeTensorMode), so this runs on any CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    posted = []
    _fake_ring_peers(monkeypatch, lambda tensors: posted.extend(t.device.type for t in tensors))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    with FakeTensorMode(allow_non_fake_inputs=True):
        grads = torch.ones(10, device="cuda")
        out = load(LESSON, "collectives").ring_all_reduce(grads)
    assert posted, "the ring posted no send or receive"
    assert set(posted) == {"cpu"}, (
        f"the ring posted tensors on {sorted(set(posted))}: under gloo, a CUDA tensor goes "
        "through a host copy (gloo's sends read host memory only)")
    assert out is grads and out.device.type == "cuda", "the sum belongs in the caller's tensor"


# --------------------------------------------------------------------------- what the notebook draws

def test_the_timeline_records_one_step_of_each_wrapper():
    """scratch_demo.timeline_rank, which the notebook's timeline draws, on a tiny MLP."""
    demo = load(LESSON, "scratch_demo")
    # 64 wide, float32: a layer is 16640 bytes, its bias 256, `out` 2600. In 0.03 MB
    # (31457 bytes): out, fc3 and fc2's bias; fc2's weight and fc1's bias; fc1's weight.
    cap = 0.03
    ranks = run_distributed(demo.timeline_rank, world_size=WORLD, timeout=90, kwargs={
        "batch": 8, "width": 64, "depth": 3, "bucket_cap_mb": cap, "steps": 1, "warmup": 1})
    for rank, out in enumerate(ranks):
        naive, overlap, bucketed = (out["runs"][n] for n in ("naive", "overlap", "bucketed"))
        for name, run in out["runs"].items():
            layers = [layer["name"] for layer in run["layers"]]
            assert layers == ["out", "fc3", "fc2", "fc1"], (rank, name, layers)
            assert run["backward"][1] <= run["sync"][0] <= run["sync"][1] <= run["step"][0]
            assert all(e["launch"] <= e["done"] <= run["step"][1] for e in run["allreduce"])
        assert [e["async"] for e in naive["allreduce"]] == [False] * 8  # 4 weights, 4 biases
        assert all(e["launch"] >= naive["sync"][0] for e in naive["allreduce"])
        assert [e["async"] for e in overlap["allreduce"]] == [True] * 8  # one per gradient
        assert overlap["allreduce"][0]["launch"] < overlap["backward"][1], (
            "overlap's first all-reduce must be launched during backward")
        assert bucketed["buckets"] == [["out", "fc3", "fc2"], ["fc2", "fc1"], ["fc1"]]
        assert [e["async"] for e in bucketed["allreduce"]] == [True] * 3
        assert bucketed["allreduce"][0]["launch"] < bucketed["backward"][1], (
            "the first bucket's all-reduce must be launched during backward")


def test_the_step_split_shows_communication_on_its_own_scale(monkeypatch):
    """A step that is 97% compute: the right panel's axis fits the communication alone."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    import matplotlib.pyplot as plt

    demo = load(LESSON, "scratch_demo")
    summary = {n: {"compute_s": 0.65, "comm_s": c, "throughput_vs_torch": 1.0}
               for n, c in (("torch", 0.033), ("bucketed", 0.003))}
    fig = demo.plot_step_split({"summary": summary, "config": {
        "world_size": 2, "backend": "gloo", "threads_per_rank": 1, "batch": 512}})
    left, right = fig.axes
    assert right.get_xlim()[1] < 0.1 * left.get_xlim()[1]
    labels = " ".join(t.get_text() for t in right.texts)
    assert "4.8% of the step" in labels and "0.5% of the step" in labels, labels
    assert "0.5% to 4.8%" in fig._suptitle.get_text()
    plt.close(fig)


def test_each_fitted_line_has_its_points_colour_and_a_legend_entry(monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    import matplotlib.pyplot as plt

    col = load(LESSON, "collectives")
    sizes = [2**k for k in range(10, 24, 2)]
    rows = [{"bytes": b, "ring_s": 1e-4 + b / 2e8, "torch_s": 5e-5 + b / 5e8} for b in sizes]
    fig = col.plot_timings({"world_size": 2, "rows": rows})
    lines = fig.axes[0].get_lines()
    points = [ln for ln in lines if ln.get_linestyle() == "None"]
    dashed = [ln for ln in lines if ln.get_linestyle() == "--"]
    assert len(points) == len(dashed) == 2
    for p, d in zip(points, dashed):
        assert p.get_color() == d.get_color(), "a fit must be drawn in its points' colour"
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert len(legend) == 4 and sum("fitted" in t for t in legend) == 2, legend
    plt.close(fig)


# --------------------------------------------------------------------------- more than two ranks
@pytest.mark.task("05.2")
def test_broadcast_state_reaches_the_buffers_of_submodules():
    """Batch norm's running statistics live in a submodule: ``module.buffers(recurse=False)``
    (or a walk over the root's own ``_buffers``) leaves them different on every rank."""
    results = run_distributed(rf.broadcast_nested_buffers, world_size=2, kwargs={"task": "05.2"},
                              timeout=30)
    for key, value in results[0].items():
        assert torch.equal(results[1][key], value), (
            f"rank 1's {key} differs from rank 0's after broadcast_state(): the buffers of "
            f"submodules were not broadcast (module.buffers() recurses; recurse=False does not)")


def _check_mean_of_three(results, who):
    world = len(results)
    mean = (world + 1) / 2  # ranks hold 1, 2, ..., world
    for rank, grads in enumerate(results):
        assert grads, f"rank {rank} has no gradients after the sync"
        for name, g in grads.items():
            got = g.unique().tolist()
            if got == [mean]:
                continue
            cause = (f"divided by 2, not by the world size {world}: use self.world_size"
                     if got == [mean * world / 2] else
                     "missing divide by world size" if got == [mean * world] else
                     f"not the mean over the {world} ranks")
            raise AssertionError(
                f"{who}, {world} ranks holding gradients 1, 2, 3: rank {rank}'s {name} is "
                f"{got}, not the mean {mean}: {cause}")


@pytest.mark.task("05.3")
def test_naive_averages_over_three_ranks():
    results = run_distributed(rf.mean_of_known_gradients, world_size=3, args=("naive",),
                              kwargs={"task": "05.3"}, timeout=40)
    _check_mean_of_three(results, "NaiveDDP")


@pytest.mark.task("05.5")
def test_overlap_averages_over_three_ranks():
    results = run_distributed(rf.mean_of_known_gradients, world_size=3, args=("overlap",),
                              kwargs={"task": "05.5"}, timeout=40)
    _check_mean_of_three(results, "OverlapDDP")


@pytest.mark.task("05.8")
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "view"])
def test_bucketed_averages_over_three_ranks(as_view):
    results = run_distributed(rf.mean_of_known_gradients, world_size=3, args=("bucketed",),
                              kwargs={"task": "05.8", "bucket_cap_mb": PARTIAL_MB,
                                      "as_view": as_view}, timeout=40)
    _check_mean_of_three(results, "BucketedDDP")


def _demo_batch(n=8):
    """An MNIST-shaped batch for the notebook's demos (scratch_demo trains an MLP on it)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


@pytest.mark.timeout(180)
def test_the_notebook_comparison_trains_each_rank_on_its_slice_and_syncs_before_the_step():
    """scratch_demo.compare_rank, which the notebook's comparison runs, with reference parts:
    every wrapper on 2 ranks must end where one process on the whole batch ends."""
    demo = load(LESSON, "scratch_demo")
    x, y = _demo_batch(8)
    truth = {k: v.detach() for k, v in demo.train(demo.make_model(seed=0), x, y, 2)
             .state_dict().items()}
    results = run_distributed(rf.demo_compare_rank, world_size=WORLD, args=(x, y, 2),
                              timeout=150)

    def off(states):
        return [k for k in truth if not torch.allclose(states[k], truth[k], rtol=1e-4,
                                                       atol=1e-5)]

    for rank, states in enumerate(results):
        assert list(states) == list(demo.WRAPPERS), list(states)
        torch_off = off(states["torch DDP"])
        for name, state in states.items():
            wrong = off(state)
            assert not wrong, (
                f"rank {rank}, {name}: {wrong} differ from one process trained on the whole "
                "batch. " + ("torch DDP is off too: each rank must train on ITS slice, "
                             "x[rank * per_rank:(rank + 1) * per_rank] (and y's)"
                             if torch_off else
                             "torch DDP matches: call sync() (finish_gradient_synchronization) "
                             "after backward and BEFORE opt.step(), or each rank steps on its "
                             "own gradients"))


# --------------------------------------------------------------------------- the notebook's given code, in-process


def test_the_notebooks_train_steps_on_fresh_gradients_synced_before_each_step():
    """scratch_demo.train: per step, zero_grad, backward, sync(), SGD(lr=0.1, momentum=0.9)."""
    import torch.nn.functional as F

    demo = load(LESSON, "scratch_demo")
    x, y = _demo_batch(4)
    model = demo.make_model(seed=0)
    params = list(model.parameters())
    at_sync = []

    def sync():  # the gradient this step's loss has at the current weights
        fresh = torch.autograd.grad(F.cross_entropy(model(x), y), params)
        at_sync.append(all(p.grad is not None and torch.allclose(p.grad, f)
                           for p, f in zip(params, fresh)))

    demo.train(model, x, y, 3, sync)
    assert len(at_sync) == 3, (
        f"train(model, x, y, steps=3) called sync() {len(at_sync)} times: it must take "
        "exactly `steps` steps, each one backward, one sync() and one opt.step()")
    assert all(at_sync), (
        f"at sync() of steps {[i for i, ok in enumerate(at_sync) if not ok]}, .grad was not "
        "this step's gradient at the current weights: zero the gradients before each backward "
        "(opt.zero_grad), or the previous steps' gradients are added in (and call sync() "
        "after backward, before opt.step())")
    ref = demo.make_model(seed=0)
    opt = rf.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, msg=lambda m, n=name: (
            f"{n} after train(): not 3 steps of SGD(lr=0.1, momentum=0.9): {m}"))


class _Recorder(nn.Module):
    """Stands in for a wrapper in compare_rank: notes the start it was given and the batches
    it saw; syncs nothing."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.start = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.inputs = []

    def forward(self, x):
        self.inputs.append(x.detach().clone())
        return self.module(x)


def test_compare_rank_starts_each_rank_from_its_own_seed_on_its_own_slice(monkeypatch):
    """scratch_demo.compare_rank, rank 1 of 4, in this process, with a recording wrapper:
    the start is rank 1's own (the broadcast must fix it) and the batch rows are x[2:4]."""
    demo = load(LESSON, "scratch_demo")
    built = []

    def wrapper(module):
        built.append(_Recorder(module))
        return built[-1]

    monkeypatch.setattr(demo, "WRAPPERS", {"recorded": wrapper})
    x, y = _demo_batch(8)
    states = demo.compare_rank(1, 4, x, y, steps=1)
    assert list(states) == ["recorded"] and len(built) == 1, (list(states), len(built))
    rec = built[0]
    own, rank0 = demo.make_model(seed=1).state_dict(), demo.make_model(seed=0).state_dict()
    assert all(torch.equal(rec.start[k], own[k]) for k in own), (
        "rank 1's model did not start from make_model(seed=rank)"
        + (": it starts from rank 0's weights, so the comparison cannot show that the "
           "wrappers' broadcast matters" if all(torch.equal(rec.start[k], rank0[k]) for k in rank0)
           else ""))
    got = rec.inputs[0]
    halves = " (x.shape[0] // 2: a hard-coded 2 ranks?)" if torch.equal(got, x[4:8]) else ""
    assert torch.equal(got, x[2:4]), (
        f"rank 1 of 4 trained on {got.shape[0]} rows that are not x[2:4]{halves}: each rank "
        "takes per_rank = x.shape[0] // world_size rows, x[rank * per_rank:(rank + 1) * "
        "per_rank]")


def test_compare_rank_builds_models_and_batches_on_the_rank_device(monkeypatch):
    """With rank_device() patched to 'meta', the model a wrapper gets and the batch its
    forward sees must both be there (on a GPU machine: the rank's GPU)."""
    import dpt.dist

    demo = load(LESSON, "scratch_demo")
    monkeypatch.setattr(dpt.dist, "rank_device", lambda: torch.device("meta"))
    seen = {}

    class Stop(Exception):
        pass

    class Probe(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module
            seen["model"] = sorted({str(p.device) for p in module.parameters()})

        def forward(self, x):
            seen["batch"] = str(x.device)
            raise Stop

    monkeypatch.setattr(demo, "WRAPPERS", {"probe": Probe})
    x, y = _demo_batch(4)
    with pytest.raises(Stop):
        demo.compare_rank(0, 2, x, y, steps=1)
    assert seen == {"model": ["meta"], "batch": "meta"}, (
        f"rank_device() is 'meta' and compare_rank put the model on {seen.get('model')} and "
        f"the batch on {seen.get('batch')}: pass device=rank_device() to make_model and move "
        "the slices there, or on a GPU machine model and batch meet on different devices")


def test_the_timeline_model_is_linear_layers_with_relus_between():
    demo = load(LESSON, "scratch_demo")
    model = demo.timeline_model(width=8, depth=2)
    layers = [(n, type(m).__name__) for n, m in model.named_children()]
    assert layers == [("fc1", "Linear"), ("relu1", "ReLU"), ("fc2", "Linear"), ("relu2", "ReLU"),
                      ("out", "Linear")], (
        f"timeline_model(width=8, depth=2) is {layers}: depth Linear(width, width) layers "
        "named fc1..fc<depth>, each followed by a ReLU, then out = Linear(width, 10)")
    assert (model.fc1.in_features, model.out.out_features) == (8, 10)


class _ScriptedClock:
    """time.perf_counter and time.sleep: the time moves only when the test says so."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds

    def advance_ms(self, ms):
        self.now += ms / 1e3


def test_a_layer_is_ready_when_its_last_gradient_is_in(monkeypatch):
    import time

    demo = load(LESSON, "scratch_demo")
    clock = _ScriptedClock()
    monkeypatch.setattr(time, "perf_counter", clock.perf_counter)
    weight, bias = torch.zeros(2), torch.zeros(1)
    recording = {"log": None}
    hook = demo._ready_hook(recording, {id(weight): "fc1", id(bias): "fc1"})
    hook(weight)  # a warm-up step: nothing is recorded
    recording["log"] = {"ready": {}, "allreduce": []}
    clock.advance_ms(5)
    hook(bias)
    clock.advance_ms(5)
    hook(weight)
    assert recording["log"]["ready"] == {"fc1": clock.now}, (
        f"the hook recorded {recording['log']['ready']} for a layer whose bias came in at "
        f"{clock.now - 0.005} and weight at {clock.now}: a layer is ready when its LAST "
        "gradient is in (overwrite the time, don't keep the first)")


class _ClockWork:
    """An async all-reduce in a world of one that completes in wait(), 2 ms later."""

    def __init__(self, clock):
        self.clock, self.future = clock, torch.futures.Future()

    def get_future(self):
        return self.future

    def wait(self, timeout=None):
        if not self.future.done():
            self.clock.advance_ms(2)
            self.future.set_result(None)
        return True


@pytest.fixture
def reference_parts(monkeypatch):
    """Every task's reference part in place for this test (undone after it): the given code
    around them is what is checked."""
    rf.apply_patches(rf.TASKS, set_attr=monkeypatch.setattr)


def test_the_timeline_keeps_the_median_step_in_ms_on_a_scripted_clock(monkeypatch,
                                                                      reference_parts):
    """scratch_demo.timeline_rank in a world of one, on a clock that moves only when told:
    1 ms per all-reduce launch, 2 ms per async wait, and the optimizer steps of each variant
    take 100 (warm-up), 50, 10 and 30 ms (the variants take turns, a step each). Nothing here
    depends on the machine's speed."""
    import itertools
    import time

    demo = load(LESSON, "scratch_demo")
    clock = _ScriptedClock()
    monkeypatch.setattr(time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(time, "sleep", clock.sleep)
    class ScriptedSGD:
        def __init__(self, params, lr):
            self.params = list(params)
            self.step_ms = itertools.cycle([100, 50, 10, 30])  # this variant's own steps

        def zero_grad(self, set_to_none=True):
            for p in self.params:
                p.grad = None

        def step(self):
            clock.advance_ms(next(self.step_ms))

    def all_reduce(tensor, op=None, group=None, async_op=False):
        clock.advance_ms(1)  # a world of one: the sum is the tensor itself
        return _ClockWork(clock) if async_op else None

    barriers = []
    monkeypatch.setattr(torch.optim, "SGD", ScriptedSGD)
    width, depth = 128, 2
    with group_of_one():
        monkeypatch.setattr(dist, "all_reduce", all_reduce)
        monkeypatch.setattr(dist, "barrier", lambda *a, **k: barriers.append(clock.now))
        # 0.1 MB: out, fc2 and fc1's bias in one bucket, fc1's weight in another
        out = demo.timeline_rank(0, 1, batch=4, width=width, depth=depth, bucket_cap_mb=0.1,
                                 steps=3, warmup=1)
        restored = dist.all_reduce is all_reduce
        n_barriers = len(barriers)
    assert restored, ("timeline_rank left its tracing wrapper in torch.distributed.all_reduce: "
                      "put the real one back in a finally:, or every later all-reduce of the "
                      "process is traced")
    assert n_barriers == 3 * (1 + 3), (
        f"dist.barrier() was called {n_barriers} times in 12 steps (3 variants x (1 warm-up "
        "+ 3 recorded)): call it before each step's backward, so that every rank starts the "
        "recorded step at the same moment")
    grad_bytes = sum(p.numel() * p.element_size()
                     for p in demo.timeline_model(width, depth).parameters())
    for name, run in out["runs"].items():
        kept = run["step"][1] - run["step"][0]
        assert kept != pytest.approx(0.030), (
            f"{name}: the kept step's optimizer step lasted 30 ms and the timeline says {kept}: "
            "times must be milliseconds ((t - t0) * 1e3), not seconds")
        assert kept == pytest.approx(30), (
            f"{name}: the recorded optimizer steps took 50, 10 and 30 ms, and the kept step's "
            f"took {kept} ms: keep the step of median length (sorted, the middle one), not the "
            "first or the fastest")
        sent = [e["bytes"] for e in run["allreduce"]]
        assert sum(sent) == grad_bytes, (
            f"{name}: the all-reduces carried {sent} bytes, {sum(sent)} in all, for "
            f"{grad_bytes} bytes of gradients: bytes are numel() * element_size(), not elements")
    bucketed = out["runs"]["bucketed"]
    assert [e["async"] for e in bucketed["allreduce"]] == [True, True], bucketed["allreduce"]
    early = [e for e in bucketed["allreduce"] if not e["done"] > bucketed["sync"][0]]
    assert not early, (
        f"async all-reduces {early} are marked done before finish_gradient_synchronization "
        f"(from {bucketed['sync'][0]} ms), where their wait() completes them: an async call is "
        "done when its future completes (the clock's on_end: a callback of "
        "work.get_future()), not when the launching call returns")
    assert out["config"]["grad_mb"] == round(grad_bytes / 2**20, 2), (
        f"grad_mb is {out['config']['grad_mb']} for {grad_bytes} bytes: MiB (/ 2**20), the "
        "unit of bucket_cap_mb")


def test_on_a_gpu_the_timeline_reads_the_all_reduces_off_the_device(monkeypatch,
                                                                    reference_parts):
    """timeline_rank on a simulated GPU with NCCL-like all-reduces (tests/fake_device.py): each
    takes 5 ms on the device, one after the other, while the host's calls return at once and
    an async handle's future is complete when it is issued. The times must be the device's:
    on the host's clock every all-reduce would be done the moment it was launched."""
    import dpt.timing
    from tests.fake_device import FakeDevice, FakeDeviceClock

    demo = load(LESSON, "scratch_demo")
    device = FakeDevice()
    monkeypatch.setattr(dpt.timing, "clock_for", lambda *a, **k: FakeDeviceClock(device))

    class DeviceSGD:  # each optimizer step: 2 ms of kernels on the compute stream
        def __init__(self, params, lr):
            self.params = list(params)

        def zero_grad(self, set_to_none=True):
            for p in self.params:
                p.grad = None

        def step(self):
            device.compute(0.002)

    def all_reduce(tensor, op=None, group=None, async_op=False):
        work = device.collective(0.005)
        if async_op:
            return work
        work.wait()  # a blocking call on NCCL: the compute stream waits for it
        return None

    monkeypatch.setattr(torch.optim, "SGD", DeviceSGD)
    with group_of_one():
        monkeypatch.setattr(dist, "all_reduce", all_reduce)
        monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
        out = demo.timeline_rank(0, 1, batch=4, width=32, depth=2, bucket_cap_mb=0.01,
                                 steps=1, warmup=1)
    for name, run in out["runs"].items():
        took = [round(e["done"] - e["launch"], 6) for e in run["allreduce"]]
        assert took and min(took) >= 5, (
            f"{name}: all-reduces done {took} ms after their launch, each took 5 ms on the "
            "device: on a GPU a collective's end must come from the device (dpt.timing's "
            "clock), not from the host, to which NCCL's handles look complete at once")
        assert run["step"][1] - run["step"][0] == pytest.approx(2), (
            f"{name}: the optimizer step took 2 ms on the device, the timeline says "
            f"{run['step']}")
        last = max(e["done"] for e in run["allreduce"])
        assert run["sync"][1] == pytest.approx(last), (
            f"{name}: the gradient sync ends when the compute stream has waited for the last "
            f"all-reduce ({last} ms), the timeline says {run['sync']}")
    naive = [round(e["done"] - e["launch"], 6) for e in out["runs"]["naive"]["allreduce"]]
    assert naive == [5] * len(naive), f"naive's blocking all-reduces took {naive} ms"


def test_the_step_split_stacks_communication_after_compute_and_saves(monkeypatch, tmp_path):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    import matplotlib.pyplot as plt

    demo = load(LESSON, "scratch_demo")
    summary = {"torch": {"compute_s": 0.650, "comm_s": 0.033, "throughput_vs_torch": 1.0},
               "bucketed": {"compute_s": 0.600, "comm_s": 0.003, "throughput_vs_torch": 1.1}}
    path = tmp_path / "split.png"
    fig = demo.plot_step_split({"summary": summary, "config": {
        "world_size": 2, "backend": "gloo", "threads_per_rank": 1, "batch": 512}}, path)
    try:
        left, right = fig.axes
        bars = [(float(p.get_x()), float(p.get_width())) for p in left.patches]
        flat = [v for bar in bars for v in bar]
        assert flat == pytest.approx([0, 650, 0, 600, 650, 33, 600, 3]), (
            f"left panel bars (start, width) in ms: {bars}: each variant's compute bar from 0, "
            "then its communication bar starting where the compute ends (left=compute)")
        widths = [float(p.get_width()) for p in right.patches]
        assert widths == pytest.approx([33, 3]), (
            f"the right panel's bars are {widths} ms: it magnifies the communication + waiting "
            "alone (33 and 3 ms), not the whole step")
        assert path.is_file() and path.stat().st_size > 0, (
            "plot_step_split(result, path) wrote no file: fig.savefig(path)")
    finally:
        plt.close(fig)


def test_naive_makes_no_collective_when_sync_is_off(monkeypatch):
    """Given code of NaiveDDP.finish_gradient_synchronization: with require_sync False (as
    inside no_sync()) it returns before any communication."""
    import torch.nn.functional as F

    rf.apply_patches(["05.2"], set_attr=monkeypatch.setattr)
    naive = load(LESSON, "naive_ddp")
    calls = []
    with group_of_one():
        model = naive.NaiveDDP(rf.build("toy", seed=0))
        x, y = rf.global_batch("toy", 0)
        F.cross_entropy(model(x), y).backward()
        model.require_sync = False
        monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(a))
        model.finish_gradient_synchronization()
    assert not calls, (
        f"NaiveDDP made {len(calls)} all-reduce(s) with require_sync False (inside no_sync()): "
        "keep the early return at the top of finish_gradient_synchronization")
