"""Lesson 10, part 1: reading a profiler trace of one step (traces.py, tasks 10.1-10.4).

Most tests feed hand-built traces, in the profiler's own format, whose answers are known
exactly: a CPU step with gloo (collectives launched on the main thread, run on gloo's worker
threads, two of them at once) and a GPU step with NCCL (kernels matched to their launches by
``args["correlation"]``). Each task is graded on its own: a test of one task gives the module
the solution's functions for the other tasks (generated from solutions/, tests/references.py).

One run traces every method of the course for real, on 2 ranks (gloo on the CPU, NCCL on a
machine with 2 GPUs), with a tiny model. Nothing here measures speed: on real traces the tests
check what is causally certain, as that the naive DDP's all-reduces all run after its
backward, so none of their time is hidden.
"""

from __future__ import annotations

import json
import random

import pytest

from dpt.ranks import RankFailure
from tests import references as refs
from tests.lessons import load

LESSON = "10_inside_a_step"
TINY = {"vocab": 64, "dim": 32, "heads": 2, "layers": 2, "seq_len": 16}


@pytest.fixture
def tr():
    return load(LESSON, "traces")


# --- the references: the solution's own functions (tests/l10_inside_a_step/_references.py) ---

def solution(name: str):
    """The solution's traces.``name``, its names (``Event``, a helper, another task's function)
    looked up in the lesson's module under test."""
    return refs.bound(LESSON, "traces", name)


def use_references(tr, monkeypatch, keep: str):
    """Every task's functions but ``keep``'s (10.2 and 10.3) are the solution's."""
    refs.put(LESSON, [t for t in ("10.2", "10.3") if t != keep], monkeypatch.setattr)


# --- hand-built traces ---------------------------------------------------------------------------

def X(name, cat, ts, dur, tid=1, pid=100, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid,
            "args": args}


def write(tmp_path, events, name="step.json", bare=False):
    path = tmp_path / name
    path.write_text(json.dumps(events if bare else {"schemaVersion": 1, "traceEvents": events}))
    return path


