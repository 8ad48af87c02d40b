"""Rank functions for the tests of lesson 09's hand-written FSDP (run by run_distributed).

Each task is graded on its own: :func:`scenario` runs the lesson's ``FSDP`` with the
student's code for the tasks in ``keep`` and the solution's code for every other task (the
references generated from solutions/, :func:`use_references`), so a task's tests fail only on
that task, and name it.

Before the real run each scenario makes a dry run: the same FSDP with collectives that send
nothing (:func:`fake_gather`, :func:`fake_reduce_scatter`), logging the order in which the
ranks issue their collectives. Ranks that disagree on that order would pair one rank's
all-gather with another's reduce-scatter and hang; the scenario compares the orders first and
stops with both when they differ.

Probes, hooks the test adds after FSDP's own, check the schedule where it happens: a unit's
parameters gathered and waited for before it computes, freed after, gathered again before its
backward, its gradient sent and the unit freed after it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from dpt.models import TinyTransformer
from tests import references as refs
from tests.lessons import load

LESSON = "09_fsdp"
# Small enough for 2 cores; at 3 ranks both kinds of unit need padding (3280 and 1216
# parameters), at 2 and 4 none does.
MODEL = {"vocab": 32, "dim": 16, "heads": 2, "layers": 3, "seq_len": 8}
BATCH = 4  # rows per rank and micro-batch
# eps=1e-5, not 1e-8: a few gradients are zero in exact arithmetic (the attention keys' bias:
# softmax ignores a shift shared by every key), and Adam with a tiny eps turns their rounding
# noise into steps of +-lr, different for any two ways of summing the same numbers.
OPTIM = {"lr": 1e-2, "eps": 1e-5, "weight_decay": 0.01}


def batch(step: int, micro: int, rank: int, world_size: int):
    """This rank's rows of the global batch of (step, micro-batch)."""
    from dpt.models import token_batch

    inputs, targets = token_batch(BATCH * world_size, MODEL["seq_len"], MODEL["vocab"],
                                  seed=1000 * step + micro)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    return inputs[rows], targets[rows]


def loss_of(logits, targets):
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# --- the reference of each task: the solution's own code, with the test's checks -------------

TASKS = tuple(task for task, places in refs.generated(LESSON).TASKS.items()
              if places[0][0] == "fsdp_by_hand")  # 09.1-09.12


def _no_gradient_yet(unit) -> None:
    """The reduce-scatter of a unit whose gradient is not there: say why, not AttributeError."""
    if unit.full.grad is None:
        raise AssertionError(
            f"unit {unit.name}: reduce_scatter() found no gradient in unit.full.grad: the unit "
            "was freed before its gradient was sent, or its reduce-scatter started before "
            "autograd had accumulated the unit's gradient")


def _checked_reduce_scatter(reference):
    def reduce_scatter(unit):
        _no_gradient_yet(unit)
        return reference(unit)
    return reduce_scatter


def _checked_finish(reference):
    """The reference finish_grad_sync, after checking the dtypes the other tasks left: fp32
    master shards, and gradients reduce-scattered in fp32."""
    def finish_grad_sync(fsdp):
        for unit in fsdp.all_units:
            if unit.shard.dtype != torch.float32:
                raise AssertionError(
                    f"unit {unit.name}'s shard is {unit.shard.dtype}: the shards are the fp32 "
                    "master weights the optimizer steps; cast a copy for compute, never the "
                    "shard itself")
            if unit.grad_shard is not None and unit.grad_shard.dtype != torch.float32:
                raise AssertionError(
                    f"unit {unit.name}: reduce_scatter() left grad_shard in "
                    f"{unit.grad_shard.dtype}: reduce the gradients in fp32, whatever the "
                    "compute dtype")
        return reference(fsdp)
    return finish_grad_sync


CHECKED = {"09.5": _checked_reduce_scatter, "09.11": _checked_finish}


def reference(task: str):
    fn = refs.reference(LESSON, task)
    return CHECKED[task](fn) if task in CHECKED else fn


