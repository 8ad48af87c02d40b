"""`make benchmark`: time every registered method at N = 1, 2, 4, ... and plot the speedups.

    python -m benchmarks.run                      # the default sweep (under 20 min on 2 cores)
    python -m benchmarks.run --quick              # under 5 minutes
    python -m benchmarks.run --methods single,ddp_spawn --nprocs 1,2
    python -m benchmarks.run --strong             # fixed global batch instead of per rank
    python -m benchmarks.run --project-bandwidth 25   # project the cost model onto 25 GB/s

Each (method, N) runs in fresh rank processes with a hard timeout; a method that fails or
hangs is recorded with its error and the sweep goes on. Results go to benchmarks/results/:
``run-<stamp>.json`` and ``.csv``, PNG plots and ``summary.md``; ``latest.json`` is replaced
only by a run with at least one successful measurement.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.costmodel import INTERCONNECTS, RingModel, fit_ring
from benchmarks.registry import BenchContext, load_all

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Config:
    batch_size: int = 256  # per rank (weak scaling) or global (strong)
    warmup: int = 5
    steps: int = 10  # per repeat
    repeats: int = 5
    strong: bool = False
    threads_per_rank: int = 1
    model: str = "convnet"
    timeout: float = 300.0
    sweep_batches: list[int] = field(default_factory=lambda: [32, 128, 512])
    allreduce_sizes: list[int] = field(default_factory=lambda: [2**k for k in range(12, 25, 2)])


# ------------------------------------------------------------------------ rank side


def _peak_memory_mb(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "process peak RSS"


def _timed(fn, steps: int, device) -> float:
    from dpt.device import synchronize

    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) / steps


def bench_rank(rank: int, world_size: int, method_name: str, cfg: dict) -> dict:
    """Runs on every rank inside an initialized process group (see dpt.testing)."""
    import torch.distributed as dist

    methods = load_all()
    m = methods[method_name]
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    per_rank = cfg["batch_size"] // world_size if cfg["strong"] else cfg["batch_size"]
    ctx = BenchContext(rank, world_size, device, max(1, per_rank), cfg["model"],
                       options=cfg.get("options", {}))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    made = m.factory(ctx)
    step, extras = (made if isinstance(made, tuple) else (made, {}))
    timers = extras.get("timers")
    for _ in range(cfg["warmup"]):
        loss = step()
    step_times, comm_times, compute_times = [], [], []
    compute_step = extras.get("compute_step")
    for _ in range(cfg["repeats"]):
        if world_size > 1:
            dist.barrier()
        if timers is not None:
            timers.clear()
        step_times.append(_timed(step, cfg["steps"], device))
        if timers is not None and "comm" in timers:
            comm_times.append(timers["comm"] / cfg["steps"])
        if compute_step is not None:
            if world_size > 1:
                dist.barrier()
            compute_times.append(_timed(compute_step, cfg["steps"], device))
    loss = step()
    # The slowest rank sets the pace: every rank reports, the parent takes the max.
    mem, mem_kind = _peak_memory_mb(device)
    out = {"rank": rank, "step_times": step_times, "loss": float(loss),
           "per_rank_batch": ctx.batch_size, "peak_mem_mb": mem, "mem_kind": mem_kind,
           "threads": torch.get_num_threads()}
    if comm_times:
        out["comm_s"] = statistics.median(comm_times)
    if compute_times:
        out["compute_s"] = statistics.median(compute_times)
    return out


def allreduce_curve(rank: int, world_size: int, sizes: list[int], repeats: int = 5) -> list:
    """Median all-reduce time per message size (bytes), measured on this machine."""
    import torch.distributed as dist

    curve = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4))
        for _ in range(2):
            dist.all_reduce(t)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        curve.append((nbytes, statistics.median(times)))
    return curve


# ------------------------------------------------------------------------ parent side


def machine_info(threads_per_rank: int) -> dict:
    flags = []
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    from dpt.dist import cpu_budget

    info = {
        "cpu": model, "cores": cpu_budget(),
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4"))),
        "torch": torch.__version__, "python": platform.python_version(),
        "gloo": torch.distributed.is_gloo_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "threads_per_rank": threads_per_rank, "hostname": platform.node(),
    }
    info["label"] = (f"{len(info['cuda_devices'])} GPU(s), NCCL" if info["cuda_devices"]
                     else f"{info['cores']}-core CPU, gloo, {threads_per_rank} thread(s) per rank")
    return info


def default_nprocs() -> list[int]:
    from dpt.dist import cpu_budget

    limit = torch.cuda.device_count() if torch.cuda.is_available() else cpu_budget()
    ns, n = [], 1
    while n <= max(1, limit):
        ns.append(n)
        n *= 2
    return ns


def unmet_requirement(req: tuple[str, ...], n: int) -> str | None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for r in req:
        if r == "cuda" and gpus == 0:
            return "needs a CUDA GPU"
        if r.startswith("cuda>=") and gpus < int(r.split(">=")[1]):
            return f"needs {r.split('>=')[1]} CUDA GPUs"
        if r == "apex":
            try:
                import apex.amp  # noqa: F401
            except ImportError:
                return "needs NVIDIA Apex"
        if r == "lightning":
            import importlib.util

            if importlib.util.find_spec("lightning_fabric") is None:
                return "needs Lightning (pip install pytorch-lightning)"
        if r == "data":
            from dpt.data import is_present

            if not is_present("fashion-mnist"):
                return "needs Fashion-MNIST (make data)"
    if gpus and n > gpus:
        return f"N={n} exceeds the {gpus} GPUs"
    return None


def run_one(name: str, n: int, cfg: Config, methods) -> dict:
    from dpt.testing import RankFailure, run_distributed

    m = methods[name]
    rec = {"method": name, "nprocs": n, "description": m.description,
           "scaling": "strong" if cfg.strong else "weak", "status": "ok"}
    why = unmet_requirement(m.requires, n)
    if why is None and n < m.min_procs:
        why = f"needs at least {m.min_procs} ranks"
    if why is None and m.max_procs is not None and n > m.max_procs:
        why = f"runs on at most {m.max_procs} rank(s)"
    if why:
        rec.update(status="skipped", error=why)
        return rec
    start = time.perf_counter()
    try:
        if m.launcher == "torchrun":
            ranks = run_torchrun(name, n, cfg)
        else:
            ranks = run_distributed(bench_rank, world_size=n, args=(name, asdict(cfg)),
                                    timeout=cfg.timeout, threads=cfg.threads_per_rank,
                                    echo=False)
    except RankFailure as exc:
        text = str(exc)
        rec.update(status="timeout" if "timed out" in text or "hung" in text else "failed",
                   error=text.strip().splitlines()[-1][:300], detail=text[-2000:])
        return rec
    except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be unpickled
        rec.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:300])
        return rec
    # Per repeat, the slowest rank's time; then the median and spread over repeats.
    per_repeat = [max(r["step_times"][i] for r in ranks) for i in range(len(ranks[0]["step_times"]))]
    step_s = statistics.median(per_repeat)
    per_rank = ranks[0]["per_rank_batch"]
    rec.update(
        wall_s=round(time.perf_counter() - start, 2), per_rank_batch=per_rank,
        global_batch=per_rank * n, step_s=step_s, step_s_min=min(per_repeat),
        step_s_max=max(per_repeat), samples_per_s=per_rank * n / step_s,
        peak_mem_mb=max(r["peak_mem_mb"] for r in ranks), mem_kind=ranks[0]["mem_kind"],
        final_loss=statistics.mean(r["loss"] for r in ranks),
        threads_per_rank=ranks[0]["threads"])
    if all("compute_s" in r for r in ranks):
        compute = max(r["compute_s"] for r in ranks)
        rec.update(compute_s=compute, comm_s=max(0.0, step_s - compute))
    elif all("comm_s" in r for r in ranks):
        comm = max(r["comm_s"] for r in ranks)
        rec.update(comm_s=comm, compute_s=max(0.0, step_s - comm))
    return rec


def run_torchrun(name: str, n: int, cfg: Config) -> list[dict]:
    """Start N ranks with torchrun (``benchmarks/torchrun_worker.py``) and read their results.

    The same ``bench_rank`` runs in each; only the launcher differs. A failed rank's traceback,
    or a timeout, raises RankFailure like the spawn path, so the sweep records it and goes on.
    """
    import signal
    import subprocess
    import tempfile

    from dpt.dist import find_free_port
    from dpt.testing import RankFailure

    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="dpt-bench-torchrun-") as tmp:
        out = Path(tmp)
        (out / "config.json").write_text(json.dumps(asdict(cfg)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
               f"--nproc-per-node={n}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{find_free_port()}", "--max-restarts=0",
               "-m", "benchmarks.torchrun_worker", name, str(out)]
        env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads_per_rank),
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=cfg.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            raise RankFailure(f"{log[-1500:]}\ntorchrun: {name} at N={n} timed out after "
                              f"{cfg.timeout:.0f} s and was killed") from None
        errors = sorted(out.glob("rank*.error"))
        if proc.returncode != 0 or errors:
            text = "\n".join(f"--- {e.stem} ---\n{e.read_text()}" for e in errors)
            raise RankFailure(text or f"torchrun exited with {proc.returncode}:\n{log[-2000:]}")
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def add_speedups(records: list[dict]) -> None:
    """Speedup and efficiency against the same method at N = 1 (or `single` if it has none)."""
    base = {}
    for r in records:
        if r["status"] == "ok" and r["nprocs"] == 1 and r.get("sweep") is None:
            base[r["method"]] = r["samples_per_s"]
    for r in records:
        if r["status"] != "ok" or r.get("sweep") is not None:
            continue
        ref = base.get(r["method"]) or base.get("independent") or base.get("single")
        if ref:
            r["speedup"] = r["samples_per_s"] / ref
            r["efficiency"] = r["speedup"] / r["nprocs"]
            r["speedup_vs"] = r["method"] if r["method"] in base else (
                "independent" if "independent" in base else "single")


def grad_bytes(model_name: str) -> int:
    from dpt.models import build_model

    return sum(p.numel() * p.element_size() for p in build_model(model_name).parameters()
               if p.requires_grad)


def fit_cost_model(curve: list, n: int) -> RingModel | None:
    if not curve:
        return None
    sizes, times = zip(*curve)
    try:
        return fit_ring(list(sizes), list(times), n)
    except ValueError:
        return None


# ----------------------------------------------------------------------------- output


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def summary_markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Benchmark: {m['label']}", "",
             f"{m['cpu']}; torch {m['torch']}; {result['config']['scaling']} scaling, "
             f"batch {result['config']['batch_size']} "
             f"{'global' if result['config']['strong'] else 'per rank'}; {result['stamp']}", "",
             "| method | N | status | samples/s | speedup | efficiency | step ms | comm ms | "
             "peak MB/rank | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt):
        return format(x, fmt) if isinstance(x, (int, float)) else ""

    for r in result["records"]:
        if r.get("sweep") is not None:
            continue
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | {r['nprocs']} | {r['status']}: {r.get('error', '')} "
                         "| | | | | | | |")
            continue
        lines.append(
            f"| {r['method']} | {r['nprocs']} | ok | {r['samples_per_s']:.0f} | "
            f"{f(r.get('speedup'), '.2f')} | {f(r.get('efficiency'), '.2f')} | "
            f"{1000 * r['step_s']:.1f} | {f(r.get('comm_s', None) and 1000 * r['comm_s'], '.1f')} "
            f"| {r['peak_mem_mb']:.0f} | {r['final_loss']:.3f} |")
    cm = result.get("cost_model")
    if cm:
        lines += ["", f"Cost model (fitted from all-reduce on {cm['fit_nprocs']} ranks): "
                      f"alpha = {cm['alpha_s'] * 1e6:.0f} us, bandwidth = "
                      f"{cm['bandwidth_Bps'] / 1e9:.2f} GB/s; gradients {cm['grad_bytes'] / 1e3:.0f} KB."]
    sweep = [r for r in result["records"] if r.get("sweep") is not None and r["status"] == "ok"]
    if sweep:
        lines += ["", "Per-rank batch sweep (DDP): batch -> speedup at N=2 over N=1: " + ", ".join(
            f"{r['per_rank_batch']}: {r.get('sweep_speedup', float('nan')):.2f}"
            for r in sweep if r["nprocs"] > 1)]
    return "\n".join(lines) + "\n"


def make_plots(result: dict, out: Path, project_ns=(1, 2, 4, 8, 16, 64)) -> list[Path]:
    import matplotlib.pyplot as plt

    recs = [r for r in result["records"] if r["status"] == "ok" and r.get("sweep") is None]
    label = result["machine"]["label"]
    paths = []
    methods = sorted({r["method"] for r in recs})
    cm = result.get("cost_model")

    def by(method, key):
        pts = sorted((r["nprocs"], r[key]) for r in recs if r["method"] == method and key in r)
        return [p[0] for p in pts], [p[1] for p in pts]

    # Speedup: measured (left, with the ideal line), and the cost model's projection (right).
    fig, (ax, axp) = plt.subplots(1, 2, figsize=(12, 4.8))
    max_n = max([r["nprocs"] for r in recs] + [2])
    ax.plot([1, max_n], [1, max_n], "k:", label="ideal (N x)")
    for mname in methods:
        ns, sp = by(mname, "speedup")
        if len(ns) > 1:
            ax.plot(ns, sp, "o-", label=mname)
    ax.set_xticks(sorted({r["nprocs"] for r in recs}))
    ax.set_xlabel("N (ranks)")
    ax.set_ylabel("speedup (samples/s over N=1)")
    ax.set_title(f"Measured: {label}", fontsize=10)
    ax.legend(fontsize=7)
    axp.plot(project_ns, project_ns, "k:", label="ideal")
    if cm:
        model = RingModel(cm["alpha_s"], cm["bandwidth_Bps"])
        axp.plot(project_ns, [model.speedup(n, cm["compute_s"], cm["grad_bytes"])
                              for n in project_ns], "--", color="gray",
                 label=f"predicted, this machine ({cm['bandwidth_Bps'] / 1e9:.2f} GB/s)")
        for name, gbps in (cm.get("projections") or {}).items():
            proj = RingModel(cm["alpha_s"], gbps * 1e9)
            axp.plot(project_ns, [proj.speedup(n, cm["compute_s"], cm["grad_bytes"])
                                  for n in project_ns], "--", label=f"predicted, {name}")
        for mname in ("ddp_spawn", "independent"):
            ns, sp = by(mname, "speedup")
            if len(ns) > 1:
                axp.plot(ns, sp, "o", label=f"measured {mname}")
    axp.set_xscale("log", base=2)
    axp.set_yscale("log", base=2)
    axp.set_xlabel("N (ranks)")
    axp.set_title("Cost model (dashed = predicted, not measured)", fontsize=10)
    axp.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for mname in methods:
        ns, ef = by(mname, "efficiency")
        if len(ns) > 1:
            ax.plot(ns, ef, "o-", label=mname)
    ax.axhline(1.0, color="k", ls=":", label="ideal")
    ax.set_ylim(0, 1.15)
    ax.set_xlabel("N (ranks)")
    ax.set_ylabel("efficiency (speedup / N)")
    ax.set_title(f"Scaling efficiency: {label}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "efficiency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    for key, ylabel, fname in (("samples_per_s", "samples / s", "throughput.png"),
                               ("peak_mem_mb", "peak memory per rank (MB)", "memory.png")):
        fig, ax = plt.subplots(figsize=(8, 4))
        ns_all = sorted({r["nprocs"] for r in recs})
        width = 0.8 / max(1, len(ns_all))
        for i, n in enumerate(ns_all):
            vals = [next((r[key] for r in recs if r["method"] == mm and r["nprocs"] == n), 0)
                    for mm in methods]
            ax.bar([j + i * width for j in range(len(methods))], vals, width, label=f"N={n}")
        ax.set_xticks([j + width * (len(ns_all) - 1) / 2 for j in range(len(methods))])
        ax.set_xticklabels(methods, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel + (f" [{recs[0]['mem_kind']}]" if key == "peak_mem_mb" and recs
                                else ""))
        ax.set_title(f"{ylabel}: {label}")
        ax.legend()
        fig.tight_layout()
        paths.append(out / fname)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    split = [r for r in recs if "comm_s" in r]
    if split:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = [f"{r['method']}\nN={r['nprocs']}" for r in split]
        comp = [1000 * r["compute_s"] for r in split]
        comm = [1000 * r["comm_s"] for r in split]
        ax.bar(names, comp, label="compute")
        ax.bar(names, comm, bottom=comp, label="communication + waiting")
        ax.set_ylabel("ms per step")
        ax.set_title("Where a step's time goes")
        ax.tick_params(axis="x", labelsize=7)
        ax.legend()
        fig.tight_layout()
        paths.append(out / "step_split.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    sweep = [r for r in result["records"] if r.get("sweep") is not None and r["status"] == "ok"]
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4))
        bs = sorted({r["per_rank_batch"] for r in sweep})
        for n in sorted({r["nprocs"] for r in sweep}):
            pts = sorted((r["per_rank_batch"], r["samples_per_s"]) for r in sweep
                         if r["nprocs"] == n)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"DDP N={n}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs)
        ax.set_xticklabels([str(b) for b in bs])
        ax.set_xlabel("batch per rank")
        ax.set_ylabel("samples / s")
        ax.set_title("Per-rank batch size: compute against communication")
        ax.legend()
        fig.tight_layout()
        paths.append(out / "batch_sweep.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


# ------------------------------------------------------------------------------- CLI


def parse_list(text: str | None, kind=str):
    return [kind(x) for x in text.split(",") if x.strip()] if text else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Time 1-vs-N runs of every method; plot speedups.")
    p.add_argument("--quick", action="store_true", help="a short run (under 5 min on 2 cores)")
    p.add_argument("--methods", default=os.environ.get("METHODS") or None,
                   help="comma-separated subset (default: all registered)")
    p.add_argument("--nprocs", default=os.environ.get("NPROCS") or None,
                   help="comma-separated N values (default: 1, 2, 4, ... up to the devices)")
    p.add_argument("--strong", action="store_true", help="fixed global batch (strong scaling)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--model", default="convnet", help="convnet, mlp or fashioncnn")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--timeout", type=float, default=None, help="seconds per (method, N)")
    p.add_argument("--no-sweep", action="store_true", help="skip the per-rank batch sweep")
    p.add_argument("--sweep-method", default="ddp_spawn")
    p.add_argument("--project-bandwidth", type=float, action="append", default=[],
                   help="GB/s of a target interconnect to project onto (repeatable)")
    p.add_argument("--project", action="append", default=[], choices=sorted(INTERCONNECTS),
                   help="a named interconnect to project onto (repeatable)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--list", action="store_true", help="list the registered methods and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")  # files only; a notebook calling make_plots keeps its own backend
    args = build_parser().parse_args(argv)
    methods = load_all()
    if args.list:
        for m in methods.values():
            req = f" (requires {', '.join(m.requires)})" if m.requires else ""
            print(f"{m.name:<26}{m.description}{req}")
        return 0
    cfg = Config(threads_per_rank=args.threads_per_rank, strong=args.strong, model=args.model)
    if args.quick:
        cfg.warmup, cfg.steps, cfg.repeats, cfg.timeout = 2, 4, 3, 180.0
        cfg.batch_size = 128
        cfg.sweep_batches = [64, 512]
        cfg.allreduce_sizes = [2**k for k in range(12, 23, 2)]
    for key in ("batch_size", "steps", "repeats", "warmup"):
        if getattr(args, key) is not None:
            if getattr(args, key) < (0 if key == "warmup" else 1):
                print(f"error: --{key.replace('_', '-')} must be positive", file=sys.stderr)
                return 2
            setattr(cfg, key, getattr(args, key))
    if args.timeout:
        cfg.timeout = args.timeout
    names = parse_list(args.methods) or list(methods)
    unknown = [n for n in names if n not in methods]
    if unknown:
        print(f"error: unknown method(s) {', '.join(unknown)}; known: {', '.join(methods)}",
              file=sys.stderr)
        return 2
    try:
        ns = parse_list(args.nprocs, int) or default_nprocs()
    except ValueError:
        print(f"error: --nprocs takes integers like 1,2,4, got {args.nprocs!r}", file=sys.stderr)
        return 2
    if any(n < 1 for n in ns):
        print("error: every N in --nprocs must be at least 1", file=sys.stderr)
        return 2
    from dpt.dist import cpu_budget

    if not torch.cuda.is_available() and max(ns) * cfg.threads_per_rank > cpu_budget():
        print(f"warning: {max(ns)} ranks x {cfg.threads_per_rank} threads exceeds the "
              f"{cpu_budget()} cores: those runs are oversubscribed", file=sys.stderr)

    from tqdm.auto import tqdm

    jobs = [(n, k) for k in names for n in ns]
    sweep_jobs = []
    if not args.no_sweep and args.sweep_method in methods and not args.methods:
        sweep_jobs = [(n, b) for b in cfg.sweep_batches for n in sorted({1, max(ns)})]
    records = []
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    machine = machine_info(cfg.threads_per_rank)
    print(f"benchmark on {machine['label']}: methods {', '.join(names)}; N in {ns}",
          flush=True)
    bar = tqdm(total=len(jobs) + len(sweep_jobs) + (1 if max(ns) > 1 else 0), unit="run",
               dynamic_ncols=True)
    curve = []
    if max(ns) > 1:
        bar.set_description(f"all-reduce curve N={max(ns)}")
        try:
            from dpt.testing import run_distributed

            curve = run_distributed(allreduce_curve, world_size=max(ns),
                                    args=(cfg.allreduce_sizes,), timeout=cfg.timeout,
                                    threads=cfg.threads_per_rank, echo=False)[0]
        except Exception as exc:  # noqa: BLE001 - the sweep goes on without a cost model
            tqdm.write(f"all-reduce curve failed: {exc}")
        bar.update()
    for n, name in jobs:
        bar.set_description(f"{name} N={n}")
        rec = run_one(name, n, cfg, methods)
        records.append(rec)
        msg = (f"{name:<24} N={n}: {rec['samples_per_s']:8.0f} samples/s, "
               f"loss {rec['final_loss']:.3f}" if rec["status"] == "ok"
               else f"{name:<24} N={n}: {rec['status']}: {rec.get('error', '')}")
        tqdm.write(msg)
        bar.update()
    base_batch = cfg.batch_size
    for n, b in sweep_jobs:
        bar.set_description(f"sweep {args.sweep_method} batch={b} N={n}")
        cfg.batch_size = b
        rec = run_one(args.sweep_method, n, cfg, methods)
        rec["sweep"] = b
        records.append(rec)
        bar.update()
    cfg.batch_size = base_batch
    bar.close()
    for r in records:  # sweep speedups, N>1 over N=1 at the same batch
        if r.get("sweep") is not None and r["status"] == "ok" and r["nprocs"] > 1:
            one = next((q for q in records if q.get("sweep") == r["sweep"] and q["nprocs"] == 1
                        and q["status"] == "ok"), None)
            if one:
                r["sweep_speedup"] = r["samples_per_s"] / one["samples_per_s"]
    add_speedups(records)

    result = {"stamp": stamp, "machine": machine,
              "config": {**asdict(cfg), "scaling": "strong" if cfg.strong else "weak",
                         "methods": names, "nprocs": ns, "quick": args.quick},
              "allreduce_curve": curve, "records": records}
    model = fit_cost_model(curve, max(ns))
    one = next((r for r in records if r["status"] == "ok" and r["nprocs"] == 1 and
                r["method"] in ("independent", "ddp_spawn", "single")), None)
    if model and one:
        projections = {f"{g:g} GB/s": g for g in args.project_bandwidth}
        projections.update({name: INTERCONNECTS[name] for name in args.project})
        result["cost_model"] = {"alpha_s": model.alpha_s, "bandwidth_Bps": model.bandwidth_Bps,
                                "fit_nprocs": max(ns), "compute_s": one["step_s"],
                                "compute_from": one["method"],
                                "grad_bytes": grad_bytes(cfg.model), "projections": projections}

    args.out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r["status"] == "ok"]
    run_json = args.out / f"run-{stamp}.json"
    write_atomic(run_json, json.dumps(result, indent=1))
    fields = ["method", "nprocs", "status", "scaling", "per_rank_batch", "global_batch",
              "samples_per_s", "speedup", "efficiency", "step_s", "step_s_min", "step_s_max",
              "compute_s", "comm_s", "peak_mem_mb", "mem_kind", "final_loss", "threads_per_rank",
              "sweep", "error"]
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    w.writerows(records)
    write_atomic(run_json.with_suffix(".csv"), buf.getvalue())
    summary = summary_markdown(result)
    print("\n" + summary)
    if ok:  # an empty or failed run never replaces the last good one
        write_atomic(args.out / "latest.json", json.dumps(result, indent=1))
        write_atomic(args.out / "latest.csv", buf.getvalue())
        write_atomic(args.out / "summary.md", summary)
        for p in make_plots(result, args.out):
            print(f"wrote {p}")
    else:
        print("no method succeeded: latest.json and the plots were left as they were",
              file=sys.stderr)
    print(f"wrote {run_json} and {run_json.with_suffix('.csv')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
