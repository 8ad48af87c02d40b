"""Rank functions for the tests of lesson 10's compile_ddp.py (run by run_distributed).

Each task is graded on its own: every experiment runs the lesson's given code
(``measure_split``, ``compare_losses``) with the student's code for one task and the
solution's (generated references, :func:`references`) for the other two. A part that raises
comes back as ``{"error": ...}``, the stub's "Task 10.K" line first when the error holds one
(dynamo wraps a backend's error in its own, and DDP a comm hook's).

The experiments use the "count" backend (each graph runs as captured, autograd stays eager)
where the graphs are compared with DDP's buckets: DDP rebuilds its buckets in the order the
gradients arrived at step 0, and only eager autograd gives that order layer by layer.
"""

from __future__ import annotations

import torch

from tests import references as refs
from tests.helpers import rank_part
from tests.lessons import load

LESSON = "10_inside_a_step"
CAPS = (None, 1, 2)  # MiB; None is DDP's default (25 MiB, first bucket 1 MiB)
STEPS = 3


# --- the other tasks' answers: the solution's code (tests/l10_inside_a_step/_references.py) ---

class RefRecorder:
    """GraphRecorder's given parts, kept here: the expected split must not be read through the
    student's copy of them. ``__call__`` (10.5) is the solution's, from :func:`references`."""

    def __init__(self, model, backend=None):
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.order = list(self.names.values())
        self.inner = None if backend in (None, "count") else (
            torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend)
        self.graphs = []

    def split(self):
        return [[n for n in self.order if n in g["params"]] for g in self.graphs]


class RefBuckets:
    """BucketRecorder's given parts, kept here (a planted bug breaks the student's
    ``buckets``); ``hook`` (10.6) is the solution's, from :func:`references`."""

    def __init__(self, model):
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.steps = []

    @property
    def buckets(self):
        last = self.steps[-1] if self.steps else {}
        return [last[i] for i in sorted(last)]


def references(cd):
    """The recorder, the bucket recorder and the builder with the solution's code for 10.5,
    10.6 and 10.7, its names looked up in the lesson's module ``cd``."""
    recorder = type("RefRecorder", (RefRecorder,), {"__call__": refs.reference(LESSON, "10.5")})
    buckets = type("RefBuckets", (RefBuckets,), {"hook": refs.reference(LESSON, "10.6")})
    return recorder, buckets, refs.reference(LESSON, "10.7")


# --- the checks ---------------------------------------------------------------------------

part = rank_part


class Spy:
    """A backend that counts its calls and runs each graph as it is."""

    def __init__(self):
        self.calls = 0

    def __call__(self, gm, example_inputs):
        self.calls += 1
        return gm.forward


def _through_spy(cd):
    spy = Spy()
    _, RefBuckets, ref_build = references(cd)
    r = cd.measure_split(None, spy, steps=2, recorder=cd.GraphRecorder, hook=RefBuckets,
                         build=ref_build)
    return {"spy_calls": spy.calls, "graphs": len(r["graphs"]), "losses": r["losses"]}


def _structure(cd, cap):
    """What build_compiled_ddp returns, described."""
    torch._dynamo.reset()
    model = cd.fresh_model(0)
    built = cd.build_compiled_ddp(model, bucket_cap_mb=cap, backend="eager")
    inner = getattr(built, "module", None)
    return {"type": type(built).__name__,
            "inner": type(inner).__name__,
            "inner_is_model": getattr(inner, "_orig_mod", None) is model,
            "compiled_ddp": type(getattr(built, "_orig_mod", None)).__name__,
            "cap_bytes": getattr(built, "bucket_bytes_cap", None)}


def compile_checks(rank, world_size, caps=CAPS, steps=STEPS):
    cd = load(LESSON, "compile_ddp")
    RefRecorder, RefBuckets, ref_build = references(cd)
    out = {"ref": {}, "graphs": {}, "buckets": {}, "build": {}}
    for cap in caps:
        out["ref"][cap] = cd.measure_split(cap, None, steps, recorder=RefRecorder,
                                           hook=RefBuckets, build=ref_build)
        out["graphs"][cap] = part(cd.measure_split, cap, None, steps, recorder=cd.GraphRecorder,
                                  hook=RefBuckets, build=ref_build)
        out["buckets"][cap] = part(cd.measure_split, cap, None, steps, recorder=RefRecorder,
                                   hook=cd.BucketRecorder, build=ref_build)
        out["build"][cap] = part(cd.measure_split, cap, None, steps, recorder=RefRecorder,
                                 hook=RefBuckets, build=cd.build_compiled_ddp)
    out["spy"] = part(_through_spy, cd)
    out["structure"] = {cap: part(_structure, cd, cap) for cap in (None, 1)}
    out["losses"] = part(cd.compare_losses, "aot_eager", steps=4, recorder=RefRecorder,
                         build=cd.build_compiled_ddp)
    return out
