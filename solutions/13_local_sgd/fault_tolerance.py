"""Lesson 13: training on when a replica dies, by hand (what torchft does).

torchrun's elastic agent (lesson 04) answers a dead worker by stopping every worker and
starting them all again from the last snapshot: every replica loses the steps it computed
since that snapshot, and waits while the job restarts. torchft (pytorch/torchft, "per-step
fault tolerance") keeps the survivors training instead. Four pieces make that work, and this
file writes each of them small enough to read in one sitting:

- **a quorum per membership** (13.11 :func:`agree_quorum`). The replicas that are alive agree
  on who takes part, and build a NEW process group for exactly those members. A group a peer
  died in is broken for good (its sockets to the dead peer are gone), so it is never reused.
  Agreement comes from one atomic write: every contender computes its view of who registered,
  and ``store.compare_set(key, "", view)`` keeps the FIRST view written; everyone uses what it
  returns. torchft's lighthouse plays the store's part (it also learns deaths from heartbeats;
  here a failed step tells the survivors one peer is gone).
- **healing** (13.12 :func:`heal`). A replacement starts with random weights and no
  optimizer state. The lowest-ranked member that has state sends model, optimizer state and
  step to every member; the joiner continues bitwise equal to the survivors. torchft does the
  same over HTTP from ``recover_src_replica_rank``. Send the optimizer state too: a joiner with
  fresh momentum takes different steps from the same gradients and drifts away for good.
- **a step that commits only when everyone got the whole gradient** (13.13 :func:`ft_step`).
  Average the gradients over the LIVE members, then vote (an all-reduce of MIN over 1/0): step
  only on a unanimous 1. A peer that dies in the middle makes the collective raise on the
  others (gloo: "Connection closed by peer", within milliseconds); then nobody steps, and the
  step is redone by the new quorum. torchft's ``Manager.should_commit`` is this vote.
- **what a policy costs** (13.14 :func:`steps_lost`): replica-steps computed and thrown away
  (discarded by a failed vote, or rolled back to a snapshot and computed again) and
  replica-seconds that replica slots spend doing nothing after a death. The same function
  scores both policies of ``supervisor.py``, which runs the job (given code).

Given: the job (:func:`make_model`, :func:`batch_for`, a float64 MLP and seeded batches, so a
test replays the run exactly), :class:`Replica`, and the collectives on a bare process group
(:func:`all_reduce_`, :func:`broadcast_object`). Run it through the supervisor::

    .venv/bin/python solutions/13_local_sgd/supervisor.py --policy ft
    .venv/bin/python solutions/13_local_sgd/supervisor.py --policy restart
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import io
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

GROUP_TIMEOUT = timedelta(seconds=5)  # a collective with a hung peer raises after this
IN, HIDDEN, OUT, BATCH = 10, 7, 3, 8


def make_model(seed: int = 0) -> nn.Module:
    """The job's model: a small float64 MLP, the same weights for a given ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT)).double()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: a state that a joiner must receive with the weights."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batch_for(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch replica ``replica`` trains on at step ``step`` (1-based): seeded, so a test
    or a replacement gets the same one."""
    g = torch.Generator().manual_seed(1000 * replica + step)
    return (torch.randn(BATCH, IN, generator=g, dtype=torch.float64),
            torch.randint(0, OUT, (BATCH,), generator=g))


@dataclass
class Replica:
    """What a replica holds: its model, its optimizer, and the last step it applied."""

    model: nn.Module
    opt: torch.optim.Optimizer
    step: int = 0


def all_reduce_(group, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """All-reduce ``tensor`` in place on a bare process group (``"sum"``, ``"min"`` or
    ``"max"``); raises RuntimeError when a peer is gone."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                     "max": dist.ReduceOp.MAX}[op]
    group.allreduce([tensor], opts).wait()
    return tensor