def _put(task, fn, originals):
    (stem, dotted), = refs.places(LESSON, task)
    owner, attr = refs.owner(LESSON, stem, dotted)
    if (owner, attr) not in originals:
        originals[(owner, attr)] = getattr(owner, attr)
    setattr(owner, attr, fn)


def use_references(keep=(), originals=None) -> dict:
    """From now on in this rank process, every task not in ``keep`` runs its reference (which
    :func:`recorded` logs as it logs the lesson's own). Returns what was replaced."""
    originals = {} if originals is None else originals
    for task in TASKS:
        if task not in keep:
            _put(task, reference(task), originals)
    return originals


def restore(originals: dict) -> None:
    for (owner, attr), fn in originals.items():
        setattr(owner, attr, fn)


# --- the dry run: collectives that send nothing ------------------------------------------------

class Done:
    """A finished collective's handle."""

    def wait(self):
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(None)
        return future

    def is_completed(self):
        return True


def fake_gather(unit):
    unit.full.untyped_storage().resize_(unit.full.numel() * unit.full.element_size())
    unit.full.data.zero_()
    return Done()


def fake_reduce_scatter(unit):
    _no_gradient_yet(unit)
    unit.grad_full = unit.full.grad.float()
    unit.grad_shard = torch.zeros(unit.shard.shape, dtype=torch.float32)
    return Done()


def recorded(fsdp):
    """``fsdp``, logged from now on by schedule.py's recorder (which wraps the object's methods,
    whoever wrote them) in ``fsdp.timeline``."""
    fsdp.timeline = load(LESSON, "schedule").record(fsdp)
    return fsdp


def check_each_unit_gathered_once(fsdp) -> None:
    """A step gathers each block once in forward and once in backward, and waits for all."""
    counts: dict[tuple[str, str], int] = {}
    for e in fsdp.timeline.events:
        if e["kind"] == "gather":
            counts[(e["unit"], e["phase"])] = counts.get((e["unit"], e["phase"]), 0) + 1
    for (unit, phase), n in counts.items():
        if n > 1:
            raise AssertionError(
                f"{unit} was gathered {n} times in {phase}, want once: a unit whose gather is "
                "pending (unit.handle is set) must not be gathered again, and backward, which "
                "runs the units in reverse, prefetches the previous unit, not the next")
    left = [u.name for u in fsdp.all_units if u.handle is not None]
    if left:
        raise AssertionError(f"after the step, the gathers of {left} were never waited for: "
                             "gather only what will be used, and wait for it before use")


def collective_order(fbh, keep, compute_dtype) -> list[tuple[str, str, str]]:
    """One step of FSDP with fake collectives: (kind, unit, phase) of each collective, in the
    order this rank issued them."""
    originals = use_references(keep)
    try:
        _put("09.2", fake_gather, originals)
        _put("09.5", fake_reduce_scatter, originals)
        torch.manual_seed(0)
        fsdp = fbh.FSDP(TinyTransformer(**MODEL), compute_dtype=compute_dtype)
        add_probes(fsdp, {})
        recorded(fsdp)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        inputs, targets = batch(0, 0, rank, world_size)
        loss_of(fsdp(inputs), targets).backward()
        fsdp.finish_grad_sync()
        check_each_unit_gathered_once(fsdp)
        return [(e["kind"], e["unit"], e["phase"]) for e in fsdp.timeline.events
                if e["kind"] in ("gather", "reduce_scatter")]
    finally:
        restore(originals)


# --- probes ----------------------------------------------------------------------------------

def _gathered(unit) -> int:
    return unit.full.untyped_storage().nbytes()


