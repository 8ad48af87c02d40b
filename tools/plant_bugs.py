"""Plant classic student bugs in a copy of ``solutions/`` and check that the suite catches each.

A grading suite is only as good as the bugs it fails on. Each entry of :data:`BUGS` is one
mistake students really make (a sum without the mean, a save without a barrier, clipping
before ``unscale_``...), written as an exact edit of one solution file, with the tests that
must fail on it and, where the tests word it, the message that proves they failed *for that
reason* and not, say, on a timeout.

For each bug the tool copies ``solutions/`` to a temporary folder, makes the edit there, and
runs the named tests against the copy (``pytest --target COPY``). The verdicts:

- ``caught``: the tests failed, with the expected message when one is given;
- ``SURVIVED``: the tests passed on the broken code: a hole in the suite;
- ``WRONG REASON``: they failed, but on a timeout or without the expected message;
- ``STALE``: the edit no longer applies (the solution changed): update the entry.

Usage (from the repository root; one bug takes 10-60 s, the whole list about 10 min on two
idle cores)::

    .venv/bin/python tools/plant_bugs.py                 # every bug, two at a time
    .venv/bin/python tools/plant_bugs.py --list          # the catalogue
    .venv/bin/python tools/plant_bugs.py --only 05.3-no-mean,03.4-no-barrier -j 1
    .venv/bin/python tools/plant_bugs.py --lesson 05

Exit status 0 when every bug is caught for the right reason. ``make plant-bugs`` runs it.
The fast test ``tests/harness/test_plant_bugs.py`` checks that every edit still applies.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = REPO / "solutions"


@dataclass(frozen=True)
class Bug:
    id: str  # "<task>-<short name>"; task NN.0 is code around the tasks
    file: str  # relative to solutions/
    find: str  # exact text, present exactly once in the file
    replace: str
    tests: tuple[str, ...]  # pytest node ids, relative to the repository root
    expect: str | None = None  # regex the failure output must contain (the right reason)
    why: str = ""  # the mistake, in a student's terms
    keywords: tuple[str, ...] = field(default=())  # -k filter for parametrized tests, if any

    @property
    def lesson(self) -> str:
        return self.file[:2]


T01 = "tests/l01_single_device/test_single_device.py::"
T02 = "tests/l02_data_parallel/test_data_parallel.py::"
T03 = "tests/l03_ddp_spawn/test_ddp_spawn.py::"
T04 = "tests/l04_ddp_torchrun/test_ddp_torchrun.py::"
T05 = "tests/l05_ddp_from_scratch/test_ddp_from_scratch.py::"
T06 = "tests/l06_mixed_precision/test_mixed_precision.py::"
T07 = "tests/l07_lightning/test_lightning.py::"
T08 = "tests/l08_sharding/test_sharding.py::"

L01 = "01_single_device/single_device.py"
L02H = "02_data_parallel/dp_by_hand.py"
L02 = "02_data_parallel/data_parallel.py"
L02T = "02_data_parallel/dp_timing.py"
L03 = "03_ddp_spawn/ddp_spawn.py"
L04 = "04_ddp_torchrun/ddp_torchrun.py"
L05B = "05_ddp_from_scratch/ddp_base.py"
L05N = "05_ddp_from_scratch/naive_ddp.py"
L05O = "05_ddp_from_scratch/overlap_ddp.py"
L05K = "05_ddp_from_scratch/bucketed_ddp.py"
L05C = "05_ddp_from_scratch/collectives.py"
L06 = "06_mixed_precision/ddp_amp.py"
L06I = "06_mixed_precision/amp_inspect.py"
L06A = "06_mixed_precision/apex_amp.py"
L07 = "07_lightning/lit_fashion.py"
L07M = "07_lightning/lit_migration.py"
L08Z = "08_sharding/zero_optimizer.py"
L08A = "08_sharding/zero_accounting.py"
L08F = "08_sharding/fsdp2_train.py"

BUGS: list[Bug] = [
    # --- lesson 01: one device ---------------------------------------------------------------
    Bug("01.1-no-zero-grad", L01,
        "        self.optimizer.zero_grad(set_to_none=True)\n        loss = F.cross_entropy(",
        "        loss = F.cross_entropy(",
        (T01 + "test_run_batch_matches_a_reference_sgd_step",),
        why="gradients of the previous batch are added to this one's"),
    Bug("01.1-nll-on-logits", L01,
        "        loss = F.cross_entropy(self.model(source), targets)\n        loss.backward()\n"
        "        self.optimizer.step()\n        return loss.item()\n        # END SOLUTION\n\n"
        "    def _run_epoch",
        "        loss = F.nll_loss(self.model(source), targets)\n        loss.backward()\n"
        "        self.optimizer.step()\n        return loss.item()\n        # END SOLUTION\n\n"
        "    def _run_epoch",
        (T01 + "test_run_batch_matches_a_reference_sgd_step",),
        why="nll_loss expects log-probabilities; the model returns logits"),
    Bug("01.1-step-before-backward", L01,
        "        loss.backward()\n        self.optimizer.step()\n        return loss.item()\n"
        "        # END SOLUTION\n\n    def _run_epoch",
        "        self.optimizer.step()\n        loss.backward()\n        return loss.item()\n"
        "        # END SOLUTION\n\n    def _run_epoch",
        (T01 + "test_run_batch_matches_a_reference_sgd_step",),
        why="the step uses no gradient (or the last batch's), then this batch's waits"),
    Bug("01.2-no-eval-mode", L01,
        "    was_training = model.training\n    model.eval()\n    correct = total = 0\n",
        "    was_training = model.training\n    correct = total = 0\n",
        (T01 + "test_evaluate_uses_eval_mode_and_restores_training_mode",),
        why="dropout and batch norm stay in training mode while evaluating"),
    Bug("01.2-mode-not-restored", L01,
        "    model.train(was_training)\n    return correct, total\n",
        "    return correct, total\n",
        (T01 + "test_evaluate_uses_eval_mode_and_restores_training_mode",),
        why="evaluate leaves the model in eval mode, so training goes on without dropout"),
    Bug("01.2-full-batches-counted", L01,
        "        total += len(targets)\n    model.train(was_training)\n    return correct, total\n",
        "        total += loader.batch_size\n    model.train(was_training)\n"
        "    return correct, total\n",
        (T01 + "test_evaluate_counts_every_sample_including_a_short_last_batch",),
        why="the short last batch is counted as a full one"),
    Bug("01.3-torch-save-in-place", L01,
        "    return ckpt.atomic_save(state, path)\n    # END SOLUTION\n\n\ndef load_checkpoint",
        "    torch.save(state, path)\n    return Path(path)\n    # END SOLUTION\n\n\n"
        "def load_checkpoint",
        (T01 + "test_a_crash_mid_save_keeps_the_previous_checkpoint",),
        why="a crash in the middle of torch.save leaves a truncated file at the final path"),
    Bug("01.3-module-prefix", L01,
        '    state = {"model": getattr(model, "module", model).state_dict(),',
        '    state = {"model": model.state_dict(),',
        (T01 + "test_checkpoint_of_a_wrapped_model_has_no_module_prefix",),
        why="a wrapped model's keys start with 'module.' and do not load into a plain model"),
    Bug("01.3-optimizer-not-restored", L01,
        "    if optimizer is not None:\n        optimizer.load_state_dict(state[\"optimizer\"])\n",
        "",
        (T01 + "test_checkpoint_round_trip_into_a_fresh_model",),
        why="the resumed run restarts momentum from zero"),
    Bug("01.2-argmax-over-the-batch", L01,
        "        correct += int((model(inputs).argmax(dim=1) == targets).sum())\n"
        "        total += len(targets)\n    model.train(was_training)\n    return correct, total\n",
        "        correct += int((model(inputs).argmax(dim=0) == targets[0]).sum())\n"
        "        total += len(targets)\n    model.train(was_training)\n    return correct, total\n",
        (T01 + "test_evaluate_counts_every_sample_including_a_short_last_batch",),
        why="argmax over the batch dimension instead of the classes"),
    Bug("01.3-epoch-not-saved", L01,
        '             "optimizer": optimizer.state_dict(), "epoch": epoch, **extra}\n'
        "    return ckpt.atomic_save(state, path)",
        '             "optimizer": optimizer.state_dict(), "epoch": 0, **extra}\n'
        "    return ckpt.atomic_save(state, path)",
        (T01 + "test_checkpoint_round_trip_into_a_fresh_model",),
        why="a resumed run does not know where it stopped"),
    # Code around the tasks: a planted bug need not sit in a student's block.
    Bug("01.0-train-resumes-from-zero", L01,
        "        for epoch in range(self.epochs_run, max_epochs):\n"
        "            losses.append(self._run_epoch(epoch, limit_batches))\n"
        "            rank0_print(f\"epoch {epoch}: mean train loss {losses[-1]:.4f}\")\n"
        "            self.epochs_run = epoch + 1\n"
        "            if self.checkpoint_path and",
        "        for epoch in range(max_epochs):\n"
        "            losses.append(self._run_epoch(epoch, limit_batches))\n"
        "            rank0_print(f\"epoch {epoch}: mean train loss {losses[-1]:.4f}\")\n"
        "            self.epochs_run = epoch + 1\n"
        "            if self.checkpoint_path and",
        (T01 + "test_trainer_resumes_where_the_checkpoint_left_off_in_training_mode",),
        why="a resumed Trainer trains the finished epochs again"),
    Bug("01.0-no-train-mode", L01,
        "        \"\"\"One pass over the data (at most ``limit_batches`` batches); returns the mean "
        "loss.\"\"\"\n        self.model.train()\n",
        "        \"\"\"One pass over the data (at most ``limit_batches`` batches); returns the mean "
        "loss.\"\"\"\n",
        (T01 + "test_trainer_resumes_where_the_checkpoint_left_off_in_training_mode",),
        why="after an evaluation the model trains in eval mode (no dropout, frozen batch norm)"),
    Bug("01.2-always-train-after", L01,
        "    model.train(was_training)\n    return correct, total\n",
        "    model.train()\n    return correct, total\n",
        (T01 + "test_evaluate_leaves_an_eval_mode_model_in_eval_mode",),
        expect=r"switched a model that was in eval mode to training mode",
        why="evaluate always ends in training mode, even for a model that was in eval mode"),
    Bug("01.3-load-ignores-wrapper", L01,
        '    getattr(model, "module", model).load_state_dict(state["model"])',
        '    model.load_state_dict(state["model"])',
        (T01 + "test_checkpoint_loads_into_a_wrapped_model_s_module",),
        expect=r"must load into its \.module",
        why="a plain checkpoint does not load into a DataParallel/DDP wrapper's own keys"),
    Bug("01.3-no-map-location", L01,
        "    state = ckpt.load(path, map_location=device)",
        "    state = ckpt.load(path)",
        (T01 + "test_load_checkpoint_puts_the_tensors_on_the_device_it_is_given",),
        expect=r"load with map_location=device",
        why="the device argument is ignored: the tensors land on the CPU, not where the model is"),
    Bug("01.0-resume-without-optimizer", L01,
        "            self.epochs_run = load_checkpoint(resume_from, self.model, optimizer, "
        'device)["epoch"]',
        "            self.epochs_run = load_checkpoint(resume_from, self.model, None, "
        'device)["epoch"]',
        (T01 + "test_trainer_resumes_where_the_checkpoint_left_off_in_training_mode",),
        expect=r"restarted momentum from zero",
        why="a resumed Trainer loads the weights but not the optimizer: momentum restarts"),
    Bug("01.0-epoch-loss-is-last-batch", L01,
        "        self.history.extend(losses)\n        return sum(losses) / max(1, len(losses))",
        "        self.history.extend(losses)\n        return losses[-1]",
        (T01 + "test_trainer_learns_and_checkpoints_every_save_every_epochs",),
        expect=r"is not the mean of that epoch's batch losses",
        why="the epoch's loss is its last batch's, not the mean over its batches"),
    Bug("01.0-limit-batches-ignored", L01,
        "            losses.append(self._run_epoch(epoch, limit_batches))\n"
        "            rank0_print(f\"epoch {epoch}: mean train loss {losses[-1]:.4f}\")",
        "            losses.append(self._run_epoch(epoch))\n"
        "            rank0_print(f\"epoch {epoch}: mean train loss {losses[-1]:.4f}\")",
        (T01 + "test_trainer_resumes_where_the_checkpoint_left_off_in_training_mode",),
        expect=r"pass limit_batches on to _run_epoch",
        why="train() drops limit_batches: --limit-batches runs whole epochs"),
    Bug("01.2-no-no-grad", L01,
        "@torch.no_grad()\ndef evaluate", "def evaluate",
        (T01 + "test_evaluate_uses_eval_mode_and_restores_training_mode",),
        expect=r"evaluate built an autograd graph",
        why="evaluation builds an autograd graph for every batch (memory and time for nothing)"),
    Bug("01.0-seed-ignored", L01,
        "    generator = torch.Generator().manual_seed(seed)",
        "    generator = torch.Generator()",
        (T01 + "test_prepare_dataloader_shuffles_by_its_seed_and_every_epoch_differently",),
        expect=r"seeds 0 and 1 gave the same order",
        why="every seed shuffles the same way"),
    Bug("01.0-never-shuffles", L01,
        "shuffle=shuffle, generator=generator)", "shuffle=False, generator=generator)",
        (T01 + "test_prepare_dataloader_shuffles_by_its_seed_and_every_epoch_differently",),
        expect=r"prepare_dataloader\(shuffle=True\) must shuffle",
        why="the training data is never shuffled"),
    # --- lesson 02: DataParallel by hand --------------------------------------------------------
    Bug("02.1-floor-chunks", L02H,
        "    size = -(-x.shape[0] // n)  # ceil(B / n)",
        "    size = max(1, x.shape[0] // n)",
        (T02 + "test_scatter_splits_the_batch_dimension_and_keeps_every_sample",),
        why="floor division makes n+1 chunks when B does not divide"),
    Bug("02.3-grad-of-replica-0", L02H,
        "        summed = [sum(grads[r * k + i] for r in range(ctx.n)) for i in range(k)]",
        "        summed = [grads[i] for i in range(k)]",
        (T02 + "test_broadcast_backward_sums_the_replicas_gradients_onto_the_root",),
        why="only the first replica's gradient reaches the root"),
    Bug("02.2-buffers-cloned-for-replica-0", L02H,
        "            if r > 0:\n                for name, b in orig._buffers.items():",
        "            if True:\n                for name, b in orig._buffers.items():",
        (T02 + "test_caveat_batch_norm_running_stats_come_from_replica_0_only",),
        why="replica 0 gets a copy of the buffers, so no running statistic reaches the root"),
    Bug("02.4-grad-mode-lost-in-threads", L02H,
        "        with torch.set_grad_enabled(grad_enabled):\n            return replica(x)",
        "        return replica(x)",
        (T02 + "test_parallel_apply_carries_grad_mode_into_the_threads_and_raises_errors",),
        why="a new thread starts with grad enabled, so no_grad() builds a graph anyway"),
    Bug("02.5-gather-reversed", L02H,
        "    return torch.cat(list(outputs), dim=0)",
        "    return torch.cat(list(outputs)[::-1], dim=0)",
        (T02 + "test_gather_concatenates_in_order_and_routes_gradients_back",),
        why="outputs come back in the wrong order"),
    Bug("02.2-replicas-share-the-root-parameters", L02H,
        "                    copy._parameters[name] = copies[r * k + index[id(p)]]",
        "                    copy._parameters[name] = p",
        (T02 + "test_replicas_compute_what_the_root_computes_with_copies_of_its_weights",),
        why="the replicas use the root's tensors themselves: on GPUs they are on the wrong "
            "device, and no Broadcast sums their gradients"),
    Bug("02.6-outputs-reversed", L02H,
        "        return gather(outputs, root)",
        "        return gather(outputs[::-1], root)",
        (T02 + "test_forward_composes_the_four_steps",),
        why="the chunks' outputs are put back in the wrong order"),
    Bug("02.8-module-prefix", L02,
        '    plain = getattr(dp_model, "module", dp_model)',
        "    plain = dp_model",
        (T02 + "test_checkpoint_saved_through_module_loads_into_a_plain_model",),
        why="the checkpoint's keys start with 'module.'"),
    Bug("02.9-no-warm-up", L02T,
        "        for _ in range(warmup):\n            model(x)\n",
        "",
        (T02 + "test_timing_warms_up_synchronizes_and_takes_the_median",),
        why="the first, slow call is timed"),
    Bug("02.9-mean-not-median", L02T,
        "    return statistics.median(times)",
        "    return statistics.mean(times)",
        (T02 + "test_timing_warms_up_synchronizes_and_takes_the_median",),
        why="one outlier moves the result"),
    Bug("02.9-no-synchronize-after", L02T,
        "            model(x)\n            synchronize(device)\n            times.append(",
        "            model(x)\n            times.append(",
        (T02 + "test_timing_warms_up_synchronizes_and_takes_the_median",),
        why="a GPU call returns before the work is done: the time measures the launch only"),
    Bug("02.6-no-intra-op-threads", L02H,
        "            with intra_op_threads(self.threads_per_replica):\n"
        "                outputs = parallel_apply(replicas, chunks)",
        "            outputs = parallel_apply(replicas, chunks)",
        (T02 + "test_forward_runs_the_replicas_with_threads_per_replica_threads",),
        expect=r"inside intra_op_threads\(self\.threads_per_replica\)",
        why="every replica uses all the cores: N replicas oversubscribe the CPU"),
    Bug("02.8-map-location-ignored", L02,
        "    state = ckpt.load(path, map_location=map_location)",
        "    state = ckpt.load(path)",
        (T02 + "test_load_plain_loads_onto_its_map_location",),
        expect=r"pass map_location on to the load",
        why="load_plain's map_location is never used"),
    Bug("02.9-no-synchronize-before", L02T,
        "            synchronize(device)\n            t0 = time.perf_counter()",
        "            t0 = time.perf_counter()",
        (T02 + "test_timing_synchronizes_before_starting_the_clock_and_reports_the_middle_time",),
        expect=r"clock was started before synchronize\(device\)",
        why="work still queued from earlier calls (the warm-up) is timed with the first call"),
    Bug("02.9-min-not-median", L02T,
        "    return statistics.median(times)",
        "    return min(times)",
        (T02 + "test_timing_synchronizes_before_starting_the_clock_and_reports_the_middle_time",),
        expect=r"return the median \(20 ms\)",
        why="the fastest call is reported, not the typical one"),
    Bug("02.5-device-ignored", L02H,
        "    if device is not None:\n        outputs = [o.to(device) for o in outputs]\n", "",
        (T02 + "test_gather_concatenates_in_order_and_routes_gradients_back",),
        expect=r"gather\(outputs, device=meta\) returned a tensor on cpu",
        why="gather leaves the outputs where the replicas made them, not on the root device"),
    Bug("02.0-default-threads-not-divided", L02H,
        "threads_per_replica or max(1, cpu_budget() // self.n)",
        "threads_per_replica or max(1, cpu_budget())",
        (T02 + "test_forward_runs_the_replicas_with_threads_per_replica_threads",),
        expect=r"the cores must be split among the replicas",
        why="by default every replica gets all the cores: N replicas oversubscribe the CPU"),
    Bug("02.0-sweep-wide-line-not-n-threads", L02T,
        "threads = dict(zip(variants, (t, None, n_devices * t)))",
        "threads = dict(zip(variants, (t, None, t)))",
        (T02 + "test_sweep_times_each_line_with_its_own_threads",),
        expect=r"the comparison line gives ONE device",
        why="the '1 device, N x t threads' line runs with t threads: the comparison is unfair"),
    Bug("02.0-sweep-train-mode", L02T,
        "    model = build_model(model_name).eval()", "    model = build_model(model_name)",
        (T02 + "test_sweep_times_each_line_with_its_own_threads",),
        expect=r"sweep timed the model in training mode",
        why="inference is timed in training mode (dropout, batch statistics)"),
    Bug("02.0-limit-batches-off-by-one", L02,
        "            if i >= total:\n", "            if i > total:\n",
        (T02 + "test_training_run_limits_its_batches_reloads_and_is_reproducible",),
        expect=r"each epoch stops after exactly --limit-batches batches",
        why="each epoch takes one batch more than --limit-batches"),
    Bug("02.0-checkpoint-not-reloaded", L02,
        "        load_plain(args.checkpoint, plain)  # no wrapper, no \"module.\" prefix\n", "",
        (T02 + "test_training_run_limits_its_batches_reloads_and_is_reproducible",),
        expect=r"reload the saved file into it \(load_plain\)",
        why="--checkpoint reports the accuracy of a fresh, untrained model"),
    Bug("02.0-seed-ignored", L02,
        "    torch.manual_seed(args.seed)\n    train = make_loader", "    train = make_loader",
        (T02 + "test_training_run_limits_its_batches_reloads_and_is_reproducible",),
        expect=r"two runs with the same --seed gave different losses",
        why="--seed is ignored: the model's initial weights change from run to run"),
    # --- lesson 03: DDP with mp.spawn -----------------------------------------------------------
    Bug("03.1-local-rank-as-rank", L03,
        "    rank = args.nr * args.gpus + local_rank\n    world_size = args.nodes * args.gpus\n"
        "    device = setup(",
        "    rank = local_rank\n    world_size = args.nodes * args.gpus\n    device = setup(",
        (T03 + "test_every_process_finds_its_global_rank_and_joins_one_group",),
        expect=r"that is the local rank",
        why="on the second node, ranks collide with the first node's"),
    Bug("03.1-world-is-one-node", L03,
        "    rank = args.nr * args.gpus + local_rank\n    world_size = args.nodes * args.gpus\n"
        "    device = setup(",
        "    rank = args.nr * args.gpus + local_rank\n    world_size = args.gpus\n"
        "    device = setup(",
        (T03 + "test_every_process_finds_its_global_rank_and_joins_one_group",),
        expect=r"world_size counts every process of every machine",
        why="the world size forgets the other nodes"),
    Bug("03.1-nodes-for-gpus", L03,
        "    rank = args.nr * args.gpus + local_rank\n",
        "    rank = args.nr * args.nodes + local_rank\n",
        (T03 + "test_every_process_finds_its_global_rank_and_joins_one_group",),
        expect=r"gpus per node, not the number of nodes",
        why="the nodes before this one counted by the number of nodes, not processes per node"),
    Bug("03.2-seed-ignored", L03,
        "    sampler = DistributedSampler(range(len(x)), shuffle=shuffle, seed=seed)",
        "    sampler = DistributedSampler(range(len(x)), shuffle=shuffle)",
        (T03 + "test_without_shuffle_the_shares_are_in_order_and_the_seed_counts",),
        why="every run shuffles the same way whatever seed it is given"),
    Bug("03.2-no-distributed-sampler", L03,
        "    sampler = DistributedSampler(range(len(x)), shuffle=shuffle, seed=seed)\n"
        "    return TensorLoader(x, y, batch_size=batch_size, sampler=sampler)",
        "    return TensorLoader(x, y, batch_size=batch_size, shuffle=shuffle)",
        (T03 + "test_each_rank_gets_its_own_shuffled_share",),
        why="every rank trains on the whole dataset"),
    Bug("03.2-drop-last", L03,
        "    sampler = DistributedSampler(range(len(x)), shuffle=shuffle, seed=seed)",
        "    sampler = DistributedSampler(range(len(x)), shuffle=shuffle, seed=seed, "
        "drop_last=True)",
        (T03 + "test_each_rank_gets_its_own_shuffled_share",),
        why="the last samples are dropped, so the shares no longer cover the dataset"),
    Bug("03.3-no-set-epoch", L03,
        "        self.train_data.sampler.set_epoch(epoch)\n",
        "        pass\n",
        (T03 + "test_every_epoch_has_its_own_order_the_same_on_every_rank",),
        why="every epoch sees the same order"),
    Bug("03.4-every-rank-saves", L03,
        "        if dist.get_rank() == 0:\n            save_checkpoint(self.checkpoint_path,",
        "        if True:\n            save_checkpoint(self.checkpoint_path,",
        (T03 + "test_only_rank0_saves_without_module_prefix_and_everyone_waits",),
        why="every rank writes the same file at once"),
    Bug("03.4-no-barrier", L03,
        "self.model.module, self.optimizer, epoch)\n        dist.barrier()\n",
        "self.model.module, self.optimizer, epoch)\n",
        (T03 + "test_only_rank0_saves_without_module_prefix_and_everyone_waits",),
        why="rank 1 reads the checkpoint before rank 0 has finished writing it"),
    Bug("03.4-barrier-only-on-rank-0", L03,
        "self.model.module, self.optimizer, epoch)\n        dist.barrier()\n",
        "self.model.module, self.optimizer, epoch)\n            dist.barrier()\n",
        (T03 + "test_only_rank0_saves_without_module_prefix_and_everyone_waits",),
        why="a collective inside `if rank == 0`: the other ranks never join it"),
    Bug("03.5-no-all-reduce", L03,
        "    counts = torch.tensor([correct, total], device=device)\n    dist.all_reduce(counts)\n",
        "    counts = torch.tensor([correct, total], device=device)\n",
        (T03 + "test_accuracy_counts_the_whole_test_set_once",),
        why="each rank reports the accuracy of its own half"),
    Bug("03.5-padding-counted", L03,
        "        keep = min(len(targets), real - total)  # the rest of this share is padding",
        "        keep = len(targets)",
        (T03 + "test_accuracy_counts_the_whole_test_set_once",),
        why="DistributedSampler's padding samples are counted twice"),
    Bug("03.2-shuffle-always", L03,
        "    sampler = DistributedSampler(range(len(x)), shuffle=shuffle, seed=seed)",
        "    sampler = DistributedSampler(range(len(x)), shuffle=True, seed=seed)",
        (T03 + "test_without_shuffle_the_shares_are_in_order_and_the_seed_counts",),
        why="the evaluation loader shuffles too"),
    Bug("03.5-reduce-to-rank-0", L03,
        "    dist.all_reduce(counts)\n    return int(counts[0]), int(counts[1])",
        "    dist.reduce(counts, dst=0)\n    return int(counts[0]), int(counts[1])",
        (T03 + "test_accuracy_counts_the_whole_test_set_once",),
        why="only rank 0 gets the totals; the others report something else"),
    Bug("03.5-no-eval-mode", L03,
        "    was_training = model.training\n    model.eval()\n    sampler = loader.sampler",
        "    was_training = model.training\n    sampler = loader.sampler",
        (T03 + "test_accuracy_counts_the_whole_test_set_once",),
        why="evaluation runs in training mode (dropout on, batch-norm statistics updated)"),
    Bug("03.0-no-ddp-wrap", L03,
        '        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" '
        'else None)',
        "        self.model = self.model",
        (T03 + "test_ddp_with_batch_b_on_two_ranks_equals_one_process_with_batch_2b",),
        why="the model is never wrapped in DDP: each rank trains alone and the copies drift"),
    Bug("03.1-global-rank-as-local-rank", L03,
        "    device = setup(rank, world_size, local_rank, args.device,",
        "    device = setup(rank, world_size, rank, args.device,",
        (T03 + "test_ddp_setup_passes_this_machine_s_layout_and_the_flags_to_setup",),
        expect=r"not the global rank",
        why="on the second node, process 0 asks for GPU `rank`, which that machine lacks"),
    Bug("03.1-device-flag-ignored", L03,
        "    device = setup(rank, world_size, local_rank, args.device,",
        '    device = setup(rank, world_size, local_rank, "auto",',
        (T03 + "test_ddp_setup_passes_this_machine_s_layout_and_the_flags_to_setup",),
        expect=r"pass args\.device on",
        why="--device cpu on a GPU machine still trains on the GPUs"),
    Bug("03.1-local-world-is-world", L03,
        "threads=args.threads, local_world_size=args.gpus)",
        "threads=args.threads, local_world_size=world_size)",
        (T03 + "test_ddp_setup_passes_this_machine_s_layout_and_the_flags_to_setup",),
        expect=r"split its CPU cores, not the whole world's",
        why="the cores of one machine are split among every process of every machine"),
    Bug("03.1-timeout-ignored", L03,
        "    device = setup(rank, world_size, local_rank, args.device, timeout_s=args.timeout,\n",
        "    device = setup(rank, world_size, local_rank, args.device,\n",
        (T03 + "test_ddp_setup_passes_this_machine_s_layout_and_the_flags_to_setup",),
        expect=r"pass args\.timeout on",
        why="--timeout is ignored: a missing peer is waited for the default time"),
    Bug("03.1-threads-ignored", L03,
        "                   threads=args.threads, local_world_size=args.gpus)",
        "                   local_world_size=args.gpus)",
        (T03 + "test_ddp_setup_passes_this_machine_s_layout_and_the_flags_to_setup",),
        expect=r"pass args\.threads on",
        why="--threads is ignored"),
    Bug("03.5-always-train-after", L03,
        "    model.train(was_training)\n    counts = torch.tensor",
        "    model.train()\n    counts = torch.tensor",
        (T03 + "test_accuracy_counts_the_whole_test_set_once",),
        expect=r"switched a model that was in eval mode to training mode",
        why="evaluate always ends in training mode, even for a model that was in eval mode"),
    Bug("03.0-no-destroy", L03,
        "    finally:\n        dist.destroy_process_group()\n",
        "    finally:\n        pass\n",
        (T03 + "test_each_process_leaves_the_group_when_run_ends",),
        expect=r"still in the process group after run\(\)",
        why="the processes never leave the process group"),
    Bug("03.0-destroy-only-on-success", L03,
        "    try:\n        return cli.train_and_evaluate(args, device, prepare_dataloader, "
        "Trainer, evaluate,\n                                      "
        "checkpoint_path=args.checkpoint, resume_from=args.resume)\n    finally:\n"
        "        dist.destroy_process_group()\n",
        "    result = cli.train_and_evaluate(args, device, prepare_dataloader, Trainer, evaluate,\n"
        "                                    checkpoint_path=args.checkpoint, "
        "resume_from=args.resume)\n    dist.destroy_process_group()\n    return result\n",
        (T03 + "test_each_process_leaves_the_group_when_run_ends",),
        expect=r"still in the process group after run\(\) raised",
        why="a failed run leaves the process group open (no finally)",
        keywords=("raises",)),
    Bug("03.2-one-replica", L03,
        "    sampler = DistributedSampler(range(len(x)), shuffle=shuffle, seed=seed)",
        "    sampler = DistributedSampler(range(len(x)), num_replicas=1, rank=0, "
        "shuffle=shuffle, seed=seed)",
        (T03 + "test_each_rank_gets_its_own_shuffled_share",),
        expect=r"DistributedSampler over every rank",
        why="a sampler told there is one replica gives every rank the whole dataset"),
    Bug("03.0-resume-without-optimizer", L03,
        "            self.epochs_run = load_checkpoint(resume_from, self.model, optimizer, "
        'device)["epoch"]',
        "            self.epochs_run = load_checkpoint(resume_from, self.model, None, "
        'device)["epoch"]',
        (T03 + "test_only_rank0_saves_without_module_prefix_and_everyone_waits",),
        expect=r"restarted momentum from zero",
        why="a resumed Trainer loads the weights but not the optimizer: momentum restarts"),
    Bug("03.5-no-no-grad", L03,
        "@torch.no_grad()\ndef evaluate", "def evaluate",
        (T03 + "test_accuracy_counts_the_whole_test_set_once",),
        expect=r"evaluate built an autograd graph",
        why="evaluation builds an autograd graph for every batch (memory and time for nothing)"),
    # --- lesson 04: torchrun and snapshots ------------------------------------------------------
    Bug("04.1-no-range-check", L04,
        "    if not (0 <= rank < world_size and 0 <= local_rank < local_world_size):",
        "    if False:",
        (T04 + "test_torchrun_env_rejects_ranks_out_of_range",),
        why="a rank outside its world is accepted"),
    Bug("04.1-restart-count-ignored", L04,
        '                       int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))',
        "                       0)",
        (T04 + "test_torchrun_env_reads_every_variable",),
        why="a restarted worker believes it is the first attempt"),
    Bug("04.1-local-world-is-world", L04,
        '    local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))',
        "    local_world_size = world_size",
        (T04 + "test_torchrun_env_reads_every_variable",),
        why="LOCAL_WORLD_SIZE is ignored"),
    Bug("04.2-own-state-only", L04,
        "    if get_world_size() > 1:\n        dist.all_gather_object(states, state)\n",
        "",
        (T04 + "test_every_rank_receives_every_ranks_rng_state_in_rank_order",),
        why="the snapshot holds rank 0's random state for every rank"),
    Bug("04.3-no-barrier", L04,
        "                            world_size=len(rngs), sampler={\"seed\": "
        "self.train_data.sampler.seed})\n        barrier()\n",
        "                            world_size=len(rngs), sampler={\"seed\": "
        "self.train_data.sampler.seed})\n",
        (T04 + "test_only_rank_0_writes_a_snapshot_without_module_prefix",),
        why="rank 1 goes on (or dies) before the snapshot is complete"),
    Bug("04.4-rank-0s-rng-everywhere", L04,
        '        rng = state["rng"][get_rank()]',
        '        rng = state["rng"][0]',
        (T04 + "test_every_rank_loads_the_snapshot_and_its_own_rng",),
        why="every rank resumes with rank 0's random numbers"),
    Bug("04.5-sampler-seed-not-restored", L04,
        '            self.train_data.sampler.seed = info["sampler_seed"]\n',
        "",
        (T04 + "test_a_resumed_run_replays_the_snapshots_data_order",),
        why="the resumed run shuffles with another seed"),
    Bug("04.5-epochs-not-restored", L04,
        '            self.epochs_run = info["epoch"]\n',
        "",
        (T04 + "test_every_rank_starts_from_the_snapshot",),
        why="the resumed run starts again from epoch 0"),
    Bug("04.5-resumes-one-epoch-late", L04,
        '            self.epochs_run = info["epoch"]\n',
        '            self.epochs_run = info["epoch"] + 1\n',
        (T04 + "test_every_rank_starts_from_the_snapshot",),
        expect=r"must resume at the snapshot.s epoch",
        why="the snapshot's epoch is the number of epochs done; +1 skips one"),
    Bug("04.0-snapshot-counts-from-zero", L04,
        "                self._save_snapshot(self.epochs_run)",
        "                self._save_snapshot(epoch)",
        (T04 + "test_every_rank_starts_from_the_snapshot",
         "tests/l04_ddp_torchrun/test_torchrun_launch.py::"
         "test_torchrun_restarts_after_a_fault_and_matches_a_run_that_never_failed"),
        expect=r"resumed at epoch 0, not 1",
        why="the snapshot records the epoch it was in, not the epochs done: one epoch twice"),
    Bug("04.3-every-rank-writes", L04,
        "        if get_rank() == 0:\n            save_checkpoint(self.snapshot_path,",
        "        if True:\n            save_checkpoint(self.snapshot_path,",
        (T04 + "test_only_rank_0_writes_a_snapshot_without_module_prefix",),
        why="every rank writes the same snapshot file at once"),
    Bug("04.3-rank-0s-rng-for-all", L04,
        "epoch, rng=rngs,",
        "epoch, rng=[rngs[0]] * len(rngs),",
        (T04 + "test_only_rank_0_writes_a_snapshot_without_module_prefix",),
        why="the snapshot keeps rank 0's random state for every rank"),
    Bug("04.4-world-size-not-checked", L04,
        '    exact = state["world_size"] == get_world_size()',
        "    exact = True",
        (T04 + "test_a_snapshot_from_another_world_size_resumes_but_not_exactly",),
        why="a snapshot from another world size restores the wrong ranks' random states"),
    Bug("04.4-optimizer-not-restored", L04,
        "    state = load_checkpoint(path, model, optimizer, device)",
        "    state = load_checkpoint(path, model, None, device)",
        (T04 + "test_every_rank_loads_the_snapshot_and_its_own_rng",),
        why="the resumed run restarts momentum from zero"),
    Bug("04.4-rng-not-restored", L04,
        '        torch.set_rng_state(rng["torch"].cpu())\n',
        "",
        (T04 + "test_every_rank_loads_the_snapshot_and_its_own_rng",),
        why="the resumed run draws other random numbers (dropout, augmentation)"),
    Bug("04.1-local-rank-lower-bound", L04,
        "    if not (0 <= rank < world_size and 0 <= local_rank < local_world_size):",
        "    if not (0 <= rank < world_size and local_rank < local_world_size):",
        (T04 + "test_torchrun_env_rejects_ranks_out_of_range",),
        expect=r"both bounds",
        why="a negative LOCAL_RANK is accepted"),
    Bug("04.1-restart-count-required", L04,
        'int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))',
        'int(env["TORCHELASTIC_RESTART_COUNT"]))',
        (T04 + "test_torchrun_env_defaults_and_reads_os_environ",),
        expect=r"TORCHELASTIC_RESTART_COUNT to 0",
        why="an optional variable is required: a launch that sets only RANK, LOCAL_RANK and "
            "WORLD_SIZE fails"),
    Bug("04.4-rng-restored-when-not-exact", L04,
        '    if exact:\n        rng = state["rng"][get_rank()]',
        '    if True:\n        rng = state["rng"][get_rank()]',
        (T04 + "test_a_snapshot_from_another_world_size_resumes_but_not_exactly",),
        expect=r"restore the random states only when the world size matches",
        why="another world size's snapshot overwrites a rank's random state with another "
            "rank's (or has no entry for it)"),
    Bug("04.0-no-destroy", L04,
        "    finally:\n        dist.destroy_process_group()\n",
        "    finally:\n        pass\n",
        (T04 + "test_each_worker_leaves_the_group_when_run_ends",),
        expect=r"still in the process group after run\(\)",
        why="the workers never leave the process group"),
    Bug("04.0-destroy-only-on-success", L04,
        "    try:\n        return cli.train_and_evaluate(args, device, prepare_dataloader, "
        "Trainer, evaluate,\n                                      snapshot_path=args.snapshot)\n"
        "    finally:\n        dist.destroy_process_group()\n",
        "    result = cli.train_and_evaluate(args, device, prepare_dataloader, Trainer, evaluate,\n"
        "                                    snapshot_path=args.snapshot)\n"
        "    dist.destroy_process_group()\n    return result\n",
        (T04 + "test_each_worker_leaves_the_group_when_run_ends",),
        expect=r"still in the process group after run\(\) raised",
        why="a failed run leaves the process group open (no finally)",
        keywords=("raises",)),
    Bug("04.3-gather-on-rank-0-only", L04,
        "        rngs = gather_rng_states(self.device)\n        if get_rank() == 0:\n",
        "        if get_rank() == 0:\n            rngs = gather_rng_states(self.device)\n",
        (T04 + "test_only_rank_0_writes_a_snapshot_without_module_prefix",),
        expect=r"hung and was stopped",
        why="a collective inside `if rank == 0`: rank 0 waits in all_gather for ranks that "
            "never join"),
    Bug("04.0-setup-local-world-is-world", L04,
        "threads=args.threads, local_world_size=env.local_world_size)",
        "threads=args.threads, local_world_size=env.world_size)",
        (T04 + "test_ddp_setup_passes_torchrun_s_layout_and_the_flags_to_setup",),
        expect=r"not LOCAL_WORLD_SIZE=2",
        why="the cores of one machine are split among every process of every machine"),
    Bug("04.0-threads-ignored", L04,
        "timeout_s=args.timeout,\n                   threads=args.threads,",
        "timeout_s=args.timeout,\n                   threads=None,",
        (T04 + "test_ddp_setup_passes_torchrun_s_layout_and_the_flags_to_setup",),
        expect=r"pass args\.threads on",
        why="--threads is ignored"),
    Bug("04.0-timeout-ignored", L04,
        "args.device, timeout_s=args.timeout,", "args.device,",
        (T04 + "test_ddp_setup_passes_torchrun_s_layout_and_the_flags_to_setup",),
        expect=r"pass args\.timeout on",
        why="--timeout is ignored: a missing peer is waited for the default time"),
    # --- lesson 05: DDP from scratch ------------------------------------------------------------
    Bug("05.1-all-gather-adds", L05C,
        "        chunks[recv_idx].copy_(exchange(send_idx, recv_idx))",
        "        chunks[recv_idx].add_(exchange(send_idx, recv_idx))",
        (T05 + "test_ring_all_reduce_equals_dist_all_reduce",),
        why="the all-gather phase adds the finished chunks instead of copying them"),
    Bug("05.1-one-step-short", L05C,
        "    for s in range(world - 1):  # reduce-scatter",
        "    for s in range(world - 2):  # reduce-scatter",
        (T05 + "test_ring_all_reduce_equals_dist_all_reduce",),
        why="the reduce-scatter stops one step early"),
    Bug("05.1-ring-backwards", L05C,
        "    right, left = (rank + 1) % world, (rank - 1) % world",
        "    right, left = (rank - 1) % world, (rank + 1) % world",
        (T05 + "test_ring_all_reduce_equals_dist_all_reduce",),
        # With 3 ranks the mismatched sends and receives deadlock: the test stops the hung
        # ranks and shows where they wait, which is the right failure for this bug.
        expect=r"differs from dist\.all_reduce|hung and was stopped",
        why="sends to the left neighbour while the chunk indices assume the right one"),
    Bug("05.2-src-ignored", L05B,
        "            dist.broadcast(tensor.data, src=src)",
        "            dist.broadcast(tensor.data, src=0)",
        (T05 + "test_broadcast_state_sends_the_state_of_the_rank_it_is_given",),
        why="broadcast_state(module, src=1) still sends rank 0's state"),
    Bug("05.2-no-buffers", L05B,
        "        for tensor in [*module.parameters(), *module.buffers()]:",
        "        for tensor in module.parameters():",
        (T05 + "test_naive_broadcasts_rank0_parameters_and_buffers",),
        expect=r"missing broadcast",
        why="buffers (batch norm's running statistics) start different on each rank"),
    Bug("05.2-no-broadcast", L05B,
        "            dist.broadcast(tensor.data, src=src)",
        "            pass",
        (T05 + "test_naive_broadcasts_rank0_parameters_and_buffers",),
        expect=r"missing broadcast",
        why="each rank starts from its own random weights"),
    Bug("05.3-no-mean", L05N,
        "            p.grad.div_(self.world_size)\n",
        "",
        (T05 + "test_naive_matches_single_process_and_torch_ddp",),
        expect=r"missing divide by world size",
        why="the gradients are summed, not averaged: the step is N times too big"),
    Bug("05.3-none-grad-skipped", L05N,
        "            if p.grad is None:\n                p.grad = torch.zeros_like(p)\n",
        "            if p.grad is None:\n                continue\n",
        (T05 + "test_naive_a_parameter_only_one_rank_used_is_averaged_with_zeros",),
        expect=r"skipped its all-reduce",
        why="a rank without a gradient skips a collective the other rank makes"),
    Bug("05.4-hook-ignores-no-sync", L05O,
        "            if self.require_sync:\n                work = dist.all_reduce(",
        "            if True:\n                work = dist.all_reduce(",
        (T05 + "test_overlap_hooks_respect_no_sync",),
        why="no_sync() still communicates"),
    Bug("05.4-register-hook", L05O,
        "        def hook(param: torch.Tensor) -> None:\n            if self.require_sync:\n"
        "                work = dist.all_reduce(param.grad, async_op=True)\n"
        "                self.pending.append((work, param))\n\n        for p in self.params:\n"
        "            self.hook_handles.append(p.register_post_accumulate_grad_hook(hook))",
        "        def make_hook(param):\n            def hook(grad):\n"
        "                if self.require_sync:\n"
        "                    work = dist.all_reduce(grad, async_op=True)\n"
        "                    self.pending.append((work, param))\n"
        "                return grad\n            return hook\n\n        for p in self.params:\n"
        "            self.hook_handles.append(p.register_hook(make_hook(p)))",
        (T05 + "test_overlap_hooks_launch_from_the_accumulated_gradient_on_a_slow_network",),
        why="register_hook sees the incoming gradient before it is accumulated into .grad"),
    Bug("05.5-no-wait", L05O,
        "        for work, p in self.pending:\n            work.wait()\n"
        "            p.grad.div_(self.world_size)",
        "        for work, p in self.pending:\n            p.grad.div_(self.world_size)",
        (T05 + "test_overlap_waits_before_the_step_on_a_slow_network",),
        expect=r"missing wait|2\.0x",
        why="the step reads gradients the network has not finished summing"),
    Bug("05.5-divide-before-wait", L05O,
        "        for work, p in self.pending:\n            work.wait()\n"
        "            p.grad.div_(self.world_size)",
        "        for work, p in self.pending:\n            p.grad.div_(self.world_size)\n"
        "            work.wait()",
        (T05 + "test_overlap_waits_before_the_step_on_a_slow_network",),
        expect=r"missing wait|2\.0x",
        why="the division happens on a gradient the network is still writing"),
    Bug("05.5-pending-kept", L05O,
        "            p.grad.div_(self.world_size)\n        self.pending.clear()\n",
        "            p.grad.div_(self.world_size)\n",
        (T05 + "test_overlap_matches_single_process_with_its_own_finish",),
        expect=r"still held this step's work",
        why="the next step waits on and divides last step's gradients again"),
    Bug("05.6-forward-order", L05K,
        "    for i in reversed(range(len(params))):",
        "    for i in range(len(params)):",
        (T05 + "test_buckets_two_in_reverse_registration_order",),
        why="buckets fill in forward order, but backward produces gradients last layer first"),
    Bug("05.6-elements-not-bytes", L05K,
        "        nbytes = params[i].numel() * params[i].element_size()",
        "        nbytes = params[i].numel()",
        (T05 + "test_buckets_several_with_a_partial_last_one",),
        why="the cap is in megabytes, the sizes in elements"),
    Bug("05.6-closes-at-the-cap", L05K,
        "        if current and size + nbytes > cap:",
        "        if current and size + nbytes >= cap:",
        (T05 + "test_buckets_one_when_the_cap_exceeds_the_model",
         T05 + "test_buckets_several_with_a_partial_last_one"),
        why="a bucket that fills the cap exactly is closed one parameter early"),
    Bug("05.7-launch-on-first-gradient", L05K,
        "            if self.ready[b] == len(self.buckets[b]):",
        "            if self.ready[b] == 1:",
        (T05 + "test_bucketed_matches_single_process_and_torch_ddp",),
        why="the bucket is sent before its other gradients are in it"),
    Bug("05.7-hook-ignores-no-sync", L05K,
        "            if not self.require_sync:\n                return\n            b, i = ",
        "            b, i = ",
        (T05 + "test_bucketed_hooks_respect_no_sync",),
        why="no_sync() still communicates"),
    Bug("05.7-views-not-kept", L05K,
        "                if self.gradient_as_bucket_view:\n                    param.grad = view\n",
        "",
        (T05 + "test_gradients_as_bucket_views_stay_correct_after_zero_grad",),
        why="after set_to_none, the fresh .grad is copied in but no longer points at its view"),
    Bug("05.8-no-mean", L05K,
        "            self.bucket_buffers[b].div_(self.world_size)\n",
        "",
        (T05 + "test_bucketed_waits_and_unflattens_on_a_slow_network",),
        expect=r"missing divide by world size",
        why="the buckets are summed, not averaged"),
    Bug("05.8-no-copy-back", L05K,
        "                for p, view in zip(self.buckets[b], self.views[b]):\n"
        "                    p.grad.copy_(view)\n",
        "                pass\n",
        (T05 + "test_bucketed_waits_and_unflattens_on_a_slow_network",),
        why="the averaged bucket never reaches .grad"),
    Bug("05.8-pending-kept-after-a-step", L05K,
        "        self.pending.clear()\n        self.ready = [0] * len(self.buckets)\n"
        "        # END SOLUTION",
        "        self.ready = [0] * len(self.buckets)\n        # END SOLUTION",
        (T05 + "test_bucketed_waits_and_unflattens_on_a_slow_network",),
        expect=r"still held this step's work",
        why="the next step waits on and divides last step's buckets again"),
    Bug("05.8-ready-not-reset", L05K,
        "        self.pending.clear()\n        self.ready = [0] * len(self.buckets)\n"
        "        # END SOLUTION",
        "        self.pending.clear()\n        # END SOLUTION",
        (T05 + "test_bucketed_waits_and_unflattens_on_a_slow_network",),
        expect=r"still held this step's work",
        why="the second step's counts start where the first ended"),
    Bug("05.9-not-restored-on-error", L05B,
        "        try:\n            yield\n        finally:\n            self.require_sync = previous",
        "        yield\n        self.require_sync = previous",
        (T05 + "test_no_sync_restores_the_flag_after_an_error_and_when_nested",),
        why="an exception inside the block leaves communication off for good"),
    Bug("05.9-nesting-turns-sync-on", L05B,
        "        finally:\n            self.require_sync = previous",
        "        finally:\n            self.require_sync = True",
        (T05 + "test_no_sync_restores_the_flag_after_an_error_and_when_nested",),
        why="leaving an inner no_sync() turns communication back on inside the outer one"),
    Bug("05.2-root-buffers-only", L05B,
        "        for tensor in [*module.parameters(), *module.buffers()]:",
        "        for tensor in [*module.parameters(), *module.buffers(recurse=False)]:",
        (T05 + "test_broadcast_state_reaches_the_buffers_of_submodules",),
        expect=r"buffers of submodules were not broadcast",
        why="only the root's own buffers are sent: batch norm's running statistics, in a "
            "submodule, start different on each rank"),
    Bug("05.3-divide-by-two", L05N,
        "            p.grad.div_(self.world_size)\n",
        "            p.grad.div_(2)\n",
        (T05 + "test_naive_averages_over_three_ranks",),
        expect=r"divided by 2, not by the world size 3",
        why="a hard-coded 2 (the world size of the run at hand) in place of the world size"),
    Bug("05.5-divide-by-two", L05O,
        "            work.wait()\n            p.grad.div_(self.world_size)",
        "            work.wait()\n            p.grad.div_(2)",
        (T05 + "test_overlap_averages_over_three_ranks",),
        expect=r"divided by 2, not by the world size 3",
        why="a hard-coded 2 (the world size of the run at hand) in place of the world size"),
    Bug("05.8-divide-by-two", L05K,
        "            self.bucket_buffers[b].div_(self.world_size)\n",
        "            self.bucket_buffers[b].div_(2)\n",
        (T05 + "test_bucketed_averages_over_three_ranks",),
        expect=r"divided by 2, not by the world size 3",
        why="a hard-coded 2 (the world size of the run at hand) in place of the world size"),
    Bug("05.8-ready-kept-after-an-error", L05K,
        "            self.pending.clear()\n            self.ready = [0] * len(self.buckets)\n"
        "            raise",
        "            self.pending.clear()\n            raise",
        (T05 + "test_bucketed_unused_parameter_raises_clearly_not_hangs",),
        expect=r"reset self\.ready",
        why="after the error for an unused parameter the counts carry over: the next step "
            "launches a bucket early (or never) and averages the wrong gradients"),
    Bug("05.5-pending-kept-after-an-error", L05O,
        "                work.wait()\n            self.pending.clear()\n            raise",
        "                work.wait()\n            raise",
        (T05 + "test_overlap_unused_parameter_raises_clearly_not_hangs",),
        expect=r"clear self\.pending before raising",
        why="after the error for an unused parameter the next step divides the failed step's "
            "gradients again"),
    # --- lesson 06: mixed precision -------------------------------------------------------------
    Bug("06.1-clip-without-unscale", L06,
        "            self.scaler.unscale_(self.optimizer)  # .grad holds the true gradients now\n",
        "",
        (T06 + "test_clipping_happens_after_unscale",),
        why="the scaled gradients are clipped: the true ones end up 1/scale of max_norm"),
    Bug("06.1-unscaled-backward", L06,
        "        self.scaler.scale(loss).backward()",
        "        loss.backward()",
        (T06 + "test_step_with_scaler_backpropagates_the_scaled_loss_and_matches_fp32_sgd",),
        why="small fp16 gradients underflow, and step() unscales gradients that were not scaled"),
    Bug("06.1-returns-the-scaled-loss", L06,
        "        self.scaler.update()\n        return loss.item()",
        "        self.scaler.update()\n        return self.scaler.scale(loss).item()",
        (T06 + "test_step_with_scaler_backpropagates_the_scaled_loss_and_matches_fp32_sgd",),
        why="the reported loss is multiplied by the scale (thousands)"),
    Bug("06.1-clip-before-unscale", L06,
        "            self.scaler.unscale_(self.optimizer)  # .grad holds the true gradients now\n"
        "            nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)",
        "            nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)\n"
        "            self.scaler.unscale_(self.optimizer)",
        (T06 + "test_clipping_happens_after_unscale",),
        why="the norm is measured on scaled gradients, so clipping is wrong by the scale"),
    Bug("06.1-optimizer-step", L06,
        "        self.scaler.step(self.optimizer)  # skips the step if a gradient is inf or NaN",
        "        self.optimizer.step()",
        (T06 + "test_inf_gradient_skips_the_step_and_backs_off_the_scale",),
        why="an inf gradient is applied to the weights"),
    Bug("06.1-no-update", L06,
        "        self.scaler.update()\n        return loss.item()",
        "        return loss.item()",
        (T06 + "test_inf_gradient_skips_the_step_and_backs_off_the_scale",),
        why="the scale never backs off nor grows"),
    Bug("06.1-autocast-default-dtype", L06,
        "        with torch.autocast(self.device.type, dtype=self.dtype, "
        "enabled=self.dtype is not None):",
        "        with torch.autocast(self.device.type, enabled=self.dtype is not None):",
        (T06 + "test_autocast_runs_in_the_dtype_asked_for_not_the_devices_default",),
        why="fp16 was asked for, but CPU autocast runs bf16"),
    Bug("06.1-autocast-around-backward", L06,
        "            loss = F.cross_entropy(self.model(source), targets)\n"
        "        self.scaler.scale(loss).backward()",
        "            loss = F.cross_entropy(self.model(source), targets)\n"
        "            self.scaler.scale(loss).backward()",
        (T06 + "test_autocast_covers_forward_only_not_backward_or_step",),
        why="backward runs under autocast"),
    Bug("06.1-no-zero-grad", L06,
        "        self.optimizer.zero_grad(set_to_none=True)\n        with torch.autocast(",
        "        with torch.autocast(",
        (T06 + "test_step_with_scaler_backpropagates_the_scaled_loss_and_matches_fp32_sgd",),
        why="each step adds the previous step's (scaled) gradients"),
    Bug("06.1-autocast-always-on", L06,
        "dtype=self.dtype, enabled=self.dtype is not None):",
        "dtype=self.dtype, enabled=True):",
        (T06 + "test_autocast_runs_in_the_dtype_asked_for_not_the_devices_default",),
        why="an fp32 run still runs under autocast, in the device's default low precision"),
    Bug("06.2-resume-without-scaler-state", L06,
        '                if not state.get("scaler"):\n',
        "                if False:\n",
        (T06 + "test_resuming_a_scaled_run_from_a_checkpoint_without_scaler_state_is_an_error",),
        why="a scaled run resumes from an unscaled checkpoint at the initial scale"),
    Bug("06.2-scaler-not-saved", L06,
        "            save_checkpoint(self.checkpoint_path, self.model.module, self.optimizer, epoch,\n"
        "                            scaler=self.scaler.state_dict())",
        "            save_checkpoint(self.checkpoint_path, self.model.module, self.optimizer, epoch)",
        (T06 + "test_checkpoint_holds_scaler_state_and_resume_restores_it",),
        why="a resumed fp16 run starts again at scale 65536 and skips steps to find its scale"),
    Bug("06.2-scaler-not-loaded", L06,
        '                self.scaler.load_state_dict(state["scaler"])\n',
        "",
        (T06 + "test_checkpoint_holds_scaler_state_and_resume_restores_it",),
        why="the saved scale is ignored on resume"),
    Bug("06.3-hook-only-records", L06I,
        "    return allreduce_hook(state.group, bucket)",
        "    fut = torch.futures.Future()\n    fut.set_result(bucket.buffer())\n    return fut",
        (T06 + "test_ddp_all_reduces_fp32_gradients_under_bf16_autocast",),
        why="the communication hook records the dtype but never all-reduces"),
    Bug("06.3-records-a-constant", L06I,
        "    state.dtypes.append(bucket.buffer().dtype)",
        "    state.dtypes.append(torch.float32)",
        (T06 + "test_ddp_all_reduces_fp32_gradients_under_bf16_autocast",),
        why="the hook writes down the expected answer instead of the bucket's dtype"),
    Bug("06.4-digit-zero-accepted", L06A,
        "    if level in OPT_LEVELS:\n        return level\n",
        "    if level in OPT_LEVELS:\n        return level\n"
        "    if level[:1] == \"0\":\n        return \"O\" + level[1:]\n",
        (T06 + "test_digit_zero_or_lowercase_o_is_caught_with_the_fix",),
        why="'01' (digit zero) is silently taken for 'O1'"),
    Bug("06.1-update-before-step", L06,
        "        self.scaler.step(self.optimizer)  # skips the step if a gradient is inf or NaN\n"
        "        self.scaler.update()",
        "        self.scaler.update()\n        self.scaler.step(self.optimizer)",
        (T06 + "test_step_with_scaler_backpropagates_the_scaled_loss_and_matches_fp32_sgd",),
        expect=r"update\(\) ran before \(or without\) its step\(\)",
        why="update() before step(): GradScaler has no inf check to update from"),
    Bug("06.1-both-steps", L06,
        "        self.scaler.step(self.optimizer)  # skips the step if a gradient is inf or NaN\n",
        "        self.scaler.step(self.optimizer)\n        self.optimizer.step()\n",
        (T06 + "test_step_with_scaler_backpropagates_the_scaled_loss_and_matches_fp32_sgd",),
        expect=r"takes the step twice",
        why="scaler.step() already steps the optimizer: every update is applied twice"),
    Bug("06.1-returns-a-tensor", L06,
        "        self.scaler.update()\n        return loss.item()",
        "        self.scaler.update()\n        return loss.detach()",
        (T06 + "test_step_with_scaler_backpropagates_the_scaled_loss_and_matches_fp32_sgd",),
        expect=r"not a float: return loss\.item\(\)",
        why="the loss comes back as a tensor, not a float"),
    Bug("06.2-no-barrier", L06,
        "                            scaler=self.scaler.state_dict())\n        dist.barrier()\n",
        "                            scaler=self.scaler.state_dict())\n",
        (T06 + "test_only_rank0_saves_and_every_rank_waits_for_the_file",),
        expect=r"went on before rank 0 had written the checkpoint",
        why="rank 1 goes on (and may resume from the file) before rank 0 has finished writing"),
    Bug("06.2-every-rank-saves", L06,
        "        if dist.get_rank() == 0:\n            save_checkpoint(self.checkpoint_path",
        "        if True:\n            save_checkpoint(self.checkpoint_path",
        (T06 + "test_only_rank0_saves_and_every_rank_waits_for_the_file",),
        expect=r"rank 1 wrote a checkpoint too",
        why="every rank writes the same file at once"),
    Bug("06.4-non-string-crashes", L06A,
        "    if not isinstance(opt_level, str):\n        raise OptLevelError(f\"opt_level must be "
        "a string like 'O1', got {opt_level!r}\")\n",
        "",
        (T06 + "test_unknown_opt_levels_are_rejected",),
        expect=r"non-string opt_level must raise an OptLevelError",
        why="opt_level=1 (a number, not 'O1') crashes in .strip() with an AttributeError"),
    # --- lesson 07: Lightning -------------------------------------------------------------------
    Bug("07.1-train-loss-synced-every-step", L07,
        '        self.log("train_loss", loss, prog_bar=True)',
        '        self.log("train_loss", loss, prog_bar=True, sync_dist=True)',
        (T07 + "test_training_step_returns_the_cross_entropy_and_logs_it",),
        why="an all-reduce on every training step, only to log"),
    Bug("07.2-val-loss-not-synced", L07,
        '        self.log("val_loss", loss, sync_dist=True)',
        '        self.log("val_loss", loss)',
        (T07 + "test_validation_logs_a_synced_loss_and_the_metric_object",),
        why="each rank logs its own validation loss"),
    Bug("07.2-metric-computed-per-batch", L07,
        '        self.log("val_acc", self.val_acc, prog_bar=True)',
        '        self.log("val_acc", self.val_acc.compute(), prog_bar=True)',
        (T07 + "test_validation_logs_a_synced_loss_and_the_metric_object",),
        why="a per-batch accuracy, averaged over batches, is not the accuracy of the set"),
    Bug("07.3-unseeded-split", L07,
        "            generator = torch.Generator().manual_seed(self.seed)",
        "            generator = torch.Generator().manual_seed(torch.seed())",
        (T07 + "test_every_rank_builds_the_same_split_and_train_val_do_not_overlap",),
        why="each rank draws its own split, so validation samples leak into training"),
    Bug("07.3-test-from-train-files", L07,
        "            x, y = dpt_data.load_tensors(self.dataset, train=False, root=self.data_dir)",
        "            x, y = dpt_data.load_tensors(self.dataset, train=True, root=self.data_dir)",
        (T07 + "test_each_stage_gets_its_own_data_the_test_set_from_the_test_files",),
        expect=r"load them with train=False",
        why="the test set read from the training files: a test accuracy on seen samples"),
    Bug("07.3-fit-stage-only", L07,
        '        if stage in ("fit", "validate", None):',
        '        if stage == "fit":',
        (T07 + "test_each_stage_gets_its_own_data_the_test_set_from_the_test_files",),
        expect=r"Trainer.validate",
        why="Trainer.validate() calls setup('validate'), which then builds nothing"),
    Bug("07.3-train-on-everything", L07,
        "            self.train_set = _head(train, self.train_limit)",
        "            self.train_set = _head(full, self.train_limit)",
        (T07 + "test_every_rank_builds_the_same_split_and_train_val_do_not_overlap",),
        why="the model trains on the validation samples too"),
    Bug("07.4-new-tensor-in-float32", L07,
        "        noise = torch.randn(x.shape, device=self.device, dtype=x.dtype)",
        "        noise = torch.randn(x.shape, device=self.device)",
        (T07 + "test_new_tensors_follow_the_module_device_and_input_dtype",),
        why="the new tensor ignores the input's dtype (wrong under bf16 or double)"),
    Bug("07.3-prepare-loads-setup-downloads", L07,
        "        dpt_data.prepare(self.dataset, self.data_dir)\n",
        "        pass\n",
        (T07 + "test_setup_never_downloads_and_prepare_data_does",),
        why="prepare_data does nothing, so the files are never fetched"),
    Bug("07.5-plain-dataloader", "07_lightning/fabric_ddp.py",
        "    return fabric.setup_dataloaders(DataLoader(dataset, batch_size=batch_size, "
        "shuffle=True))",
        "    return DataLoader(dataset, batch_size=batch_size, shuffle=True)",
        (T07 + "test_fabric_loader_and_epoch_match_the_raw_loop_on_one_device",
         T07 + "test_fabric_trains_on_two_cpu_processes"),
        why="each rank loads the whole dataset, and batches stay on the CPU"),
    Bug("07.5-loss-backward", "07_lightning/fabric_ddp.py",
        "        fabric.backward(loss)  # Fabric: in place of loss.backward()",
        "        loss.backward()",
        (T07 + "test_fabric_loader_and_epoch_match_the_raw_loop_on_one_device",
         T07 + "test_fabric_trains_on_two_cpu_processes"),
        why="Fabric's precision plugin (loss scaling) and strategy hooks are skipped"),
    Bug("07.6-sharded-is-fsdp-on-cpu", L07M,
        '"ddp_sharded": "fsdp" if cuda else "ddp",',
        '"ddp_sharded": "fsdp",',
        (T07 + "test_ddp_sharded_becomes_fsdp_on_gpus_and_ddp_on_cpu",),
        why="Lightning's fsdp refuses the CPU"),
    Bug("07.6-gpus-0-means-gpu", L07M,
        "        if gpus not in (None, 0):",
        "        if gpus is not None:",
        (T07 + "test_migrate_trainer_kwargs",),
        why="gpus=0 (the CPU in 1.x) becomes accelerator='gpu', devices=0"),
    Bug("07.6-dp-kept", L07M,
        '    strategies = {"dp": "ddp", ',
        '    strategies = {"dp": "dp", ',
        (T07 + "test_migrate_trainer_kwargs",),
        why="Lightning 2.x has no 'dp' strategy"),
    Bug("07.2-val-loss-on-step-only", L07,
        '        self.log("val_loss", loss, sync_dist=True)',
        '        self.log("val_loss", loss, sync_dist=True, on_step=True, on_epoch=False)',
        (T07 + "test_logged_validation_metrics_cover_the_whole_set_on_one_device",),
        expect=r"reports no epoch value for \['val_loss'\]",
        why="val_loss logged per batch only: no value for the whole validation set"),
    Bug("07.3-limits-swapped", L07,
        "            self.train_set = _head(train, self.train_limit)\n"
        "            self.val_set = _head(val, self.val_limit)",
        "            self.train_set = _head(train, self.val_limit)\n"
        "            self.val_set = _head(val, self.train_limit)",
        (T07 + "test_setup_keeps_each_limit_for_its_own_split_and_reads_from_data_dir",),
        expect=r"limits swapped",
        why="train_limit cuts the validation split and val_limit the training one"),
    Bug("07.3-data-dir-ignored", L07,
        "            x, y = dpt_data.load_tensors(self.dataset, train=True, root=self.data_dir)",
        "            x, y = dpt_data.load_tensors(self.dataset, train=True)",
        (T07 + "test_setup_keeps_each_limit_for_its_own_split_and_reads_from_data_dir",),
        expect=r"not from the DataModule's data_dir",
        why="the DataModule's data_dir is ignored: setup reads the default folder"),
    Bug("07.4-noise-std-ignored", L07,
        "        return x + self.hparams.noise_std * noise",
        "        return x + noise",
        (T07 + "test_new_tensors_follow_the_module_device_and_input_dtype",),
        expect=r"scale the unit noise by self\.hparams\.noise_std",
        why="unit noise whatever noise_std says"),
    Bug("07.5-no-shuffle", "07_lightning/fabric_ddp.py",
        "    return fabric.setup_dataloaders(DataLoader(dataset, batch_size=batch_size, "
        "shuffle=True))",
        "    return fabric.setup_dataloaders(DataLoader(dataset, batch_size=batch_size))",
        (T07 + "test_fabric_loader_and_epoch_match_the_raw_loop_on_one_device",),
        expect=r"in the dataset's order",
        why="the training loader never shuffles, on one device or (Fabric's sampler) on many"),
    Bug("07.6-summary-always-off", L07M,
        '        new["enable_model_summary"] = new.pop("weights_summary") is not None',
        '        new.pop("weights_summary")\n        new["enable_model_summary"] = False',
        (T07 + "test_migrate_trainer_kwargs",),
        expect=r"becomes .*enable_model_summary': False",
        why="weights_summary='top' (a summary asked for) also turns the summary off"),
    Bug("07.6-accelerator-not-popped", L07M,
        '        backend = backend or new.pop("accelerator")',
        '        backend = backend or new.get("accelerator")',
        (T07 + "test_migrate_trainer_kwargs",),
        expect=r"Trainer\(\{'accelerator': 'ddp'\}\) becomes",
        why="accelerator='ddp' is copied to strategy= but left behind as an accelerator"),
    Bug("07.6-ddp-spawn-accelerator", L07M,
        '    if new.get("accelerator") in ("dp", "ddp", "ddp2", "ddp_spawn", "ddp_sharded"):',
        '    if new.get("accelerator") in ("dp", "ddp", "ddp2", "ddp_sharded"):',
        (T07 + "test_migrate_trainer_kwargs",),
        expect=r"'accelerator': 'ddp_spawn'\}\) becomes",
        why="accelerator='ddp_spawn' (a strategy in 1.x) is lost under gpus=2"),
    Bug("07.0-lr-hard-coded", L07,
        "return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)",
        "return torch.optim.Adam(self.parameters(), lr=1e-3)",
        (T07 + "test_a_short_fit_lowers_the_loss",),
        expect=r"must read self\.hparams\.learning_rate",
        why="configure_optimizers ignores the learning_rate hyperparameter"),
    # --- lesson 08: sharding --------------------------------------------------------------------
    Bug("08.1-grads-sharded-at-stage-1", L08A,
        "    grads = num_params * grad_bytes / (n if sharded >= 2 else 1)",
        "    grads = num_params * grad_bytes / (n if sharded >= 1 else 1)",
        (T08 + "test_prediction_shards_one_more_thing_per_stage",),
        why="ZeRO-1 shards only the optimizer state"),
    Bug("08.1-state-not-sharded-at-stage-1", L08A,
        "    state = num_params * state_bytes / (n if sharded >= 1 else 1)",
        "    state = num_params * state_bytes / (n if sharded >= 2 else 1)",
        (T08 + "test_prediction_shards_one_more_thing_per_stage",),
        why="ZeRO-1 is exactly the sharding of the optimizer state"),
    Bug("08.2-round-robin", L08Z,
        "        rank = min(range(world_size), key=lambda r: (loads[r], r))",
        "        rank = i % world_size",
        (T08 + "test_partition_is_balanced_by_size_and_covers_everything",),
        why="dealt out by count, not by size: one rank gets every weight, another the biases"),
    Bug("08.3-no-copy-back", L08Z,
        "                if r != self.rank:\n                    offset = 0\n",
        "                if False:\n                    offset = 0\n",
        (T08 + "test_sharded_optimizer_matches_plain_and_torch_zero",),
        why="each rank updates its own shard, and the others never see the new weights"),
    Bug("08.1-params-sharded-at-stage-2", L08A,
        "    params = num_params * param_bytes / (n if sharded >= 3 else 1)",
        "    params = num_params * param_bytes / (n if sharded >= 2 else 1)",
        (T08 + "test_prediction_shards_one_more_thing_per_stage",),
        why="ZeRO-2 keeps every parameter on every rank"),
    Bug("08.3-no-local-step", L08Z,
        "            self._sync_options()\n            self.local_optimizer.step()\n",
        "            self._sync_options()\n",
        (T08 + "test_sharded_optimizer_matches_plain_and_torch_zero",),
        why="nobody steps: the weights never change"),
    Bug("08.3-broadcast-from-rank-0", L08Z,
        "                dist.broadcast(flat, src=self._global_rank(r), group=self.process_group)",
        "                dist.broadcast(flat, src=self._global_rank(0), group=self.process_group)",
        (T08 + "test_sharded_optimizer_matches_plain_and_torch_zero",),
        why="every shard is taken from rank 0, which owns only its own"),
    Bug("08.3-group-rank-as-src", L08Z,
        "                dist.broadcast(flat, src=self._global_rank(r), group=self.process_group)",
        "                dist.broadcast(flat, src=r, group=self.process_group)",
        (T08 + "test_the_optimizer_works_on_a_process_group_that_is_not_the_world",),
        expect=r"not part of|global rank|GLOBAL",
        why="src= takes a global rank; on a subgroup the group's rank r is someone else"),
    Bug("08.0-zero2-sum-not-mean", L08Z,
        "            if r == self.rank:\n                flat /= self.world_size\n",
        "            if r == self.rank:\n",
        (T08 + "test_zero2_reduce_gradients_then_step_matches_ddp",),
        why="ZeRO-2's reduce leaves the owner the sum of the gradients, not their mean"),
    Bug("08.0-zero2-grads-kept", L08Z,
        "            else:\n                for p in with_grad:\n                    p.grad = None\n",
        "",
        (T08 + "test_zero2_reduce_gradients_then_step_matches_ddp",),
        why="the gradients a rank does not own are kept: no memory saved, the point of ZeRO-2"),
    Bug("08.0-options-not-synced", L08Z,
        "        if self.local_optimizer is not None:\n            self._sync_options()\n"
        "            self.local_optimizer.step()",
        "        if self.local_optimizer is not None:\n            self.local_optimizer.step()",
        (T08 + "test_sharded_optimizer_matches_plain_and_torch_zero",),
        why="a scheduler's new learning rate never reaches the inner optimizer"),
    Bug("08.4-root-only", L08F,
        "    for block in blocks:\n        fully_shard(block, **fsdp_kwargs)\n",
        "",
        (T08 + "test_fsdp2_shards_every_parameter_and_trains_like_ddp",),
        why="one all-gather unit for the whole model: no overlap, the whole model in memory"),
    Bug("08.4-options-to-the-root-only", L08F,
        "        fully_shard(block, **fsdp_kwargs)",
        "        fully_shard(block)",
        (T08 + "test_fsdp2_options_reach_every_block",),
        expect=r"not only for the root",
        why="the blocks get fully_shard's defaults: another mesh, no mixed precision"),
    Bug("08.4-root-not-sharded", L08F,
        "    fully_shard(model, **fsdp_kwargs)\n",
        "",
        (T08 + "test_fsdp2_shards_every_parameter_and_trains_like_ddp",),
        why="the parameters outside the blocks (the head) stay whole on every rank"),
    Bug("08.5-sharded-state-dict", L08F,
        "    options = StateDictOptions(full_state_dict=True, cpu_offload=True)",
        "    options = StateDictOptions(full_state_dict=False, cpu_offload=False)",
        (T08 + "test_full_state_dict_on_rank0_equals_ddps",),
        why="each rank saves its own shard as if it were the whole model"),
    Bug("08.5-every-rank-keeps-the-copy", L08F,
        "full_state_dict=True, cpu_offload=True", "full_state_dict=True, cpu_offload=False",
        (T08 + "test_full_state_dict_on_rank0_equals_ddps",),
        expect=r"only rank 0 keeps",
        why="without cpu_offload every rank holds the whole model again, on its device"),
    Bug("08.1-grads-priced-as-params", L08A,
        "    grads = num_params * grad_bytes / (n if sharded >= 2 else 1)",
        "    grads = num_params * param_bytes / (n if sharded >= 2 else 1)",
        (T08 + "test_each_kind_is_priced_with_its_own_bytes_per_parameter",),
        expect=r"gradients grad_bytes",
        why="the gradients are priced at the parameters' bytes (the same only in fp32)"),
    Bug("08.2-smallest-first", L08Z,
        "    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):",
        "    for i in sorted(range(len(sizes)), key=lambda i: (sizes[i], i)):",
        (T08 + "test_partition_uses_every_rank_and_keeps_big_tensors_apart",),
        expect=r"biggest first",
        why="smallest first: the big tensors come last and land on already loaded ranks"),
    Bug("08.0-zero2-divide-by-two", L08Z,
        "                flat /= self.world_size\n",
        "                flat /= 2\n",
        (T08 + "test_zero2_reduce_gradients_averages_over_three_ranks",),
        expect=r"divided by 2, not by the world size 3",
        why="a hard-coded 2 in place of the world size"),
    Bug("08.0-zero2-all-reduce", L08Z,
        "            dist.reduce(flat, dst=self._global_rank(r), group=self.process_group)",
        "            dist.all_reduce(flat, group=self.process_group)",
        (T08 + "test_zero2_reduce_gradients_averages_over_three_ranks",),
        expect=r"sends each gradient to its owner only",
        why="every rank receives every sum, only for the non-owners to throw it away"),
    Bug("08.0-load-state-dict-ignored", L08Z,
        "            self.local_optimizer.load_state_dict(state_dict[\"local\"])\n",
        "            pass\n",
        (T08 + "test_a_rank_resumes_from_its_own_shard_of_the_state",),
        expect=r"never reached the inner optimizer",
        why="a resumed run restarts Adam from zero moments"),
    Bug("08.4-no-reshard-after-forward", L08F,
        "    for block in blocks:\n        fully_shard(block, **fsdp_kwargs)\n",
        "    for block in blocks:\n"
        "        fully_shard(block, reshard_after_forward=False, **fsdp_kwargs)\n",
        (T08 + "test_fsdp2_shards_every_parameter_and_trains_like_ddp",),
        expect=r"between forward and backward",
        why="the blocks stay whole from forward to backward: ZeRO-2's memory, not ZeRO-3's"),
    Bug("08.0-caller-mesh-overridden", L08F,
        '    fsdp_kwargs.setdefault("mesh", device_mesh())',
        '    fsdp_kwargs["mesh"] = device_mesh()',
        (T08 + "test_fsdp2_options_reach_every_block",),
        expect=r"on another mesh than the one it was given",
        why="shard_model(model, mesh=...) throws the caller's mesh away for its own"),
    Bug("08.0-dtensor-counted-whole", L08A,
        '    return t.to_local() if hasattr(t, "to_local") else t',
        "    return t",
        (T08 + "test_measure_bytes_counts_a_plain_model_and_adam",),
        expect=r"count t\.to_local\(\) for a DTensor",
        why="measure_bytes prices a DTensor at its full size: FSDP seems to save nothing"),
    Bug("08.0-only-lr-synced", L08Z,
        '                if key != "params":\n                    inner[key] = value',
        '                if key == "lr":\n                    inner[key] = value',
        (T08 + "test_sharded_optimizer_matches_plain_and_torch_zero",),
        expect=r"every option, not only",
        why="a scheduler's new weight decay (or OneCycleLR's momentum) never reaches the "
            "inner optimizer"),
    Bug("08.0-empty-inner-group-dropped", L08Z,
        "                        for g in self.param_groups]",
        "                        for g in self.param_groups\n"
        "                        if any(self.owner[id(p)] == self.rank for p in g['params'])]",
        (T08 + "test_sharded_optimizer_matches_plain_and_torch_zero",),
        expect=r"one inner group per outer group",
        why="a rank that owns nothing of a group drops it: zip(outer, inner) then gives the "
            "next group this group's lr and weight decay"),
    # --- a forgotten .to(device): nothing shows on a CPU, so the tests watch the call ------
    Bug("01.0-batch-not-on-device", L01,
        "            source, targets = source.to(self.device), targets.to(self.device)",
        "            targets = targets.to(self.device)",
        (T01 + "test_the_trainer_sends_the_model_and_every_batch_to_its_device",),
        expect=r"never sent\s+to the device with \.to\(device\)",
        why="the inputs stay on the CPU while the weights are on the GPU"),
    Bug("01.0-model-not-on-device", L01,
        "        self.model = model.to(device)",
        "        self.model = model",
        (T01 + "test_the_trainer_sends_the_model_and_every_batch_to_its_device",),
        expect=r"never sent the model to its device",
        why="the Trainer trains a model that stays on the CPU"),
    Bug("01.2-eval-batch-not-on-device", L01,
        "        inputs, targets = inputs.to(device), targets.to(device)",
        "        inputs = inputs.to(device)",
        (T01 + "test_evaluate_sends_every_batch_to_the_device",),
        expect=r"never sent\s+to the device",
        why="the predictions are on the GPU, the targets they are compared with on the CPU"),
    Bug("02.7-model-not-on-root", L02,
        "    model = model.to(root)\n",
        "",
        (T02 + "test_wrap_puts_the_model_on_the_root_and_trains_like_one_device",),
        expect=r"never sent the model to the root device",
        why="nn.DataParallel refuses a model whose weights are not on device_ids[0]"),
    Bug("02.0-batch-not-on-root", L02,
        "    inputs, targets = (t.to(root, non_blocking=True) for t in batch)",
        "    inputs, targets = batch",
        (T02 + "test_wrap_puts_the_model_on_the_root_and_trains_like_one_device",),
        expect=r"never sent\s+to the device",
        why="the loss compares the root's outputs with targets left on the CPU"),
    Bug("03.0-batch-not-on-device", L03,
        "            source, targets = source.to(self.device), targets.to(self.device)",
        "            source = source.to(self.device)",
        (T03 + "test_every_epoch_has_its_own_order_the_same_on_every_rank",),
        expect=r"never sent\s+to the device",
        why="the targets stay on the CPU while the loss is computed on the GPU"),
    Bug("03.0-model-not-on-device", L03,
        "        self.model = model.to(device)",
        "        self.model = model",
        (T03 + "test_every_epoch_has_its_own_order_the_same_on_every_rank",),
        expect=r"never sent the model to its device",
        why="DDP wraps a model that is still on the CPU"),
    Bug("03.5-eval-batch-not-on-device", L03,
        "        inputs, targets = inputs[:keep].to(device), targets[:keep].to(device)",
        "        inputs, targets = inputs[:keep], targets[:keep].to(device)",
        (T03 + "test_accuracy_counts_the_whole_test_set_once",),
        expect=r"never sent\s+to the device",
        why="the test batch is fed to a model on the GPU from the CPU"),
    Bug("04.0-model-not-on-device", L04,
        "        self.model = model.to(device)",
        "        self.model = model",
        (T04 + "test_every_rank_starts_from_the_snapshot",),
        expect=r"never sent the model to its device",
        why="DDP wraps a model that is still on the CPU"),
    Bug("06.0-model-not-on-device", L06,
        "        self.model = model.to(device)  # the weights",
        "        self.model = model  # the weights",
        (T06 + "test_only_rank0_saves_and_every_rank_waits_for_the_file",),
        expect=r"never sent the model to its device",
        why="DDP wraps a model that is still on the CPU"),
    Bug("03.5-counts-on-the-cpu", L03,
        "    counts = torch.tensor([correct, total], device=device)",
        "    counts = torch.tensor([correct, total])",
        (T03 + "test_accuracy_counts_the_whole_test_set_once",),
        expect=r"NCCL takes only CUDA tensors",
        why="the counts are all-reduced from the CPU: gloo takes them, NCCL refuses them"),
    Bug("05.0-timing-median-on-the-cpu", L05C,
        "    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)",
        "    t = torch.tensor([statistics.median(times)], dtype=torch.float64)",
        (T05 + "test_the_timing_gives_every_collective_a_tensor_on_the_rank_device",),
        expect=r"NCCL takes only CUDA tensors",
        why="the timing script's own all-reduce fails on GPUs before it prints anything"),
    Bug("05.0-gathered-from-the-cpu", L05C,
        "    mine = torch.tensor([rank, 10.0 * rank], device=dev)",
        "    mine = torch.tensor([rank, 10.0 * rank])",
        (T05 + "test_each_collective_returns_what_it_must",),
        expect=r"NCCL takes only CUDA tensors",
        why="all_gather's input is made on the CPU: gloo takes it, NCCL refuses it"),
    Bug("08.0-model-not-on-device", L08F,
        "    model = wrap(build_model(model_name).to(device), mode, device)",
        "    model = wrap(build_model(model_name), mode, device)",
        (T08 + "test_train_worker_reports_the_loss_averaged_over_the_ranks",),
        expect=r"never sent the model to the rank's device",
        why="DDP or FSDP wraps a model that is still on the CPU"),
    Bug("08.0-batch-not-on-device", L08F,
        "        x, y = (t.to(device, non_blocking=True) for t in next(batches))",
        "        x, y = next(batches)",
        (T08 + "test_train_worker_reports_the_loss_averaged_over_the_ranks",),
        expect=r"never sent\s+to the device",
        why="the batches stay on the CPU while the model is on the GPU"),
    # --- found by mutation testing, third round ------------------------------------------
    Bug("07.0-test-acc-per-step", L07,
        '        self.log("test_acc", self.test_acc)',
        '        self.log("test_acc", self.test_acc, on_step=True, on_epoch=False)',
        (T07 + "test_test_accuracy_is_logged_once_per_epoch_over_every_rank",),
        expect=r"test_acc is logged with on_step=True, on_epoch=False",
        why="test_acc logged per batch: under ddp each rank reports its own batches' accuracy"),
    Bug("07.0-test-acc-tensor-not-synced", L07,
        '        self.test_acc.update(self(x).argmax(dim=1), y)\n'
        '        self.log("test_acc", self.test_acc)',
        '        acc = self.test_acc(self(x).argmax(dim=1), y)\n'
        '        self.log("test_acc", acc)',
        (T07 + "test_test_accuracy_is_logged_once_per_epoch_over_every_rank",),
        expect=r"logged as a plain Tensor without sync_dist=True",
        why="a per-batch accuracy tensor without sync_dist: each rank reports its own share"),
    Bug("08.0-reported-loss-summed", L08F,
        "        dist.all_reduce(mean)\n        mean /= world_size\n",
        "        dist.all_reduce(mean)\n",
        (T08 + "test_train_worker_reports_the_loss_averaged_over_the_ranks",),
        expect=r"the sum of the ranks' losses",
        why="the all_reduce'd loss is the sum over the ranks, reported without the mean"),
    Bug("08.0-reported-loss-divided-by-two", L08F,
        "        mean /= world_size\n",
        "        mean /= 2\n",
        (T08 + "test_train_worker_reports_the_loss_averaged_over_the_ranks",),
        expect=r"divided by 2, not by the world size 3",
        why="a hard-coded 2 ranks: the reported loss is wrong on any other world size"),
    Bug("04.5-restarts-at-0-on-another-world-size", L04,
        '            self.epochs_run = info["epoch"]\n',
        '            self.epochs_run = info["epoch"] if info["exact"] else 0\n',
        (T04 + "test_a_snapshot_from_another_world_size_resumes_at_its_epoch",),
        expect=r"restarted at epoch 0, not at the snapshot's 3",
        why="a snapshot from another world size restarts training from epoch 0"),
]


def apply(bug: Bug, tree: Path) -> str | None:
    """Make ``bug``'s edit in ``tree`` (a copy of solutions/); an error text if it can't."""
    path = tree / bug.file
    if not path.exists():
        return f"{bug.file} does not exist"
    text = path.read_text()
    count = text.count(bug.find)
    if count != 1:
        return f"the text to replace occurs {count} times in {bug.file} (expected once)"
    path.write_text(text.replace(bug.find, bug.replace))
    return None


def _failure_lines(output: str) -> list[str]:
    """The lines that say why a test failed: pytest's ``E ...`` lines and summary lines."""
    return [ln for ln in output.splitlines()
            if ln.startswith("E ") or ln.startswith("FAILED") or ln.startswith("ERROR")]


