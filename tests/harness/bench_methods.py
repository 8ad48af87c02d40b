"""Benchmark methods that misbehave on purpose, for the harness's own tests."""

import time

from benchmarks.registry import method


@method("broken", "raises on construction (test only)")
def broken(ctx):
    raise RuntimeError("this method is broken on purpose")


@method("stuck", "never finishes a step (test only)")
def stuck(ctx):
    def step():
        time.sleep(3600)

    return step


@method("broken_torchrun", "raises on rank 1 under torchrun (test only)", launcher="torchrun")
def broken_torchrun(ctx):
    if ctx.rank == 1:
        raise RuntimeError("rank 1 is broken on purpose under torchrun")

    def step():
        return 0.0

    return step


@method("slow_step", "a step of 0.05 s on rank 0 and 0.2 s on the others (test only)")
def slow_step(ctx):
    seconds = 0.05 if ctx.rank == 0 else 0.2

    def step():
        time.sleep(seconds)
        return 0.0

    return step


@method("fast_step", "a step of about 1 ms, as a GPU step takes (test only)")
def fast_step(ctx):
    def step():
        time.sleep(0.001)
        return 0.0

    return step


# A fake clock (seconds) that the harness's own test reads in place of time.perf_counter
CLOCK = [0.0]


@method("round_of_4", "a call is a round of 4 inner steps of 1 s and a sync of 2 s on a fake "
        "clock (test only)")
def round_of_4(ctx):
    def inner_steps():
        CLOCK[0] += 4 * 1.0
        return 0.0

    def round_():
        inner_steps()
        CLOCK[0] += 2.0  # the sync
        return 0.0

    return round_, {"inner_steps": 4, "compute_step": inner_steps}


@method("bad_inner_steps", "says a call is half a step (test only)")
def bad_inner_steps(ctx):
    return (lambda: 0.0), {"inner_steps": 0.5}
