"""Planted bugs of lesson 13, diloco.py (format: tests/planted.py)."""

from tests.planted import Bug

S = "13_local_sgd/diloco.py"
T = "tests/l13_local_sgd/test_diloco.py::"
DELTA = T + "test_pseudo_gradient_is_start_minus_now"
SIMULATOR = T + "test_diloco_equals_simulator"
OUTER_STATE = T + "test_outer_state_identical_on_every_rank"
SNAPSHOT = "        self.snapshot = [p.detach().clone() for p in self.params]\n"
ZERO = "        self.outer_optimizer.zero_grad(set_to_none=True)\n"

BUGS = [
    # --- 13.3 pseudo_gradients ---------------------------------------------------------------------
    Bug("13.3-sign", S, where="13.3",
        find="[s.detach() - p.detach() for", replace="[p.detach() - s.detach() for",
        tests=(DELTA,),
        expect=r"the outer step moved away from the average: Δ = start − now",
        why="now − start: the outer optimizer, which steps against its gradient, moves the "
            "weights back past the start instead of towards the ranks' average"),
    Bug("13.3-autograd", S, where="13.3",
        find="    with torch.no_grad():\n"
             "        return [s.detach() - p.detach() for s, p in zip(snapshot, params)]\n",
        replace="    return [s - p for s, p in zip(snapshot, params)]\n",
        tests=(DELTA,),
        expect=r"Δ is part of autograd's graph",
        why="Δ computed from the parameters with autograd on: a graph kept alive, and a "
            "grad_fn on what becomes p.grad"),
    # --- 13.4 DiLoCo.sync ---------------------------------------------------------------------------
    Bug("13.4-outer-on-local-delta", S, where="13.4",
        find="        sent = local_sgd.average_(deltas, self.group)\n", replace="        sent = 0\n",
        more=(("13.4", ZERO, ZERO + "        sent = local_sgd.average_(self.params, "
                                    "self.group)\n"),),
        tests=(OUTER_STATE,),
        expect=r"outer momentum differs between ranks .*step the outer optimizer on the "
               r"AVERAGED pseudo-gradient",
        why="each rank steps its outer optimizer on its own Δ, then the weights are averaged: "
            "the outer momentum is each rank's own and drifts apart"),
    Bug("13.4-no-restore", S, where="13.4",
        find="                p.copy_(s)\n", replace="",
        tests=(SIMULATOR,),
        expect=r"outer step applied to the local weights: restore the snapshot first",
        why="the outer step starts from each rank's own weights, not from the round's start: "
            "the ranks never agree again"),
    Bug("13.4-snapshot-before-outer-step", S, where="13.4",
        find="        self.outer_optimizer.step()\n",
        replace=SNAPSHOT + "        self.outer_optimizer.step()\n",
        more=(("13.4", ZERO + SNAPSHOT, ZERO),),
        tests=(SIMULATOR,),
        expect=r"pseudo-gradient measured from the previous round's start: snapshot after the "
               r"outer step",
        why="the snapshot is taken before the outer step moves the weights: every later Δ is "
            "measured from a start the ranks were never at"),
]