# A CPU step with gloo, in µs. Times in ms from the first complete event (ts 1000):
# forward 0-2, backward 2-6, sync 6-7.5, optimizer 7.5-8, on the main thread (tid 1). In the
# backward the main thread computes 2-3, 3-4 and 4.2-5 (operators, with others nested in them,
# the launches of the all-reduces among them), then waits 5-6. Gloo's two worker threads run
# all-reduces at 2.6-4.0 and 3.5-4.5 (overlapping each other), 4.8-5.8 and 6.1-7.2 (in sync).
# Communication: 1.9 + 1.0 + 1.1 = 4.0 ms, of which 1.4 + 0.3 + 0.2 = 1.9 while the backward
# computes (2.9 during its span, waits included).
CPU_STEP = [
    {"ph": "M", "name": "process_name", "ts": 0, "pid": 100, "tid": 0, "args": {"name": "py"}},
    X("forward", "user_annotation", 1000, 2000),
    X("optimizer", "user_annotation", 8500, 500),  # a trace is not sorted by time
    X("aten::linear", "cpu_op", 1100, 500),
    X("backward", "user_annotation", 3000, 4000),
    X("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 3000, 1000),
    X("aten::mm", "cpu_op", 3100, 600),
    X("autograd::engine::evaluate_function: AccumulateGrad", "cpu_op", 4000, 1000),
    X("c10d::allreduce_", "cpu_op", 4400, 50),
    X("gloo:all_reduce", "user_annotation", 3600, 1400, tid=7),
    X("aten::copy_", "cpu_op", 3700, 100, tid=7),  # gloo's thread copies: not the backward's
    X("gloo:all_reduce", "user_annotation", 4500, 1000, tid=8),
    X("autograd::engine::evaluate_function: AccumulateGrad", "cpu_op", 5200, 800),
    X("c10d::allreduce_", "cpu_op", 5300, 50),
    X("gloo:all_reduce", "user_annotation", 5800, 1000, tid=7),
    X("aten::copy_", "cpu_op", 6200, 400, tid=9),  # another thread, while the main one waits
    X("sync", "user_annotation", 7000, 1500),
    X("c10d::allreduce_", "cpu_op", 7010, 30),
    X("gloo:all_reduce", "user_annotation", 7100, 1100, tid=7),
    X("aten::div_", "cpu_op", 7200, 300),
    {"ph": "i", "name": "marker", "ts": 2000, "pid": 100, "tid": 1, "s": "t"},
    {"ph": "s", "name": "fwdbwd", "cat": "fwdbwd", "ts": 1200, "pid": 100, "tid": 1, "id": 1},
    {"ph": "f", "name": "fwdbwd", "cat": "fwdbwd", "ts": 3100, "pid": 100, "tid": 1, "id": 1},
]
CPU_COMM = [(2.6, 4.0), (3.5, 4.5), (4.8, 5.8), (6.1, 7.2)]
CPU_BACKWARD = [(2.0, 3.0), (2.1, 2.7), (3.0, 4.0), (3.4, 3.45), (4.2, 5.0), (4.3, 4.35)]
CPU_COMM_MS, CPU_HIDDEN_MS = 4.0, 1.9


def launch(corr, ts, cat="cuda_runtime", name="cudaLaunchKernel"):
    return X(name, cat, ts, 10, tid=2, correlation=corr)


def kernel(name, corr, ts, dur, stream=7):
    return X(name, "kernel", ts, dur, tid=stream, pid=0, correlation=corr)


# A GPU step with NCCL, in µs; ms from ts 1000. The CPU's phases: forward 0-2, backward 2-4,
# sync 4-5, optimizer 5-5.5; the autograd thread (tid 2) launches the kernels. Compute
# kernels: k1 launched in forward, running 1.0-3.3; k2 and k3 launched in backward, running
# 3.3-3.5 and 3.8-6.0 (past the CPU's backward: the GPU runs behind); k6 of the optimizer,
# 6.0-6.2. NCCL kernels on stream 20: 3.0-4.5 (launched in backward) and 6.0-7.0 (in sync).
# The backward's compute is k2 and k3; communication 2.5 ms, 0.9 of it during k2 and k3.
GPU_STEP = [
    X("forward", "user_annotation", 1000, 2000),
    X("backward", "user_annotation", 3000, 2000),
    X("sync", "user_annotation", 5000, 1000),
    X("optimizer", "user_annotation", 6000, 500),
    X("backward", "gpu_user_annotation", 3100, 5900, tid=7, pid=0),  # on the GPU's lane
    X("nccl:all_reduce", "user_annotation", 3290, 20),  # the launch, on the CPU
    launch(1, 1500), launch(2, 3200), launch(4, 3300),
    launch(3, 4800, cat="cuda_driver", name="cuLaunchKernelEx"),
    launch(5, 5200), launch(6, 6100),
    kernel("ampere_sgemm_128x64_nn", 1, 2000, 2300),
    kernel("void at::native::elementwise_kernel", 2, 4300, 200),
    kernel("ampere_sgemm_64x64_tn", 3, 4800, 2200),
    kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 4, 4000, 1500, stream=20),
    kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 5, 7000, 1000, stream=20),
    kernel("void at::native::multi_tensor_apply_kernel", 6, 7000, 200),
]
GPU_COMM = [(3.0, 4.5), (6.0, 7.0)]
GPU_BACKWARD = [(3.3, 3.5), (3.8, 6.0)]
GPU_COMM_MS, GPU_HIDDEN_MS = 2.5, 0.9


def pairs(intervals):
    return sorted((round(s, 6), round(e, 6)) for s, e in intervals)


def events_of(tr, tmp_path, raw):
    return solution("read_trace")(write(tmp_path, raw))


# --- 10.1 read_trace -----------------------------------------------------------------------------

@pytest.mark.task("10.1")
def test_read_trace_keeps_complete_events_in_ms_from_the_first(tr, tmp_path):
    events = tr.read_trace(write(tmp_path, CPU_STEP))
    assert all(isinstance(e, tr.Event) for e in events), "read_trace must return Event objects"
    names = [e.name for e in events]
    assert "process_name" not in names and "marker" not in names and "fwdbwd" not in names, (
        "read_trace kept metadata, instant or flow events: only 'ph': 'X' events have a "
        "duration")
    assert len(events) == sum(e["ph"] == "X" for e in CPU_STEP), "an 'X' event is missing"
    forward = next(e for e in events if e.name == "forward")
    assert forward.start == pytest.approx(0.0, abs=1e-9), (
        "times start at the earliest *complete* event (the metadata's ts is not an event's "
        f"start): forward starts at ts 1000, the first X event; got start {forward.start}")
    assert forward.end == pytest.approx(2.0), (
        f"forward lasts 2000 µs = 2 ms (ts and dur are microseconds); got end {forward.end}")
    gloo = [e for e in events if e.name == "gloo:all_reduce"]
    assert pairs((e.start, e.end) for e in gloo) == pairs(CPU_COMM), (
        "start = (ts - first ts) / 1000 and end = start + dur / 1000, in ms")
    assert {e.tid for e in gloo} == {7, 8} and all(e.pid == 100 for e in events), (
        "keep each event's pid and tid: they say which thread ran it")
    assert next(e for e in events if e.name == "c10d::allreduce_").cat == "cpu_op", (
        "keep each event's category ('cat')")
    starts = [e.start for e in events]
    assert starts == sorted(starts), "the events must be sorted by start"


