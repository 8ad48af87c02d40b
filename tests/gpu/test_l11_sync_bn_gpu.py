"""Lesson 11 on CUDA: the hand SyncBatchNorm (11.3-11.5) against torch's ``nn.SyncBatchNorm``.

torch's SyncBatchNorm runs only on GPUs, so the CPU suite compares the hand layer with one
process on the whole batch (``tests/l11_time_to_accuracy/test_sync_bn.py``); here it meets
torch's own (under NCCL, and under gloo with ranks sharing the GPUs) on the same uneven shares
(2, 3 and 5 rows) and the same inputs: outputs of 3 training forwards, input, weight and bias
gradients, running statistics, and the eval output, to float32 precision.

Ranks: one per GPU, NCCL, up to 3. NCCL cannot put two ranks on one device, so on a machine
with ONE GPU that run is a world of one rank, where torch's layer falls back to plain batch
norm: it checks the hand layer's CUDA path against torch's kernels, not the synchronisation.
The second test checks the synchronisation on any GPU count: 3 ranks share the GPUs
(``DPT_SHARE_GPU=1``) and talk through gloo, whose all-gather and all-reduce take CUDA tensors
(through pinned host copies); torch's SyncBatchNorm uses the list ``all_gather`` under gloo.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpt.ranks import run_distributed
from tests.l11_time_to_accuracy import rank_fns_sync_bn as rf
from tests.lessons import load

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLD = min(max(N_GPUS, 1), rf.N)
LESSON = rf.LESSON
TOL = 1e-4  # float32 on GPUs, sums in other orders

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(N_GPUS < 1, reason="needs a CUDA GPU (torch's SyncBatchNorm "
                                                    "runs only on GPUs)")]


def _run(layer: nn.Module, kind: str, rank: int, device: torch.device) -> dict:
    outputs = []
    for step in range(rf.FORWARDS):
        x = rf.inputs(kind, rank, step).float().to(device).requires_grad_(True)
        y = layer(x)
        outputs.append(y.detach().cpu())
    (y * rf.out_weights(kind, rank).float().to(device)).sum().backward()
    layer.eval()
    return {"outputs": outputs, "grad": x.grad.cpu(), "weight_grad": layer.weight.grad.cpu(),
            "bias_grad": layer.bias.grad.cpu(), "running_mean": layer.running_mean.cpu(),
            "running_var": layer.running_var.cpu(),
            "eval": layer(rf.inputs(kind, rank, rf.EVAL_STEP).float().to(device)).detach().cpu()}


def hand_and_torch(rank: int, world_size: int) -> dict:
    """Rank ``rank``: the converted layer and torch's SyncBatchNorm on the same inputs."""
    from dpt.dist import rank_device

    sb = load(LESSON, "sync_bn")
    device = rank_device()
    out = {}
    for kind in rf.SHAPES:
        plain = rf.bn_layer(kind).float()
        hand = sb.convert_sync_by_hand(rf.bn_layer(kind).float()).to(device)
        theirs = nn.SyncBatchNorm.convert_sync_batchnorm(plain).to(device)
        out[kind] = {"type": type(hand).__name__, "hand": _run(hand, kind, rank, device),
                     "torch": _run(theirs, kind, rank, device)}
    return out


def test_hand_sync_bn_matches_torchs_sync_batch_norm(monkeypatch):
    monkeypatch.setenv("DPT_TEST_BACKEND", "nccl")
    monkeypatch.delenv("DPT_SHARE_GPU", raising=False)
    results = run_distributed(hand_and_torch, world_size=WORLD, backend="nccl", timeout=250,
                              echo=False)
    _compare(results, "NCCL")


def test_hand_sync_bn_matches_torchs_with_three_ranks_sharing_the_gpus(monkeypatch):
    monkeypatch.setenv("DPT_TEST_BACKEND", "gloo")
    monkeypatch.setenv("DPT_SHARE_GPU", "1")
    results = run_distributed(hand_and_torch, world_size=rf.N, backend="gloo", timeout=250,
                              echo=False)
    _compare(results, f"gloo, {rf.N} ranks on {N_GPUS} GPU(s)")


def _compare(results: list[dict], how: str) -> None:
    for r, res in enumerate(results):
        for kind, both in res.items():
            assert both["type"] == "SyncBatchNormByHand", (
                f"convert_sync_by_hand gave a {both['type']}")
            hand, theirs = both["hand"], both["torch"]
            who = f"rank {r} of {len(results)} ({rf.ROWS[r]} rows, input {kind}, {how})"
            pairs = [(f"training output {i}", a, b)
                     for i, (a, b) in enumerate(zip(hand["outputs"], theirs["outputs"]))]
            pairs += [(k, hand[k], theirs[k]) for k in ("grad", "weight_grad", "bias_grad",
                                                       "running_mean", "running_var", "eval")]
            for what, a, b in pairs:
                gap = (a - b).abs().max().item()
                assert gap <= TOL * (1 + b.abs().max().item()), (
                    f"{who}: {what} differs from torch's nn.SyncBatchNorm by {gap:.3g}")
