# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 10: torch.compile with DDP, and why the compiled graph is cut where DDP's buckets are.

DDP overlaps communication with backward: as soon as every gradient of a bucket is ready, it
starts that bucket's all-reduce while autograd goes on computing the rest. ``torch.compile``
turns the model into graphs, and a compiled graph's backward is one opaque step: all its
gradients become ready together, at its end. One graph for the whole model would leave DDP
nothing to overlap. So when dynamo compiles a model that DDP wraps, its **DDPOptimizer**
(``torch._dynamo.backends.distributed``, on while ``torch._dynamo.config.optimize_ddp``) cuts
the graph where DDP's buckets end and compiles each piece on its own: one graph per bucket.

It predicts the buckets rather than asking DDP for them: it counts parameter bytes backwards
through the graph, layer by layer, with a first bucket of 1 MiB. DDP agrees when its own first
bucket is 1 MiB, which is the case at its default cap (``bucket_cap_mb=None``) or at 1 MiB.
Pass another cap and DDP makes its first bucket the whole cap: the cut drifts. The script
shows both.

You look at both sides of that cut here:

- a dynamo **backend** of your own (10.5) records each graph it is given: its operations and
  the model parameters it uses (parameters are graph inputs, passed when the graph runs);
- a DDP **comm hook** (10.6) records which parameters each bucket holds, then all-reduces as
  DDP would. DDP builds its buckets once at the start and *rebuilds* them after the first
  step, in the order the gradients really arrived: the steady state is what the split follows;
- **compile, then wrap** (10.7): ``DDP(torch.compile(model))``, as nanoGPT does. DDP stays
  eager around a compiled model, and the DDPOptimizer's 1 MiB first bucket must fit the cap.

The other order, ``torch.compile(DDP(model))``, asks dynamo to trace DDP's own forward: it
breaks the graph there, and what gets compiled then depends on the torch version and on the
model (:func:`other_order` reports what this machine does).

    .venv/bin/python exercises/10_inside_a_step/compile_ddp.py                 # 2 ranks, count
    .venv/bin/python exercises/10_inside_a_step/compile_ddp.py --backend aot_eager --caps 1 2
    .venv/bin/python exercises/10_inside_a_step/compile_ddp.py --backend inductor --bench 5
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from dpt.device import compiler_problem, synchronize
from dpt.dist import rank_device

MiB = 1024 * 1024
FIRST_BUCKET_BYTES = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", MiB)  # DDP's first bucket
WIDTH, DEPTH, BATCH = 512, 6, 8  # six 1 MiB layers: caps of 1, 2 and 25 MiB cut them 6, 4, 2 ways
LR = 0.05


class LayerStack(nn.Module):
    """``depth`` Linear+ReLU layers of ``width``: each layer's parameters are ~1 MiB at 512."""

    def __init__(self, width: int = WIDTH, depth: int = DEPTH):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def pick_backend(name: str, device_type: str = "cpu") -> str:
    """``name``, or aot_eager (with one line saying why) when inductor cannot work here."""
    if name == "inductor":
        problem = compiler_problem(device_type)
        if problem:
            print(f"note: {problem}; using aot_eager instead", file=sys.stderr)
            return "aot_eager"
    return name


# --- the tasks --------------------------------------------------------------------------

class GraphRecorder:
    """A dynamo backend: ``torch.compile(model, backend=GraphRecorder(model))``.

    Dynamo calls it once per graph it captured, with the graph (an ``fx.GraphModule``) and
    example inputs, and runs whatever callable it returns in place of the graph. It appends
    one record per graph to ``graphs``: ``{"ops": operations in the graph, "params": names of
    the model parameters the graph uses}``, and returns the graph compiled by ``backend``:
    ``None`` or ``"count"`` runs the graph as it is, a name (``"aot_eager"``, ``"inductor"``)
    or a callable is another backend, called the same way.

    ``names`` maps ``id(parameter)`` to its name in ``model``. The example inputs are fake
    tensors (shapes and dtypes, no data) and are not the model's parameters, but when the
    graph runs its inputs include the real parameters (dynamo lifts them to inputs; a torch
    that does not keeps them as attributes of ``gm``: ``gm.parameters()``).
    """

    def __init__(self, model: nn.Module, backend: str | Callable | None = None):
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.order = list(self.names.values())
        if backend in (None, "count"):
            self.inner = None
        elif isinstance(backend, str):
            self.inner = torch._dynamo.lookup_backend(backend)
        else:
            self.inner = backend
        self.graphs: list[dict] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        raise NotImplementedError("Task 10.5: one record per graph (its call nodes, and the parameters among its inputs when it runs); return what runs it, compiled by the inner backend if any")

    def split(self) -> list[list[str]]:
        """Each graph's parameter names, in the model's order, graphs in the order compiled."""
        return [[n for n in self.order if n in g["params"]] for g in self.graphs]