@pytest.mark.task("10.1")
def test_read_trace_keeps_args_and_reads_a_bare_list(tr, tmp_path):
    events = tr.read_trace(write(tmp_path, GPU_STEP, bare=True))
    assert len(events) == len(GPU_STEP), (
        "a trace may be the bare list of events, not a dict with 'traceEvents'")
    kernels = [e for e in events if e.cat == "kernel"]
    assert all(e.args.get("correlation") for e in kernels), (
        "keep each event's args: a kernel's 'correlation' leads to its launch")


@pytest.mark.task("10.1")
def test_read_trace_measures_from_the_earliest_event_not_the_first_in_the_file(tr, tmp_path):
    """In CPU_STEP the first complete event in the file is also the earliest; here the file
    is in reverse order (last event first), as nothing in the format forbids."""
    events = tr.read_trace(write(tmp_path, CPU_STEP[::-1]))
    starts = {e.name: e.start for e in events}
    assert min(e.start for e in events) == pytest.approx(0.0, abs=1e-9), (
        f"the earliest event starts at {min(e.start for e in events)} ms, not 0: measure from "
        "the smallest ts of the complete events, wherever it is in the file (not the first "
        "event's ts)")
    assert starts["forward"] == pytest.approx(0.0, abs=1e-9) and starts["sync"] == (
        pytest.approx(6.0)), f"forward and sync start at {starts['forward']}, {starts['sync']}"
    assert pairs((e.start, e.end) for e in events if e.name == "gloo:all_reduce") == (
        pairs(CPU_COMM))


# --- 10.2 comm_intervals, compute_intervals ------------------------------------------------------

@pytest.mark.task("10.2")
def test_comm_on_cpu_is_gloos_workers_not_the_launches(tr, tmp_path):
    got = pairs(tr.comm_intervals(events_of(tr, tmp_path, CPU_STEP)))
    assert (0.0, 2.0) not in got and (2.0, 6.0) not in got, (
        "a phase label is not communication")
    assert not any(round(e - s, 6) in (0.05, 0.03) for s, e in got), (
        "counted the launch events (c10d::allreduce_) as communication: they only queue the "
        "work; the gloo:... events on gloo's threads are the collectives running")
    assert got == pairs(CPU_COMM), f"expected the three gloo:all_reduce events, got {got}"


@pytest.mark.task("10.2")
def test_comm_on_gpu_is_the_nccl_kernels(tr, tmp_path):
    got = pairs(tr.comm_intervals(events_of(tr, tmp_path, GPU_STEP)))
    assert (2.29, 2.31) not in got, (
        "counted nccl:all_reduce, the CPU's launch, as communication: on a GPU the kernels "
        "whose name contains 'nccl' are the collectives running")
    assert got == pairs(GPU_COMM), (
        f"expected the two ncclDevKernel_... kernels, not other kernels or launches; got {got}")


@pytest.mark.task("10.2")
def test_backward_compute_on_cpu_is_its_threads_operators(tr, tmp_path):
    events = events_of(tr, tmp_path, CPU_STEP)
    got = pairs(tr.compute_intervals(events))
    assert (2.0, 6.0) not in got and (0.0, 8.0) not in got, (
        "took the backward's whole span, or the step's, for its compute: the main thread also "
        "waits in it (torch DDP waits for its last buckets at the end of backward); keep the "
        "operators ('cpu_op') it ran inside the span")
    assert (5.2, 5.6) not in got and (2.7, 2.8) not in got, (
        "counted operators of other threads (gloo's copies): keep those of the thread that "
        "ran the backward, the span's tid")
    assert (0.1, 0.6) not in got and (6.2, 6.5) not in got, (
        "counted operators outside the backward's span (forward, sync)")
    assert got == pairs(CPU_BACKWARD), f"expected the main thread's operators in backward, got {got}"
    forward = pairs(tr.compute_intervals(events, "forward"))
    assert forward == [(0.1, 0.6)], (
        f"compute_intervals(events, phase) must pick the phase asked for; forward: {forward}")


