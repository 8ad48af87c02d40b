"""Planted bugs of lesson 11, part: global_batch (see planted_bugs.py)."""

from tests.planted import Bug

G = "11_time_to_accuracy/global_batch.py"
T = "tests/l11_time_to_accuracy/test_global_batch.py::"
SGD = T + "test_accumulation_sgd_equals_n_ranks"
ONCE = T + "test_accumulation_all_reduces_once_per_step"

BUGS = [
    # --- 11.1 micro_batches -------------------------------------------------------------------
    Bug("11.1-rank-ignored", G, where="11.1",
        find="xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]",
        replace="xs, ys = x[:share], y[:share]",
        tests=(T + "test_micro_batches_cover_the_global_batch",),
        expect=r"the ranks' micro-batches overlap",
        why="every rank takes the first share: the ranks train on the same samples, and the "
            "rest of the global batch is never seen"),
    # --- 11.2 accumulation_step ---------------------------------------------------------------
    Bug("11.2-no-division", G, where="11.2",
        find="loss = loss_fn(model(xb), yb) / len(micro)",
        replace="loss = loss_fn(model(xb), yb)",
        tests=(SGD,),
        expect=r"times too large: divide each micro-batch's loss by their count",
        why="the accumulated gradient is the sum of K means, K times the mean: SGD steps K "
            "times too far (AdamW hides it)"),
    Bug("11.2-no-sync-every-micro", G, where="11.2",
        find='hasattr(model, "no_sync") and not last',
        replace='hasattr(model, "no_sync")',
        tests=(SGD,),
        expect=r"the ranks differ .*the last micro-batch must synchronise",
        why="no_sync around every backward, the last one too: DDP never all-reduces, each "
            "rank steps with its own gradient and the replicas drift apart"),
    Bug("11.2-sync-every-micro", G, where="11.2",
        find='quiet = model.no_sync() if hasattr(model, "no_sync") and not last \\\n'
             '            else contextlib.nullcontext()',
        replace="quiet = contextlib.nullcontext()",
        tests=(ONCE,),
        expect=r"all-reduced 2 times per step .*no_sync on all but the last",
        why="no no_sync at all: the same weights, but K all-reduces per step where one does"),
    Bug("11.2-step-every-micro", G, where="11.2",
        find="        total += loss.item()\n    optimizer.step()\n",
        replace="        total += loss.item()\n        optimizer.step()\n",
        tests=(ONCE,),
        expect=r"stepped 2 times per global batch",
        why="steps after every micro-batch: K small steps on partial gradients, not one step "
            "on the global batch"),
    Bug("11.2-zero-grad-in-loop", G, where="11.2",
        find="    optimizer.zero_grad(set_to_none=True)\n    total = 0.0\n"
             "    for i, (xb, yb) in enumerate(micro):\n",
        replace="    total = 0.0\n    for i, (xb, yb) in enumerate(micro):\n"
                "        optimizer.zero_grad(set_to_none=True)\n",
        tests=(SGD,),
        expect=r"only the last micro-batch's gradient survives",
        why="zeroes the gradients before every micro-batch: nothing accumulates"),
]