def add_probes(fsdp, log: dict) -> None:
    """Hooks run after FSDP's own (registered later), checking the schedule as it happens."""
    log.setdefault("compute_dtypes", set())
    log.setdefault("post_backward_calls", {})
    log.setdefault("alive_in_forward", [])
    seen: dict = {}  # the views each slot held in the last forward

    for unit in fsdp.units:
        def pre(module, args, unit=unit):
            if unit.handle is not None:
                raise AssertionError(
                    f"{unit.name} started its forward while its all-gather was still pending: "
                    "wait for it (unit.wait()) before the unit computes")
            if _gathered(unit) == 0:
                raise AssertionError(f"{unit.name} started its forward with its parameters "
                                     "not gathered (unit.full holds 0 bytes)")
            for (module_, attr), shape in zip(unit.slots, unit.shapes):
                param = getattr(module_, attr, None)
                if not (torch.is_tensor(param) and param._base is unit.full
                        and param.shape == shape):
                    raise AssertionError(
                        f"{unit.name} started its forward with {attr} of {type(module_).__name__}"
                        f" not a view of unit.full in shape {tuple(shape)}: once the gather "
                        "is waited for, unit.use() must point every slot at its piece")
                if torch.is_grad_enabled() and param is seen.get((unit.name, attr)):
                    raise AssertionError(
                        f"{unit.name} started its forward with the views of an earlier forward:"
                        " call unit.use() in each forward, just before the unit computes")
                seen[(unit.name, attr)] = param
            module_, attr = unit.slots[0]
            log["compute_dtypes"].add(getattr(module_, attr).dtype)
            log["alive_in_forward"].append(sorted(u.name for u in fsdp.all_units
                                                  if _gathered(u)))

        def post(module, args, output, unit=unit):
            if _gathered(unit):
                raise AssertionError(
                    f"{unit.name}'s gathered parameters are still allocated after its forward "
                    f"({_gathered(unit)} bytes): free them once the unit has computed")
            if torch.is_grad_enabled() and output.requires_grad:
                output.register_hook(lambda grad, unit=unit: before_backward(unit))

        unit.module.register_forward_pre_hook(pre)
        unit.module.register_forward_hook(post)

    def before_backward(unit):
        if _gathered(unit) == 0:
            raise AssertionError(
                f"in backward, autograd was about to compute {unit.name}'s gradients with its "
                "parameters freed: the hook on the unit's output gradient (_pre_backward) must "
                "gather them again")
        if unit.handle is not None:
            raise AssertionError(f"in backward, {unit.name}'s gradients were about to be "
                                 "computed while its all-gather was still pending: wait for it")

    for unit in fsdp.all_units:
        def after(full, unit=unit):
            calls = log["post_backward_calls"]
            calls[unit.name] = calls.get(unit.name, 0) + 1
            if unit.grad_handle is None:
                raise AssertionError(
                    f"after {unit.name}'s gradient was accumulated, no reduce-scatter of it had "
                    "been started: did a post-backward hook run for it? (every unit's flat full "
                    "tensor needs one, the root's too)")
            if _gathered(unit) or unit.full.grad is not None:
                raise AssertionError(
                    f"{unit.name} is still gathered after its gradient was sent: free the "
                    "parameters and the gradient once the reduce-scatter has started")

        unit.full.register_post_accumulate_grad_hook(after)


# --- the scenario ----------------------------------------------------------------------------

def _layout(fsdp) -> dict:
    return {u.name: {"names": list(u.names), "shapes": [tuple(s) for s in u.shapes],
                     "numels": list(u.numels), "padded": u.padded, "index": u.index}
            for u in fsdp.all_units}


@contextmanager
def sent_dtypes():
    """The dtypes of the tensors this rank sends in all-gathers while inside (a set)."""
    seen: set = set()
    saved = {}
    for name in ("all_gather_into_tensor", "all_gather"):
        real = getattr(dist, name)

        def spy(*args, real=real, **kwargs):
            tensor = args[1] if len(args) > 1 else kwargs.get("input_tensor",
                                                               kwargs.get("tensor"))
            if torch.is_tensor(tensor):
                seen.add(str(tensor.dtype))
            return real(*args, **kwargs)

        saved[name] = real
        setattr(dist, name, spy)
    try:
        yield seen
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)


