"""Planted bugs of lesson 13, streaming.py (format: tests/planted.py)."""

from tests.planted import Bug

F = "13_local_sgd/streaming.py"
T = "tests/l13_local_sgd/test_streaming.py::"
SIMULATOR = T + "test_streaming_equals_simulator"

BUGS = [
    Bug("13.5-contiguous", F, where="13.5",
        find="    return [blocks[p::fragments] for p in range(fragments)]\n",
        replace="    size = -(-len(blocks) // fragments)\n"
                "    return [blocks[p * size:(p + 1) * size] for p in range(fragments)]\n",
        tests=(T + "test_strided_fragments",),
        expect=r"fragments are strided: block i → fragment i % F",
        why="contiguous slices of the network ({0, 1}, {2, 3}, {4, 5}), not the paper's "
            "strided pattern: each fragment should hold layers from bottom to top"),
    Bug("13.6-rank-order", F, where="13.6",
        find="    return (step // every - 1) % fragments\n",
        replace="    import torch.distributed as dist\n"
                "    rank = dist.get_rank() if dist.is_initialized() else 0\n"
                "    return (step // every - 1 + rank) % fragments\n",
        tests=(T + "test_every_rank_syncs_the_same_fragment",),
        expect=r"ranks averaged different fragments: every rank syncs the same fragment at "
               r"the same step",
        why="the ranks stagger their fragments by rank: the all-reduce adds values of "
            "different layers, silently since the fragments are the same size"),
    Bug("13.6-reversed", F, where="13.6",
        find="    return (step // every - 1) % fragments\n",
        replace="    return -(step // every) % fragments\n",
        tests=(T + "test_fragment_schedule",),
        expect=r"fragments out of order: 0, 1, 2, \.\.\.",
        why="the fragments are synced in the order F−1, ..., 1, 0"),
    Bug("13.6-every-h", F, where="13.6",
        find="    every = sync_every // fragments\n", replace="    every = sync_every\n",
        tests=(T + "test_fragment_schedule",),
        expect=r"one fragment every H/F = 2 steps",
        why="one fragment every H steps: each fragment synced once per F·H steps"),
    Bug("13.7-shared-snapshot", F, where="13.7",
        find="        self.snapshots[p] = [x.detach().clone() for x in params]\n",
        replace="        self.snapshots = [[x.detach().clone() for x in ps]\n"
                "                          for ps in self.fragment_params]\n",
        tests=(SIMULATOR,),
        expect=r"changed fragment \d's snapshot: each fragment measures Δ from its own last "
               r"sync",
        why="one snapshot of the whole model renewed at every fragment's sync: the other "
            "fragments' Δ then counts only the steps since ANY sync"),
    Bug("13.7-no-restore", F, where="13.7",
        find="                x.copy_(s)\n", replace="",
        tests=(SIMULATOR,),
        expect=r"weights differ from the one-process simulator .* params restored to "
               r"snapshots\[p\]",
        why="the outer step applied to the rank's local weights, not to the snapshot"),
    Bug("13.7-whole-model", F, where="13.7",
        find="        params, snapshot = self.fragment_params[p], self.snapshots[p]\n",
        replace="        params = [x for ps in self.fragment_params for x in ps]\n"
                "        snapshot = [s for ss in self.snapshots for s in ss]\n",
        more=(("13.7", "        self.outer_optimizers[p].step()\n"
                       "        self.outer_optimizers[p].zero_grad(set_to_none=True)\n"
                       "        self.snapshots[p] = [x.detach().clone() for x in params]\n",
               "        for opt in self.outer_optimizers:\n"
               "            opt.step()\n"
               "            opt.zero_grad(set_to_none=True)\n"
               "        self.snapshots = [[x.detach().clone() for x in ps]\n"
               "                          for ps in self.fragment_params]\n"),),
        tests=(T + "test_peak_bytes_per_sync_is_total_over_f",),
        expect=r"expected 672 = the whole model's 2016 / F: a sync sends its fragment only",
        why="every sync sends the whole model: the peak is DiLoCo's, F times the total"),
]
