"""Planted bugs of lesson 11, part: lr_scaling (see planted_bugs.py)."""

from tests.planted import Bug

F = "11_time_to_accuracy/lr_scaling.py"
T = "tests/l11_time_to_accuracy/test_lr_scaling.py::"

BUGS = [
    Bug("11.6-sqrt-for-linear", F, where="11.6",
        find="        return base_lr * k\n", replace="        return base_lr * math.sqrt(k)\n",
        tests=(T + "test_scaled_lr_by_rule",),
        expect=r"linear scaling multiplies lr by global/base batch \(4x here\)",
        why="the square-root rule under the name linear: the lr grows too little"),
    Bug("11.6-integer-ratio", F, where="11.6",
        find="k = global_batch / base_batch", replace="k = global_batch // base_batch",
        tests=(T + "test_scaled_lr_by_rule",),
        expect=r"96 // 64 is 1",
        why="integer division: a batch of 96 keeps the lr of 64"),
    Bug("11.7-warmup-off-by-one", F, where="11.7",
        find="return base_lr + (peak_lr - base_lr) * step / warmup_steps",
        replace="return base_lr + (peak_lr - base_lr) * (step + 1) / warmup_steps",
        tests=(T + "test_warmup_in_a_lambda_lr",),
        expect=r"step 0 uses base_lr \(Goyal et al. start from eta\)",
        why="the ramp starts one step late: step 0 already takes a larger lr than base_lr"),
    Bug("11.8-lr-after-step", F, where="11.8",
        find="            optimizer.step()\n            steps += 1\n",
        replace="            optimizer.step()\n"
                "            if lr_at is not None:\n"
                "                for group in optimizer.param_groups:\n"
                "                    group[\"lr\"] = lr_at(steps)\n"
                "            steps += 1\n",
        more=(("11.8", "            if lr_at is not None:\n"
                       "                for group in optimizer.param_groups:\n"
                       "                    group[\"lr\"] = lr_at(steps)\n"
                       "            optimizer.zero_grad", "            optimizer.zero_grad"),),
        tests=(T + "test_train_to_target_stops_at_first_eval_reaching_it",
               T + "test_train_to_target_never_reached"),
        expect=r"lr_at\(step\) must be set before optimizer.step\(\)",
        why="each step runs with the previous step's lr (the first with the optimizer's own)"),
    Bug("11.8-no-zero-grad", F, where="11.8",
        find="            optimizer.zero_grad(set_to_none=True)\n", replace="",
        tests=(T + "test_train_to_target_stops_at_first_eval_reaching_it",),
        expect=r"each step zeroes the gradients",
        why="gradients pile up from step to step"),
    Bug("11.8-stays-in-eval", F, where="11.8",
        find="                model.train()\n", replace="",
        tests=(T + "test_train_to_target_stops_at_first_eval_reaching_it",),
        expect=r"put it back in train mode",
        why="after the first evaluation, training runs in eval mode (dropout off, BN frozen)"),
    Bug("11.9-fit-in-b", F, where="11.9",
        find="statistics.linear_regression([1 / b for b in batches],",
        replace="statistics.linear_regression([float(b) for b in batches],",
        tests=(T + "test_critical_batch_from_exact_steps",),
        expect=r"fit steps against 1/B",
        why="a line in B, not in 1/B: the model S = S_min (1 + B_noise / B) is linear in 1/B"),
]