@pytest.mark.task("10.2")
def test_backward_compute_on_gpu_is_the_kernels_it_launched(tr, tmp_path):
    got = pairs(tr.compute_intervals(events_of(tr, tmp_path, GPU_STEP)))
    assert got, ("no compute found in a GPU trace: there the backward's compute is the kernels "
                 "('cat': 'kernel') it launched, not the CPU's operators")
    assert (2.0, 4.0) not in got, (
        "on a GPU the CPU's backward span only launches kernels: the compute is the kernels")
    assert (1.0, 3.3) not in got, (
        "counted a kernel that runs during the backward span but was launched in forward: "
        "find each kernel's launch by args['correlation'] and keep those launched in backward")
    assert (3.8, 4.0) not in got and (3.8, 6.0) in got, (
        "a kernel launched in backward belongs to it even when it runs after the CPU's span "
        "ended (the GPU runs behind the CPU): keep its whole interval")
    assert not any(e - s == pytest.approx(1.0) or e - s == pytest.approx(1.5) for s, e in got), (
        "counted NCCL kernels as compute")
    assert got == pairs(GPU_BACKWARD), (
        f"expected the kernels launched inside the CPU's backward span ('cuda_runtime' or "
        f"'cuda_driver' launches, not the GPU lane's own annotation); got {got}")


# --- 10.3 merge, overlap -------------------------------------------------------------------------

@pytest.mark.task("10.3")
@pytest.mark.parametrize("given, want", [
    ([], []),
    ([(3, 4), (0, 1)], [(0, 1), (3, 4)]),
    ([(0, 5), (1, 2)], [(0, 5)]),
    ([(0, 2), (1, 3)], [(0, 3)]),
    ([(1, 2), (0, 1)], [(0, 2)]),
    ([(0, 2), (2, 2), (5, 4)], [(0, 2)]),
    ([(4, 6), (0, 3), (1, 2), (2.5, 4.5), (8, 9)], [(0, 6), (8, 9)]),
], ids=["empty", "unordered", "nested", "overlapping", "touching", "empty-intervals", "mixed"])
def test_merge_cases(tr, given, want):
    got = [tuple(p) for p in tr.merge(given)]
    assert got == want, (f"merge({given}) should be {want}, got {got}: sort by start, and "
                         "extend the last interval while the next starts at or before its end")


@pytest.mark.task("10.3")
def test_merge_matches_a_reference_on_random_sets(tr):
    rng = random.Random(10)
    for _ in range(200):
        given = [(a, a + rng.randint(-1, 6)) for a in (rng.randint(0, 30) for _ in range(8))]
        cells = {c for s, e in given for c in range(s, e)}
        got = [tuple(p) for p in tr.merge(given)]
        assert {c for s, e in got for c in range(s, e)} == cells, (
            f"merge({given}) = {got} does not cover the same time")
        assert all(a[1] < b[0] for a, b in zip(got, got[1:])), (
            f"merge({given}) = {got}: the pairs must be sorted, apart and not touching")


@pytest.mark.task("10.3")
def test_overlap_counts_shared_time_once(tr):
    assert tr.overlap([(0, 4)], [(2, 6)]) == pytest.approx(2)
    assert tr.overlap([(0, 1)], [(1, 2)]) == pytest.approx(0), "touching intervals share 0"
    assert tr.overlap([(0, 1)], [(2, 3)]) == pytest.approx(0)
    assert tr.overlap([], [(0, 3)]) == pytest.approx(0)
    twice = tr.overlap([(0, 4), (1, 3)], [(0, 10)])
    assert twice == pytest.approx(4), (
        f"overlap([(0, 4), (1, 3)], [(0, 10)]) is 4, got {twice}: a set that overlaps itself "
        "(two gloo threads at once) counts each moment once; merge each set first")
    both = tr.overlap([(0, 10)], [(1, 3), (2, 4), (6, 7)])
    assert both == pytest.approx(4), f"the other set may overlap itself too; got {both}"
    assert tr.overlap([(5, 8), (0, 2)], [(1, 6)]) == pytest.approx(2), "sets in any order"


