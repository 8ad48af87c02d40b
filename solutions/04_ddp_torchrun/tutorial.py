# %% [markdown]
# # Lesson 04: torchrun, snapshots, and training that survives a dead worker
#
# In lesson 03 our own code started the ranks (`mp.spawn`) and handed each one its rank.
# Here a launcher does that: `torchrun` starts one process per device and tells each one who it
# is through environment variables. In exchange, it can do what `mp.spawn` cannot: restart the
# whole group when a worker dies, and join processes on several machines.
#
# `ddp_torchrun.py` is lesson 03's `ddp_spawn.py` plus what that takes (`CHANGES.diff` in the
# lesson folder), as `multigpu_torchrun.py` grows from `multigpu.py` in PyTorch's DDP tutorial
# series. You write:
#
# | task | where | what it does |
# |---|---|---|
# | 04.1 | `torchrun_env` | who this process is, from `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, ... (no `--local_rank` argument) |
# | 04.2 | `gather_rng_states` | every rank's random-number state, on every rank |
# | 04.3 | `Trainer._save_snapshot` | model, optimizer, epoch, every rank's RNG state, sampler seed: written once, safely |
# | 04.4 | `load_snapshot` | every rank loads it, and gets its own RNG state back |
# | 04.5 | `Trainer.__init__` | a restarted job resumes where the snapshot left off |
#
# The functions marked `from lesson 03_ddp_spawn` are your earlier answers (lessons 01 and
# 03): run `make carry` at the course's root to copy them there. `ddp_setup` hands torchrun's
# numbers to your lesson-03 `join_group`, which joins the group as before; the processes are
# started by torchrun, so there is no `launch` here.

# %%
from dpt.notebook import needs_tasks, ranks_device, script_env, use_lesson

folder = use_lesson("04_ddp_torchrun")

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import ddp_torchrun as lesson
from dpt.data import is_present, prepare

DATASET = "mnist" if is_present("mnist") else "fashion-mnist"  # MNIST after `make data`
prepare(DATASET)

# %% [markdown]
# Each cell below runs inside `with needs_tasks(...)`, which names the tasks it uses. A cell
# that reaches a task you have not done yet prints `skipped: this cell needs Task NN.K` instead
# of a traceback, and the rest of the notebook still runs. Edits to your lesson files are
# picked up when you re-run a cell.

# %% [markdown]
# ## What torchrun tells each worker
#
# `torchrun --nproc-per-node=2 script.py` starts `script.py` twice. Each copy finds its
# identity in its environment:
#
# | variable | meaning |
# |---|---|
# | `RANK` | global rank, 0 .. `WORLD_SIZE`-1, across all machines |
# | `LOCAL_RANK` | rank on this machine: which GPU to pin |
# | `WORLD_SIZE`, `LOCAL_WORLD_SIZE` | processes in the job, and on this machine |
# | `MASTER_ADDR`, `MASTER_PORT` | where the process group meets (`init_process_group` reads them) |
# | `TORCHELASTIC_RESTART_COUNT` | 0 on the first attempt, 1 after the first restart, ... |
#
# So the script parses no rank arguments at all. Here is 04.1 on a made-up environment, as
# worker 3 of 4 on the second machine would see it after one restart:

# %%
with needs_tasks("04.1"):
    print(lesson.torchrun_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                               "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1"}))

# %% [markdown]
# ## Migrating from `torch.distributed.launch`
#
# Older tutorials still show the old launcher. It passed the local rank as an *argument*, so
# every script had to parse it:
#
# ```bash
# # before (deprecated): the launcher appends --local-rank=N (older torch: --local_rank=N)
# python -m torch.distributed.launch --nproc_per_node=2 train.py --epochs 2
# #   parser.add_argument("--local_rank", type=int); torch.cuda.set_device(args.local_rank)
#
# # halfway: --use_env (--use-env) puts it in LOCAL_RANK instead
# python -m torch.distributed.launch --use_env --nproc_per_node=2 train.py --epochs 2
#
# # now: torchrun always sets the variables; the script reads os.environ["LOCAL_RANK"]
# torchrun --standalone --nproc-per-node=2 train.py --epochs 2
# ```
#
# Delete the `--local_rank` argument, read `LOCAL_RANK` (04.1), and call
# `init_process_group` without a rank or a URL: the `env://` default reads the rest. Our
# script refuses the old argument with one line telling you what to do:

# %%
with needs_tasks():
    print("exit code:", lesson.cli.main(lesson.main, lesson.build_parser(), ["--local_rank=0"]))