class BucketRecorder:
    """A DDP comm hook: ``ddp.register_comm_hook(None, recorder.hook)``
    where ``recorder = BucketRecorder(model)``.

    DDP calls it once per bucket and step, when the bucket's gradients are all ready, with a
    ``GradBucket`` (``index()``, ``parameters()``, ``buffer()``); it must return a future of
    the bucket's reduced gradients. This one notes the names of the bucket's parameters, then
    averages them over the ranks as DDP's default does (``allreduce_hook``).

    ``steps`` holds one dict per step, ``{bucket index: parameter names}``. DDP reduces its
    buckets in index order, so bucket 0 is the first call of every step.
    """

    def __init__(self, model: nn.Module):
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.steps: list[dict[int, list[str]]] = []

    def hook(self, state, bucket):  # no annotations: DDP checks them, and here they are strings
        raise NotImplementedError("Task 10.6: a new step starts at bucket 0; note this bucket's parameter names under its index; then average the gradients over the ranks as DDP does")

    @property
    def buckets(self) -> list[list[str]]:
        """The steady state: the last step's buckets, in index order (DDP rebuilds its buckets
        after the first step, so read them after two steps or more)."""
        last = self.steps[-1] if self.steps else {}
        return [last[i] for i in sorted(last)]


def build_compiled_ddp(model: nn.Module, bucket_cap_mb: float | None = None,
                       backend: str | Callable = "inductor") -> DDP:
    """``model`` compiled by ``backend``, then wrapped in DDP with ``bucket_cap_mb`` (None:
    DDP's default, 25 MiB).

    The DDPOptimizer always makes its first piece 1 MiB (``FIRST_BUCKET_BYTES``), and cannot
    work with a cap smaller than that: such a cap is a one-line ``ValueError``, raised before
    anything is built.
    """
    raise NotImplementedError("Task 10.7: refuse a cap below the first bucket (one line; None is DDP's default); then compile the model, and wrap the compiled model in DDP with the cap")


def graphs_per_bucket(graphs: list[list[str]], buckets: list[list[str]]) -> list[list[int]]:
    """For each bucket, the graphs that hold its parameters. The split follows the buckets
    when every bucket is in one graph and no two buckets share one: a bucket spread over two
    graphs waits for both backwards before its all-reduce can start."""
    where = {name: i for i, names in enumerate(graphs) for name in names}
    return [sorted({where[n] for n in bucket if n in where}) for bucket in buckets]


def follows(graphs: list[list[str]], buckets: list[list[str]]) -> bool:
    """One graph per bucket, and each graph's parameters exactly one bucket's."""
    return sorted(map(sorted, graphs)) == sorted(map(sorted, buckets))


# --- experiments (run on every rank) -----------------------------------------------------

