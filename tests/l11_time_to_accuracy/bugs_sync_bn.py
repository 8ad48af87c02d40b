"""Planted bugs of lesson 11, part: sync_bn (see planted_bugs.py)."""

from tests.planted import Bug

S = "11_time_to_accuracy/sync_bn.py"
T = "tests/l11_time_to_accuracy/test_sync_bn.py::"
MOMENTS = T + "test_global_moments_are_the_whole_batchs"
SUMS = "sums = all_reduce_sum(torch.cat([x.sum(dims), (x * x).sum(dims), n]), group)"
RUNNING = "self.running_var.mul_(1 - m).add_(m * var * count / (count - 1))"

BUGS = [
    # --- 11.3 global_moments ------------------------------------------------------------------
    Bug("11.3-count-not-reduced", S, where="11.3",
        find="count = sums[2 * c]", replace="count = n[0]",
        tests=(MOMENTS,),
        expect=r"count not all-reduced: uneven batches need the global n",
        why="divides the global sums by this rank's count: wrong whenever the ranks hold "
            "different numbers of samples, and N times off when they do not"),
    Bug("11.3-mean-of-means", S, where="11.3",
        find=SUMS,
        replace="sums = all_reduce_sum(torch.cat([x.sum(dims) / n, (x * x).sum(dims) / n, "
                "n / n]), group)",
        tests=(MOMENTS,),
        expect=r"the mean of the ranks' means, which is not the mean of uneven batches",
        why="averages the ranks' means: a rank of 2 samples weighs as much as one of 5"),
    Bug("11.3-unbiased-normalise", S, where="11.3",
        find="var = (sums[c:2 * c] / count - mean * mean).clamp_min(0)",
        replace="var = ((sums[c:2 * c] - count * mean * mean) / (count - 1)).clamp_min(0)",
        tests=(MOMENTS,),
        expect=r"BatchNorm normalises with the biased variance \(divide by n\)",
        why="normalises with the unbiased variance (n − 1): not what BatchNorm computes"),
    Bug("11.3-plain-all-reduce", S, where="11.3",
        find=SUMS,
        replace="sums = torch.cat([x.sum(dims), (x * x).sum(dims), n])\n"
                "    dist.all_reduce(sums, group=group)",
        tests=(T + "test_global_moments_gradients_reach_every_rank",),
        expect=r"input gradients differ: .*the statistics' all-reduce must be part of autograd",
        why="dist.all_reduce is invisible to autograd: the right statistics, but each rank's "
            "input gradients miss the other ranks' losses"),
    # --- 11.4 SyncBatchNormByHand.forward -----------------------------------------------------
    Bug("11.4-running-var-biased", S, where="11.4",
        find=RUNNING, replace="self.running_var.mul_(1 - m).add_(m * var)",
        tests=(T + "test_sync_bn_by_hand_running_statistics_and_eval",),
        expect=r"running_var takes var·n/\(n−1\)",
        why="keeps the biased variance in running_var, where torch keeps the unbiased one"),
    Bug("11.4-local-n-in-unbiased", S, where="11.4",
        find=RUNNING,
        replace="self.running_var.mul_(1 - m).add_(m * var * (x.numel() / x.shape[1]) / "
                "(x.numel() / x.shape[1] - 1))",
        tests=(T + "test_sync_bn_by_hand_running_statistics_and_eval",),
        expect=r"n/\(n−1\) with this rank's n",
        why="Bessel's correction with this rank's count: 2/1 on a rank of 2 samples, where "
            "the global batch of 10 gives 10/9"),
    Bug("11.4-stats-detached", S, where="11.4",
        find="mean, var, count = global_moments(x, self.group)",
        replace="mean, var, count = (t.detach() for t in global_moments(x, self.group))",
        tests=(T + "test_sync_bn_by_hand_trains_as_one_process",),
        expect=r"input gradients differ from one process's",
        why="treats the statistics as constants: the gradient through the mean and the "
            "variance is lost"),
    Bug("11.4-batch-stats-in-eval", S, where="11.4",
        find="if self.training or self.running_mean is None:", replace="if True:",
        tests=(T + "test_sync_bn_by_hand_running_statistics_and_eval",),
        expect=r"in eval mode the output must use the running statistics",
        why="normalises with the batch's statistics in eval too"),
    # --- 11.5 convert_sync_by_hand ------------------------------------------------------------
    Bug("11.5-running-stats-not-copied", S, where="11.5",
        find="            out.running_mean = module.running_mean\n"
             "            out.running_var = module.running_var\n"
             "            out.num_batches_tracked = module.num_batches_tracked\n",
        replace="            pass\n",
        tests=(T + "test_convert_keeps_weights_and_statistics",),
        expect=r"the converted model's running_mean differs",
        why="a fresh layer's running statistics (0 and 1) replace what the model had learned"),
    Bug("11.5-no-recursion", S, where="11.5",
        find="out.add_module(name, convert_sync_by_hand(child, group))",
        replace="out.add_module(name, child)",
        tests=(T + "test_convert_keeps_weights_and_statistics",
               T + "test_converted_convnet_trains_as_one_process"),
        expect=r"every batch norm, at any depth, becomes a SyncBatchNormByHand|differs from "
               r"one process",
        why="replaces only a batch norm passed in itself, none inside the model"),
    Bug("11.5-copies-the-weights", S, where="11.5",
        find="out.weight, out.bias = module.weight, module.bias",
        replace="out.weight.data.copy_(module.weight.data)\n"
                "            out.bias.data.copy_(module.bias.data)",
        tests=(T + "test_convert_keeps_weights_and_statistics",),
        expect=r"must be the very same parameters",
        why="new parameters with the old values: an optimizer built before the conversion "
            "steps parameters the model no longer uses"),
]
