"""Planted bugs of lesson 12, bandwidth.py (format: tests/planted.py)."""

from tests.planted import Bug

S = "12_step_cost/bandwidth.py"
T = "tests/l12_step_cost/test_bandwidth.py::"
FACTORS = T + "test_bus_factors_are_nccl_tests"
SIZE = T + "test_bandwidths_count_the_whole_array"
TENSORS = T + "test_time_collective_sizes_the_tensors_per_operation"
SLOWEST = T + "test_time_collective_reports_the_slowest_ranks_time_on_every_rank"
FINISHED = T + "test_time_collective_times_finished_work_after_the_warm_up"

BUGS = [
    # --- 12.5 bus_factor, bandwidths ----------------------------------------------------------
    Bug("12.5-all-gather-factor-as-all-reduce", S, where="12.5",
        find="    return (n - 1) / n\n", replace="    return 2 * (n - 1) / n\n",
        tests=(FACTORS,),
        expect=r"bus_factor\('all_gather', \d\) = .*only the assignment half of an all-reduce",
        why="gives all-gather (and reduce-scatter) all-reduce's 2(n-1)/n: their busbw comes "
            "out twice what the links carried"),
    Bug("12.5-broadcast-factor-n-1-over-n", S, where="12.5",
        find="        return 1.0\n", replace="        return (n - 1) / n\n",
        tests=(FACTORS,),
        expect=r"bus_factor\('broadcast', \d\) = .*every byte leaves the root through its one "
               r"link",
        why="treats broadcast like all-gather: but the root alone sends all S bytes, so "
            "nothing is spread over n links"),
    Bug("12.5-algbw-from-the-chunk", S, where="12.5",
        find='size = output_bytes if op == "all_gather" else input_bytes',
        replace="size = input_bytes",
        tests=(SIZE,),
        expect=r"all_gather: S = \d+ bytes, one rank's chunk; nccl-tests' S is the whole array",
        why="divides each rank's input chunk by the time: an all-gather's algbw comes out N "
            "times too small, and shrinks as N grows"),
    # --- 12.6 time_collective -----------------------------------------------------------------
    Bug("12.6-all-gather-input-is-the-whole-array", S, where="12.6",
        find="        inp = torch.zeros(chunk, dtype=DTYPE, device=dev)\n"
             "        out = torch.zeros(chunk * n, dtype=DTYPE, device=dev)\n",
        replace="        inp = torch.zeros(chunk * n, dtype=DTYPE, device=dev)\n"
                "        out = torch.zeros(chunk * n * n, dtype=DTYPE, device=dev)\n",
        tests=(TENSORS,),
        expect=r"all_gather of S = 4096 bytes on 2 ranks: the tensors passed were .*"
               r"each rank's input is a chunk of S/N",
        why="gives each rank the whole S to contribute: the all-gather moves N times the "
            "bytes the row reports"),
    Bug("12.6-own-time-not-the-slowest", S, where="12.6",
        find="    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)\n", replace="",
        tests=(SLOWEST,),
        expect=r"each reported its own; the collective is done when its slowest rank is",
        why="each rank reports its own median: a rank that left the collective early "
            "reports a time the collective did not take"),
    Bug("12.6-no-warm-up", S, where="12.6",
        find="    for _ in range(warmup):\n        collective_call(op, inp, out)\n",
        replace="",
        tests=(FINISHED,),
        expect=r"the first call's set-up counted: make `warmup` untimed calls first",
        why="times the first call too, which sets up the connections (NCCL's communicator): "
            "with few repeats the median holds the set-up"),
    Bug("12.6-clock-before-the-sync", S, where="12.6",
        find="        collective_call(op, inp, out)\n        synchronize(dev)",
        replace="        collective_call(op, inp, out)\n        stop = time.perf_counter()\n"
                "        synchronize(dev)",
        more=(("12.6", "times.append(time.perf_counter() - start)",
               "times.append(stop - start)"),),
        tests=(FINISHED,),
        expect=r"the clock was read before the device finished",
        why="reads the clock when the call returns: on a GPU that is when the work was "
            "queued, not done"),
]