@pytest.mark.task("10.3")
def test_overlap_matches_a_reference_on_random_sets(tr):
    rng = random.Random(11)
    for _ in range(100):
        a = [(s, s + rng.randint(0, 5)) for s in (rng.randint(0, 20) for _ in range(5))]
        b = [(s, s + rng.randint(0, 5)) for s in (rng.randint(0, 20) for _ in range(5))]
        want = len({c for s, e in a for c in range(s, e)} & {c for s, e in b for c in range(s, e)})
        assert tr.overlap(a, b) == pytest.approx(want), f"overlap({a}, {b}) should be {want}"


# --- 10.4 hidden_fraction ------------------------------------------------------------------------

@pytest.mark.task("10.4")
def test_hidden_fraction_on_a_cpu_step(tr, tmp_path, monkeypatch):
    use_references(tr, monkeypatch, keep="10.4")
    got = tr.hidden_fraction(events_of(tr, tmp_path, CPU_STEP))
    assert got["comm_ms"] == pytest.approx(CPU_COMM_MS), (
        f"comm_ms is {got['comm_ms']}, expected {CPU_COMM_MS}: two gloo threads ran at once, "
        "so adding their durations counts that time twice; take the length of their union")
    assert got["hidden_ms"] == pytest.approx(CPU_HIDDEN_MS), (
        f"hidden_ms is {got['hidden_ms']}, expected {CPU_HIDDEN_MS}: the communication that "
        "overlaps the backward's compute, not the whole step's (nor the backward's span)")
    assert got["fraction"] == pytest.approx(CPU_HIDDEN_MS / CPU_COMM_MS), (
        f"fraction is {got['fraction']}: hidden_ms / comm_ms, a share of the communication "
        "(not of the step time)")


@pytest.mark.task("10.4")
def test_hidden_fraction_on_a_gpu_step(tr, tmp_path, monkeypatch):
    use_references(tr, monkeypatch, keep="10.4")
    got = tr.hidden_fraction(events_of(tr, tmp_path, GPU_STEP))
    assert (got["comm_ms"], got["hidden_ms"]) == (pytest.approx(GPU_COMM_MS),
                                                  pytest.approx(GPU_HIDDEN_MS)), got
    assert got["fraction"] == pytest.approx(GPU_HIDDEN_MS / GPU_COMM_MS)


@pytest.mark.task("10.4")
def test_hidden_fraction_of_other_phases_and_of_no_communication(tr, tmp_path, monkeypatch):
    use_references(tr, monkeypatch, keep="10.4")
    events = events_of(tr, tmp_path, CPU_STEP)
    sync = tr.hidden_fraction(events, "sync")
    assert sync["hidden_ms"] == pytest.approx(0.3), (
        "hidden_fraction(events, phase) must measure against the phase asked for")
    alone = [e for e in events if not e.name.startswith("gloo:")]
    got = tr.hidden_fraction(alone)
    assert got["comm_ms"] == 0 and got["hidden_ms"] == 0, got
    assert got["fraction"] is None, (
        "a trace without communication has nothing to hide: fraction is None, not 0 or 1 "
        "(and no ZeroDivisionError)")


# --- real traces of every method, on 2 ranks -----------------------------------------------------

@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """Each method traced once on 2 ranks with a tiny model: (rank results, folder)."""
    tr = load(LESSON, "traces")
    out = tmp_path_factory.mktemp("l10_traces")
    try:
        ranks = tr.run_traces(tr.METHODS, nproc=2, out=out, timeout=100, warmup=1, timed=1,
                              model_config=TINY, batch=2)
    except RankFailure as exc:
        pytest.fail(f"tracing the methods failed on a rank:\n{exc}")
    return ranks, out


def method_events(tr, traced, method, rank=0):
    """The test's own reading of ``method``'s trace; raises a lesson's pending task."""
    return solution("read_trace")(tr.result_of(traced[0], method)[rank]["path"])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("method", ["torch_ddp", "naive", "overlap", "bucketed", "fsdp", "fsdp2"])
def test_a_trace_per_method_and_rank_with_its_collectives(tr, traced, method):
    for rank, result in enumerate(tr.result_of(traced[0], method)):
        assert result["path"].endswith(f"{method}.rank{rank}.json")
        events = solution("read_trace")(result["path"])
        names = {e.name for e in events if e.cat == "user_annotation"}
        assert set(tr.PHASES) <= names, f"rank {rank}'s trace lacks a phase label: {names}"
        assert solution("comm_intervals")(events), (
            f"no collective in {method}'s trace on rank {rank}")
        assert result["step_ms"] > 0


