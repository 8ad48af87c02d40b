"""Functions the harness tests run on several ranks (importable, so they can be pickled)."""

import os
import time

import torch
import torch.distributed as dist


def all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item(), "threads": torch.get_num_threads(),
            "port": os.environ["MASTER_PORT"]}


def raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    time.sleep(60)  # rank 0 would wait forever; the helper must not wait for it
    return rank


def exit_on_rank_0(rank, world_size):
    if rank == 0:
        os._exit(3)
    time.sleep(60)


def hang_on_rank_0(rank, world_size):
    if rank == 0:
        time.sleep(600)
    return rank


def print_and_return_tensor(rank, world_size):
    print(f"hello from rank {rank}")
    return torch.full((2,), float(rank))


def join_and_barrier(local_rank, args):
    """What a lesson-03 rank does first: join the group at MASTER_ADDR:MASTER_PORT."""
    from datetime import timedelta

    dist.init_process_group("gloo", rank=local_rank, world_size=args.gpus,
                            timeout=timedelta(seconds=args.timeout))
    dist.barrier()
    dist.destroy_process_group()


def parent_pid(rank, world_size):
    return os.getppid()


def pin_and_report(rank, world_size, threads):
    """Pin this rank as the benchmark does; report the cores of every thread it then has."""
    import threading

    from dpt.dist import pin_rank

    cores = pin_rank(rank, world_size, threads)
    later = threading.Thread(target=time.sleep, args=(0.5,))
    later.start()  # a thread started after pinning inherits the rank's cores
    each = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
    later.join()
    return {"cores": cores, "threads": each}


def buffer_after_forward(rank, world_size, keep_local):
    """Rank 1 marks its batch-norm mean (1000) after DDP is built, then one training forward.

    torch DDP broadcasts rank 0's buffers at every forward unless told not to, which would
    replace the mark with rank 0's mean (near 0). Returns the mean and any warnings raised.
    """
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.methods_core import no_forward_buffer_sync

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = DDP(net, **(no_forward_buffer_sync() if keep_local else {}))
    if rank == 1:
        with torch.no_grad():
            net[1].running_mean.fill_(1000.0)
    ddp(torch.randn(8, 4))
    return {"mean": net[1].running_mean.mean().item(),
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def progress_bar_rank(rank, world_size):
    from tqdm import tqdm

    return sum(tqdm(range(3), disable=False))


def segfault_on_rank_1(rank, world_size):
    """A crash below Python (as a collective reading device memory as host memory does)."""
    if rank == 1:
        import ctypes
        import faulthandler

        faulthandler._sigsegv()  # noqa: SLF001 - the documented way to test a crash
        ctypes.string_at(0)
    return rank


def cuda_seen(rank, world_size):
    import os

    import torch

    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "available": torch.cuda.is_available(), "count": torch.cuda.device_count()}


def full_state_dict_through_staged_gathers(rank, world_size):
    """FSDP2 on gloo, its full state dict gathered inside dpt.dist.gathers_for_shared_gpu
    (forced on the CPU); returns the state dict and the collective ops that ran."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.utils._python_dispatch import TorchDispatchMode

    from dpt.dist import device_mesh, gathers_for_shared_gpu

    class Seen(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "c10d" in str(func):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for block in (model[0], model[2]):
        fully_shard(block, mesh=device_mesh())
    fully_shard(model, mesh=device_mesh())
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    with Seen() as seen, gathers_for_shared_gpu(force=True):
        state = get_model_state_dict(model, options=options)
    return {"state": state, "full": full, "ops": sorted(set(seen.ops))}
