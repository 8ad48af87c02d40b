"""Lesson 01's planted bugs: the mistakes its tests must catch, each for the right reason.

The format and how an edit is made: ``tests/planted.py``. Plant them with
``make plant-bugs LESSON=01`` (``tools/plant_bugs.py``).
"""

from tests.planted import Bug

L01 = "01_single_device/single_device.py"
T01 = "tests/l01_single_device/test_single_device.py::"

BUGS = [
    # --- 01.0: code around the tasks
    Bug("01.0-train-resumes-from-zero", L01, where="Trainer.train",
        find="        for epoch in range(self.epochs_run, max_epochs):\n"
        "            losses.append(self._run_epoch(epoch, limit_batches))\n"
        "            rank0_print(f\"epoch {epoch}: mean train loss {losses[-1]:.4f}\")\n"
        "            self.epochs_run = epoch + 1\n"
        "            if self.checkpoint_path and",
        replace="        for epoch in range(max_epochs):\n"
        "            losses.append(self._run_epoch(epoch, limit_batches))\n"
        "            rank0_print(f\"epoch {epoch}: mean train loss {losses[-1]:.4f}\")\n"
        "            self.epochs_run = epoch + 1\n"
        "            if self.checkpoint_path and",
        tests=(T01 + "test_trainer_resumes_where_the_checkpoint_left_off_in_training_mode",),
        why="a resumed Trainer trains the finished epochs again"),
    Bug("01.0-no-train-mode", L01, where="Trainer._run_epoch",
        find="        \"\"\"One pass over the data (at most ``limit_batches`` batches); returns the mean "
        "loss.\"\"\"\n        self.model.train()\n",
        replace="        \"\"\"One pass over the data (at most ``limit_batches`` batches); returns the mean "
        "loss.\"\"\"\n",
        tests=(T01 + "test_trainer_resumes_where_the_checkpoint_left_off_in_training_mode",),
        why="after an evaluation the model trains in eval mode (no dropout, frozen batch norm)"),
    Bug("01.0-resume-without-optimizer", L01, where="Trainer.__init__",
        find="            self.epochs_run = load_checkpoint(resume_from, self.model, optimizer, "
        'device)["epoch"]',
        replace="            self.epochs_run = load_checkpoint(resume_from, self.model, None, "
        'device)["epoch"]',
        tests=(T01 + "test_trainer_resumes_where_the_checkpoint_left_off_in_training_mode",),
        expect=r"restarted momentum from zero",
        why="a resumed Trainer loads the weights but not the optimizer: momentum restarts"),
    Bug("01.0-epoch-loss-is-last-batch", L01, where="Trainer._run_epoch",
        find="        self.history.extend(losses)\n        return sum(losses) / max(1, len(losses))",
        replace="        self.history.extend(losses)\n        return losses[-1]",
        tests=(T01 + "test_trainer_learns_and_checkpoints_every_save_every_epochs",),
        expect=r"is not the mean of that epoch's batch losses",
        why="the epoch's loss is its last batch's, not the mean over its batches"),
    Bug("01.0-limit-batches-ignored", L01, where="Trainer.train",
        find="            losses.append(self._run_epoch(epoch, limit_batches))\n"
        "            rank0_print(f\"epoch {epoch}: mean train loss {losses[-1]:.4f}\")",
        replace="            losses.append(self._run_epoch(epoch))\n"
        "            rank0_print(f\"epoch {epoch}: mean train loss {losses[-1]:.4f}\")",
        tests=(T01 + "test_trainer_resumes_where_the_checkpoint_left_off_in_training_mode",),
        expect=r"pass limit_batches on to _run_epoch",
        why="train() drops limit_batches: --limit-batches runs whole epochs"),
    Bug("01.0-seed-ignored", L01, where="prepare_dataloader",
        find="    generator = torch.Generator().manual_seed(seed)",
        replace="    generator = torch.Generator()",
        tests=(T01 + "test_prepare_dataloader_shuffles_by_its_seed_and_every_epoch_differently",),
        expect=r"seeds 0 and 1 gave the same order",
        why="every seed shuffles the same way"),
    Bug("01.0-never-shuffles", L01, where="prepare_dataloader",
        find="shuffle=shuffle, generator=generator)",
        replace="shuffle=False, generator=generator)",
        tests=(T01 + "test_prepare_dataloader_shuffles_by_its_seed_and_every_epoch_differently",),
        expect=r"prepare_dataloader\(shuffle=True\) must shuffle",
        why="the training data is never shuffled"),
    Bug("01.0-batch-not-on-device", L01, where="Trainer._run_epoch",
        find="            source, targets = source.to(self.device), targets.to(self.device)",
        replace="            targets = targets.to(self.device)",
        tests=(T01 + "test_the_trainer_sends_the_model_and_every_batch_to_its_device",),
        expect=r"never sent\s+to the device with \.to\(device\)",
        why="the inputs stay on the CPU while the weights are on the GPU"),
    Bug("01.0-model-not-on-device", L01, where="Trainer.__init__",
        find="        self.model = model.to(device)",
        replace="        self.model = model",
        tests=(T01 + "test_the_trainer_sends_the_model_and_every_batch_to_its_device",),
        expect=r"never sent the model to its device",
        why="the Trainer trains a model that stays on the CPU"),
    Bug("01.0-save-every-ignored", L01, where="Trainer.train",
        find="            if self.checkpoint_path and self.epochs_run % self.save_every == 0:",
        replace="            if self.checkpoint_path:",
        tests=(T01 + "test_train_checkpoints_only_every_save_every_epochs",),
        expect=r"not \[2, 4\]: save only when epochs_run % save_every == 0",
        why="save_every is ignored: a checkpoint is written after every epoch"),
    Bug("01.0-threads-flag-ignored", L01, where="run",
        find="    if args.threads:\n        set_threads(args.threads)\n",
        replace="",
        tests=(T01 + "test_run_applies_threads_and_passes_checkpoint_and_resume_on",),
        expect=r"run\(\) must apply --threads",
        why="--threads is ignored"),
    Bug("01.0-checkpoint-flag-ignored", L01, where="run",
        find="checkpoint_path=args.checkpoint, resume_from",
        replace="checkpoint_path=None, resume_from",
        tests=(T01 + "test_run_applies_threads_and_passes_checkpoint_and_resume_on",),
        expect=r"pass --checkpoint and --resume on",
        why="--checkpoint is ignored: no checkpoint is ever written"),
    Bug("01.0-loader-drops-last-batch", L01, where="prepare_dataloader",
        find="shuffle=shuffle, generator=generator)",
        replace="shuffle=shuffle, generator=generator, drop_last=True)",
        tests=(T01 + "test_prepare_dataloader_keeps_the_short_last_batch",),
        expect=r"keep the short last batch \(no drop_last\)",
        why="prepare_dataloader drops the short last batch (drop_last=True): those "
            "samples are never trained on nor evaluated"),
    Bug("01.0-progress-always-on", L01, where="Trainer._run_epoch",
        find="                                           self.progress):",
        replace="                                           True):",
        tests=(T01 + "test_the_progress_flag_reaches_the_epoch_loop",),
        expect=r"pass self\.progress on to the epoch's cli\.batches",
        why="the epoch loop hard-codes show=True: --no-progress no longer turns the "
            "progress bar off"),
    Bug("01.0-epoch-mean-over-loader-length", L01, where="Trainer._run_epoch",
        find="        return sum(losses) / max(1, len(losses))",
        replace="        return sum(losses) / len(self.train_data)",
        tests=(T01 + "test_an_epoch_returns_and_prints_the_mean_of_the_batches_it_ran",),
        expect=r"an epoch's loss is the mean over the batches it ran",
        why="the epoch's loss divides by len(loader), not by the batches run: wrong "
            "under --limit-batches"),
    Bug("01.0-printed-loss-is-last-batch", L01, where="Trainer.train",
        find='rank0_print(f"epoch {epoch}: mean train loss {losses[-1]:.4f}")',
        replace='rank0_print(f"epoch {epoch}: mean train loss {self.history[-1]:.4f}")',
        tests=(T01 + "test_an_epoch_returns_and_prints_the_mean_of_the_batches_it_ran",),
        expect=r"must show that epoch's mean loss",
        why="the printed 'mean train loss' is the last batch's loss (history[-1]), not "
            "the epoch's mean"),
    Bug("01.0-run-result-dropped", L01, where="run",
        find="    return cli.train_and_evaluate(args, device,",
        replace="    cli.train_and_evaluate(args, device,",
        tests=(T01 + "test_run_trains_on_the_device_asked_for_and_returns_the_result",),
        expect=r"run\(\) returned None: return what cli\.train_and_evaluate returns",
        why="run() forgets to return train_and_evaluate's result: the accuracy and "
            "history are lost"),
    Bug("01.0-device-flag-ignored", L01, where="run",
        find="    device = pick_device(args.device)",
        replace='    device = pick_device("auto")',
        tests=(T01 + "test_run_trains_on_the_device_asked_for_and_returns_the_result",),
        expect=r"run\(\) must pick the device --device names",
        why="run() picks 'auto' whatever --device says: --device cpu on a GPU machine "
            "trains on the GPU"),
    Bug("01.0-no-resume-message", L01, where="Trainer.__init__",
        find='            rank0_print(f"resumed from {resume_from} at epoch {self.epochs_run}")\n',
        replace="",
        tests=(T01 + "test_cli_trains_and_reports_test_accuracy",),
        expect=r"'resumed from' in",
        why="a resumed run no longer says where it resumed"),
    Bug("01.0-history-replaced", L01, where="Trainer._run_epoch",
        find="        self.history.extend(losses)\n",
        replace="        self.history = losses\n",
        tests=(T01 + "test_an_epoch_returns_and_prints_the_mean_of_the_batches_it_ran",),
        expect=r"it must keep the loss of every batch of every epoch",
        why="history = losses instead of history.extend(losses): the loss curve keeps "
            "only the last epoch"),
    Bug("01.0-global-seed-instead-of-generator", L01, where="prepare_dataloader",
        find="    generator = torch.Generator().manual_seed(seed)\n"
        "    return TensorLoader(x, y, batch_size=batch_size, shuffle=shuffle, "
        "generator=generator)",
        replace="    torch.manual_seed(seed)\n"
        "    return TensorLoader(x, y, batch_size=batch_size, shuffle=shuffle)",
        tests=(T01 + "test_prepare_dataloader_shuffles_with_a_generator_of_its_own",),
        expect=r"shuffle with the loader's own torch\.Generator\(\)\.manual_seed\(seed\)",
        why="torch.manual_seed(seed) instead of a loader generator: the order depends on "
            "every other random draw, and the model's init is reseeded"),
    Bug("01.0-missing-resume-ignored", L01, where="Trainer.__init__",
        find="if resume_from:",
        replace="if resume_from and Path(resume_from).exists():",
        tests=(T01 + "test_resuming_from_a_missing_checkpoint_is_an_error",),
        expect=r"let load_checkpoint's\s+CheckpointError through",
        why="'if resume_from and Path(resume_from).exists()': a mistyped --resume "
            "silently trains from scratch"),
    Bug("01.0-resume-before-to-device", L01, where="Trainer.__init__",
        find="        self.model = model.to(device)\n"
        "        self.train_data = train_data\n",
        replace="        self.train_data = train_data\n",
        more=(
            ("Trainer.__init__",
             "            self.epochs_run = load_checkpoint(resume_from, self.model, optimizer, device)[\"epoch\"]\n"
        "            rank0_print(f\"resumed from {resume_from} at epoch {self.epochs_run}\")\n",
             "            self.epochs_run = load_checkpoint(resume_from, model, optimizer, device)[\"epoch\"]\n"
        "            rank0_print(f\"resumed from {resume_from} at epoch {self.epochs_run}\")\n"
        "        self.model = model.to(device)\n"),
        ),
        tests=(T01 + "test_a_resumed_trainer_loads_the_checkpoint_into_the_model_on_its_device",),
        expect=r"loaded the checkpoint before it sent the model to its device",
        why="the checkpoint is loaded before model.to(device): the momentum stays on the "
            "CPU, and the first step on a GPU fails"),
    Bug("01.0-notebook-reloads-on-the-cpu", "01_single_device/tutorial.py", where="<module>",
        find="        fresh = ConvNet().to(device)\n",
        replace="        fresh = ConvNet()\n",
        tests=(T01 + "test_the_notebook_evaluates_the_reloaded_model_where_the_test_batches_go",),
        expect=r"evaluates a fresh model it never sent to `device`",
        why="the notebook evaluates a CPU model on CUDA test batches"),
    # --- 01.1: one optimization step on this batch
    Bug("01.1-no-zero-grad", L01, where="01.1",
        find="        self.optimizer.zero_grad(set_to_none=True)\n        loss = F.cross_entropy(",
        replace="        loss = F.cross_entropy(",
        tests=(T01 + "test_run_batch_matches_a_reference_sgd_step",),
        why="gradients of the previous batch are added to this one's"),
    Bug("01.1-nll-on-logits", L01, where="01.1",
        find="loss = F.cross_entropy(self.model(source), targets)",
        replace="loss = F.nll_loss(self.model(source), targets)",
        tests=(T01 + "test_run_batch_matches_a_reference_sgd_step",),
        why="nll_loss expects log-probabilities; the model returns logits"),
    Bug("01.1-step-before-backward", L01, where="01.1",
        find="        loss.backward()\n"
        "        self.optimizer.step()\n",
        replace="        self.optimizer.step()\n"
        "        loss.backward()\n",
        tests=(T01 + "test_run_batch_matches_a_reference_sgd_step",),
        why="the step uses no gradient (or the last batch's), then this batch's waits"),
    Bug("01.1-returns-loss-tensor", L01, where="01.1",
        find="        return loss.item()\n",
        replace="        return loss\n",
        tests=(T01 + "test_run_batch_matches_a_reference_sgd_step",),
        expect=r"return the loss as a Python float",
        why="_run_batch returns the loss tensor (and keeps its graph alive), not loss.item()"),
    Bug("01.1-zero-grad-after-backward", L01, where="01.1",
        find="        self.optimizer.zero_grad(set_to_none=True)\n"
        "        loss = F.cross_entropy(self.model(source), targets)\n"
        "        loss.backward()\n",
        replace="        loss = F.cross_entropy(self.model(source), targets)\n"
        "        loss.backward()\n"
        "        self.optimizer.zero_grad(set_to_none=True)\n",
        tests=(T01 + "test_run_batch_matches_a_reference_sgd_step",),
        expect=r"did not update the weights",
        why="zero_grad() between backward() and step(): every step has no gradient, "
            "nothing learns"),
    # --- 01.2: count the correct predictions over every sample
    Bug("01.2-no-eval-mode", L01, where="01.2",
        find="    was_training = model.training\n    model.eval()\n    correct = total = 0\n",
        replace="    was_training = model.training\n    correct = total = 0\n",
        tests=(T01 + "test_evaluate_uses_eval_mode_and_restores_training_mode",),
        why="dropout and batch norm stay in training mode while evaluating"),
    Bug("01.2-mode-not-restored", L01, where="01.2",
        find="    model.train(was_training)\n    return correct, total\n",
        replace="    return correct, total\n",
        tests=(T01 + "test_evaluate_uses_eval_mode_and_restores_training_mode",),
        why="evaluate leaves the model in eval mode, so training goes on without dropout"),
    Bug("01.2-full-batches-counted", L01, where="01.2",
        find="        total += len(targets)\n    model.train(was_training)\n    return correct, total\n",
        replace="        total += loader.batch_size\n    model.train(was_training)\n"
        "    return correct, total\n",
        tests=(T01 + "test_evaluate_counts_every_sample_including_a_short_last_batch",),
        why="the short last batch is counted as a full one"),
    Bug("01.2-argmax-over-the-batch", L01, where="01.2",
        find="        correct += int((model(inputs).argmax(dim=1) == targets).sum())\n"
        "        total += len(targets)\n    model.train(was_training)\n    return correct, total\n",
        replace="        correct += int((model(inputs).argmax(dim=0) == targets[0]).sum())\n"
        "        total += len(targets)\n    model.train(was_training)\n    return correct, total\n",
        tests=(T01 + "test_evaluate_counts_every_sample_including_a_short_last_batch",),
        why="argmax over the batch dimension instead of the classes"),
    Bug("01.2-always-train-after", L01, where="01.2",
        find="    model.train(was_training)\n    return correct, total\n",
        replace="    model.train()\n    return correct, total\n",
        tests=(T01 + "test_evaluate_leaves_an_eval_mode_model_in_eval_mode",),
        expect=r"switched a model that was in eval mode to training mode",
        why="evaluate always ends in training mode, even for a model that was in eval mode"),
    Bug("01.2-no-no-grad", L01, where="evaluate",
        find="@torch.no_grad()\ndef evaluate",
        replace="def evaluate",
        tests=(T01 + "test_evaluate_uses_eval_mode_and_restores_training_mode",),
        expect=r"evaluate built an autograd graph",
        why="evaluation builds an autograd graph for every batch (memory and time for nothing)"),
    Bug("01.2-eval-batch-not-on-device", L01, where="01.2",
        find="        inputs, targets = inputs.to(device), targets.to(device)",
        replace="        inputs = inputs.to(device)",
        tests=(T01 + "test_evaluate_sends_every_batch_to_the_device",),
        expect=r"never sent\s+to the device",
        why="the predictions are on the GPU, the targets they are compared with on the CPU"),
    Bug("01.2-counts-as-tensors", L01, where="01.2",
        find="        correct += int((model(inputs).argmax(dim=1) == targets).sum())",
        replace="        correct += (model(inputs).argmax(dim=1) == targets).sum()",
        tests=(T01 + "test_evaluate_counts_every_sample_including_a_short_last_batch",),
        expect=r"return the counts as Python ints",
        why="evaluate adds up tensor counts (no int()): it returns a tensor, not an int"),
    Bug("01.2-mode-read-after-eval", L01, where="01.2",
        find="    was_training = model.training\n"
        "    model.eval()\n",
        replace="    model.eval()\n"
        "    was_training = model.training\n",
        tests=(T01 + "test_evaluate_uses_eval_mode_and_restores_training_mode",),
        expect=r"evaluate must put the model back in training mode",
        why="the mode is read after model.eval(), so evaluate always leaves the model in "
            "eval mode"),
    # --- 01.3: an atomic checkpoint of the unwrapped model, optimizer and epoch
    Bug("01.3-torch-save-in-place", L01, where="01.3",
        find="    return ckpt.atomic_save(state, path)\n",
        replace="    torch.save(state, path)\n"
        "    return Path(path)\n",
        tests=(T01 + "test_a_crash_mid_save_keeps_the_previous_checkpoint",),
        why="a crash in the middle of torch.save leaves a truncated file at the final path"),
    Bug("01.3-module-prefix", L01, where="01.3",
        find='    state = {"model": getattr(model, "module", model).state_dict(),',
        replace='    state = {"model": model.state_dict(),',
        tests=(T01 + "test_checkpoint_of_a_wrapped_model_has_no_module_prefix",),
        why="a wrapped model's keys start with 'module.' and do not load into a plain model"),
    Bug("01.3-optimizer-not-restored", L01, where="01.3",
        find="    if optimizer is not None:\n        optimizer.load_state_dict(state[\"optimizer\"])\n",
        replace="",
        tests=(T01 + "test_checkpoint_round_trip_into_a_fresh_model",),
        why="the resumed run restarts momentum from zero"),
    Bug("01.3-epoch-not-saved", L01, where="01.3",
        find='             "optimizer": optimizer.state_dict(), "epoch": epoch, **extra}\n'
        "    return ckpt.atomic_save(state, path)",
        replace='             "optimizer": optimizer.state_dict(), "epoch": 0, **extra}\n'
        "    return ckpt.atomic_save(state, path)",
        tests=(T01 + "test_checkpoint_round_trip_into_a_fresh_model",),
        why="a resumed run does not know where it stopped"),
    Bug("01.3-load-ignores-wrapper", L01, where="01.3",
        find='    getattr(model, "module", model).load_state_dict(state["model"])',
        replace='    model.load_state_dict(state["model"])',
        tests=(T01 + "test_checkpoint_loads_into_a_wrapped_model_s_module",),
        expect=r"must load into its \.module",
        why="a plain checkpoint does not load into a DataParallel/DDP wrapper's own keys"),
    Bug("01.3-no-map-location", L01, where="01.3",
        find="    state = ckpt.load(path, map_location=device)",
        replace="    state = ckpt.load(path)",
        tests=(T01 + "test_load_checkpoint_puts_the_tensors_on_the_device_it_is_given",),
        expect=r"load with map_location=device",
        why="the device argument is ignored: the tensors land on the CPU, not where the model is"),
    Bug("01.3-load-not-strict", L01, where="01.3",
        find='    getattr(model, "module", model).load_state_dict(state["model"])',
        replace='    getattr(model, "module", model).load_state_dict(state["model"], strict=False)',
        tests=(T01 + "test_load_checkpoint_refuses_another_model_s_checkpoint",),
        expect=r"without an error: keep load_state_dict strict",
        why="strict=False silences the 'module.' error by loading nothing: the model keeps "
            "random weights"),
    Bug("01.3-raw-torch-load", L01, where="01.3",
        find="    state = ckpt.load(path, map_location=device)",
        replace="    state = torch.load(path, map_location=device, weights_only=True)",
        tests=(T01 + "test_checkpoint_errors_are_clear",),
        why="load_checkpoint calls torch.load directly: a missing or broken file is not "
            "a CheckpointError"),
    Bug("01.3-extra-dropped", L01, where="01.3",
        find='"epoch": epoch, **extra}',
        replace='"epoch": epoch}',
        tests=(T01 + "test_checkpoint_round_trip_into_a_fresh_model",),
        expect=r"KeyError: 'note'",
        why="save_checkpoint drops the **extra entries"),
]