# %% [markdown]
# ## Why this notebook launches a script
#
# torchrun starts *programs*: it cannot run a function defined in a notebook cell, and neither
# can `mp.spawn`, whose fresh interpreters would have to unpickle it. So the training lives in
# `ddp_torchrun.py` and we start it with `subprocess`, exactly as on the command line
# (`python -m torch.distributed.run` is torchrun, run by this kernel's Python).
#
# One variable must be set wherever the course starts torchrun:
# `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`. By default torchrun's agent shares its rendezvous
# key-value store with the workers. After a restart, workers can then read keys left over from
# the previous attempt, and with gloo they may never meet again (pytorch/pytorch
# #167288 is the same trap with NCCL). The variable gives each attempt a fresh store.

# %%
with needs_tasks():
    SCRIPT = folder / "ddp_torchrun.py"
    work = Path(tempfile.mkdtemp(prefix="l04-"))
    DEVICE = ranks_device(2)  # cuda with a GPU per worker (or DPT_SHARE_GPU=1), else cpu
    print("workers on:", DEVICE)
    TINY = ["--dataset", DATASET, "--epochs", "3", "--limit-batches", "40", "--train-limit", "4096", "--test-limit", "1000",
            "--batch-size", "32", "--threads", "1", "--no-progress", "--device", DEVICE,
            "--deterministic", "--timeout", "300"]


    def torchrun(*args, nproc=2, max_restarts=0, log="run.log"):
        """Start `torchrun --nproc-per-node=nproc ... ddp_torchrun.py args` in the background."""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
               str(SCRIPT), *map(str, args)]
        env = script_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1",
                         PYTHONUNBUFFERED="1")
        return subprocess.Popen(cmd, stdout=open(work / log, "w"), stderr=subprocess.STDOUT,
                                env=env)


    def finish(proc, log, timeout=600):
        proc.wait(timeout=timeout)
        text = (work / log).read_text()
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun exited {proc.returncode}:\n{text[-3000:]}")
        return text

# %% [markdown]
# ## A run that fails halfway, next to one that does not
#
# Both runs train the ConvNet for 3 short epochs on 2 workers, with a snapshot after every
# epoch. In the second, as soon as the first snapshot is on disk, we kill one worker with
# SIGKILL, as an out-of-memory killer or a failing machine would: no cleanup, no goodbye.
# With `--max-restarts=2`, torchrun sees the dead worker, stops the other, and starts both
# again; they find the snapshot and go on from there. Both runs start at once to save time.

# %%
# the whole script, every task of the lesson
with needs_tasks("01.1", "01.3", "03.2", "03.3", "03.4", "03.6", "04.1", "04.2", "04.3", "04.4",
                 "04.5"):
    def kill_a_worker_after_first_snapshot(proc, snapshot, timeout=600):
        """SIGKILL one worker of the torchrun agent `proc` once `snapshot` exists."""
        deadline = time.monotonic() + timeout
        while not snapshot.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (work / "faulty.log").read_text()[-3000:]
                raise RuntimeError("the run ended, or took too long, before its first "
                                   f"snapshot:\n{log}")
            time.sleep(0.2)
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                 text=True).stdout.split()
        os.kill(int(max(workers, key=int)), signal.SIGKILL)
        print(f"killed worker {max(workers, key=int)} of {len(workers)} after the first snapshot")


    start = time.perf_counter()
    clean = torchrun(*TINY, "--snapshot", work / "clean.pt", log="clean.log")
    faulty = torchrun(*TINY, "--snapshot", work / "faulty.pt", max_restarts=2, log="faulty.log")
    kill_a_worker_after_first_snapshot(faulty, work / "faulty.pt")
    clean_log, faulty_log = finish(clean, "clean.log"), finish(faulty, "faulty.log")
    print(f"both runs done in {time.perf_counter() - start:.0f}s\n")
    keep = ("resumed", "epoch ", "accuracy", "exitcode", "Signals.SIGKILL", "restart")
    for line in faulty_log.splitlines():
        if any(k in line for k in keep) and not line.startswith("[rank"):
            print(line[:160])

# %% [markdown]
# The log reads: the workers train epoch 0 and snapshot; one of them is killed; torchrun
# reports the failure and starts them again, and they resume after the last snapshot. Now the
# claim that makes snapshots worth their trouble: the final weights (in the last snapshot)
# equal those of the run that never failed.