def launches(events):
    return [e.start for e in events if e.cat == "cpu_op" and e.name.startswith("c10d::")
            and any(k in e.name for k in ("allreduce", "allgather", "reduce_scatter"))]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("method, inside", [("naive", False), ("overlap", True),
                                            ("bucketed", True), ("torch_ddp", True)])
def test_collectives_are_launched_inside_backward_or_not(tr, traced, method, inside):
    events = method_events(tr, traced, method)
    (start, end), = [(e.start, e.end) for e in events
                     if e.cat == "user_annotation" and e.name == "backward"]
    during = [t for t in launches(events) if start <= t <= end]
    if inside:
        assert during, f"{method} launched no collective during backward"
    else:
        assert not during, f"{method} launched a collective during backward: {during}"


@pytest.mark.timeout(150)
@pytest.mark.task("10.1")
def test_read_trace_reads_the_real_traces(tr, traced):
    path = tr.result_of(traced[0], "torch_ddp")[0]["path"]
    got, want = tr.read_trace(path), solution("read_trace")(path)
    assert len(got) == len(want), f"{len(got)} events read, the trace has {len(want)} complete"
    assert sorted((e.name, round(e.start, 6)) for e in got) == sorted(
        (e.name, round(e.start, 6)) for e in want)


@pytest.mark.timeout(150)
@pytest.mark.task("10.2")
def test_real_traces_have_comm_and_backward_compute(tr, traced):
    events = method_events(tr, traced, "torch_ddp")
    comm, compute = tr.comm_intervals(events), tr.compute_intervals(events)
    assert pairs(comm) == pairs(solution("comm_intervals")(events)), (
        "comm_intervals of a real trace: every collective's execution, no launch")
    assert pairs(compute) == pairs(solution("compute_intervals")(events)), (
        "compute_intervals of a real trace")


@pytest.mark.timeout(150)
@pytest.mark.task("10.4")
@pytest.mark.parametrize("method", ["torch_ddp", "naive", "overlap", "bucketed", "fsdp", "fsdp2"])
def test_hidden_fraction_of_real_traces(tr, traced, monkeypatch, method):
    result = traced[0][0][method]
    if isinstance(result, str):  # a lesson 05 or 09 task is not done: nothing to measure
        pytest.skip(f"{method} was not traced: {result} (an earlier lesson's task: lesson 10 "
                    "traces your code of lessons 05 and 09, see its README's Needs)")
    events = solution("read_trace")(result["path"])
    use_references(tr, monkeypatch, keep="10.4")
    got = tr.hidden_fraction(events)
    assert 0 < got["comm_ms"] and 0 <= got["hidden_ms"] <= got["comm_ms"] + 1e-9, got
    assert 0 <= got["fraction"] <= 1
    if method == "naive":  # in every mode, of the communication as it ran (tr.as_run)
        ran = tr.as_run(events)
        assert ran is not None, (
            f"{tr.comm_mode(events)}: as_run could not match gloo's spans to their launches "
            "in a real trace of the naive DDP")
        got = tr.hidden_fraction(ran)
        assert got["hidden_ms"] == 0 and got["fraction"] == 0, (
            "naive DDP all-reduces after backward has returned: nothing can be hidden, yet "
            f"hidden_fraction says {got} ({tr.comm_mode(events)})")