def run_steps(fsdp, optimizer, run, log, rank, world_size, steps, micro) -> None:
    """The training steps of ``scenario``: what each step leaves is put in ``run``."""
    for step in range(steps):
        fsdp.timeline.events.clear()
        optimizer.zero_grad(set_to_none=True)
        losses = []
        for m in range(micro):
            inputs, targets = batch(step, m, rank, world_size)
            loss = loss_of(fsdp(inputs), targets)
            loss.backward()
            fsdp.finish_grad_sync()
            losses.append(loss.item())
            pending = [u.name for u in fsdp.all_units
                       if u.grad_handle is not None or u.handle is not None]
            if pending:
                raise AssertionError(f"collectives of unit(s) {pending} were still pending "
                                     "after finish_grad_sync(): it must wait for them all")
        run["losses"].append(losses)
        run["grads"].append({u.name: u.shard.grad.detach().clone() for u in fsdp.all_units})
        run["post_backward_calls"] = dict(log["post_backward_calls"])
        log["post_backward_calls"].clear()
        optimizer.step()
        run["shards"].append({u.name: u.shard.detach().clone() for u in fsdp.all_units})


def scenario(rank: int, world_size: int, keep=(), dtypes=(None,), steps: int = 3,
             micro: int = 1, no_prefetch_step: bool = False, eval_forward: bool = False,
             full_params: bool = False) -> dict:
    """Train the lesson's FSDP (student code for ``keep``, references elsewhere) for each
    compute dtype in ``dtypes``; return what the tests compare with a single process."""
    fbh = load(LESSON, "fsdp_by_hand")
    orders = []
    for dtype in dtypes:
        order = collective_order(fbh, keep, dtype)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, order)
        orders.append(gathered)
        if any(o != gathered[0] for o in gathered):
            return {"rank": rank, "orders": orders, "mismatch": True}
    use_references(keep)
    out = {"rank": rank, "orders": orders, "mismatch": False, "runs": {}}
    for dtype in dtypes:
        torch.manual_seed(0)
        fsdp = fbh.FSDP(TinyTransformer(**MODEL), compute_dtype=dtype)
        log: dict = {}
        add_probes(fsdp, log)
        recorded(fsdp)
        optimizer = torch.optim.AdamW(fsdp.parameters(), **OPTIM)
        run = {"layout": _layout(fsdp), "losses": [], "grads": [], "shards": [],
               "shard_dtypes": [str(p.dtype) for p in fsdp.parameters()],
               "n_parameters": len(list(fsdp.parameters())),
               "numel_parameters": sum(p.numel() for p in fsdp.parameters())}
        with sent_dtypes() as sent:
            run_steps(fsdp, optimizer, run, log, rank, world_size, steps, micro)
        run["gather_dtypes"] = sorted(sent)
        run["events"] = list(fsdp.timeline.events)
        run["memory"] = fsdp.memory()
        run["full_grads_left"] = [u.name for u in fsdp.all_units if u.full.grad is not None]
        run["compute_dtypes"] = sorted(str(d) for d in log["compute_dtypes"])
        run["alive_in_forward"] = log["alive_in_forward"][-len(fsdp.units):]
        if eval_forward:
            inputs, _ = batch(0, 0, rank, world_size)
            with torch.no_grad():
                fsdp(inputs)
            run["gathered_after_eval"] = fsdp.memory()["gathered"]
        if full_params:
            run["full_params"] = fsdp.gather_full_params()
            state = {k: v + 1 for k, v in run["full_params"].items()}
            fsdp.load_full_params(state)
            run["reloaded"] = fsdp.gather_full_params()
        out["runs"][str(dtype)] = run
        if no_prefetch_step:
            torch.manual_seed(0)
            plain = fbh.FSDP(TinyTransformer(**MODEL), compute_dtype=dtype, prefetch=False)
            recorded(plain)
            inputs, targets = batch(0, 0, rank, world_size)
            loss_of(plain(inputs), targets).backward()
            plain.finish_grad_sync()
            out["runs"][str(dtype)]["events_no_prefetch"] = list(plain.timeline.events)
    return out
