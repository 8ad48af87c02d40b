"""The GPU acceptance run: every GPU path of the course, briefly, with a checklist at the end.

    make gpu-check                 # or: python tools/gpu_check.py [--out DIR] [--only a,b]

Run it first on a GPU machine (one GPU or N). Each item is a command with a time limit; the
checklist says pass, fail, or skipped with the reason (say, "needs 2 GPUs"), and is written as
JSON and Markdown to ``--out`` (default ``runs/gpu-check/``, untracked). Commit the Markdown
beside the README's machine table to record what has run on a GPU. On a machine without CUDA
it says so in one line and exits with status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NO_GPU_EXIT = 3
S = "solutions"


@dataclass
class Item:
    name: str
    what: str
    argv: list[str]
    min_gpus: int = 1
    timeout: float = 300
    env: dict[str, str] = field(default_factory=dict)
    expect: str | None = None  # a string the output must contain


def items(n_gpus: int, tmp: Path) -> list[Item]:
    py = sys.executable
    torchrun = [py, "-m", "torch.distributed.run", "--standalone"]
    ck = tmp / "ckpt"
    ck.mkdir(exist_ok=True)
    n = str(min(n_gpus, 2) if n_gpus >= 2 else 1)
    return [
        Item("suite-gpu", "the suite's GPU tests (tests/gpu, CUDA tests of every lesson)",
             [py, "-m", "pytest", "-q", "-p", "no:randomly", "tests/gpu", "-k", "gpu or cuda",
              "tests"], timeout=900),
        Item("l01-cuda-resume", "lesson 01 on cuda, checkpoint, then resume",
             ["bash", "-c",
              f"{py} {S}/01_single_device/single_device.py --device cuda --epochs 1 "
              f"--limit-batches 50 --checkpoint {ck}/l01.pt --no-progress && "
              f"{py} {S}/01_single_device/single_device.py --device cuda --epochs 2 "
              f"--limit-batches 50 --resume {ck}/l01.pt --no-progress"],
             expect="resumed from"),
        Item("l02-dataparallel", "nn.DataParallel across every GPU",
             [py, f"{S}/02_data_parallel/data_parallel.py", "--limit-batches", "20",
              "--no-progress"]),
        Item("l02-dp-by-hand", "DataParallel by hand (scatter, replicate, gather) on the GPUs",
             [py, f"{S}/02_data_parallel/dp_timing.py", "--devices", n, "--out",
              str(tmp / "dp_timing.json")], timeout=600),
        Item("l03-ddp-spawn-resume", "lesson 03: mp.spawn, NCCL, one process per GPU, resume",
             ["bash", "-c",
              f"{py} {S}/03_ddp_spawn/ddp_spawn.py -g {n} --device cuda --epochs 1 "
              f"--limit-batches 20 --checkpoint {ck}/l03.pt --no-progress && "
              f"{py} {S}/03_ddp_spawn/ddp_spawn.py -g {n} --device cuda --epochs 2 "
              f"--limit-batches 20 --resume {ck}/l03.pt --no-progress"],
             expect="resumed from"),
        Item("l04-torchrun-restart", "lesson 04: torchrun, a worker killed, restarted, resumed",
             [*torchrun, f"--nproc-per-node={n}", "--max-restarts=1",
              "tests/l04_ddp_torchrun/faulty_worker.py", "--epochs", "3", "--limit-batches", "20",
              "--snapshot", str(ck / "l04.pt"), "--deterministic", "--no-progress"],
             timeout=600, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "DPT_FAULT": "1:5:0"},
             expect="resumed"),
        Item("l04-torchrun", "lesson 04 under torchrun on the GPUs",
             [*torchrun, f"--nproc-per-node={n}", f"{S}/04_ddp_torchrun/ddp_torchrun.py",
              "--epochs", "1", "--limit-batches", "20", "--no-progress"],
             env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
        Item("l05-ring", "the hand-written ring all-reduce on NCCL, under a time limit",
             [py, f"{S}/05_ddp_from_scratch/collectives.py", "--world-size", n, "--max-mb", "16",
              "--repeats", "3", "--out", str(tmp / "ring.json"), "--plot",
              str(tmp / "ring.png")], min_gpus=2, timeout=180),
        Item("l06-fp16-inf", "fp16 + GradScaler on cuda with an injected inf",
             [py, f"{S}/06_mixed_precision/amp_train.py", "--device", "cuda", "--precision",
              "fp16", "--steps", "30", "--inject-inf", "10"], expect="skipped"),
        Item("l06-ddp-amp", "DDP + autocast on NCCL",
             [py, f"{S}/06_mixed_precision/ddp_amp.py", "--device", "cuda", "-g", n,
              "--precision", "auto", "--dataset", "fashion-mnist", "--limit-batches", "10",
              "--no-progress"]),
        *[Item(f"l07-{strategy}", f"Lightning strategy={strategy!r} on the GPUs",
               [py, f"{S}/07_lightning/lit_train.py", "--accelerator", "cuda", "--devices", n,
                "--strategy", strategy, "--limit-train-batches", "20"], timeout=400)
          for strategy in ("ddp", "ddp_spawn", "fsdp")],
        Item("l07-16-mixed", "Lightning precision='16-mixed' on one GPU",
             [py, f"{S}/07_lightning/lit_train.py", "--accelerator", "cuda", "--devices", "1",
              "--precision", "16-mixed", "--limit-train-batches", "20"], timeout=400),
        Item("l08-fsdp2", "FSDP2 fully_shard on NCCL",
             [py, f"{S}/08_sharding/fsdp2_train.py", "--nproc", n, "--steps", "10",
              "--data", "synthetic"]),
        Item("benchmark-quick", "benchmarks.run --quick: no failed record, cost model present",
             [py, "-m", "benchmarks.run", "--quick", "--out", str(tmp / "bench")],
             timeout=900),
        Item("notebooks", "every notebook, with the ranks on the GPUs where there are enough",
             [py, "-m", "pytest", "-q", "-p", "no:randomly", "tests/harness/test_notebooks.py"],
             env={"DPT_TEST_BACKEND": "auto"}, timeout=1800),
    ]


def check_benchmark(out_dir: Path) -> str | None:
    """None when the quick benchmark ran every method without failure and fitted its model."""
    files = sorted(out_dir.rglob("results.json")) or sorted(out_dir.rglob("latest.json"))
    if not files:
        return "no results JSON written"
    result = json.loads(files[0].read_text())
    failed = [f"{r['method']}@{r['nprocs']}: {r.get('error', '')[:80]}"
              for r in result.get("records", []) if r.get("status") in ("failed", "timeout")]
    if failed:
        return "failed records: " + "; ".join(failed)
    if not result.get("cost_model"):
        return "no cost model in the results"
    return None


def run_item(item: Item, n_gpus: int, tmp: Path) -> dict:
    rec = {"name": item.name, "what": item.what, "command": " ".join(item.argv)}
    if n_gpus < item.min_gpus:
        return {**rec, "status": "skipped",
                "reason": f"needs {item.min_gpus} GPUs, this machine has {n_gpus}"}
    env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               **item.env)
    start = time.monotonic()
    proc = subprocess.Popen(item.argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=item.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return {**rec, "status": "fail", "reason": f"timed out after {item.timeout:.0f} s",
                "seconds": round(time.monotonic() - start, 1), "tail": out[-3000:]}
    rec.update(seconds=round(time.monotonic() - start, 1), tail=out[-3000:])
    if proc.returncode != 0:
        last = [ln for ln in out.strip().splitlines() if ln.strip()][-1:] or [""]
        return {**rec, "status": "fail", "reason": f"exit {proc.returncode}: {last[0][:200]}"}
    if item.expect and item.expect not in out:
        return {**rec, "status": "fail", "reason": f"output lacks {item.expect!r}"}
    if item.name == "benchmark-quick":
        why = check_benchmark(tmp / "bench")
        if why:
            return {**rec, "status": "fail", "reason": why}
    return {**rec, "status": "pass"}


def machine() -> dict:
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    caps = [".".join(map(str, torch.cuda.get_device_capability(i)))
            for i in range(torch.cuda.device_count())]
    return {"host": platform.node(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpus": gpus, "capabilities": caps, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def write(results: list[dict], info: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "checklist.json").write_text(json.dumps({"machine": info, "items": results},
                                                   indent=2))
    lines = [f"# GPU check: {', '.join(info['gpus'])}", "",
             f"torch {info['torch']}, CUDA {info['cuda']}, {info['date']}", "",
             "| item | result | seconds | what |", "|---|---|---|---|"]
    for r in results:
        result = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        lines.append(f"| {r['name']} | {result} | {r.get('seconds', '')} | {r['what']} |")
    (out / "checklist.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check")
    ap.add_argument("--only", default=None, help="comma-separated item names")
    ap.add_argument("--list", action="store_true", help="list the items and exit")
    args = ap.parse_args(argv)
    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with tempfile.TemporaryDirectory(prefix="dpt-gpu-check-") as tmp_name:
        tmp = Path(tmp_name)
        todo = items(max(n_gpus, 1), tmp)
        if args.list:
            for it in todo:
                print(f"{it.name:22} {it.what} (needs {it.min_gpus} GPU(s))")
            return 0
        if n_gpus == 0:
            print("gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is "
                  "False); nothing to check here", file=sys.stderr)
            return NO_GPU_EXIT
        if args.only:
            names = set(args.only.split(","))
            unknown = names - {it.name for it in todo}
            if unknown:
                print(f"error: unknown item(s) {sorted(unknown)}; see --list", file=sys.stderr)
                return 2
            todo = [it for it in todo if it.name in names]
        info = machine()
        print(f"gpu-check: {n_gpus} GPU(s): {', '.join(info['gpus'])}", flush=True)
        results = []
        for i, item in enumerate(todo, 1):
            print(f"[{i}/{len(todo)}] {item.name}: {item.what} ...", flush=True)
            rec = run_item(item, n_gpus, tmp)
            results.append(rec)
            note = f" ({rec['reason']})" if rec.get("reason") else ""
            print(f"    {rec['status']}{note}", flush=True)
        write(results, info, args.out)
    print("\nchecklist:")
    for r in results:
        print(f"  [{r['status']:7}] {r['name']}" + (f": {r['reason']}" if r.get("reason") else ""))
    print(f"written: {args.out / 'checklist.md'} and checklist.json")
    return 1 if any(r["status"] == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
