"""Planted bugs of lesson 12, flops.py (format: tests/planted.py)."""

from tests.planted import Bug

F = "12_step_cost/flops.py"
T = "tests/l12_step_cost/test_flops.py::"

BUGS = [
    Bug("12.1-multiply-add-is-one-flop", F, where="12.1",
        find="return 2 * tokens * in_features * out_features",
        replace="return tokens * in_features * out_features",
        tests=(T + "test_linear_flops",),
        expect=r"a multiply-add is 2 FLOPs \(forgot the 2\)",
        why="counts multiply-adds (MACs), not FLOPs: half of what every FLOP figure means"),
    Bug("12.1-conv-input-size", F, where="12.1",
        find="2 * batch * out_channels * h_out * w_out *",
        replace="2 * batch * out_channels * h * w *",
        tests=(T + "test_conv2d_flops",), keywords=("3x3-stride2",),
        expect=r"used the input's 15x11 where the output's 8x6 counts",
        why="the input's height and width where the output's count: right only when stride and "
            "padding keep the size"),
    Bug("12.1-attention-linear-in-t", F, where="12.1",
        find="heads * q_len * kv_len * head_dim", replace="heads * q_len * head_dim",
        tests=(T + "test_attention_flops",),
        expect=r"every query meets every key, q_len x kv_len scores \(t\^2, not t\)",
        why="attention counted like a Linear over the tokens: the scores are a t x t square"),
    Bug("12.2-first-layer-input-grad", F, where="12.2",
        find="return fwd, fwd * (int(layer.weight_needs_grad) + int(layer.input_needs_grad))",
        replace="return fwd, 2 * fwd",
        tests=(T + "test_count_flops_matches_flop_counter",), keywords=("mlp", "convnet"),
        expect=r"the first layer's input is the data and needs no gradient",
        why="backward = 2x forward everywhere: the first layer computes no input gradient"),
    Bug("12.3-n-counts-embeddings", F, where="12.3",
        find="return layers * per_block + dim * vocab",
        replace="return layers * per_block + 2 * dim * vocab",
        tests=(T + "test_transformer_params_are_the_linear_weights",),
        expect=r"N counts the embedding tables",
        why="N with the token embedding table: a lookup, no FLOPs; 6N then overcounts"),
    Bug("12.4-mfu-inverted", F, where="12.4",
        find='"mfu": achieved / peak_flops', replace='"mfu": peak_flops / achieved',
        tests=(T + "test_utilization_numbers",),
        expect=r"MFU inverted, it is achieved / peak",
        why="peak over achieved: an MFU above 1 for any real run"),
    Bug("12.4-counts-recomputation", F, where="12.4",
        find="flops = count_flops(model, example_input).step",
        replace='flops = __import__("dpt.flops").flops.step_flops(model, example_input)',
        tests=(T + "test_utilization_counts_model_flops_not_recomputation",),
        expect=r"checkpointing recomputes in backward \(hardware FLOPs, HFU\)",
        why="FlopCounterMode over a real step: a recomputed forward is counted, so MFU is "
            "flattered into HFU"),
]