# %%
with needs_tasks("01.1", "01.3", "03.2", "03.3", "03.4", "03.6", "04.1", "04.2", "04.3", "04.4",
                 "04.5"):
    a = torch.load(work / "clean.pt", weights_only=True, map_location="cpu")["model"]
    b = torch.load(work / "faulty.pt", weights_only=True, map_location="cpu")["model"]
    diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    print(f"largest difference over {len(a)} tensors: {diff:g}",
          "(bit for bit)" if all(torch.equal(a[k], b[k]) for k in a) else "")


    def epoch_losses(log):
        return {int(m[1]): float(m[2]) for m in re.finditer(r"epoch (\d+): mean train loss ([\d.]+)",
                                                             log)}


    lc, lf = epoch_losses(clean_log), epoch_losses(faulty_log)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(list(lc), list(lc.values()), "o-", label="never failed")
    ax.plot(list(lf), list(lf.values()), "x", ms=12, label="resumed after the fault (attempt 1)")
    ax.axvline(0.5, color="red", ls=":", label="a worker is killed after epoch 0")
    ax.set(xlabel="epoch", ylabel="mean train loss", xticks=list(lc),
           title="Resuming from a snapshot repeats the same numbers")
    ax.legend(fontsize=8)
    plt.show()

# %% [markdown]
# Why exactly equal, and not just close? Everything the next epoch depends on is in the
# snapshot or derived from it:
#
# - weights *and* batch-norm buffers (`state_dict`), and the optimizer's momentum buffers;
# - the epoch, so `set_epoch(epoch)` gives the `DistributedSampler` the same shuffle (it is
#   seeded by `seed + epoch`; the snapshot keeps the seed);
# - each rank's RNG state, gathered to rank 0 (nothing in this ConvNet draws random numbers
#   during training, but dropout or augmentation would, and then a resume without it differs);
# - and the same arithmetic: the CPU kernels used here are deterministic, and on GPUs
#   `--deterministic` asks cuDNN and cuBLAS for deterministic ones too.
#
# A kill that strikes mid-epoch throws that partial epoch away: it is redone after the restart.
# That is the price of snapshots at epoch boundaries: up to `save-every` epochs of lost work.
# Here is what rank 0 wrote:

# %%
with needs_tasks("01.1", "01.3", "03.2", "03.3", "03.4", "03.6", "04.1", "04.2", "04.3", "04.4",
                 "04.5"):
    snap = torch.load(work / "faulty.pt", weights_only=True, map_location="cpu")
    for key, value in snap.items():
        if key == "model":
            print(f"{key:10} {len(value)} tensors, no 'module.' prefix: "
                  f"{not any(k.startswith('module.') for k in value)}")
        elif key == "optimizer":
            print(f"{key:10} momentum buffers for {len(value['state'])} parameters")
        elif key == "rng":
            print(f"{key:10} one CPU generator state per rank: {[r['torch'].shape for r in value]}")
        else:
            print(f"{key:10} {value}")

# %% [markdown]
# ### Why the write must be atomic
#
# If a worker is killed *while* rank 0 writes, a snapshot written in place would be half a file,
# and the restart would fail on it: the fault would have destroyed the very thing meant to
# survive it. `dpt.checkpoint.atomic_save` writes to a temporary file in the same folder,
# `fsync`s it, and renames it over the old one; on POSIX the rename is atomic, so the path
# holds either the old snapshot or the new one. A
# snapshot that is corrupted anyway (copied badly, disk full) stops every rank with one line:
# `error: checkpoint .../snapshot.pt is corrupted or not a torch checkpoint (...)`.
#
# ## More machines
#
# On two machines, run the same torchrun command on each, with the same rendezvous endpoint
# (a host and port of the first machine) and `--nnodes=2`. To try it on one machine, open two
# terminals, with one free port:
#
# ```bash
# export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# torchrun --nnodes=2 --node-rank=0 --nproc-per-node=1 --rdzv-backend=c10d \
#     --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo exercises/04_ddp_torchrun/ddp_torchrun.py --device cpu
# torchrun --nnodes=2 --node-rank=1 --nproc-per-node=1 --rdzv-backend=c10d \
#     --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo exercises/04_ddp_torchrun/ddp_torchrun.py --device cpu
# ```
#
# (`--device cpu` here: on one machine with GPUs both "nodes" have `LOCAL_RANK` 0, so both
# would take `cuda:0`; give each its own GPU with `CUDA_VISIBLE_DEVICES` instead.)
#
# With the `c10d` rendezvous the agents agree on node ranks among themselves in the order they
# join, so `--node-rank` is only a label (torchrun warns that it ignores it); with
# `--rdzv-backend=static` plus `--master-addr/--master-port` it is what fixes the ranks.
# On a SLURM cluster, `torchrun.sbatch` does this for you: `srun` starts one torchrun per node,
# and the endpoint is the first host of `scontrol show hostnames $SLURM_JOB_NODELIST`.
