"""Lesson 03's launcher (dpt.cli.spawn) and the free-port race.

The launcher finds a free port (bind to port 0, release) and rank 0 binds it seconds later;
another process can take it in between (seen once in a stress run). For a port it chose itself,
the launcher starts again on a new one; a port the user gave is never changed.
"""

import socket
from argparse import Namespace

import pytest

from dpt import cli
from dpt.dist import find_free_port
from tests.harness import rank_fns


def setup_and_barrier(local_rank, args):
    """What a lesson's rank does: join through dpt.dist.setup, whose ranks meet on a store at
    MASTER_ADDR:MASTER_PORT to agree on the backend before the group is made."""
    import torch.distributed as dist

    from dpt.dist import cleanup, setup

    setup(local_rank, args.gpus, local_rank, args.device, timeout_s=args.timeout, threads=1,
          local_world_size=args.gpus)
    dist.barrier()
    cleanup()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("join", [rank_fns.join_and_barrier, setup_and_barrier],
                         ids=["init_process_group", "dpt.dist.setup"])
def test_a_chosen_port_taken_before_rank_0_listens_is_replaced(monkeypatch, capsys, join):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    ports = iter([taken])
    monkeypatch.setattr(cli, "find_free_port", lambda: next(ports, None) or find_free_port())
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("DPT_PORT_CHOSEN", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    args = Namespace(nodes=1, gpus=2, nr=0, device="cpu", master_port=None, master_addr=None,
                     timeout=60.0)
    try:
        cli.spawn(join, args)
    finally:
        squatter.close()
    out = capsys.readouterr().out
    assert f"port {taken} was taken" in out, out


@pytest.mark.timeout(240)
def test_a_port_the_user_gave_is_not_replaced(monkeypatch, capsys):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("DPT_PORT_CHOSEN", raising=False)
    args = Namespace(nodes=1, gpus=2, nr=0, device="cpu", master_port=taken, master_addr=None,
                     timeout=20.0)
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.spawn(rank_fns.join_and_barrier, args)
    finally:
        squatter.close()
    assert exit_info.value.code == 2
    assert "was taken" not in capsys.readouterr().out
