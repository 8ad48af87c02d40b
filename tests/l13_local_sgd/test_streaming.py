"""Lesson 13, tasks 13.5-13.7: Streaming DiLoCo, ``streaming.py``.

13.5 and 13.6 are pure functions, checked here in this process on cases solved by hand. 13.7
runs on 3 gloo ranks (``rank_fns_streaming.py``: one launch, its parts each on their own) and
is compared, after every one of 24 inner steps, with a simulator written here: the 3 replicas
run one after the other in ONE process, each fragment's global weights and outer optimizer
kept once, so it needs no collective and no lesson code. float64 throughout: 1e-10.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import checked_part, ranks_or_fail
from tests.l13_local_sgd import rank_fns_streaming as rf
from tests.lessons import load
from tests.references import put

LESSON = rf.LESSON
N = rf.N
TIMEOUT = 250
TOL = 1e-10


@pytest.fixture(scope="module")
def st():
    return load(LESSON, "streaming")


@pytest.fixture(scope="module")
def runs():
    return ranks_or_fail(rf.streaming_checks, N, timeout=TIMEOUT)


# --- 13.5 strided fragments ---------------------------------------------------------------------

def members(fragments, blocks) -> list[list[int]]:
    index = {id(b): i for i, b in enumerate(blocks)}
    return [[index[id(b)] for b in frag] for frag in fragments]


@pytest.mark.task("13.5")
def test_strided_fragments(st):
    blocks = [nn.Linear(2, 2) for _ in range(6)]
    got = members(st.strided_fragments(blocks, 3), blocks)
    if got == [[0, 1], [2, 3], [4, 5]]:
        pytest.fail("6 blocks, F=3: got contiguous fragments [[0, 1], [2, 3], [4, 5]]: "
                    "fragments are strided: block i → fragment i % F ([[0, 3], [1, 4], [2, 5]])",
                    pytrace=False)
    assert got == [[0, 3], [1, 4], [2, 5]], (
        f"6 blocks, F=3: got {got}; fragments are strided: block i → fragment i % F")
    got4 = members(st.strided_fragments(blocks, 4), blocks)
    assert got4 == [[0, 4], [1, 5], [2], [3]], (
        f"6 blocks, F=4: got {got4}, expected [[0, 4], [1, 5], [2], [3]] (block i → "
        "fragment i % F: sizes 2, 2, 1, 1)")
    assert members(st.strided_fragments(blocks, 1), blocks) == [list(range(6))], (
        "F=1: one fragment holding every block, in order (DiLoCo)")
    assert members(st.strided_fragments(blocks, 6), blocks) == [[i] for i in range(6)]
    for bad in (0, 7):
        with pytest.raises(ValueError, match=str(bad)):
            st.strided_fragments(blocks, bad)


# --- 13.6 the schedule --------------------------------------------------------------------------

@pytest.mark.task("13.6")
def test_fragment_schedule(st):
    got = [st.fragment_due(s, 6, 3) for s in range(1, 13)]
    want = [None, 0, None, 1, None, 2, None, 0, None, 1, None, 2]
    due = [p for p in got if p is not None]
    if got != want and sorted(due) == sorted(p for p in want if p is not None):
        pytest.fail(f"H=6, F=3, steps 1..12: got {got}: fragments out of order: 0, 1, 2, ... "
                    f"(expected {want})", pytrace=False)
    assert got == want, (
        f"H=6, F=3, steps 1..12: got {got}, expected {want}: one fragment every H/F = 2 "
        "steps (after steps 2, 4, 6, ...), in the order 0, 1, 2, then again")
    one = [st.fragment_due(s, 4, 1) for s in range(1, 13)]
    assert one == [None, None, None, 0] * 3, (
        f"H=4, F=1 (DiLoCo): got {one}, expected fragment 0 after steps 4, 8 and 12")
    every = [st.fragment_due(s, 4, 4) for s in range(1, 9)]
    assert every == [0, 1, 2, 3, 0, 1, 2, 3], f"H=4, F=4: one fragment every step, got {every}"
    with pytest.raises(ValueError, match="7"):
        st.fragment_due(1, 7, 3)


@pytest.mark.task("13.6")
@pytest.mark.timeout(TIMEOUT + 50)
def test_every_rank_syncs_the_same_fragment(runs):
    """On 3 ranks (sync_fragment recorded, not run): the same fragment at the same step."""
    seen = [checked_part(r["schedule"])["seen"] for r in runs]
    want = [(s, (s // 2 - 1) % 3) for s in range(2, 13, 2)]
    if any(s != seen[0] for s in seen):
        pytest.fail(f"ranks averaged different fragments: every rank syncs the same fragment "
                    f"at the same step (a count every rank shares, never the rank): (step, "
                    f"fragment) per rank: {seen}", pytrace=False)
    assert seen[0] == want, f"(step, fragment) synced: {seen[0]}, expected {want}"


# --- 13.7 one fragment's outer step -------------------------------------------------------------

def simulate() -> list[torch.Tensor]:
    """The 3 replicas in one process: per fragment, its global weights and ONE outer Nesterov
    SGD; the flat weights of every replica after every step."""
    replicas = [rf.model() for _ in range(N)]
    opts = [rf.inner(m) for m in replicas]
    blocks = [list(m.children()) for m in replicas]
    frag_params = [[[p for i in range(f, rf.BLOCKS, rf.FRAGMENTS) for p in b[i].parameters()]
                    for f in range(rf.FRAGMENTS)] for b in blocks]
    glob = [[p.detach().clone().requires_grad_(True) for p in ps] for ps in frag_params[0]]
    outers = [torch.optim.SGD(g, lr=rf.OUTER_LR, momentum=rf.OUTER_MOMENTUM, nesterov=True)
              for g in glob]
    every = rf.H // rf.FRAGMENTS
    out = []
    for step in range(rf.STEPS):
        for r, (m, opt) in enumerate(zip(replicas, opts)):
            rf.inner_step(m, opt, r, step)
        s = step + 1
        if s % every == 0:
            f = (s // every - 1) % rf.FRAGMENTS
            with torch.no_grad():
                for i, g in enumerate(glob[f]):
                    g.grad = sum(g - frag_params[r][f][i] for r in range(N)) / N
            outers[f].step()
            with torch.no_grad():
                for r in range(N):
                    for g, p in zip(glob[f], frag_params[r][f]):
                        p.copy_(g)
        out.append(torch.stack([rf.flat_weights(m) for m in replicas]))
    return out


@pytest.fixture(scope="module")
def simulated():
    return simulate()


def first_difference(got: torch.Tensor, want: list[torch.Tensor], rank: int):
    for step in range(rf.STEPS):
        err = (got[step] - want[step][rank]).abs().max().item()
        if err > TOL:
            return step + 1, err
    return None


@pytest.mark.task("13.7")
@pytest.mark.timeout(TIMEOUT + 50)
def test_streaming_equals_simulator(runs, simulated):
    parts = [checked_part(r["stream"]) for r in runs]
    for r, part in enumerate(parts):
        if part["touched"]:
            step, p, q = part["touched"][0]
            pytest.fail(f"rank {r}: the sync of fragment {p} after step {step} changed "
                        f"fragment {q}'s snapshot: each fragment measures Δ from its own last "
                        "sync (only snapshots[p] is renewed)", pytrace=False)
    for r, part in enumerate(parts):
        diff = first_difference(part["weights"], simulated, r)
        if diff is None:
            continue
        step, err = diff
        synced = [(s, p) for s, p, _ in part["history"] if s <= step]
        pytest.fail(f"rank {r}: weights differ from the one-process simulator by {err:.1e} "
                    f"after inner step {step} (syncs so far, (step, fragment): {synced}). "
                    "Fragment p's sync: Δ = snapshots[p] − its params, averaged over the "
                    "ranks, params restored to snapshots[p], grad = Δ̄, a step of "
                    "outer_optimizers[p] only, then snapshots[p] renewed", pytrace=False)


@pytest.mark.task("13.7")
@pytest.mark.timeout(TIMEOUT + 50)
def test_peak_bytes_per_sync_is_total_over_f(runs):
    """The whole model is 252 float64 values (2016 bytes); 3 equal fragments of 84."""
    part = checked_part(runs[0]["stream"])
    total = rf.BLOCKS * (rf.WIDTH * rf.WIDTH + rf.WIDTH) * 8
    fragment = total // rf.FRAGMENTS
    syncs = rf.STEPS // (rf.H // rf.FRAGMENTS)
    sizes = [b for _, _, b in part["records"]]
    assert len(sizes) == syncs, (
        f"{len(sizes)} collectives in {rf.STEPS} steps, expected {syncs} (one fragment "
        f"every H/F = {rf.H // rf.FRAGMENTS} steps, ONE flat all-reduce each): {part['records']}")
    assert part["peak"] == fragment, (
        f"the largest collective sent {part['peak']} bytes, expected {fragment} = the whole "
        f"model's {total} / F: a sync sends its fragment only")
    assert part["bytes"] == total * rf.STEPS // rf.H, (
        f"{part['bytes']} bytes in {rf.STEPS // rf.H} rounds, expected {total} per round "
        "(each fragment once): the same total as DiLoCo's")
    assert [b for _, _, b in part["history"]] == [fragment] * syncs, (
        f"sync_fragment returned {[b for _, _, b in part['history']]}, expected {fragment} "
        "each (the bytes average_ sent)")


@pytest.mark.timeout(TIMEOUT + 50)
def test_one_fragment_is_diloco(runs):
    """Given code: F = 1 is DiLoCo (``diloco.DiLoCo``, same outer optimizer) to 1e-10."""
    for r, res in enumerate(runs):
        part = checked_part(res["diloco"])
        err = (part["streaming"] - part["diloco"]).abs().max().item()
        assert err <= TOL, f"rank {r}: F=1 differs from DiLoCo by {err:.1e}"


def test_streaming_rejects_bad_input(st, monkeypatch):
    put(LESSON, ("13.5",), monkeypatch.setattr)
    m = rf.model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="multiple of the number of fragments"):
        st.StreamingDiLoCo(m, opt, 7, 3)
    with pytest.raises(ValueError, match="fragments must be an integer"):
        st.StreamingDiLoCo(m, opt, 6, 0)
    relu_blocks = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(ValueError, match="holds no trainable parameters"):
        st.StreamingDiLoCo(relu_blocks, torch.optim.SGD(relu_blocks.parameters(), lr=.1), 2, 2)
