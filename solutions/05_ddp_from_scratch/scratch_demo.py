"""Rank functions the lesson 05 notebook launches (notebook code cannot be pickled for new
processes, so the code each rank runs lives here, in an importable file).

:func:`compare_rank` trains the course's small MLP (from PyTorch's MNIST example) for a few
SGD steps with every wrapper of this lesson and with torch DDP, each rank on its half of one
Fashion-MNIST batch, and returns the weights, so the notebook can compare them with one
process trained on the whole batch. Models and batches go to ``dpt.dist.rank_device()``.

:func:`timeline_rank` records training steps of ``NaiveDDP``, ``OverlapDDP`` and
``BucketedDDP``, taken in turns: when each layer's gradients are ready, when each all-reduce
starts and ends, and the optimizer step (``figures/backward_timeline.py`` draws it).
:func:`plot_step_split` draws the step split of ``benchmarks/bench_l05_scratch_vs_torch.py``,
for the notebook and the benchmark.

A wrapper that reaches a task you have not done yet does not stop the others: both functions
note the task's message in its place (every rank stops that wrapper at the same point, so the
ranks still agree on every collective), and :func:`result_of` raises it again in the
notebook, where ``needs_tasks`` turns it into one ``skipped:`` line for that wrapper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bucketed_ddp import BucketedDDP
from naive_ddp import NaiveDDP
from overlap_ddp import OverlapDDP
from torch.nn.parallel import DistributedDataParallel

from dpt.notebook import task_message

WRAPPERS = {
    "naive": NaiveDDP,
    "overlap": OverlapDDP,
    "bucketed": lambda m: BucketedDDP(m, bucket_cap_mb=0.1),
    "bucketed, grads as views": lambda m: BucketedDDP(m, bucket_cap_mb=0.1,
                                                     gradient_as_bucket_view=True),
    "torch DDP": DistributedDataParallel,
}


def make_model(seed: int, device: torch.device | str = "cpu"):
    from dpt.models import MLP

    torch.manual_seed(seed)
    return MLP().to(device)


def train(model, x, y, steps: int, sync=lambda: None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        sync()
        opt.step()
    return model


def compare_rank(rank: int, world_size: int, x, y, steps: int = 5) -> dict:
    """Train each wrapper from rank-dependent weights on this rank's slice; return states.

    A wrapper whose code reaches a task not done yet gets that task's message instead."""
    from dpt.dist import rank_device

    device = rank_device()
    per_rank = x.shape[0] // world_size
    xr = x[rank * per_rank:(rank + 1) * per_rank].to(device)
    yr = y[rank * per_rank:(rank + 1) * per_rank].to(device)
    states = {}
    for name, wrapper in WRAPPERS.items():
        try:
            model = wrapper(make_model(seed=rank, device=device))  # the broadcast fixes the start
            sync = getattr(model, "finish_gradient_synchronization", lambda: None)
            train(model, xr, yr, steps, sync)
        except NotImplementedError as exc:
            states[name] = task_message(exc)
            continue
        states[name] = {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}
    return states


def result_of(ranks: list[dict], name: str) -> list:
    """Every rank's result for wrapper ``name``, from what :func:`compare_rank` or
    :func:`timeline_rank` returned; raises the NotImplementedError of the task the wrapper
    reached and found not done."""
    found = [(r["runs"] if "runs" in r else r).get(name) for r in ranks]
    for result in found:
        if result is None:
            raise KeyError(f"no result for {name!r} (a wrapper of this lesson: "
                           f"{', '.join(WRAPPERS)})")
        if isinstance(result, str):
            raise NotImplementedError(result)
    return found


# ------------------------------------------------------------ backward against the all-reduces

def timeline_model(width: int = 1024, depth: int = 6):
    """``depth`` layers ``Linear(width, width)`` with ReLUs, then ``out = Linear(width, 10)``:
    big gradients (4 MB per layer at width 1024) and little compute, so that on a CPU the
    all-reduces take about as long as the backward."""
    from collections import OrderedDict

    from torch import nn

    layers = OrderedDict()
    for i in range(1, depth + 1):
        layers[f"fc{i}"] = nn.Linear(width, width)
        layers[f"relu{i}"] = nn.ReLU()
    layers["out"] = nn.Linear(width, 10)
    return nn.Sequential(layers)


def _ms(t: float, t0: float) -> float:
    return round((t - t0) * 1e3, 3)


