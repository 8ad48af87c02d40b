"""Planted bugs of lesson 10, part: compile (see planted_bugs.py)."""

from tests.planted import Bug

C = "10_inside_a_step/compile_ddp.py"
T = "tests/l10_inside_a_step/test_compile.py::"
T3 = "tests/l10_inside_a_step/test_at_three_ranks.py::"  # what only 3 ranks show

BUGS = [
    # --- 10.5 GraphRecorder --------------------------------------------------------------------
    Bug("10.5-params-from-example-inputs", C, where="10.5",
        find="        def recording(*args):\n"
             "            record[\"params\"].update(self.names[id(a)] for a in args "
             "if id(a) in self.names)\n"
             "            return run(*args)\n\n"
             "        return recording\n",
        replace="        record[\"params\"].update(self.names[id(a)] for a in example_inputs\n"
                "                                if id(a) in self.names)\n"
                "        return run\n",
        tests=(T + "test_recorder_sees_each_graph_and_its_parameters",),
        expect=r"no graph recorded any parameter: the example inputs are fake tensors",
        why="looks for the parameters among the example inputs, which are fake tensors made "
            "for tracing: no graph ever names a parameter"),
    Bug("10.5-one-set-for-all-graphs", C, where="10.5",
        find="        self.graphs.append(record)\n",
        replace="        if self.graphs:\n"
                "            record[\"params\"] = self.graphs[0][\"params\"]\n"
                "        self.graphs.append(record)\n",
        tests=(T + "test_recorder_sees_each_graph_and_its_parameters",),
        expect=r"one set per record, not one shared by all",
        why="every record shares the first graph's set: each graph seems to hold the whole "
            "model, and the split is invisible"),
    Bug("10.5-inner-backend-ignored", C, where="10.5",
        find="run = gm.forward if self.inner is None else self.inner(gm, example_inputs)",
        replace="run = gm.forward",
        tests=(T + "test_recorder_runs_each_graph_through_the_inner_backend",),
        expect=r"the inner backend compiled 0 of",
        why="always runs the captured graph as it is: --backend inductor compiles nothing, "
            "and the benchmark times eager code"),
    Bug("10.5-ops-count-every-node", C, where="10.5",
        find="sum(node.op.startswith(\"call\") for node in gm.graph.nodes)",
        replace="len(gm.graph.nodes)",
        tests=(T + "test_recorder_sees_each_graph_and_its_parameters",),
        expect=r"count the graph's call nodes",
        why="counts the placeholders (inputs, parameters) and the output as operations"),
    # --- 10.6 BucketRecorder.hook --------------------------------------------------------------
    Bug("10.6-no-all-reduce", C, where="10.6",
        find="        return allreduce_hook(state, bucket)\n",
        replace="        done = torch.futures.Future()\n"
                "        done.set_result(bucket.buffer())\n"
                "        return done\n",
        tests=(T + "test_bucket_recorder_still_averages_the_gradients",),
        expect=r"so it must still average",
        why="returns the bucket as it is: the hook replaced DDP's all-reduce, so each rank "
            "trains on its own gradients and the replicas drift apart"),
    Bug("10.6-averages-over-two", C, where="10.6",
        find="        return allreduce_hook(state, bucket)\n",
        replace="        buffer = bucket.buffer().div_(2)\n"
                "        work = dist.all_reduce(buffer, async_op=True)\n"
                "        return work.get_future().then(lambda fut: fut.value()[0])\n",
        tests=(T3 + "test_bucket_recorder_averages_over_three_ranks",),
        expect=r"it divides by 2, not by the world size",
        why="writes DDP's average by hand for the lesson's 2 ranks: at 3 the gradients are "
            "1.5 times too big"),
    Bug("10.6-one-dict-for-every-step", C, where="10.6",
        find="if bucket.index() == 0:",
        replace="if not self.steps:",
        tests=(T + "test_bucket_recorder_reads_the_rebuilt_buckets",),
        expect=r"a step starts at bucket 0",
        why="keeps one dict for all steps: step 0's buckets are overwritten by the rebuilt "
            "ones, and a bucket index that no longer exists stays in"),
    Bug("10.6-names-by-position", C, where="10.6",
        find="[self.names[id(p)] for p in bucket.parameters()]",
        replace="list(self.names.values())[:len(bucket.parameters())]",
        tests=(T + "test_bucket_recorder_reads_the_rebuilt_buckets",),
        expect=r"named through self.names \(by identity\)",
        why="names a bucket's parameters by counting from the model's first parameter: "
            "buckets are in backward order, the last layers first"),
    Bug("10.0-compile-buckets-read-at-step-0", C, where="BucketRecorder.buckets",
        find="last = self.steps[-1] if self.steps else {}",
        replace="last = self.steps[0] if self.steps else {}",
        tests=(T + "test_bucket_recorder_reads_the_rebuilt_buckets",),
        expect=r"DDP rebuilds its buckets after step 0",
        why="reads the buckets DDP made at construction, before it rebuilt them in the "
            "order the gradients arrived"),
    # --- 10.7 build_compiled_ddp -----------------------------------------------------------------
    Bug("10.7-wrap-then-compile", C, where="10.7",
        find="return DDP(torch.compile(model, backend=backend), bucket_cap_mb=bucket_cap_mb)",
        replace="return torch.compile(DDP(model, bucket_cap_mb=bucket_cap_mb), backend=backend)",
        tests=(T + "test_build_compiles_the_model_then_wraps_it",),
        expect=r"compile the model first, then wrap the compiled model in DDP",
        why="compiles DDP itself: dynamo breaks the graph in DDP's forward, and what it "
            "compiles then depends on the torch version and the model"),
    Bug("10.7-cap-not-passed", C, where="10.7",
        find="return DDP(torch.compile(model, backend=backend), bucket_cap_mb=bucket_cap_mb)",
        replace="return DDP(torch.compile(model, backend=backend))",
        tests=(T + "test_build_compiles_the_model_then_wraps_it",),
        expect=r"pass bucket_cap_mb to DDP as it is",
        why="DDP keeps its 25 MiB default whatever the caller asked"),
    Bug("10.7-default-made-explicit", C, where="10.7",
        find="bucket_cap_mb=bucket_cap_mb)",
        replace="bucket_cap_mb=bucket_cap_mb or 25)",
        tests=(T + "test_graphs_follow_the_buckets",),
        expect=r"None stays None",
        why="passes 25 for None: DDP then makes its first bucket 25 MiB too, while the "
            "DDPOptimizer cuts a 1 MiB first graph, and the graphs no longer follow the "
            "buckets"),
    Bug("10.7-no-cap-check", C, where="10.7",
        find="    if bucket_cap_mb is not None and bucket_cap_mb * MiB < FIRST_BUCKET_BYTES:\n"
             "        raise ValueError(",
        replace="    if False:\n        raise ValueError(",
        tests=(T + "test_a_cap_below_the_first_bucket_is_a_one_line_error",),
        expect=r"check the cap before building anything",
        why="no check: the small cap fails later, inside dynamo, with an AssertionError "
            "about 'comms warmed up'"),
    Bug("10.7-first-bucket-refused", C, where="10.7",
        find="bucket_cap_mb * MiB < FIRST_BUCKET_BYTES",
        replace="bucket_cap_mb * MiB <= FIRST_BUCKET_BYTES",
        tests=(T + "test_graphs_follow_the_buckets",),
        expect=r"bucket_cap_mb=1 is smaller than DDP's first bucket",
        why="refuses a cap of exactly 1 MiB, which the DDPOptimizer accepts"),
]