@pytest.mark.timeout(150)
def test_summary_and_timeline_from_the_traces(tr, traced, tmp_path):
    ranks, _ = traced
    rows = tr.summary(ranks)
    assert [r["method"] for r in rows] == list(tr.METHODS)
    table = tr.format_summary(rows)
    assert all(tr.LABELS[m] in table for m in tr.METHODS)
    drawn = [m for m in ("naive", "bucketed") if not isinstance(ranks[0][m], str)]
    if not drawn:
        pytest.skip("naive and bucketed were not traced (lesson 05 not done in this tree)")
    fig = tr.figure(ranks, drawn, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 0 and len(fig.axes) == len(drawn)


def test_the_script_says_in_one_line_why_it_draws_no_timeline(tr, monkeypatch, capsys, tmp_path):
    """Lesson 05's code not done: naive and bucketed are not traced, and the script said
    nothing about the timeline it did not write. Now one line names the task and the course's
    reference timeline."""
    from tests.lessons import REPO

    pending = "Task 05.3: sum each trainable gradient over ranks, then take the mean"
    monkeypatch.setattr(tr, "run_traces", lambda *a, **k: [{"naive": pending,
                                                             "bucketed": pending}] * 2)
    figure = tmp_path / "timeline.png"
    assert tr.main(["--methods", "naive", "bucketed", "--out", str(tmp_path),
                    "--figure", str(figure)]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "timeline" in line]
    assert len(said) == 1, said
    assert "naive and bucketed" in said[0] and "Task 05.3" in said[0], said[0]
    reference = said[0].rsplit("reference: ", 1)[-1].rstrip(")")
    assert (REPO / reference).is_file(), f"the line names {reference}, which is not committed"
    assert not figure.exists()


# --- the communication as it ran, in each mode the course runs (given code) -------------------

def all_references(tr, monkeypatch):
    """Every task's function is the test's reference: what is checked is the given code."""
    refs.put(LESSON, ("10.1", "10.2", "10.3", "10.4"), monkeypatch.setattr)


def memcpy(name, corr, ts, dur, stream=30):
    return X(name, "gpu_memcpy", ts, dur, tid=stream, pid=0, correlation=corr)


# The naive DDP on a GPU shared by the ranks (gloo with CUDA tensors), in µs; ms from ts 1000.
# The CPU: forward 0-2, backward 2-4, sync 4-7, optimizer 7-7.5. The backward's kernels run
# 2.3-3.5 and 3.5-5.5, behind the CPU. In sync the main thread issues two all-reduces (4.1-4.2
# and 4.3-4.4), each queueing the copy of its gradient to the host; the copies can only run
# once the backward's kernels are done (5.5-5.6 and 5.6-5.65). gloo's thread starts the first
# all-reduce at 4.21, while the backward still runs, and waits for its copy until 5.6: it
# communicates 5.6-6.0, then 6.0-6.5 for the second. gloo's copy back to the GPU (HtoD) and
# the optimizer's kernel come after. Nothing of the communication ran during the backward.
SHARED_NAIVE = [
    X("forward", "user_annotation", 1000, 2000),
    X("backward", "user_annotation", 3000, 2000),
    X("sync", "user_annotation", 5000, 3000),
    X("optimizer", "user_annotation", 8000, 500),
    launch(1, 3200), launch(2, 3600),
    kernel("ampere_sgemm_128x64_nn", 1, 3300, 1200),
    kernel("ampere_sgemm_64x64_tn", 2, 4500, 2000),
    X("c10d::allreduce_", "cpu_op", 5100, 100),
    X("aten::copy_", "cpu_op", 5140, 30),
    launch(3, 5150, name="cudaMemcpyAsync"),
    X("c10d::allreduce_", "cpu_op", 5300, 100),
    launch(4, 5350, name="cudaMemcpyAsync"),
    memcpy("Memcpy DtoH (Device -> Pinned)", 3, 6500, 100),
    memcpy("Memcpy DtoH (Device -> Pinned)", 4, 6600, 50),
    X("gloo:all_reduce", "user_annotation", 5210, 1790, tid=7),
    X("gloo:all_reduce", "user_annotation", 7000, 500, tid=7),
    X("cudaMemcpyAsync", "cuda_runtime", 6990, 5, tid=7, correlation=5),
    memcpy("Memcpy HtoD (Pinned -> Device)", 5, 7000, 900),
    launch(6, 8100),
    kernel("void at::native::multi_tensor_apply_kernel", 6, 8600, 100),
]
SHARED_NAIVE_COMM = [(5.6, 6.0), (6.0, 6.5)]

# An all-reduce issued during the backward on a shared GPU: the kernel queued before it runs
# 2.2-2.8, its copy to the host 2.8-2.85, and a kernel the backward queued after it
# 2.85-4.5. gloo's span starts at 2.41 and ends at 3.2: it communicates from 2.85, all of it
# while that later kernel computes (which must not delay its start).
SHARED_OVERLAP = [
    X("forward", "user_annotation", 1000, 2000),
    X("backward", "user_annotation", 3000, 3000),
    X("sync", "user_annotation", 6000, 500),
    X("optimizer", "user_annotation", 6500, 500),
    launch(1, 3100),
    kernel("ampere_sgemm_128x64_nn", 1, 3200, 600),
    X("c10d::allreduce_", "cpu_op", 3300, 100, tid=2),
    launch(2, 3350, name="cudaMemcpyAsync"),
    memcpy("Memcpy DtoH (Device -> Pinned)", 2, 3800, 50),
    launch(3, 3500),
    kernel("ampere_sgemm_64x64_tn", 3, 3850, 1650),
    X("gloo:all_reduce", "user_annotation", 3410, 790, tid=7),
]

# The naive DDP on the CPU (gloo) and with NCCL: its all-reduces start after the backward.
CPU_NAIVE = [
    X("forward", "user_annotation", 1000, 2000),
    X("backward", "user_annotation", 3000, 2000),
    X("aten::mm", "cpu_op", 3000, 1900),
    X("sync", "user_annotation", 5000, 1500),
    X("c10d::allreduce_", "cpu_op", 5100, 50),
    X("gloo:all_reduce", "user_annotation", 5200, 800, tid=7),
    X("optimizer", "user_annotation", 6500, 500),
]
NCCL_NAIVE = [
    X("forward", "user_annotation", 1000, 2000),
    X("backward", "user_annotation", 3000, 2000),
    X("sync", "user_annotation", 5000, 1500),
    X("optimizer", "user_annotation", 6500, 500),
    launch(1, 3200), launch(2, 5100),
    kernel("ampere_sgemm_64x64_tn", 1, 3300, 3200),
    kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 2, 6500, 1000, stream=20),
]