def verdict(bug: Bug, rc: int, output: str) -> tuple[str, str]:
    """``(verdict, detail)`` for a run of ``bug``'s tests that exited with ``rc``."""
    lines = _failure_lines(output)
    last = output.strip().splitlines()[-1] if output.strip() else ""
    first = next((ln[2:].strip() for ln in lines if ln.startswith("E ")),
                 lines[0] if lines else last)
    if rc == 0:
        return "SURVIVED", "the tests passed on the broken code"
    if rc != 1:
        return "ERROR", f"pytest exited {rc}: {first[:200]}"
    if bug.expect:  # the entry says what the right failure reads like (a hang, for some)
        if re.search(bug.expect, output):
            return "caught", first[:200]
        return "WRONG REASON", f"no /{bug.expect}/ in the failure: {first[:200]}"
    if re.search(r"Timeout|timed out after|hung and was stopped", "\n".join(lines)):
        return "WRONG REASON", f"a timeout, not an assertion: {first[:200]}"
    return "caught", first[:200]


def run_one(bug: Bug, python: str, timeout: int) -> dict:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"dpt-bug-{bug.id}-") as tmp:
        tree = Path(tmp) / "solutions"
        shutil.copytree(SOLUTIONS, tree, ignore=shutil.ignore_patterns("__pycache__"))
        problem = apply(bug, tree)
        if problem:
            return {"id": bug.id, "verdict": "STALE", "detail": problem, "seconds": 0.0}
        cmd = [python, "-m", "pytest", "--target", str(tree), "-q", "-x", "-p", "no:randomly",
               "-p", "no:cacheprovider", "--no-header", *bug.tests]
        if bug.keywords:
            cmd += ["-k", " or ".join(bug.keywords)]
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env,
                                  timeout=timeout)
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, output = 1, f"E   Timeout: the tests ran past {timeout} s\n{exc.stdout or ''}"
    v, detail = verdict(bug, rc, output)
    return {"id": bug.id, "verdict": v, "detail": detail,
            "seconds": round(time.monotonic() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="print the catalogue and exit")
    p.add_argument("--only", default="", help="comma-separated bug ids")
    p.add_argument("--lesson", default="", help="only this lesson's bugs, e.g. 05")
    p.add_argument("-j", "--jobs", type=int, default=2, help="bugs tested at once (default 2)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per bug (default 600)")
    p.add_argument("--python", default=sys.executable, help="the venv's python")
    args = p.parse_args(argv)

    bugs = BUGS
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = sorted(set(wanted) - {b.id for b in BUGS})
        if unknown:
            p.error(f"unknown bug id(s): {', '.join(unknown)} (see --list)")
        bugs = [b for b in BUGS if b.id in wanted]
    if args.lesson:
        bugs = [b for b in bugs if b.lesson == args.lesson.zfill(2)]
        if not bugs:
            p.error(f"no bug in lesson {args.lesson!r} (see --list)")
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    if args.list:
        for b in bugs:
            print(f"{b.id:36s} {b.file}: {b.why}")
        return 0

    print(f"[plant-bugs] {len(bugs)} bug(s), {args.jobs} at a time, tests against a broken "
          f"copy of solutions/", flush=True)
    results = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for n, result in enumerate(pool.map(lambda b: run_one(b, args.python, args.timeout),
                                            bugs), 1):
            results.append(result)
            print(f"[{n}/{len(bugs)}] {result['verdict']:12s} {result['id']} "
                  f"({result['seconds']:.0f} s): {result['detail']}", flush=True)
    bad = [r for r in results if r["verdict"] != "caught"]
    print(f"\n[plant-bugs] {len(results) - len(bad)} of {len(results)} planted bugs caught "
          "for the right reason")
    for r in bad:
        print(f"  {r['verdict']}: {r['id']}: {r['detail']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
