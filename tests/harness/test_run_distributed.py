"""The multi-process helper: results, loud failures, hard timeouts, no port collisions."""

import threading
import time

import pytest
import torch

from dpt.ranks import RankFailure, run_distributed
from tests.harness import rank_fns


def test_runs_a_collective_on_two_ranks_with_one_thread_each():
    results = run_distributed(rank_fns.all_reduce_rank, world_size=2)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum"] == 3.0 for r in results)
    assert all(r["threads"] == 1 for r in results)


def test_returns_tensors_and_echoes_rank_output(capsys):
    results = run_distributed(rank_fns.print_and_return_tensor, world_size=2)
    torch.testing.assert_close(results[1], torch.tensor([1.0, 1.0]))
    out = capsys.readouterr().out
    assert "hello from rank 0" in out and "hello from rank 1" in out


def test_a_rank_that_raises_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_distributed(rank_fns.raise_on_rank_1, world_size=2, timeout=60)
    assert time.monotonic() - start < 20, "the failure took too long to surface"
    message = str(info.value)
    assert "rank 1 of 2 failed" in message
    assert "ValueError: rank 1 broke on purpose" in message
    assert "raise_on_rank_1" in message  # the traceback, not just the message


def test_a_rank_that_dies_without_a_traceback_is_reported():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 0 of 2 died with exit code 3"):
        run_distributed(rank_fns.exit_on_rank_0, world_size=2, timeout=60)
    assert time.monotonic() - start < 20


def test_a_rank_that_hangs_is_killed_at_the_timeout_with_its_stack():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_distributed(rank_fns.hang_on_rank_0, world_size=2, timeout=8)
    assert time.monotonic() - start < 20
    message = str(info.value)
    assert "rank 0" in message and "hang_on_rank_0" in message  # where it hung


def test_two_runs_at_once_use_different_ports():
    results = {}

    def go(key):
        results[key] = run_distributed(rank_fns.all_reduce_rank, world_size=2, echo=False)

    threads = [threading.Thread(target=go, args=(k,)) for k in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert set(results) == {"a", "b"}
    assert results["a"][0]["port"] != results["b"][0]["port"]
    assert all(r["sum"] == 3.0 for run in results.values() for r in run)


def test_after_a_restart_the_ranks_fork_from_a_new_server():
    from dpt.ranks import _context, restart_fork_server

    if _context().get_start_method() != "forkserver":
        pytest.skip("the ranks are not forked from a server here (DPT_MP_START)")
    before = run_distributed(rank_fns.parent_pid, world_size=1, backend=None, echo=False)
    again = run_distributed(rank_fns.parent_pid, world_size=1, backend=None, echo=False)
    assert before == again, "without a restart the ranks come from the same server"
    assert restart_fork_server() is True
    after = run_distributed(rank_fns.parent_pid, world_size=2, backend=None, echo=False)
    assert after[0] == after[1] and after[0] != before[0], (
        "restart_fork_server() left the old fork server in place: every round of a benchmark "
        "would share one memory layout")


@pytest.mark.timeout(120)
def test_a_progress_bar_in_a_rank_leaves_no_leaked_semaphore_warning():
    """tqdm's default lock is a multiprocessing semaphore; ranks leave with os._exit, so the
    resource tracker used to print "leaked semaphore objects" after every lesson script that
    showed a progress bar in its ranks."""
    import subprocess
    import sys

    code = ("from dpt.ranks import run_distributed\n"
            "from tests.harness import rank_fns\n"
            "if __name__ == '__main__':\n"
            "    print(run_distributed(rank_fns.progress_bar_rank, world_size=2, echo=False))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=100, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert out.returncode == 0, out.stderr
    assert "[3, 3]" in out.stdout
    assert "leaked semaphore" not in out.stderr, out.stderr


def test_a_rank_that_segfaults_is_reported_with_the_signal_and_its_python_stack():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_distributed(rank_fns.segfault_on_rank_1, world_size=2, timeout=60)
    assert time.monotonic() - start < 20
    message = str(info.value)
    assert "rank 1 of 2 died" in message and "SIGSEGV" in message
    assert "segfault_on_rank_1" in message  # faulthandler's stack, from the rank's output


def test_a_port_taken_before_rank_0_listens_is_replaced_by_a_new_one(monkeypatch):
    """find_free_port releases the port it found; another program can bind it before rank 0
    does. Rank 0 then fails to listen, and every rank starts again on a new port."""
    import socket

    import dpt.ranks

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real, calls = dpt.ranks.find_free_port, []

    def first_one_taken():
        calls.append(1)
        return taken if len(calls) == 1 else real()

    monkeypatch.setattr(dpt.ranks, "find_free_port", first_one_taken)
    try:
        results = run_distributed(rank_fns.all_reduce_rank, world_size=2, timeout=60,
                                  echo=False)
        assert len(calls) == 2 and all(r["sum"] == 3.0 for r in results)
        monkeypatch.setattr(dpt.ranks, "find_free_port", lambda: taken)
        with pytest.raises(RankFailure, match="could not listen on 3 free ports"):
            run_distributed(rank_fns.all_reduce_rank, world_size=2, timeout=60, echo=False)
    finally:
        squatter.close()


def test_ranks_started_with_no_gpu_env_see_no_gpu():
    """tests.helpers.NO_GPU_ENV reaches the ranks before torch first asks for a GPU (on a GPU
    machine the count would otherwise be its GPUs)."""
    from tests.helpers import NO_GPU_ENV

    for r in run_distributed(rank_fns.cuda_seen, world_size=2, env=NO_GPU_ENV, echo=False):
        assert r == {"visible": "", "available": False, "count": 0}


def test_staged_gathers_give_the_full_state_dict_through_gloos_plain_all_gather():
    """dpt.dist.gathers_for_shared_gpu: DTensor's functional all-gather (which gloo runs as a
    coalesced all-gather with no CUDA path: a SIGSEGV with ranks sharing a GPU) becomes its
    ``_out`` form, gloo's plain all-gather; the full state dict is the same."""
    ranks = run_distributed(rank_fns.full_state_dict_through_staged_gathers, world_size=2,
                            backend="gloo", timeout=90, echo=False)
    rank0 = ranks[0]
    assert rank0["state"].keys() == rank0["full"].keys()
    for key, value in rank0["full"].items():
        torch.testing.assert_close(rank0["state"][key], value, rtol=0, atol=0)
    ops = rank0["ops"]
    assert any("all_gather_into_tensor_out" in op for op in ops), ops
    assert not any(op.endswith("all_gather_into_tensor.default") for op in ops), ops