def summary_of(tr, tmp_path, trace, method="naive"):
    path = write(tmp_path, trace, name=f"{method}.rank0.json")
    return tr.summary([{method: {"path": str(path), "step_ms": 10.0}}])[0]


@pytest.mark.parametrize("mode, trace", [("cpu", CPU_NAIVE), ("nccl", NCCL_NAIVE),
                                         ("shared", SHARED_NAIVE)])
def test_naive_ddp_hides_nothing_in_every_mode(tr, tmp_path, monkeypatch, mode, trace):
    all_references(tr, monkeypatch)
    row = summary_of(tr, tmp_path, trace)
    assert row["mode"] == mode and row["comparable"], row
    assert row["comm_ms"] > 0 and row["hidden_ms"] == pytest.approx(0), (
        f"naive DDP all-reduces after its backward, yet the table says {row} on {mode}: on a "
        "shared GPU gloo's span starts while the backward's kernels still run, and its first "
        "part waits for them (the copy of the gradient to the host): that is not communication")
    assert row["fraction"] == pytest.approx(0)


def test_on_a_shared_gpu_gloo_s_spans_start_when_their_input_reached_the_host(tr, tmp_path,
                                                                            monkeypatch):
    all_references(tr, monkeypatch)
    raw = events_of(tr, tmp_path, SHARED_NAIVE)
    assert solution("hidden_fraction")(raw)["hidden_ms"] > 1, (
        "the trace shows the trap: raw spans look hidden")
    ran = tr.as_run(raw)
    assert pairs(solution("comm_intervals")(ran)) == pairs(SHARED_NAIVE_COMM)
    assert len(ran) == len(raw) and tr.as_run(events_of(tr, tmp_path, CPU_STEP)) is not None
    overlap = tr.as_run(events_of(tr, tmp_path, SHARED_OVERLAP))
    assert pairs(solution("comm_intervals")(overlap)) == [(2.85, 3.2)], (
        "a span starts when the work queued BEFORE its collective is done (its copy to the "
        "host included), not after kernels the backward queued later")
    assert solution("hidden_fraction")(overlap)["fraction"] == pytest.approx(1.0)
    for trace in (CPU_STEP, GPU_STEP):  # gloo on the CPU and NCCL: the trace as it is
        events = events_of(tr, tmp_path, trace)
        assert tr.as_run(events) == events


def test_unmatched_spans_on_a_shared_gpu_are_not_comparable(tr, tmp_path, monkeypatch):
    all_references(tr, monkeypatch)
    extra = SHARED_NAIVE + [X("gloo:all_reduce", "user_annotation", 7600, 100, tid=7)]
    row = summary_of(tr, tmp_path, extra)
    assert not row["comparable"] and row["fraction"] is None and row["hidden_ms"] is None
    assert row["comm_ms"] > 0
    table = tr.format_summary([row, {"method": "fsdp", "skipped": "Task 09.2: ..."}])
    assert "n/c" in table and "not comparable" in table and "shared" in table, table
