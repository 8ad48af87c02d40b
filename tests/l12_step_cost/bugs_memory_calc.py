"""Planted bugs of lesson 12, memory_calc.py (format: tests/planted.py)."""

from tests.planted import Bug

F = "12_step_cost/memory_calc.py"
T = "tests/l12_step_cost/test_memory_calc.py::"

BUGS = [
    Bug("12.7-zero2-grads-whole", F, where="12.7",
        find="    grads = held(2) * g_bytes\n", replace="    grads = held(3) * g_bytes\n",
        tests=(T + "test_memory_of_the_zero_papers_figure_1",),
        expect=r"zero2: grads 15000000000 bytes, expected 234375000: ZeRO-2 and ZeRO-3 shard "
               r"the gradients",
        why="ZeRO-2 keeps every gradient on every rank, as ZeRO-1 does: its whole point lost"),
    Bug("12.7-no-master-weights", F, where="12.7",
        find="    master = held(1) * MASTER_BYTES if p_bytes < MASTER_BYTES else 0\n",
        replace="    master = 0\n",
        tests=(T + "test_memory_of_the_zero_papers_figure_1",),
        expect=r"master 0 bytes, expected 30000000000: 16-bit parameters mean mixed "
               r"precision: an fp32 master copy",
        why="mixed precision counted as 16-bit parameters only: the fp32 master copy the "
            "optimizer updates is forgotten (K = 8, not 12)"),
    Bug("12.7-adam-one-state", F, where="12.7",
        find="    states = OPTIMIZER_STATES[optimizer]\n",
        replace="    states = 0 if optimizer == \"sgd\" else 1\n",
        tests=(T + "test_memory_of_the_zero_papers_figure_1",),
        expect=r"optimizer 30000000000 bytes, expected 60000000000: Adam keeps 2 fp32 states",
        why="Adam counted with one state (the momentum), its second moment exp_avg_sq forgotten"),
    Bug("12.7-floor-shards", F, where="12.7",
        find="shard = -(-num_params // world_size)",
        replace="shard = num_params // world_size",
        tests=(T + "test_memory_small_cases_by_hand",),
        expect=r"a shard is ceil\(P/N\) = 3 elements .*not P // N = 2",
        why="P // N elements per rank: the flat vector is padded to a multiple of N, so each "
            "rank holds ceil(P/N)"),
    Bug("12.8-fsdp-as-ddp", F, where="12.8",
        find="        sent[\"all_gather\"] = 2 * passes * p_bytes\n",
        replace="        sent[\"all_gather\"] = passes * p_bytes\n",
        tests=(T + "test_bytes_per_step_by_hand",
               T + "test_bytes_match_what_lessons_08_09_send"),
        expect=r"zero3: all_gather 36 bytes sent, expected 72: .*ZeRO-3 gathers them in "
               r"forward and again in backward",
        why="FSDP's traffic taken for DDP's: the parameters are gathered for backward again, "
            "so it moves 3(N-1)/N, 1.5x DDP's, not 2(N-1)/N"),
    Bug("12.8-ring-factor-n", F, where="12.8",
        find="passes = (world_size - 1) * -(-num_params // world_size)",
        replace="passes = world_size * -(-num_params // world_size)",
        tests=(T + "test_bytes_per_step_by_hand",),
        expect=r"N=1, ddp: \d+ bytes sent, expected 0: .*the factor is \(N-1\)/N, not N/N",
        why="a ring pass counted as N chunks: one rank would send its whole buffer to nobody"),
    Bug("12.8-all-reduce-one-pass", F, where="12.8",
        find="        sent[\"all_reduce\"] = 2 * passes * g_bytes\n",
        replace="        sent[\"all_reduce\"] = passes * g_bytes\n",
        tests=(T + "test_bytes_per_step_by_hand",),
        expect=r"ddp: all_reduce 36 bytes sent, expected 72: DDP all-reduces the gradients: "
               r"two ring passes",
        why="an all-reduce counted as one pass: it is a reduce-scatter then an all-gather, "
            "2(N-1)/N of the buffer"),
]
