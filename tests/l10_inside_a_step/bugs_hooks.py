"""Planted bugs of lesson 10, part: hooks (see planted_bugs.py)."""

from tests.planted import Bug

H = "10_inside_a_step/comm_hooks.py"
T = "tests/l10_inside_a_step/test_hooks.py::"
T3 = "tests/l10_inside_a_step/test_at_three_ranks.py::"  # what only 3 ranks show

BUGS = [
    # --- 10.8 bf16_hook_by_hand --------------------------------------------------------------
    Bug("10.8-no-divide", H, where="10.8",
        find="compressed = bucket.buffer().to(torch.bfloat16).div_(world_size)",
        replace="compressed = bucket.buffer().to(torch.bfloat16)",
        tests=(T + "test_hand_hook_returns_the_averaged_bucket_in_its_own_buffer",
               T + "test_first_ddp_step_with_the_hand_hook_gives_bf16_averaged_gradients"),
        expect=r"missing divide by world size",
        why="the all-reduce sums the shares: every step is world-size times too big"),
    Bug("10.8-returns-the-bf16-tensor", H, where="10.8",
        find="return future.then(decompress)",
        replace="return future.then(lambda fut: fut.value()[0])",
        tests=(T + "test_hand_hook_returns_the_averaged_bucket_in_its_own_buffer",),
        expect=r"decompressed into the bucket's fp32 buffer",
        why="the Future holds the bf16 tensor that was sent, not the fp32 gradients"),
    Bug("10.8-blocking-all-reduce", H, where="10.8",
        find="future = dist.all_reduce(compressed, group=group, async_op=True).get_future()",
        replace="dist.all_reduce(compressed, group=group)\n"
                "    future = torch.futures.Future()\n"
                "    future.set_result([compressed])",
        tests=(T + "test_hand_hook_returns_the_averaged_bucket_in_its_own_buffer",),
        expect=r"the all-reduce blocks",
        why="waits for the all-reduce inside the hook: backward stalls on every bucket, no "
            "overlap of communication with computation"),
    Bug("10.8-sends-fp32", H, where="10.8",
        find="compressed = bucket.buffer().to(torch.bfloat16).div_(world_size)",
        replace="compressed = bucket.buffer().div(world_size)",
        tests=(T + "test_hand_hook_returns_the_averaged_bucket_in_its_own_buffer",
               T + "test_ddp_trains_with_the_hand_hook_exactly_as_with_torchs_bf16_hook"),
        expect=r"send the bf16 copy of the bucket|bf16 is 2 bytes",
        why="forgets to compress: the hook sends the fp32 bucket, nothing saved"),
    Bug("10.8-result-in-a-new-tensor", H, where="10.8",
        find="        buffer = bucket.buffer()\n        buffer.copy_(fut.value()[0])\n"
             "        return buffer",
        replace="        return fut.value()[0].float()",
        tests=(T + "test_hand_hook_returns_the_averaged_bucket_in_its_own_buffer",),
        expect=r"the Future's tensor is a new tensor",
        why="decompresses into a new fp32 tensor: one more bucket-sized buffer per bucket, "
            "and the bucket's own buffer keeps the local gradients"),
    Bug("10.8-divides-by-two", H, where="10.8",
        find="compressed = bucket.buffer().to(torch.bfloat16).div_(world_size)",
        replace="compressed = bucket.buffer().to(torch.bfloat16).div_(2)",
        tests=(T3 + "test_hand_hook_gives_torchs_bits_at_three_ranks",),
        expect=r"it divides by 2, not by the world size",
        why="averages over the 2 ranks the lesson runs: at 3 every gradient is 1.5 times "
            "too big"),
    Bug("10.8-divides-in-fp32", H, where="10.8",
        find="compressed = bucket.buffer().to(torch.bfloat16).div_(world_size)",
        replace="compressed = bucket.buffer().div(world_size).to(torch.bfloat16)",
        tests=(T3 + "test_hand_hook_gives_torchs_bits_at_three_ranks",),
        expect=r"close to the mean but not bit for bit",
        why="divides the fp32 buffer, then rounds to bf16: at 3 ranks a different rounding "
            "from torch's hook (at 2 the division is exact and the bits agree)"),
    Bug("10.8-divides-after-the-sum", H, where="10.8",
        find="compressed = bucket.buffer().to(torch.bfloat16).div_(world_size)",
        replace="compressed = bucket.buffer().to(torch.bfloat16)",
        more=(("10.8", "        buffer.copy_(fut.value()[0])\n",
               "        buffer.copy_(fut.value()[0]).div_(world_size)\n"),),
        tests=(T3 + "test_hand_hook_gives_torchs_bits_at_three_ranks",),
        expect=r"close to the mean but not bit for bit",
        why="sums the undivided bf16 gradients, then divides the fp32 result: other bits "
            "than torch's hook at 3 ranks, and a sum that can overflow fp16"),
    # --- 10.9 attach_hook ------------------------------------------------------------------
    Bug("10.9-powersgd-rank-ignored", H, where="10.9",
        find='matrix_approximation_rank=o["rank"]', replace="matrix_approximation_rank=1",
        tests=(T + "test_attach_hook_builds_powersgd_state_from_the_options",),
        expect=r"build it from the options",
        why="PowerSGD always runs at rank 1, whatever the caller asked"),
    Bug("10.9-defaults-override-options", H, where="10.9",
        find="o = {**POWERSGD_DEFAULTS, **opts}", replace="o = {**opts, **POWERSGD_DEFAULTS}",
        tests=(T + "test_attach_hook_builds_powersgd_state_from_the_options",),
        expect=r"build it from the options",
        why="the defaults are merged last, so the caller's options are thrown away"),
    Bug("10.9-by-hand-is-torchs", H, where="10.9",
        find='"bf16_by_hand": bf16_hook_by_hand}',
        replace='"bf16_by_hand": default_hooks.bf16_compress_hook}',
        tests=(T + "test_attach_hook_registers_the_named_hook",),
        expect=r"want bf16_hook_by_hand",
        why="registers torch's hook under the student's name: the hand-written one never runs"),
    Bug("10.9-none-registers-a-hook", H, where="10.9",
        find='    if name == "none":\n        return None\n',
        replace='    if name == "none":\n'
                "        ddp.register_comm_hook(None, default_hooks.allreduce_hook)\n"
                "        return None\n",
        tests=(T + "test_attach_hook_registers_the_named_hook",),
        expect=r"register nothing",
        why="'none' is the baseline: a Python hook there is not DDP's own all-reduce"),
    # --- 10.10 AllReduceCounter ------------------------------------------------------------
    Bug("10.10-counts-elements", H, where="10.10",
        find="self.bytes += tensor.numel() * tensor.element_size()",
        replace="self.bytes += tensor.numel()",
        tests=(T + "test_counter_counts_the_bytes_of_every_all_reduce_and_puts_it_back",
               T + "test_counter_sees_what_each_hook_sends_per_step"),
        expect=r"adds elements, not bytes",
        why="counts elements: bf16 and fp32 look the same size"),
    Bug("10.10-never-restored", H, where="10.10",
        find="dist.all_reduce = self._real", replace="pass",
        tests=(T + "test_counter_counts_the_bytes_of_every_all_reduce_and_puts_it_back",),
        expect=r"still the wrapper",
        why="leaves the wrapper in torch.distributed after the block: every later counter "
            "wraps the wrapper"),
    Bug("10.10-drops-the-work-handle", H, where="10.10",
        find="return real(tensor, *args, **kwargs)", replace="real(tensor, *args, **kwargs)",
        tests=(T + "test_counter_counts_the_bytes_of_every_all_reduce_and_puts_it_back",),
        expect=r"must return what the real all_reduce returns",
        why="the wrapper returns None: every hook's .get_future() fails"),
    Bug("10.10-counts-link-bytes", H, where="10.10",
        find="self.bytes += tensor.numel() * tensor.element_size()",
        replace="n = dist.get_world_size()\n"
                "            self.bytes += 2 * (n - 1) * tensor.numel() * tensor.element_size() "
                "// n",
        tests=(T3 + "test_counter_counts_the_payload_at_three_ranks",),
        expect=r"the bytes a ring all-reduce puts on each link",
        why="counts what a ring all-reduce sends per rank, 2 (N - 1) / N of the payload: the "
            "payload at 2 ranks, 4/3 of it at 3"),
]
