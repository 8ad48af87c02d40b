"""Planted bugs of lesson 12, crossover.py (format: tests/planted.py)."""

from tests.planted import Bug

F = "12_step_cost/crossover.py"
T = "tests/l12_step_cost/test_crossover.py::"

BUGS: list = [
    Bug("12.9-gbits-as-bytes", F, where="12.9",
        find="        return link.rate * 1e9 / 8\n", replace="        return link.rate * 1e9\n",
        tests=(T + "test_link_bandwidth_from_its_unit",),
        expect=r"a network's rate is in bits per second",
        why="a 100 Gb/s Ethernet link taken for 100 GB/s: communication 8x too fast"),
    Bug("12.9-bytes-counted-again", F, where="12.9",
        find="sent = by_op[op] / ops.count(op)",
        replace="sent = (2 if op == \"all_reduce\" else 1) * (setup.n - 1) / setup.n "
                "* setup.params * setup.bytes_per_elem",
        more=(("12.9", "    by_op = ring_bytes(strategy, setup)\n", ""),),
        tests=(T + "test_collectives_take_their_bytes_from_bytes_per_step",),
        expect=r"collectives never asked 12.8's bytes_per_step",
        why="the ring volume written a second time, (N-1)/N·P·b by hand, instead of taking "
            "12.8's bytes_per_step: two answers to keep in step"),
    Bug("12.9-fsdp-gathers-not-split", F, where="12.9",
        find="sent = by_op[op] / ops.count(op)", replace="sent = by_op[op]",
        tests=(T + "test_collectives_take_their_bytes_from_bytes_per_step",
               T + "test_bytes_one_rank_sends_per_strategy"),
        expect=r"each of the two all-gathers sent bytes_per_step's whole all_gather|FSDP sends "
               r"4\(N-1\)/N·P·b: each gather took bytes_per_step's whole all_gather",
        why="each FSDP gather given bytes_per_step's all_gather, which already counts both: "
            "FSDP's parameters counted four times, not twice"),
    Bug("12.9-zero-gather-in-backward", F, where="12.9",
        find='"zero2": [("reduce_scatter", "backward"), ("all_gather", "after_step")],',
        replace='"zero2": [("reduce_scatter", "backward"), ("all_gather", "backward")],',
        tests=(T + "test_collectives_take_their_bytes_from_bytes_per_step",),
        expect=r"zero2's collectives are .*all-gather of the updated parameters after the "
               r"optimizer step",
        why="ZeRO-2's all-gather of the parameters put in backward, where it would hide: the "
            "parameters it gathers exist only after the optimizer step"),
    Bug("12.9-latency-once", F, where="12.9",
        find="setup.calls * setup.link.latency_us * 1e-6", replace="setup.link.latency_us * 1e-6",
        tests=(T + "test_alpha_beta_seconds",),
        expect=r"5 calls paid the latency once",
        why="alpha paid once per collective instead of once per bucket or unit"),
    Bug("12.10-six-is-two", F, where="12.10",
        find="per_token = setup.flops_per_token or 6 * setup.params",
        replace="per_token = setup.flops_per_token or 2 * setup.params",
        tests=(T + "test_step_split_by_hand",),
        expect=r"that is forward only; a training step is 6 FLOPs per parameter per token",
        why="compute counted as forward's 2·P·tokens: a step's compute 3x too small"),
    Bug("12.10-ddp-hides-under-forward", F, where="12.10",
        find='max(0.0, by_when["backward"] - backward)',
        replace='max(0.0, by_when["backward"] - compute)',
        tests=(T + "test_step_split_by_hand",),
        expect=r"hid behind forward too",
        why="the gradient all-reduce hidden behind the whole step, forward included, though "
            "no gradient exists before backward"),
    Bug("12.10-hide-against-whole-step", F, where="12.10",
        find='by_when["backward"] / (2 * c / 3)', replace='by_when["backward"] / c',
        tests=(T + "test_hiding_batch_hides_and_one_token_less_does_not",),
        expect=r"the batch whose whole compute equals the all-reduce",
        why="the hiding batch solved against forward + backward: 2/3 of the batch needed"),
]
