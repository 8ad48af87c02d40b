"""Planted bugs of lesson 13, fault_tolerance.py (format: tests/planted.py)."""

from tests.planted import Bug

F = "13_local_sgd/fault_tolerance.py"
T = "tests/l13_local_sgd/test_fault_tolerance.py::"

BUGS = [
    Bug("13.11-no-compare-set", F, where="13.11",
        find='    agreed = store.compare_set(f"epoch/{epoch}/members", "", view)\n',
        replace="    agreed = view.encode()\n",
        tests=(T + "test_quorum_agreed_once",),
        expect=r"two contenders got different member lists",
        why="each contender keeps its own view of who registered: a late one builds a group "
            "the others never join"),
    Bug("13.11-one-prefix-for-every-epoch", F, where="13.11",
        find='dist.PrefixStore(f"epoch{epoch}/", store)',
        replace='dist.PrefixStore("group/", store)',
        tests=(T + "test_each_epoch_gets_a_new_group",),
        expect=r"reused the group a peer died in",
        why="every membership rendezvous under the same keys: the new group meets the old "
            "one's addresses (the dead peer's among them)"),
    Bug("13.12-model-only", F, where="13.12",
        find='    state.opt.load_state_dict(payload["optimizer"])\n', replace="",
        tests=(T + "test_healed_replica_equals_survivors",),
        expect=r"the joiner's optimizer state differs: send it with the weights",
        why="the joiner gets the weights but keeps a fresh optimizer (no momentum): it takes "
            "other steps from the same gradients and drifts away"),
    Bug("13.12-no-step", F, where="13.12",
        find='    state.step = payload["step"]\n', replace="",
        tests=(T + "test_healed_replica_equals_survivors",),
        expect=r"the joiner's step differs",
        why="the joiner starts counting from 0: it trains on other batches, stops at another "
            "step, and its snapshots are named wrong"),
    Bug("13.13-no-divide", F, where="13.13",
        find="        flat /= n_members\n", replace="",
        tests=(T + "test_survivors_equal_simulator",),
        expect=r"divided by the LIVE count",
        why="the sum of the members' gradients applied: N times the step DDP takes"),
    Bug("13.13-step-on-error", F, where="13.13",
        find="    except RuntimeError:\n        opt.zero_grad()\n        return False\n",
        replace="    except RuntimeError:\n        vote = torch.ones(1)\n",
        tests=(T + "test_failed_step_is_discarded_and_redone",),
        expect=r"a partial all-reduce was applied: commit only on a unanimous vote",
        why="a failed all-reduce is ignored and the half-reduced buffer applied: the survivors "
            "step on a gradient no quorum agreed on"),
    Bug("13.14-no-rollback", F, where="13.14",
        find="            rolled_back += len(applied[r]) - len(kept)\n", replace="",
        tests=(T + "test_steps_lost_on_a_scripted_log",
               T + "test_steps_lost_of_both_policies"),
        expect=r"count the applied steps a restore throws away",
        why="only the failed steps counted: a restart's cost (every replica recomputing since "
            "the snapshot) disappears"),
    Bug("13.14-idle-ends-at-any-step", F, where="13.14",
        find='        if e["event"] == "step":\n            if not e["committed"]:\n',
        replace='        if e["event"] == "step":\n            if r in down_since:\n'
                '                idle += e["t"] - down_since.pop(r)\n'
                '            if not e["committed"]:\n',
        tests=(T + "test_steps_lost_on_a_scripted_log",),
        expect=r"a failed step does not end the idle time",
        why="a slot counts as working again at a step that is then thrown away"),
]