def broadcast_object(group, obj, src: int):
    """Send ``obj`` (anything ``torch.save`` takes) from group rank ``src`` to every member;
    returns what was sent, on every member (``obj`` is ignored on the others)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    size = torch.zeros(1, dtype=torch.int64)
    data = None
    if group.rank() == src:
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size[0] = data.numel()
    group.broadcast([size], opts).wait()
    if data is None:
        data = torch.empty(int(size), dtype=torch.uint8)
    group.broadcast([data], opts).wait()
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)


def agree_quorum(store, epoch: int, me: int, expected: int, wait_s: float):
    """13.11: register for ``epoch``, agree on its members, and build their process group.

    Returns ``(members, group)``: the sorted replica ids of the quorum and a new
    ``ProcessGroupGloo`` of exactly those members (rank = ``members.index(me)``), or
    ``(members, None)`` when ``me`` registered too late to be in it.
    """
    if expected < 1 or wait_s < 0:
        raise ValueError(f"expected must be at least 1 and wait_s >= 0, got {expected}, {wait_s}")
    # BEGIN SOLUTION 13.11: register, wait for `expected` (or wait_s), compare_set the sorted list, new group
    count_key = f"epoch/{epoch}/count"
    slot = store.add(count_key, 1) - 1
    store.set(f"epoch/{epoch}/member/{slot}", str(me))
    deadline = time.monotonic() + wait_s
    while store.add(count_key, 0) < expected and time.monotonic() < deadline:
        time.sleep(0.002)
    seen = store.add(count_key, 0)
    view = ",".join(str(r) for r in sorted(
        int(store.get(f"epoch/{epoch}/member/{i}")) for i in range(seen)))
    agreed = store.compare_set(f"epoch/{epoch}/members", "", view)
    members = [int(r) for r in agreed.decode().split(",")]
    if me not in members:
        return members, None
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"epoch{epoch}/", store),
                                  members.index(me), len(members), GROUP_TIMEOUT)
    return members, group
    # END SOLUTION


def heal(group, members: list[int], state: Replica, have_state: bool) -> int:
    """13.12: bring every member to the state of the lowest-ranked member that has one.

    ``have_state`` says whether THIS member holds a trained state (a replacement does not).
    Loads the received model, optimizer state and step into ``state`` on every member and
    returns the replica id of the source. RuntimeError when no member has state.
    """
    # BEGIN SOLUTION 13.12: agree on the source (all-reduce MIN), broadcast model + optimizer + step, load them
    me = group.rank()
    candidate = torch.tensor([me if have_state else len(members)], dtype=torch.int64)
    src = int(all_reduce_(group, candidate, "min"))
    if src == len(members):
        raise RuntimeError(f"no member of {members} has a state to heal from")
    payload = None
    if me == src:
        payload = {"model": state.model.state_dict(), "optimizer": state.opt.state_dict(),
                   "step": state.step}
    payload = broadcast_object(group, payload, src)
    state.model.load_state_dict(payload["model"])
    state.opt.load_state_dict(payload["optimizer"])
    state.step = payload["step"]
    return members[src]
    # END SOLUTION


def ft_step(model: nn.Module, opt: torch.optim.Optimizer, batch, group, n_members: int) -> bool:
    """13.13: one training step that commits only if every member got the whole gradient.

    Returns True when the optimizer stepped. False (gradients zeroed, weights untouched)
    when a collective failed (a peer died) or a member voted no: the caller re-forms the
    quorum and redoes the step.
    """
    x, y = batch
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    # BEGIN SOLUTION 13.13: all-reduce the flat grads / LIVE count, vote with MIN, step only on a unanimous 1
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    try:
        all_reduce_(group, flat)
        flat /= n_members
        vote = all_reduce_(group, torch.ones(1), "min")
    except RuntimeError:
        opt.zero_grad()
        return False
    if vote.item() < 1:
        opt.zero_grad()
        return False
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    opt.step()
    return True
    # END SOLUTION


def steps_lost(log: list[dict], n: int) -> dict:
    """13.14: what a policy cost, from a run's event log (``supervisor.py`` writes it).

    The events, in time order (``t`` in seconds, ``replica`` a slot id below ``n``):

    - ``{"event": "step", "replica", "step", "committed", "t"}``: the replica computed a
      gradient for ``step``; ``committed`` says whether it was applied;
    - ``{"event": "restore", "replica", "step", "t"}``: the replica went back to a snapshot
      of ``step``: its applied steps after it are thrown away;
    - ``{"event": "down", "replica", "t"}``: the slot stopped working (its process died, or
      was stopped to be restarted); it is idle until its next committed step.

    Returns ``{"discarded": uncommitted steps, "rolled_back": applied steps thrown away by a
    restore, "replica_steps": their sum, "idle_replica_s": seconds the slots spent between a
    "down" and their next committed step}``. ValueError for a slot id outside ``range(n)``.
    """
    # BEGIN SOLUTION 13.14: per replica: count uncommitted steps, steps undone by a restore, and down-to-next-commit gaps
    applied: dict[int, list[int]] = {r: [] for r in range(n)}
    down_since: dict[int, float] = {}
    discarded = rolled_back = 0
    idle = 0.0
    for e in sorted(log, key=lambda e: e["t"]):
        r = e["replica"]
        if not 0 <= r < n:
            raise ValueError(f"event of replica {r}, outside the {n} slots: {e}")
        if e["event"] == "step":
            if not e["committed"]:
                discarded += 1
                continue
            applied[r].append(e["step"])
            if r in down_since:
                idle += e["t"] - down_since.pop(r)
        elif e["event"] == "restore":
            kept = [s for s in applied[r] if s <= e["step"]]
            rolled_back += len(applied[r]) - len(kept)
            applied[r] = kept
        elif e["event"] == "down":
            down_since.setdefault(r, e["t"])
    return {"discarded": discarded, "rolled_back": rolled_back,
            "replica_steps": discarded + rolled_back, "idle_replica_s": idle}
    # END SOLUTION


def main(argv: list[str] | None = None) -> int:
    """This file holds the tasks; ``supervisor.py`` runs them (it imports this file, so this
    file does not import it back)."""
    print("fault_tolerance.py holds tasks 13.11-13.14; run them with "
          "`python supervisor.py --policy ft` (or `--policy restart`) from this folder")
    return 0


if __name__ == "__main__":
    sys.exit(main())
