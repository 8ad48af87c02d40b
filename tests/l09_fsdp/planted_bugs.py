"""Lesson 09's planted bugs: the mistakes its tests must catch, each for the right reason.

The format and how an edit is made: ``tests/planted.py``. Plant them with
``make plant-bugs LESSON=09`` (``tools/plant_bugs.py``).
"""

from tests.planted import Bug

F = "09_fsdp/fsdp_by_hand.py"
T = "tests/l09_fsdp/test_fsdp_by_hand.py::"

# The memory table and activation checkpointing
MT = "09_fsdp/memory_table.py"
AC = "09_fsdp/activation_checkpointing.py"
TM = "tests/l09_fsdp/test_memory.py::"

# FSDP2 in practice and DCP
# FSDP2 and DCP (09.17-09.23)
FP = "09_fsdp/fsdp2_practice.py"
FD = "09_fsdp/dcp_checkpoint.py"
TP = "tests/l09_fsdp/test_fsdp2_dcp.py::"

BUGS = [
    # --- FSDP by hand (09.1-09.12) ------------------------------------------------------------
    # 09.1 shard_flat
    Bug("09.1-padding-at-the-front", F, where="09.1",
        find="flat = F.pad(flat, (0, padded - flat.numel()))",
        replace="flat = F.pad(flat, (padded - flat.numel(), 0))",
        tests=(T + "test_shard_flat_pads_with_zeros_and_keeps_this_ranks_chunk",),
        expect=r"the padding goes at the end",
        why="the zeros go first: every parameter's piece of the flat vector moves, and the "
            "views read the padding as weights"),
    Bug("09.1-shard-is-a-view", F, where="09.1",
        find="return flat.chunk(world_size)[rank].clone(), padded",
        replace="return flat.chunk(world_size)[rank], padded",
        tests=(T + "test_shard_flat_keeps_an_fp32_copy_of_its_own",),
        expect=r"keeps the whole flat vector alive",
        why="the shard is a view of the whole flat vector, which then stays in memory on "
            "every rank: nothing is saved"),
    Bug("09.1-shard-not-fp32", F, where="09.1",
        find="t.detach().reshape(-1).to(torch.float32)", replace="t.detach().reshape(-1)",
        tests=(T + "test_shard_flat_keeps_an_fp32_copy_of_its_own",),
        expect=r"the shards are the fp32 master weights",
        why="the shards keep the dtype of the weights they came from: low-precision master "
            "weights lose small updates"),
    # 09.2 gather
    Bug("09.2-master-weights-in-low-precision", F, where="09.2",
        find="mine = self.shard.detach().to(full.dtype)",
        replace="self.shard.data = self.shard.data.to(full.dtype)\n"
                "        mine = self.shard.detach()",
        tests=(T + "test_gather_gives_each_unit_its_parameters_in_the_compute_dtype",),
        expect=r"the shards are the fp32 master weights",
        why="casts the shard itself to the compute dtype: the optimizer then steps bf16 "
            "master weights"),
    Bug("09.2-gather-into-the-autograd-tensor", F, where="09.2",
        find="dist.all_gather_into_tensor(full.data, mine,",
        replace="dist.all_gather_into_tensor(full, mine,",
        tests=(T + "test_gather_gives_each_unit_its_parameters_in_the_compute_dtype",),
        expect=r"modified inplace",
        why="writes the gather into the tensor autograd tracks: an in-place change of the "
            "views it saved"),
    # 09.3 use
    Bug("09.3-views-skip-a-front-padding", F, where="09.3",
        find="pieces = self.full.split([*self.numels, self.padded - self.numel])",
        replace="pieces = self.full.split([self.padded - self.numel, *self.numels])[1:]",
        tests=(T + "test_use_points_every_parameter_at_its_piece_of_the_gathered_unit",),
        expect=r"the loss averaged over ranks is",
        why="the views start after the padding, as if it came first: with padding (3 ranks) "
            "every parameter reads its neighbour's numbers and the padding"),
    Bug("09.3-copies-not-views", F, where="09.3",
        find="setattr(module, attr, piece.view(shape))",
        replace="setattr(module, attr, piece.detach().reshape(shape).clone())",
        tests=(T + "test_use_points_every_parameter_at_its_piece_of_the_gathered_unit",),
        expect=r"not a view of unit\.full",
        why="the modules get copies: no gradient reaches the unit's flat tensor"),
    # 09.4 free
    Bug("09.4-memory-kept", F, where="09.4",
        find="        self.full.untyped_storage().resize_(0)\n", replace="",
        tests=(T + "test_free_leaves_each_rank_only_its_shards",),
        expect=r"still allocated after its forward",
        why="free drops the gradient but keeps the gathered parameters: every unit ends up "
            "whole on every rank"),
    Bug("09.4-gradient-kept", F, where="09.4",
        find="        self.full.grad = None\n", replace="",
        tests=(T + "test_free_leaves_each_rank_only_its_shards",),
        expect=r"still gathered after its gradient was sent",
        why="the unit's full gradient stays allocated after the reduce-scatter"),
    # 09.5 reduce_scatter
    Bug("09.5-gradients-summed", F, where="09.5",
        find="self.full.grad.to(torch.float32) / self.world_size",
        replace="self.full.grad.to(torch.float32)",
        tests=(T + "test_reduce_scatter_leaves_each_rank_the_average_of_its_chunk",),
        expect=r"the SUM over the 3 ranks",
        why="reduce-scatter sums: without the division each gradient is N times too big"),
    Bug("09.5-reduced-in-low-precision", F, where="09.5",
        find="self.grad_full = self.full.grad.to(torch.float32) / self.world_size\n"
             "        self.grad_shard = torch.empty_like(self.shard, dtype=torch.float32)",
        replace="self.grad_full = self.full.grad / self.world_size\n"
                "        self.grad_shard = torch.empty_like(self.shard, dtype=self.full.dtype)",
        tests=(T + "test_reduce_scatter_leaves_each_rank_the_average_of_its_chunk",),
        expect=r"reduce the gradients in fp32",
        why="the gradients are summed in bf16, losing precision the fp32 master weights need"),
    # 09.6 the hooks
    Bug("09.6-reduce-scatter-before-the-gradient-is-in", F, where="09.6",
        find="        for unit in self.all_units:\n"
             "            unit.full.register_post_accumulate_grad_hook(\n"
             "                lambda full, unit=unit: self._post_backward(unit))\n",
        replace="        for unit in self.units:\n"
                "            unit.module.register_full_backward_hook(\n"
                "                lambda module, gin, gout, unit=unit: self._post_backward(unit))\n"
                "        self.root.full.register_post_accumulate_grad_hook(\n"
                "            lambda full: self._post_backward(self.root))\n",
        tests=(T + "test_hooks_run_every_unit_s_schedule_once_per_step",),
        expect=r"started before autograd had accumulated the unit's gradient",
        why="the module's backward hook fires when the gradient of its INPUT is ready, before "
            "autograd has summed the gradients of its parameters"),
    Bug("09.6-root-never-sent", F, where="09.6",
        find="        for unit in self.all_units:\n", replace="        for unit in self.units:\n",
        tests=(T + "test_hooks_run_every_unit_s_schedule_once_per_step",),
        expect=r"after root's gradient was accumulated, no reduce-scatter",
        why="only the blocks get a post-backward hook: the root's gradient is never sent"),
    # 09.7 pre-forward
    Bug("09.7-gather-too-late", F, where="09.7",
        find="        if self.prefetch and unit.index + 1 < len(self.units):\n"
             "            following = self.units[unit.index + 1]\n"
             "            following.handle = following.gather()\n",
        replace="",
        tests=(T + "test_pre_forward_gathers_the_next_unit_while_this_one_computes",),
        expect=r"issue the next unit's gather before this one computes",
        why="no prefetch: each unit waits for its own gather (right numbers, slower)"),
    Bug("09.7-prefetched-unit-gathered-again", F, where="09.7",
        find="        if unit.handle is None:\n            unit.handle = unit.gather()\n",
        replace="        unit.handle = unit.gather()\n",
        tests=(T + "test_pre_forward_gathers_the_next_unit_while_this_one_computes",),
        expect=r"gathered 2 times in forward",
        why="gathers the unit even when its prefetch is in flight: twice the traffic, and the "
            "prefetch's handle is lost"),
    Bug("09.7-computes-before-the-gather-arrived", F, where="09.7",
        find="        unit.wait()\n", replace="",
        tests=(T + "test_pre_forward_gathers_the_next_unit_while_this_one_computes",),
        expect=r"started its forward while its all-gather was still pending",
        why="the unit computes with whatever the buffer holds while the gather is in flight"),
    Bug("09.7-views-not-made", F, where="09.7",
        find="        unit.use()\n", replace="",
        tests=(T + "test_pre_forward_gathers_the_next_unit_while_this_one_computes",),
        expect=r"not a view of unit\.full|views of an earlier forward",
        why="the unit is gathered but its modules are never pointed at the gathered tensor"),
    # 09.8 post-forward
    Bug("09.8-not-freed", F, where="09.8",
        find="        unit.free()\n", replace="",
        tests=(T + "test_post_forward_frees_the_unit_and_prepares_its_backward",),
        expect=r"still allocated after its forward",
        why="the unit stays gathered after its forward: the whole model is gathered by the "
            "end of forward"),
    Bug("09.8-no-pre-backward-hook", F, where="09.8",
        find="        if torch.is_grad_enabled() and output.requires_grad:\n"
             "            output.register_hook(lambda grad: self._pre_backward(unit))\n",
        replace="",
        tests=(T + "test_post_forward_frees_the_unit_and_prepares_its_backward",),
        expect=r"with its parameters freed",
        why="nothing gathers the unit again before its backward: autograd reads freed weights"),
    Bug("09.8-hook-without-grad", F, where="09.8",
        find="if torch.is_grad_enabled() and output.requires_grad:",
        replace="if True:",
        tests=(T + "test_post_forward_frees_the_unit_and_prepares_its_backward",),
        expect=r"doesn't require gradient",
        why="a forward under torch.no_grad (evaluation) registers a backward hook on an output "
            "that has no gradient"),
    # 09.9 pre-backward
    Bug("09.9-backward-without-re-gather", F, where="09.9",
        find="        if unit.handle is None:\n            unit.handle = unit.gather()\n"
             "        if self.prefetch and unit.index > 0:\n"
             "            previous = self.units[unit.index - 1]\n"
             "            previous.handle = previous.gather()\n"
             "        unit.wait()\n",
        replace="        if unit.handle is not None:\n            unit.wait()\n",
        tests=(T + "test_pre_backward_gathers_again_and_prefetches_the_previous_unit",),
        expect=r"with its parameters freed",
        why="forward freed the unit and backward does not gather it again"),
    Bug("09.9-prefetches-the-wrong-way", F, where="09.9",
        find="        if self.prefetch and unit.index > 0:\n"
             "            previous = self.units[unit.index - 1]\n",
        replace="        if self.prefetch and unit.index + 1 < len(self.units):\n"
                "            previous = self.units[unit.index + 1]\n",
        tests=(T + "test_pre_backward_gathers_again_and_prefetches_the_previous_unit",),
        expect=r"gathered 2 times in backward",
        why="backward prefetches the next unit, as forward does, but backward runs the units in "
            "reverse: it gathers one already done"),
    Bug("09.9-ranks-prefetch-differently", F, where="09.9",
        find="if self.prefetch and unit.index > 0:",
        replace="if self.prefetch and unit.index > 0 and self.rank == 0:",
        tests=(T + "test_pre_backward_gathers_again_and_prefetches_the_previous_unit",),
        expect=r"issued their collectives in different orders",
        why="the ranks decide differently whether to prefetch (here by rank; in practice by a "
            "local timer or memory check): one rank's all-gather meets another's "
            "reduce-scatter"),
    # 09.10 post-backward
    Bug("09.10-freed-before-sending", F, where="09.10",
        find="        unit.grad_handle = unit.reduce_scatter()\n        unit.free()\n",
        replace="        unit.free()\n        unit.grad_handle = unit.reduce_scatter()\n",
        tests=(T + "test_post_backward_sends_each_gradient_as_soon_as_it_is_ready",),
        expect=r"freed before its gradient was sent",
        why="free() drops the gradient the reduce-scatter was about to send"),
    Bug("09.10-not-freed", F, where="09.10",
        find="        unit.free()\n", replace="",
        tests=(T + "test_post_backward_sends_each_gradient_as_soon_as_it_is_ready",),
        expect=r"still gathered after its gradient was sent",
        why="the unit and its full gradient stay allocated after backward"),
    # 09.11 finish_grad_sync
    Bug("09.11-grad-overwritten", F, where="09.11",
        find="            if unit.shard.grad is None:\n"
             "                unit.shard.grad = unit.grad_shard\n"
             "            else:\n"
             "                unit.shard.grad += unit.grad_shard\n",
        replace="            unit.shard.grad = unit.grad_shard\n",
        tests=(T + "test_finish_grad_sync_waits_and_adds_to_the_shards_grads",),
        expect=r"whose gradients add up",
        why="the gradient replaces the one already there: gradient accumulation keeps only the "
            "last micro-batch"),
    Bug("09.11-not-waited", F, where="09.11",
        find="            unit.wait_grad()\n", replace="",
        tests=(T + "test_finish_grad_sync_waits_and_adds_to_the_shards_grads",),
        expect=r"still pending after finish_grad_sync",
        why="the optimizer may read a gradient the network is still writing"),
    # 09.12 gather_full_params
    Bug("09.12-padding-cut-from-the-front", F, where="09.12",
        find="pieces = flat[:unit.numel].split(unit.numels)",
        replace="pieces = flat[unit.padded - unit.numel:].split(unit.numels)",
        tests=(T + "test_gather_full_params_gives_every_rank_the_whole_model_by_name",),
        expect=r"differs from the shards' values put together",
        why="cuts the padding off the front: with padding every saved parameter is shifted"),

    # ===== the memory table and activation checkpointing =====

    # --- 09.13 the peak of one FSDP step
    Bug("09.13-no-prefetch", MT, where="09.13",
        find="gathered = root + blocks[0] + (blocks[1] if prefetch and len(blocks) > 1 else 0)",
        replace="gathered = root + blocks[0]",
        tests=(TM + "test_fsdp_peak_on_a_hand_computed_case",),
        expect=r"plus the next largest \(3000\) when prefetching",
        why="the prefetched block is gathered while the current one computes: two blocks, "
            "not one"),
    Bug("09.13-every-block-gathered", MT, where="09.13",
        find="gathered = root + blocks[0] + (blocks[1] if prefetch and len(blocks) > 1 else 0)",
        replace="gathered = root + sum(blocks)",
        tests=(TM + "test_fsdp_prediction_is_near_the_measured_peak_of_fsdp2",),
        expect=r"too high means more is counted than FSDP holds at once",
        why="counts the whole model gathered, as if FSDP never freed a block after use"),
    Bug("09.13-no-unsharded-grads", MT, where="09.13",
        find="buffers = gathered * param_bytes + (root + blocks[0]) * grad_bytes",
        replace="buffers = gathered * param_bytes",
        tests=(TM + "test_fsdp_peak_on_a_hand_computed_case",),
        expect=r"the full gradients of the root and of the block in backward",
        why="forgets that a unit's whole gradient exists before its reduce-scatter"),
    Bug("09.13-grads-at-param-bytes", MT, where="09.13",
        find="buffers = gathered * param_bytes + (root + blocks[0]) * grad_bytes",
        replace="buffers = (gathered + root + blocks[0]) * param_bytes",
        tests=(TM + "test_fsdp_peak_prices_parameters_and_gradients_with_their_own_bytes",),
        expect=r"the full gradients grad_bytes each",
        why="prices the full gradients at the parameters' bytes (wrong under mixed precision)"),
    Bug("09.13-sharded-grads-counted", MT, where="09.13",
        find="peak = params + state + buffers + activation_bytes",
        replace="peak = params + rest[\"grads\"] + state + buffers + activation_bytes",
        tests=(TM + "test_fsdp_peak_on_a_hand_computed_case",),
        expect=r"The sharded gradients are not counted",
        why="counts the sharded gradients, which zero_grad freed and backward has not made yet"),
    Bug("09.13-prefetch-past-the-end", MT, where="09.13",
        find="(blocks[1] if prefetch and len(blocks) > 1 else 0)",
        replace="(blocks[-1] if prefetch else 0)",
        tests=(TM + "test_fsdp_peak_of_a_single_block_model",),
        expect=r"no next block to prefetch",
        why="a single block prefetches itself a second time"),
    # --- 09.14 what one block keeps
    Bug("09.14-no-gelu-input", AC, where="09.14",
        find="+ 2 * mlp_ratio * dim", replace="+ mlp_ratio * dim",
        tests=(TM + "test_block_activations_on_hand_computed_cases",),
        expect=r"fc1's output, which\s+GELU keeps",
        why="counts the MLP's wide tensor once: GELU keeps its input and fc2 keeps GELU's "
            "output"),
    Bug("09.14-qkv-as-one", AC, where="09.14",
        find="(3 * dim + dim + heads)", replace="(dim + dim + heads)",
        tests=(TM + "test_block_activations_match_what_autograd_keeps",),
        expect=r"keeps \d+ bytes for backward",
        why="q, k and v are three tensors of width dim, not one"),
    Bug("09.14-bytes-ignored", AC, where="09.14",
        find="return batch * seq_len * per_token * bytes_per_element",
        replace="return batch * seq_len * per_token * 4",
        tests=(TM + "test_block_activations_on_hand_computed_cases",),
        expect=r"bytes_per_element=2 \(bf16 activations\) halves every tensor",
        why="assumes fp32 activations whatever bytes_per_element says"),
    # --- 09.15 a stack with and without checkpointing
    Bug("09.15-no-rebuilt-block", AC, where="09.15",
        find="return layers * input_bytes + (block_bytes - input_bytes)",
        replace="return layers * input_bytes",
        tests=(TM + "test_stack_with_checkpointing_keeps_inputs_and_rebuilds_one_block",),
        expect=r"backward rebuilds one block at a time",
        why="forgets that backward rebuilds a block's activations before it can use them"),
    Bug("09.15-input-counted-twice", AC, where="09.15",
        find="return layers * input_bytes + (block_bytes - input_bytes)",
        replace="return layers * input_bytes + block_bytes",
        tests=(TM + "test_stack_with_checkpointing_keeps_inputs_and_rebuilds_one_block",),
        expect=r"its input is already counted",
        why="counts the rebuilt block's input twice"),
    # --- 09.16 checkpointing the blocks
    Bug("09.16-not-checkpointed", AC, where="09.16",
        find="x = checkpoint(block, x, use_reentrant=False)", replace="x = block(x)",
        tests=(TM + "test_each_block_runs_its_forward_again_in_backward",),
        expect=r"want two each: a checkpointed block\s+runs its forward again",
        why="runs the blocks plainly: every activation is kept"),
    Bug("09.16-reentrant", AC, where="09.16",
        find="x = checkpoint(block, x, use_reentrant=False)",
        replace="x = checkpoint(block, x, use_reentrant=True)",
        tests=(TM + "test_checkpointed_model_gives_the_same_loss_and_gradients",),
        expect=r"use_reentrant=True a checkpointed block whose\s+input needs no gradient",
        why="the reentrant checkpoint gives no gradient to a block whose input needs none"),
    Bug("09.16-no-grad", AC, where="09.16",
        find="x = checkpoint(block, x, use_reentrant=False)",
        replace="with torch.no_grad():\n                x = block(x)",
        tests=(TM + "test_checkpointed_model_gives_the_same_loss_and_gradients",),
        expect=r"not in\s+autograd's graph",
        why="saves memory by not recording the blocks at all: nothing to backpropagate"),

    # ===== FSDP2 in practice and DCP checkpoints =====

    # --- 09.17 fully_shard with a policy
    Bug("09.17-root-first", FP, where="09.17",
        find="    for block in model.blocks:\n"
             "        fully_shard(block, mesh=mesh, mp_policy=policy,\n"
             "                    reshard_after_forward=reshard_after_forward)\n"
             "    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)\n",
        replace="    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)\n"
                "    for block in model.blocks:\n"
                "        fully_shard(block, mesh=mesh, mp_policy=policy,\n"
                "                    reshard_after_forward=reshard_after_forward)\n",
        tests=(TP + "test_every_block_and_the_root_are_units",),
        expect=r"fully_shard each block, then the root",
        why="the root sharded before its blocks: it takes every parameter into one unit"),
    Bug("09.17-no-root", FP, where="09.17",
        find="    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)\n",
        replace="",
        tests=(TP + "test_every_block_and_the_root_are_units",),
        expect=r"root is not an FSDP unit",
        why="the root is never sharded: every rank keeps the embeddings and head whole"),
    Bug("09.17-reduce-in-bf16", FP, where="09.17",
        find="reduce_dtype=torch.float32", replace="reduce_dtype=torch.bfloat16",
        tests=(TP + "test_bf16_policy_computes_in_bf16_and_reduces_in_fp32",),
        expect=r"reduce-scattered in \['torch.bfloat16'\]",
        why="gradients summed over the ranks in bf16: each rounded to 8 bits before the sum"),
    Bug("09.17-no-policy-on-blocks", FP, where="09.17",
        find="        fully_shard(block, mesh=mesh, mp_policy=policy,\n",
        replace="        fully_shard(block, mesh=mesh,\n",
        tests=(TP + "test_bf16_policy_computes_in_bf16_and_reduces_in_fp32",),
        expect=r"computed with weights in",
        why="the policy given to the root only: the blocks, most of the model, compute in fp32"),
    Bug("09.17-root-resharded", FP, where="09.17",
        find="fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)",
        replace="fully_shard(model, mesh=mesh, mp_policy=policy, "
                "reshard_after_forward=reshard_after_forward)",
        tests=(TP + "test_reshard_after_forward_frees_the_blocks_and_keeps_the_root",),
        expect=r"keep the root gathered",
        why="the root freed after forward, to be gathered again at once when backward starts"),
    Bug("09.17-flag-ignored", FP, where="09.17",
        find="        fully_shard(block, mesh=mesh, mp_policy=policy,\n"
             "                    reshard_after_forward=reshard_after_forward)\n",
        replace="        fully_shard(block, mesh=mesh, mp_policy=policy)\n",
        tests=(TP + "test_reshard_after_forward_frees_the_blocks_and_keeps_the_root",),
        expect=r"must keep their gathered parameters",
        why="reshard_after_forward never reaches the blocks: no way to trade memory for time"),
    # --- 09.18 explicit prefetch
    Bug("09.18-backward-farthest-first", FP, where="09.18",
        find="list(blocks[max(0, i - ahead):i])[::-1]", replace="list(blocks[max(0, i - ahead):i])",
        tests=(TP + "test_prefetch_lists_look_ahead_in_the_order_blocks_run",),
        expect=r"in backward, not .*nearest first",
        why="backward prefetches the farthest block first: the next one to run waits for it"),
    Bug("09.18-forward-includes-itself", FP, where="09.18",
        find="list(blocks[i + 1:i + 1 + ahead])", replace="list(blocks[i:i + ahead])",
        tests=(TP + "test_prefetch_lists_look_ahead_in_the_order_blocks_run",),
        expect=r"in forward, not .*the blocks after it",
        why="a block prefetches itself (already gathered) and one block fewer ahead"),
    Bug("09.18-backward-goes-forward", FP, where="09.18",
        find="block.set_modules_to_backward_prefetch(list(blocks[max(0, i - ahead):i])[::-1])",
        replace="block.set_modules_to_backward_prefetch(list(blocks[i + 1:i + 1 + ahead]))",
        tests=(TP + "test_prefetch_lists_look_ahead_in_the_order_blocks_run",),
        expect=r"backward runs the blocks in reverse",
        why="backward prefetches the blocks after it, which backward has already done"),
    # --- 09.19 meta-device initialisation
    Bug("09.19-rows-from-zero", FP, where="09.19",
        find="fill_rows(local, name, param.shape, start, seed)",
        replace="fill_rows(local, name, param.shape, 0, seed)",
        tests=(TP + "test_sharded_init_equals_the_seeded_init_of_the_whole_model",),
        expect=r"rank 1 drew the first rows again",
        why="every rank fills its shard with rows 0.. of the init: the model depends on N"),
    Bug("09.19-whole-model-on-each-rank", FP, where="09.19",
        find="    model.to_empty(device=device)\n",
        replace="    whole = dict(init_full(TinyTransformer(**CONFIG), seed).named_parameters())\n"
                "    model.to_empty(device=device)\n",
        more=(("09.19", "        fill_rows(local, name, param.shape, start, seed)\n",
               "        local.copy_(whole[name][start:start + len(local)])\n"),),
        tests=(TP + "test_materialize_allocates_only_this_ranks_shards",),
        expect=r"never build or initialise the whole model",
        why="the whole model initialised on every rank, then sliced: what meta init avoids"),
    Bug("09.19-local-random-init", FP, where="09.19",
        find="        fill_rows(local, name, param.shape, start, seed)\n",
        replace="        torch.nn.init.normal_(local, 0.0, 0.02)\n",
        tests=(TP + "test_sharded_init_equals_the_seeded_init_of_the_whole_model",),
        expect=r"differs from the seeded init of the whole model",
        why="each rank draws its own random values: not reproducible, not the same at any N"),
    Bug("09.0-built-off-meta", FP, where="build_sharded",
        find="    with torch.device(\"meta\"):",
        replace="    with torch.device(\"cpu\"):",
        tests=(TP + "test_the_recipe_trains_like_the_plain_model_and_never_holds_all_of_it",),
        expect=r"build on the meta device",
        why="the whole model built (and initialised) on every rank before it is sharded"),
    # --- 09.20 slices of the global batch
    Bug("09.20-same-slice-everywhere", FP, where="09.20",
        find="    return inputs[rank * per:(rank + 1) * per], targets[rank * per:(rank + 1) * per]",
        replace="    return inputs[:per], targets[:per]",
        tests=(TP + "test_rank_slices_split_the_global_batch",),
        expect=r"each rank takes its own piece",
        why="every rank takes the first slice: half the batch is never seen"),
    Bug("09.20-per-rank-batch", FP, where="09.20",
        find="    per = len(inputs) // world_size\n", replace="    per = 4\n",
        tests=(TP + "test_rank_slices_split_the_global_batch",),
        expect=r"share the global batch equally",
        why="a fixed per-rank batch: the global batch, and so the math, changes with N"),
    Bug("09.20-whole-batch-on-every-rank", FP, where="09.20",
        find="    return inputs[rank * per:(rank + 1) * per], targets[rank * per:(rank + 1) * per]",
        replace="    return inputs, targets",
        tests=(TP + "test_rank_slices_split_the_global_batch",),
        expect=r"share the global batch equally",
        why="every rank computes the whole batch: the same losses at N times the compute"),
    # --- 09.21 DCP save
    Bug("09.21-model-only", FD, where="09.21",
        find='dcp.save({"model": model_state, "optim": optim_state, "step": step},',
        replace='dcp.save({"model": model_state, "step": step},',
        tests=(TP + "test_save_writes_a_checkpoint_any_world_size_can_load",),
        expect=r"no optimizer state by parameter name",
        why="Adam's moments not saved: the resumed run restarts them from zero"),
    Bug("09.21-optimizer-by-position", FD, where="09.21",
        find="    model_state, optim_state = get_state_dict(model, optimizer)\n",
        replace="    model_state, optim_state = model.state_dict(), optimizer.state_dict()\n",
        tests=(TP + "test_save_writes_a_checkpoint_any_world_size_can_load",),
        expect=r"no optimizer state by parameter name",
        why="optimizer.state_dict() keys its state by position, not by parameter name"),
    Bug("09.21-no-step", FD, where="09.21",
        find=', "step": step},', replace="},",
        tests=(TP + "test_save_writes_a_checkpoint_any_world_size_can_load",),
        expect=r"no 'step' in the checkpoint",
        why="the step is not saved: the resume cannot know where it stopped"),
    # --- 09.22 DCP load
    Bug("09.22-optimizer-without-model", FD, where="09.22",
        find='state = {"model": model_state, "optim": optim_state, "step": 0}',
        replace='state = {"model": {}, "optim": optim_state, "step": 0}',
        tests=(TP + "test_resume_at_1_2_and_4_ranks_gives_the_uninterrupted_losses",),
        expect=r"the weights of .* after load_checkpoint are not those saved",
        why="the optimizer's state loaded but not the model's weights"),
    Bug("09.22-model-without-optimizer", FD, where="09.22",
        find='state = {"model": model_state, "optim": optim_state, "step": 0}',
        replace='state = {"model": model_state, "step": 0}',
        more=(("09.22", "        set_state_dict(model, optimizer, model_state_dict=state[\"model\"],\n"
               "                       optim_state_dict=state[\"optim\"])\n",
               "        model.load_state_dict(state[\"model\"])\n"),),
        tests=(TP + "test_resume_at_1_2_and_4_ranks_gives_the_uninterrupted_losses",),
        expect=r"Adam's state of .* is not the saved",
        why="the weights loaded, Adam's moments not: the steps after resuming differ"),
    Bug("09.22-step-not-returned", FD, where="09.22",
        find='        return state["step"]', replace="        return 0",
        tests=(TP + "test_resume_at_1_2_and_4_ranks_gives_the_uninterrupted_losses",),
        expect=r"load_checkpoint returned step 0",
        why="the resume starts again at step 0 and repeats the batches already trained on"),
    # --- 09.23 the full export
    Bug("09.23-sharded-state-as-full", FD, where="09.23",
        find="    state = get_model_state_dict(model, options=options)\n",
        replace="    state = model.state_dict()\n",
        tests=(TP + "test_export_is_the_whole_model_for_a_plain_transformer",),
        expect=r"holds \['DTensor'\]",
        why="the sharded model's state_dict() saved as if it were the whole model"),
    # --- given code: schedule.py's recorder
    Bug("09.0-collective-end-on-the-host", "09_fsdp/schedule.py", where="Timeline.issued",
        find="        if not clock.on_end(work, done):",
        replace="        if not clock.on_end(work, lambda _stamp: done(clock.host_now())):",
        tests=("tests/l09_fsdp/test_schedule.py::"
               "test_on_the_device_clock_gathers_end_and_waits_last_as_on_the_device",),
        expect=r"must be its end on the device",
        why="a collective's end is the host's moment its future completed: under NCCL, its "
            "issue"),
    # ===== seen only at 3 ranks, in low precision, or in a file's layout =====
    Bug("09.1-pads-by-the-remainder", F, where="09.1",
        find="padded = -(-flat.numel() // world_size) * world_size",
        replace="padded = flat.numel() + flat.numel() % world_size",
        tests=(T + "test_shard_flat_pads_with_zeros_and_keeps_this_ranks_chunk",),
        expect=r"31 numbers over 3 ranks: padded is 32, want 33",
        why="adds the remainder instead of rounding up: right when nothing is left over or "
            "when the remainder is half of N (30 numbers at 1..4 ranks), wrong elsewhere"),
    Bug("09.2-gathers-the-fp32-masters", F, where="09.2",
        find="        mine = self.shard.detach().to(full.dtype)\n"
             "        return dist.all_gather_into_tensor(full.data, mine, group=self.group, "
             "async_op=True)\n",
        replace="        whole = torch.empty(full.numel(), dtype=torch.float32, device=full.device)\n"
                "        work = dist.all_gather_into_tensor(whole, self.shard.detach(),\n"
                "                                           group=self.group, async_op=True)\n"
                "        work.wait()\n"
                "        full.data.copy_(whole)\n"
                "        return work\n",
        tests=(T + "test_gather_gives_each_unit_its_parameters_in_the_compute_dtype",),
        expect=r"moves twice the bytes",
        why="gathers the fp32 master shards and casts the whole unit afterwards: the right "
            "numbers, twice the traffic of a bf16 gather (and the gather no longer overlaps)"),
    Bug("09.12-gathers-the-compute-copy", F, where="09.12",
        find="            flat = torch.empty(unit.padded, dtype=torch.float32, "
             "device=unit.shard.device)\n"
             "            dist.all_gather_into_tensor(flat, unit.shard.detach(), "
             "group=self.group)\n",
        replace="            flat = torch.empty(unit.padded, dtype=unit.full.dtype, "
                "device=unit.shard.device)\n"
                "            dist.all_gather_into_tensor(flat, unit.shard.detach().to("
                "unit.full.dtype), group=self.group)\n",
        tests=(T + "test_gather_full_params_gives_every_rank_the_whole_model_by_name",),
        expect=r"never the compute dtype's copy",
        why="gathers the model in the compute dtype: in bf16 the saved weights lose the "
            "fp32 masters' precision (in fp32 nothing shows)"),
    Bug("09.14-mlp-width-from-heads", AC, where="09.14",
        find="+ 2 * mlp_ratio * dim", replace="+ 2 * heads * dim",
        tests=(TM + "test_block_activations_on_hand_computed_cases",),
        expect=r"MLP ratio 6",
        why="the MLP's width taken from the number of heads: equal in the lesson's model "
            "(4 and 4), wrong in any other"),
    Bug("09.19-start-from-own-length", FP, where="09.19",
        find="        start, _ = shard_rows(param)\n"
             "        local = param.to_local() if isinstance(param, DTensor) else param\n",
        replace="        local = param.to_local() if isinstance(param, DTensor) else param\n"
                "        start = get_rank() * len(local) if isinstance(param, DTensor) else 0\n",
        tests=(TP + "test_sharded_init_at_3_ranks_with_uneven_shards",),
        expect=r"filled the wrong rows",
        why="a shard's first row as rank x its own length: right when the rows split evenly "
            "(every tensor at 2 ranks), wrong for the last rank at 3 (64 rows: 22, 22, 20)"),
    Bug("09.20-slice-of-the-lesson-batch", FP, where="09.20",
        find="    per = len(inputs) // world_size\n", replace="    per = GLOBAL_BATCH // world_size\n",
        tests=(TP + "test_rank_slices_split_the_global_batch",),
        expect=r"whatever the batch size",
        why="the slice's length from the lesson's batch size, not the batch given: right only "
            "for a batch of 8"),
    Bug("09.21-saves-whole-tensors", FD, where="09.21",
        find="    model_state, optim_state = get_state_dict(model, optimizer)\n",
        replace="    model_state, optim_state = get_state_dict(\n"
                "        model, optimizer, options=StateDictOptions(full_state_dict=True))\n",
        tests=(TP + "test_the_checkpoint_holds_one_piece_per_rank_of_every_tensor",),
        expect=r"stored whole, in one piece",
        why="gathers the whole model and Adam's state on every rank, then saves that: as many "
            "files as ranks and a loadable checkpoint, but not sharded (each rank held all of "
            "it)"),
    Bug("09.23-every-rank-writes", FD, where="09.23",
        find="    options = StateDictOptions(full_state_dict=True, cpu_offload=True)\n"
             "    state = get_model_state_dict(model, options=options)\n"
             "    if get_rank() == 0:\n"
             "        atomic_save(state, path)\n",
        replace="    options = StateDictOptions(full_state_dict=True)\n"
                "    state = {k: v.cpu() for k, v in get_model_state_dict(model, "
                "options=options).items()}\n"
                "    atomic_save(state, path)\n",
        tests=(TP + "test_the_export_is_written_by_rank_0_alone",),
        expect=r"also wrote in export_full",
        why="every rank holds the whole model and writes it to the same path: N writers race "
            "for one file (the same bytes here, so the file still loads)"),
]