def _ready_hook(recording: dict, layer_of: dict):
    """A post-accumulate-grad hook that notes when each layer's gradient is in: a stamp of
    ``recording["clock"]`` (``dpt.timing``; the host's clock if it has none)."""
    from dpt.timing import HostClock

    def ready(param) -> None:
        log = recording["log"]
        if log is not None:
            stamp = recording.get("clock", HostClock()).now
            log["ready"][layer_of[id(param)]] = stamp()

    return ready


TIMELINE_WRAPPERS = ("naive", "overlap", "bucketed")


def timeline_rank(rank: int, world_size: int, batch: int = 64, width: int = 1024,
                  depth: int = 6, bucket_cap_mb: float = 9.0, steps: int = 7,
                  warmup: int = 2) -> dict:
    """When, in one training step, each layer's gradients are ready, each all-reduce runs and
    the optimizer steps, for ``NaiveDDP``, ``OverlapDDP`` and ``BucketedDDP`` (rank fn).

    Milliseconds of this rank's clock since ``loss.backward()`` was called. Layers: the time
    the last gradient of the layer was accumulated (a post-accumulate-grad hook registered
    after the wrapper's own). All-reduces: ``dist.all_reduce`` is wrapped for the recorded
    steps; a call is timed from launch to return, or, launched with ``async_op=True``, to the
    moment its future completes. The wrappers take turns, one step each, ``warmup`` rounds
    and then ``steps`` recorded ones, so that a machine busy for a while slows them all alike;
    of each wrapper's ``steps`` recorded steps the one of median length is kept. ``buckets``
    lists, per bucket, the layers with a parameter in it: a layer's bias (registered after its
    weight, so bucketed before it) can close one bucket while its weight opens the next. A
    wrapper that reaches a task not done yet gets the task's message instead of its step.

    The clock (``dpt.timing.clock_for``): on the CPU the host's. On a GPU every stamp is a CUDA
    event recorded on the compute stream, read after the step, so the times are when the device
    got there, not when the host queued the work; with NCCL an async all-reduce is done when
    its kernels finished on the device (its future completes when it is queued). With gloo on
    CUDA tensors (``DPT_SHARE_GPU=1``) an async all-reduce's end is the host's moment its
    future completed.
    """
    import time

    import torch.distributed as dist

    from dpt.dist import rank_device
    from dpt.timing import clock_for

    dev = rank_device()
    clock = clock_for(dev)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g).to(dev)
    y = torch.randint(0, 10, (batch,), generator=g).to(dev)
    real_all_reduce = dist.all_reduce
    recording: dict = {"log": None, "clock": clock}

    def traced_all_reduce(tensor, *args, async_op=False, **kwargs):
        launch = clock.now()
        work = real_all_reduce(tensor, *args, async_op=async_op, **kwargs)
        log = recording["log"]
        if log is not None:
            event = {"launch": launch, "bytes": tensor.numel() * tensor.element_size(),
                     "async": bool(async_op)}
            log["allreduce"].append(event)
            if async_op:
                clock.on_end(work, lambda stamp, e=event: e.__setitem__("done", stamp))
            else:
                event["done"] = clock.now()
        return work

    wrappers = {"naive": NaiveDDP, "overlap": OverlapDDP,
                "bucketed": lambda m: BucketedDDP(m, bucket_cap_mb=bucket_cap_mb)}
    runs: dict = {}
    live = {}  # name -> (model, optimizer, layer of each parameter, recorded steps)
    dist.all_reduce = traced_all_reduce
    try:
        for name in TIMELINE_WRAPPERS:
            torch.manual_seed(0)
            try:
                model = wrappers[name](timeline_model(width, depth).to(dev))
            except NotImplementedError as exc:
                runs[name] = task_message(exc)
                continue
            layer_of = {id(p): n.split(".")[0] for n, p in model.module.named_parameters()}
            for p in model.module.parameters():
                p.register_post_accumulate_grad_hook(_ready_hook(recording, layer_of))
            live[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01), layer_of, [])
        for i in range(warmup + steps):
            for name in list(live):
                model, opt, layer_of, recorded = live[name]
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                dist.barrier()
                log = {"ready": {}, "allreduce": []}
                recording["log"] = log if i >= warmup else None
                t0 = clock.now()
                loss.backward()
                t1 = clock.now()
                try:
                    model.finish_gradient_synchronization()
                except NotImplementedError as exc:
                    recording["log"] = None
                    runs[name] = task_message(exc)
                    del live[name]
                    continue
                t2 = clock.now()
                opt.step()
                t3 = clock.now()
                recording["log"] = None
                if i < warmup:
                    continue
                deadline = time.perf_counter() + 5  # a future's callback may lag its wait()
                while (any("done" not in e for e in log["allreduce"])
                       and time.perf_counter() < deadline):
                    time.sleep(0.001)
                clock.settle()  # on a GPU: the device is done, its stamps can be read
                sec = clock.seconds
                t0, t1, t2, t3 = (sec(t) for t in (t0, t1, t2, t3))
                ready = {n: sec(t) for n, t in log["ready"].items()}
                run = {"backward": [0.0, _ms(t1, t0)], "sync": [_ms(t1, t0), _ms(t2, t0)],
                       "step": [_ms(t2, t0), _ms(t3, t0)],
                       "layers": [{"name": n, "ready": _ms(t, t0)}
                                  for n, t in sorted(ready.items(), key=lambda kv: kv[1])],
                       "allreduce": [{"launch": _ms(sec(e["launch"]), t0),
                                      "done": _ms(sec(e.get("done", t2)), t0),
                                      "bytes": e["bytes"], "async": e["async"]}
                                     for e in log["allreduce"]]}
                if hasattr(model, "buckets"):
                    run["buckets"] = [list(dict.fromkeys(layer_of[id(p)] for p in b))
                                      for b in model.buckets]
                recorded.append(run)
        for name, (_, _, _, recorded) in live.items():
            recorded.sort(key=lambda r: r["step"][1])
            runs[name] = recorded[len(recorded) // 2]  # the step of median length
            runs[name]["step_ms"] = [r["step"][1] for r in recorded]
    finally:
        dist.all_reduce = real_all_reduce
    grad_bytes = sum(p.numel() * p.element_size() for p in timeline_model(width, depth).parameters())
    return {"rank": rank, "runs": {name: runs[name] for name in TIMELINE_WRAPPERS},
            "config": {"world_size": world_size, "backend": dist.get_backend(),
                       "threads_per_rank": torch.get_num_threads(), "batch": batch,
                       "width": width, "depth": depth, "bucket_cap_mb": bucket_cap_mb,
                       "grad_mb": round(grad_bytes / 2**20, 2), "steps": steps,
                       "warmup": warmup, "interleaved": True, "torch": torch.__version__}}


def plot_step_split(result: dict, path=None):
    """Draw a result of ``benchmarks/bench_l05_scratch_vs_torch.py``: each variant's step,
    compute against communication + waiting (left), and communication + waiting alone on its
    own scale (right), since it is a few percent of the step. Returns the figure."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cfg = result["summary"], result["config"]
    names = list(rows)
    compute = [rows[n]["compute_s"] * 1e3 for n in names]
    comm = [rows[n]["comm_s"] * 1e3 for n in names]
    step = [c + m for c, m in zip(compute, comm)]
    share = [m / s for m, s in zip(comm, step)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.8), sharey=True,
                                      gridspec_kw={"width_ratios": [1.2, 1]})
    left.barh(names, compute, color="C0", label="compute (the same step under no_sync)")
    left.barh(names, comm, left=compute, color="C1", label="communication + waiting")
    for i, n in enumerate(names):
        left.text(step[i], i, f" {step[i]:.0f} ms ({rows[n]['throughput_vs_torch']:.2f}x)",
                  va="center", fontsize=8)
    left.set_xlim(0, max(step) * 1.4)
    left.set_xlabel("ms per step (median); (x): throughput against torch DDP")
    left.legend(fontsize=7.5, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2, frameon=False)
    left.invert_yaxis()
    right.barh(names, comm, color="C1")
    for i in range(len(names)):
        right.text(comm[i], i, f" {comm[i]:.1f} ms, {share[i]:.1%} of the step", va="center",
                   fontsize=8)
    right.set_xlim(0, max(comm) * 1.9)
    right.set_xlabel("communication + waiting alone, ms per step")
    right.set_title("the same, on its own scale", fontsize=8.5)
    fig.suptitle(f"{cfg['world_size']} ranks ({cfg['backend']}), "
                 f"{cfg['threads_per_rank']} thread each, {cfg.get('model', 'ConvNet')}, batch "
                 f"{cfg['batch']} per rank\ncommunication + waiting is {min(share):.1%} to "
                 f"{max(share):.1%} of a step: a sliver on the left, magnified on the right",
                 fontsize=9)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