def batch(step: int, rank: int, device, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs and targets at ``step``: different on each rank, the same in
    every run."""
    g = torch.Generator().manual_seed(10_007 * step + rank)
    x, y = torch.randn(2, BATCH, width, generator=g)
    return x.to(device), y.to(device)


def train(model: nn.Module, steps: int, device) -> list[float]:
    """``steps`` SGD steps of a mean-squared error; this rank's losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = batch(step, dist.get_rank(), device)
        optimizer.zero_grad(set_to_none=True)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def fresh_model(seed: int = 0, device=None) -> nn.Module:
    torch.manual_seed(seed)
    return LayerStack().to(device or rank_device())


def measure_split(bucket_cap_mb: float | None, backend: str | Callable | None = None, steps: int = 3,
                  recorder: type = GraphRecorder, hook: type = BucketRecorder,
                  build: Callable = build_compiled_ddp) -> dict:
    """Compile then wrap one fresh model, train ``steps`` steps, and return what the backend
    saw (``graphs``: parameters per graph, ``ops`` per graph), DDP's buckets at the first step
    and at the last (``first``, ``buckets``), the losses and a digest of the trained weights
    (``weights``: each parameter's sum).

    ``recorder``, ``hook`` and ``build`` are the three tasks; the tests swap in their own.
    """
    torch._dynamo.reset()  # a clean slate: no graphs or counters left by an earlier experiment
    device = rank_device()
    model = fresh_model(0, device)
    rec, buckets = recorder(model, backend), hook(model)
    ddp = build(model, bucket_cap_mb=bucket_cap_mb, backend=rec)
    ddp.register_comm_hook(None, buckets.hook)
    losses = train(ddp, steps, device)
    return {"graphs": rec.split(), "ops": [g["ops"] for g in rec.graphs],
            "first": [buckets.steps[0][i] for i in sorted(buckets.steps[0])] if buckets.steps
            else [], "buckets": buckets.buckets, "losses": losses,
            "weights": [p.detach().double().sum().item() for p in model.parameters()]}


def compare_losses(backend: str | Callable, steps: int = 4, bucket_cap_mb: float | None = None,
                   recorder: type = GraphRecorder, build: Callable = build_compiled_ddp) -> dict:
    """Eager DDP and compiled DDP, from the same initial weights on the same batches: this
    rank's losses for each, and how many graphs the compiled one ran."""
    torch._dynamo.reset()
    device = rank_device()
    model = fresh_model(0, device)
    twin = copy.deepcopy(model)
    eager = train(DDP(model, bucket_cap_mb=bucket_cap_mb), steps, device)
    rec = recorder(twin, backend)
    compiled = train(build(twin, bucket_cap_mb=bucket_cap_mb, backend=rec), steps, device)
    return {"eager": eager, "compiled": compiled, "graphs": len(rec.graphs)}


def other_order(bucket_cap_mb: float | None = None, steps: int = 2, as_container: bool = False) -> dict:
    """``torch.compile(DDP(model))``: the graphs the backend got and dynamo's graph breaks
    (first line of each reason). ``as_container`` uses an ``nn.Sequential`` of torch's own
    modules instead of :class:`LayerStack`."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    device = rank_device()
    torch.manual_seed(0)
    if as_container:
        model = nn.Sequential(*(m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH),
                                                                    nn.ReLU()))).to(device)
    else:
        model = LayerStack().to(device)
    rec = GraphRecorder(model)
    wrapped = torch.compile(DDP(model, bucket_cap_mb=bucket_cap_mb), backend=rec)
    train(wrapped, steps, device)
    breaks = sorted({reason.splitlines()[0] for reason in counters["graph_break"]})
    return {"graphs": rec.split(), "breaks": breaks}


def time_steps(model: nn.Module, steps: int, device) -> float:
    """Seconds per step of ``steps`` training steps (after the caller's warm-up)."""
    synchronize(device)
    start = time.perf_counter()
    train(model, steps, device)
    synchronize(device)
    return (time.perf_counter() - start) / steps


def bench(rounds: int, backend: str, steps: int = 20, bucket_cap_mb: float | None = None
          ) -> dict:
    """Eager and compiled DDP, ``rounds`` alternating rounds of ``steps`` steps each (after
    a warm-up that includes the compile): seconds per step of each, per round."""
    torch._dynamo.reset()
    device = rank_device()
    eager = DDP(fresh_model(0, device), bucket_cap_mb=bucket_cap_mb)
    model = fresh_model(0, device)
    compiled = build_compiled_ddp(model, bucket_cap_mb, GraphRecorder(model, backend))
    start = time.perf_counter()
    time_steps(compiled, 2, device)
    compile_s = time.perf_counter() - start
    time_steps(eager, 2, device)
    out = {"eager": [], "compiled": [], "compile_s": compile_s}
    for _ in range(rounds):
        out["eager"].append(time_steps(eager, steps, device))
        out["compiled"].append(time_steps(compiled, steps, device))
    return out


def compare_losses_worker(rank: int, world_size: int, backend: str, steps: int = 4) -> dict:
    """:func:`compare_losses` with ``backend`` on each rank (for ``run_distributed``)."""
    return compare_losses(backend, steps)


def worker(rank: int, world_size: int, backend: str, caps: list, bench_rounds: int
           ) -> dict:
    out = {"splits": {cap: measure_split(cap, backend) for cap in caps},
           "losses": compare_losses(backend),
           "other": other_order(), "other_container": other_order(as_container=True)}
    if bench_rounds:
        out["bench"] = bench(bench_rounds, backend)
    return out


# --- the report ---------------------------------------------------------------------------

def layers_of(names: list[str]) -> str:
    """``layers.3.weight, layers.3.bias, layers.4.weight`` -> ``3-4``: the layers named."""
    idx = sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
    if not idx:
        return "-"
    return f"{idx[0]}" if idx[0] == idx[-1] else f"{idx[0]}-{idx[-1]}"


def split_worker(rank: int, world_size: int, backend: str, caps: list) -> dict:
    """:func:`measure_split` at each cap (for ``run_distributed``)."""
    return {cap: measure_split(cap, backend) for cap in caps}


def print_splits(splits: dict) -> None:
    """One line per cap: the graphs, the buckets, and whether the first follow the second."""
    for cap, s in splits.items():
        graphs = [layers_of(g) for g in s["graphs"]]
        buckets = [layers_of(b) for b in s["buckets"]]
        verdict = ("one graph per bucket" if follows(s["graphs"], s["buckets"]) else
                   f"NOT following the buckets (graphs of each bucket: "
                   f"{graphs_per_bucket(s['graphs'], s['buckets'])})")
        print(f"bucket_cap_mb={cap}: {len(graphs)} graphs, layers {graphs} (ops {s['ops']}); "
              f"{len(buckets)} buckets, layers {buckets}: {verdict}")
        print(f"    buckets at step 0, before DDP rebuilt them: "
              f"{[layers_of(b) for b in s['first']]}")


def report(out: dict, backend: str) -> None:
    print_splits(out["splits"])
    ls = out["losses"]
    gap = max(abs(a - b) for a, b in zip(ls["eager"], ls["compiled"]))
    print(f"losses, eager:    {[round(v, 6) for v in ls['eager']]}")
    print(f"losses, {backend}: {[round(v, 6) for v in ls['compiled']]}  "
          f"(largest gap {gap:.2g}, {ls['graphs']} graphs)")
    for key, what in (("other", "LayerStack"), ("other_container", "nn.Sequential")):
        o = out[key]
        print(f"torch.compile(DDP({what})): {len(o['graphs'])} graphs "
              f"{[layers_of(g) for g in o['graphs']]}, graph breaks: {o['breaks'] or 'none'}")
    if "bench" in out:
        b = out["bench"]
        ratios = [e / c for e, c in zip(b["eager"], b["compiled"])]
        print(f"compile and first steps: {b['compile_s']:.1f} s")
        print(f"ms/step eager {1e3 * statistics.median(b['eager']):.2f}, compiled "
              f"{1e3 * statistics.median(b['compiled']):.2f}; speed-up per round "
              f"median {statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}] "
              f"over {len(ratios)} rounds (rank 0)")


def cap_arg(text: str) -> float | None:
    return None if text in ("default", "none", "None") else float(text)


def main(argv: list[str] | None = None) -> int:
    from dpt.ranks import placement, run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="count",
                        choices=["count", "aot_eager", "inductor"],
                        help="count: record the graphs and run them as they are (no compiler)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--caps", type=cap_arg, nargs="+", default=[None, 1, 2],
                        help="bucket caps in MiB (at least 1), or 'default' (None: 25 MiB)")
    parser.add_argument("--bench", type=int, default=0, metavar="ROUNDS",
                        help="also time eager against compiled DDP, this many rounds")
    args = parser.parse_args(argv)
    too_small = [c for c in args.caps if c is not None and c * MiB < FIRST_BUCKET_BYTES]
    if too_small:
        parser.error(f"--caps {too_small[0]:g} is below DDP's first bucket "
                     f"({FIRST_BUCKET_BYTES / MiB:g} MiB)")
    where = placement(args.nproc)  # NCCL, the GPUs shared with gloo, or the CPU
    backend = pick_backend(args.backend, where.device)
    print(f"{args.nproc} ranks ({where.label}), backend {backend}, caps {args.caps} MiB",
          flush=True)
    try:
        out = run_distributed(worker, args.nproc, args=(backend, args.caps, args.bench),
                              timeout=600)[0]
    except RuntimeError as exc:  # a rank failed (dpt.ranks.RankFailure)
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    report(out, backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
