"""Rank functions and shared data for lesson 11's SyncBN tests (test_sync_bn.py).

``N`` = 3 ranks holding uneven shares, ``ROWS`` = 2, 3 and 5 rows: the mean of the ranks' means
is then not the mean, the count must be the global one, and n/(n − 1) is 2.0 on rank 0 but
10/9 globally. Inputs are float64 (3 + 2·randn, per channel shifted), so every check is to
1e-10, and each input is a function of (kind, rank, step), computed alike by the ranks and by
the test's one-process reference.

One launch, three parts, each on its own (``rank_part``) and in this order: 11.3 with the
student's code; 11.4 with 11.3's reference; 11.5 (a DDP ConvNet, converted) with 11.3's and
11.4's references. The unconverted ConvNet, given code only, runs beside it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import rank_part
from tests.lessons import load
from tests.references import put

LESSON = "11_time_to_accuracy"
N = 3
ROWS = (2, 3, 5)
SHAPES = {"1d": (4,), "2d": (3, 2, 2)}  # BatchNorm1d(4) on (b, 4), BatchNorm2d(3) on (b, 3, 2, 2)
FORWARDS = 3  # training forwards before the running statistics are compared
EVAL_STEP = 99
CONV_STEPS = 3
CONV_PER_RANK = 4


def _gen(*key: int) -> torch.Generator:
    seed = 0
    for k in key:
        seed = seed * 1000 + k
    return torch.Generator().manual_seed(seed)


def _kind_id(kind: str) -> int:
    return list(SHAPES).index(kind) + 1


def inputs(kind: str, rank: int, step: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input at ``step``: ROWS[rank] rows, float64, channel c around 3 + c."""
    shape = (ROWS[rank], *SHAPES[kind])
    x = 3 + 2 * torch.randn(shape, generator=_gen(_kind_id(kind), rank, step),
                            dtype=torch.float64)
    offset = torch.arange(shape[1], dtype=torch.float64).view(1, -1, *[1] * (len(shape) - 2))
    return x + offset


def out_weights(kind: str, rank: int) -> torch.Tensor:
    """The weights of rank ``rank``'s loss, sum(out * w): every output element counts."""
    return torch.randn((ROWS[rank], *SHAPES[kind]), generator=_gen(7, _kind_id(kind), rank),
                       dtype=torch.float64)


def stat_weights(kind: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s loss on the moments: sum(mean * a + var * b)."""
    g = _gen(8, _kind_id(kind), rank)
    c = SHAPES[kind][0]
    return (torch.randn(c, generator=g, dtype=torch.float64),
            torch.randn(c, generator=g, dtype=torch.float64))


def affine(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(9, _kind_id(kind))
    c = SHAPES[kind][0]
    return (1 + 0.5 * torch.randn(c, generator=g, dtype=torch.float64),
            torch.randn(c, generator=g, dtype=torch.float64))


def bn_layer(kind: str, cls=None, momentum: float | None = 0.1) -> nn.Module:
    """A batch norm of ``cls`` (None: torch's BatchNorm1d or 2d, by ``kind``), float64, its
    weight and bias set, the same everywhere."""
    cls = cls or {"1d": nn.BatchNorm1d, "2d": nn.BatchNorm2d}[kind]
    bn = cls(SHAPES[kind][0], momentum=momentum).double()
    weight, bias = affine(kind)
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    return bn


def conv_batches(world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ConvNet's global batches (float64): rank r takes rows r·b..(r+1)·b."""
    g = _gen(5)
    n = CONV_PER_RANK * world_size
    return [(torch.randn(n, 1, 28, 28, generator=g, dtype=torch.float64),
             torch.randint(0, 10, (n,), generator=g)) for _ in range(CONV_STEPS)]


def conv_model() -> nn.Module:
    from dpt.models import ConvNet

    torch.manual_seed(0)
    return ConvNet(batch_norm=True).double()


def train_conv(model: nn.Module, batches, rank: int, world_size: int) -> dict:
    """SGD on rank ``rank``'s share of each of ``batches`` (1 rank: all of it); the state
    afterwards."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        b = len(x) // world_size
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[rank * b:(rank + 1) * b]), y[rank * b:(rank + 1) * b]).backward()
        opt.step()
    inner = getattr(model, "module", model)
    return {k: v.detach().cpu().clone() for k, v in inner.state_dict().items()}


# --- the parts --------------------------------------------------------------------------------

def moments_part(rank: int, world_size: int) -> dict:
    """11.3 on every kind: the moments and the input gradient of sum(mean·a + var·b)."""
    sb = load(LESSON, "sync_bn")
    out = {}
    for kind in SHAPES:
        x = inputs(kind, rank).requires_grad_(True)
        mean, var, count = sb.global_moments(x)
        a, b = stat_weights(kind, rank)
        ((mean * a).sum() + (var * b).sum()).backward()
        out[kind] = {"mean": mean.detach(), "var": var.detach(), "count": float(count),
                     "grad": x.grad}
    return out


def module_part(rank: int, world_size: int) -> dict:
    """11.4 on every kind: FORWARDS training forwards (the last one backward), then eval; and
    the running statistics with momentum None (the cumulative average)."""
    sb = load(LESSON, "sync_bn")
    out = {}
    for kind in SHAPES:
        bn = bn_layer(kind, sb.SyncBatchNormByHand)
        cumulative = bn_layer(kind, sb.SyncBatchNormByHand, momentum=None)
        outputs = []
        for step in range(FORWARDS):
            x = inputs(kind, rank, step).requires_grad_(True)
            y = bn(x)
            outputs.append(y.detach())
            cumulative(x.detach())
        (y * out_weights(kind, rank)).sum().backward()
        bn.eval()
        out[kind] = {"outputs": outputs, "grad": x.grad, "weight_grad": bn.weight.grad,
                     "bias_grad": bn.bias.grad, "running_mean": bn.running_mean.clone(),
                     "running_var": bn.running_var.clone(),
                     "num_batches_tracked": int(bn.num_batches_tracked),
                     "cumulative_mean": cumulative.running_mean.clone(),
                     "cumulative_var": cumulative.running_var.clone(),
                     "eval": bn(inputs(kind, rank, EVAL_STEP)).detach()}
    return out


def convert_part(rank: int, world_size: int, convert: bool) -> dict:
    """The ConvNet under DDP, its batch norms converted (11.5) or left per-rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = conv_model()
    if convert:
        model = load(LESSON, "sync_bn").convert_sync_by_hand(model)
    return train_conv(DDP(model), conv_batches(world_size), rank, world_size)


def sync_bn_checks(rank: int, world_size: int) -> dict:
    res = {"moments": rank_part(moments_part, rank, world_size)}
    put(LESSON, ["11.3"])
    res["module"] = rank_part(module_part, rank, world_size)
    put(LESSON, ["11.4"])
    res["converted"] = rank_part(convert_part, rank, world_size, True)
    res["per_rank"] = convert_part(rank, world_size, False)
    return res
