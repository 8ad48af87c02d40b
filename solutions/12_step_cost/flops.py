"""Lesson 12: the FLOPs of a training step, counted by hand, and how much of the chip it used.

A FLOP here is one floating-point multiply or add; a multiply-add is 2 FLOPs. Almost all of
a network's arithmetic is matrix multiplication: an (m x k) by (k x n) product does m*n dot
products of length k, so ``2 m k n`` FLOPs. Everything else (bias adds, norms, activations,
pooling, an embedding lookup) is a few FLOPs per element, costs memory traffic rather than
arithmetic, and is left out by the convention every FLOP counter here uses, PyTorch's own
``torch.utils.flop_counter.FlopCounterMode`` included (it counts the matmuls and
convolutions, biases not):

- **Linear** ``in -> out`` on ``T`` rows (tokens; batch x sequence for a transformer)::

      forward  2 T in out

- **Conv2d** ``C_in -> C_out``, kernel ``kh x kw``, ``groups`` g, on a batch of ``B`` images
  whose *output* is ``H_out x W_out`` (``H_out = (H + 2 pad - kh) // stride + 1``): every
  output value is a dot product over ``C_in / g`` channels and the kernel::

      forward  2 B C_out H_out W_out (C_in / g) kh kw

- **Attention** (``softmax(Q K^T / sqrt(d)) V``), per head ``q_len x d`` queries against
  ``kv_len`` keys: the scores ``Q K^T`` and the weighted sum ``A V`` are two matmuls of
  ``2 q_len kv_len d`` each. A causal mask does not halve it: the plain (MATH) path
  multiplies the full square and then masks, and that is what FlopCounterMode counts::

      forward  4 B heads q_len kv_len d_head

**Backward.** A layer ``y = x W`` gets ``dL/dy`` and computes up to two matmuls of the
forward's size: ``dL/dW = x^T dL/dy`` (the weight's gradient) and ``dL/dx = dL/dy W^T`` (the
input's, passed on to the layer before). So backward = 2 x forward, except where an input
needs no gradient: the first layer, whose input is the data, computes only ``dL/dW``
(1 x forward). Attention has no weight but four matmuls in backward (dV, dP, dQ, dK): 2 x
forward. A step (forward + backward) of a model whose first layer sees the data is therefore
a little under 3 x forward; a transformer (whose first matmul sees the embeddings, which need
gradients) is exactly 3 x forward.

**The 6N rule.** Each weight of a Linear layer is used once per token in a multiply-add: 2
FLOPs forward, 4 backward. With ``N`` the weights every token is multiplied by, a step on
``D`` tokens costs about ``6 N D`` FLOPs (Kaplan et al. 2020, "Scaling Laws for Neural
Language Models", section 2.1; Chinchilla, Hoffmann et al. 2022, uses it too). Here N counts
the weights of every Linear (the blocks and the output head); the embedding tables are a
lookup (no multiply) and are not in N; biases and norms are left out as FlopCounterMode leaves
them. What 6N misses is attention: ``12 L B t^2 d`` per step, against ``6 N B t`` with
``N ~ 12 L d^2``, a share of about ``t / (6 d)``: small while the width ``d`` is large next to
the sequence ``t`` (Kaplan: ``d > t / 12``), large for long sequences on narrow models.

**MFU.** The model FLOPs utilisation (PaLM, Chowdhery et al. 2022, appendix B) is the FLOP/s
the model needs at the measured speed, over the chip's peak::

      achieved = model FLOPs per step / seconds per step        MFU = achieved / peak

*Model* FLOPs are the step's FLOPs as counted above, whatever the implementation spends:
recomputing activations (activation checkpointing) costs time and hardware FLOPs but adds
nothing to the model FLOPs, so it lowers MFU (counting it gives the "hardware FLOPs
utilisation", HFU, which flatters such a run). The peak is the datasheet's dense figure for
the dtype in use on a known GPU, and on a CPU a matmul probe (``dpt.flops.peak_flops``).

Your tasks:

- 12.1 :func:`linear_flops`, :func:`conv2d_flops`, :func:`attention_flops`: one layer's
  forward FLOPs;
- 12.2 :func:`layer_flops`: one recorded layer's forward and backward FLOPs, which
  :func:`count_flops` (given: it records every layer's shapes with forward hooks) adds up;
- 12.3 :func:`transformer_params`, :func:`transformer_step_flops`, :func:`six_n_flops`: a
  transformer's N and step FLOPs from its configuration, and the 6N estimate;
- 12.4 :func:`utilization`: achieved FLOP/s and MFU of a measured step.

The CLI counts each course model by hand and with FlopCounterMode, then times a few steps
here and prints the achieved FLOP/s and MFU::

    .venv/bin/python solutions/12_step_cost/flops.py
    .venv/bin/python solutions/12_step_cost/flops.py --batch 32 --models transformer
"""

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import statistics
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode


def _pair(value) -> tuple[int, int]:
    """``3`` -> ``(3, 3)``; ``(3, 5)`` stays."""
    if isinstance(value, int):
        return value, value
    h, w = value
    return int(h), int(w)


# --- 12.1 one layer's forward FLOPs --------------------------------------------------------

def linear_flops(tokens: int, in_features: int, out_features: int) -> int:
    """Forward FLOPs of ``nn.Linear(in_features, out_features)`` applied to ``tokens`` rows
    (every leading dimension of the input multiplied together). The bias is not counted (as
    FlopCounterMode counts ``addmm``)."""
    # BEGIN SOLUTION 12.1: each of the tokens x out_features outputs is a dot product of length in_features: one multiply and one add per term
    return 2 * tokens * in_features * out_features
    # END SOLUTION


def conv2d_flops(batch: int, in_channels: int, out_channels: int, kernel_size, in_hw,
                 stride=1, padding=0, groups: int = 1) -> int:
    """Forward FLOPs of ``nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding,
    groups=groups)`` on ``batch`` images of ``in_hw`` = (H, W). ``kernel_size``, ``stride``
    and ``padding`` are an int or an (h, w) pair, as for ``nn.Conv2d``; no dilation. The bias
    is not counted."""
    if in_channels % groups or out_channels % groups:
        raise ValueError(f"groups={groups} must divide in_channels={in_channels} and "
                         f"out_channels={out_channels}")
    (kh, kw), (sh, sw), (ph, pw), (h, w) = (_pair(kernel_size), _pair(stride), _pair(padding),
                                            _pair(in_hw))
    # BEGIN SOLUTION 12.1: the output's height and width first (stride and padding change them); each output value is a dot product over the in_channels of its group and the kernel
    h_out = (h + 2 * ph - kh) // sh + 1
    w_out = (w + 2 * pw - kw) // sw + 1
    return 2 * batch * out_channels * h_out * w_out * (in_channels // groups) * kh * kw
    # END SOLUTION


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int) -> int:
    """Forward FLOPs of scaled-dot-product attention: the scores Q K^T and the weighted sum
    A V, for ``heads`` heads of ``head_dim``, ``q_len`` queries against ``kv_len`` keys. The
    full q_len x kv_len square, causal or not (the MATH path computes all of it); the softmax
    and the scaling are not counted."""
    # BEGIN SOLUTION 12.1: two matmuls per head, each (q_len x head_dim) by (head_dim x kv_len) or (q_len x kv_len) by (kv_len x head_dim)
    return 2 * (2 * batch * heads * q_len * kv_len * head_dim)
    # END SOLUTION


# --- 12.2 a model's forward and backward FLOPs ---------------------------------------------

class Layer(NamedTuple):
    """One layer call recorded during a forward pass (:func:`record_layers`).

    ``kind``: ``"linear"``, ``"conv2d"``, ``"attention"`` (a call of
    ``F.scaled_dot_product_attention``; ``module`` is then None) or the class name of any other
    leaf module (``"layernorm"``, ``"relu"``, ``"embedding"``, ...). ``in_shapes``: the shapes
    of its tensor inputs (``(x,)`` for a module, ``(q, k, v)`` for attention, each
    (batch, heads, length, head_dim)); ``out_shape``: its output's. ``input_needs_grad``:
    whether backward must compute a gradient for its input (any of q, k, v for attention);
    ``weight_needs_grad``: whether its weight gets one (False when it has none).
    """

    name: str
    kind: str
    module: nn.Module | None
    in_shapes: tuple[tuple[int, ...], ...]
    out_shape: tuple[int, ...]
    input_needs_grad: bool
    weight_needs_grad: bool


class _RecordAttention(TorchFunctionMode):
    """Records every ``F.scaled_dot_product_attention`` call (a function, not a module: no
    module hook sees it)."""

    def __init__(self, layers: list[Layer]):
        super().__init__()
        self.layers = layers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            self.layers.append(Layer(f"attention.{sum(x.kind == 'attention' for x in self.layers)}",
                                     "attention", None, (tuple(q.shape), tuple(k.shape),
                                                         tuple(v.shape)), tuple(out.shape),
                                     any(t.requires_grad for t in (q, k, v)), False))
        return out


def record_layers(model: nn.Module, example_input: torch.Tensor) -> list[Layer]:
    """Run ``model(example_input)`` once and return every leaf module's call and every
    attention call, in the order they ran, with their shapes (:class:`Layer`).

    Forward hooks on the leaf modules (those without children) see each call's input and
    output; a torch-function mode sees the attention calls. Gradient tracking stays on, so
    ``input_needs_grad`` is what a training step would see.
    """
    layers: list[Layer] = []

    def hook(name):
        def record(module, inputs, output):
            x = inputs[0] if inputs and torch.is_tensor(inputs[0]) else None
            weight = getattr(module, "weight", None)
            kind = ("linear" if isinstance(module, nn.Linear) else
                    "conv2d" if isinstance(module, nn.Conv2d) else type(module).__name__.lower())
            layers.append(Layer(name, kind, module,
                                () if x is None else (tuple(x.shape),),
                                tuple(output.shape) if torch.is_tensor(output) else (),
                                bool(x is not None and x.requires_grad),
                                isinstance(weight, torch.Tensor) and weight.requires_grad))
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()
               if not any(True for _ in m.children())]
    try:
        with _RecordAttention(layers):
            model(example_input)
    finally:
        for h in handles:
            h.remove()
    return layers


def layer_flops(layer: Layer) -> tuple[int, int]:
    """``(forward, backward)`` FLOPs of one recorded layer, counted as FlopCounterMode counts.

    Linear and Conv2d: the forward by 12.1's formulas from the module's settings and the
    recorded shapes; backward one forward's worth for the weight's gradient (if
    ``weight_needs_grad``) plus one for the input's (if ``input_needs_grad``). Attention:
    backward 2 x forward when any of q, k, v needs a gradient (in every model here they all
    do), else 0. Any other layer (norms, activations, pooling, embeddings, dropout): (0, 0).
    """
    # BEGIN SOLUTION 12.2: linear: tokens = the product of every input dimension but the last; conv2d: the module's channels, kernel, stride, padding and groups with the input's (H, W); attention: q is (batch, heads, q_len, head_dim), k gives kv_len; then a backward matmul per input or weight that needs a gradient
    m = layer.module
    if layer.kind == "linear":
        *lead, _ = layer.in_shapes[0]
        tokens = 1
        for n in lead:
            tokens *= n
        fwd = linear_flops(tokens, m.in_features, m.out_features)
    elif layer.kind == "conv2d":
        b, _, h, w = layer.in_shapes[0]
        fwd = conv2d_flops(b, m.in_channels, m.out_channels, m.kernel_size, (h, w), m.stride,
                           m.padding, m.groups)
    elif layer.kind == "attention":
        (b, heads, q_len, head_dim), (_, _, kv_len, _), _ = layer.in_shapes
        fwd = attention_flops(b, heads, q_len, kv_len, head_dim)
        return fwd, 2 * fwd if layer.input_needs_grad else 0
    else:
        return 0, 0
    return fwd, fwd * (int(layer.weight_needs_grad) + int(layer.input_needs_grad))
    # END SOLUTION


class Count(NamedTuple):
    """A model's FLOPs for one batch: totals and the layers that have any."""

    forward: int
    backward: int
    layers: list[tuple[str, str, int, int]]  # (name, kind, forward, backward)

    @property
    def step(self) -> int:
        return self.forward + self.backward


def count_flops(model: nn.Module, example_input: torch.Tensor) -> Count:
    """Forward and backward FLOPs of a training step of ``model`` on ``example_input``,
    counted by hand: :func:`layer_flops` of every recorded layer, added up."""
    rows = []
    for layer in record_layers(model, example_input):
        fwd, bwd = layer_flops(layer)
        if fwd or bwd:
            rows.append((layer.name, layer.kind, fwd, bwd))
    return Count(sum(r[2] for r in rows), sum(r[3] for r in rows), rows)


# --- 12.3 a transformer's step from its configuration, and 6N -----------------------------

def transformer_params(layers: int, dim: int, vocab: int, mlp_ratio: int = 4) -> int:
    """N of ``dpt.models.TinyTransformer``: the weights of its Linear layers, those every token
    is multiplied by (per block: qkv, proj, fc1, fc2; then the output head). Not the embedding
    tables (a lookup), not the biases nor the norms."""
    # BEGIN SOLUTION 12.3: per block qkv is dim x 3 dim, proj dim x dim, fc1 and fc2 dim x mlp_ratio dim each; the head is dim x vocab
    per_block = 3 * dim * dim + dim * dim + 2 * mlp_ratio * dim * dim
    return layers * per_block + dim * vocab
    # END SOLUTION


def transformer_step_flops(batch: int, seq_len: int, layers: int, dim: int, vocab: int,
                           mlp_ratio: int = 4) -> int:
    """FLOPs of one training step (forward + backward) of ``dpt.models.TinyTransformer`` on
    ``batch`` sequences of ``seq_len`` tokens, exactly as FlopCounterMode counts them (MATH
    attention). The number of heads does not matter (heads x head_dim = dim)."""
    # BEGIN SOLUTION 12.3: forward = every Linear's 2 x tokens x its weights, plus attention over the full seq_len square in every block; every layer's input needs a gradient (the embeddings do), so backward is twice the forward
    tokens = batch * seq_len
    forward = (2 * tokens * transformer_params(layers, dim, vocab, mlp_ratio)
               + layers * attention_flops(batch, 1, seq_len, seq_len, dim))
    return 3 * forward
    # END SOLUTION


def six_n_flops(n_params: int, tokens: int) -> int:
    """Kaplan et al.'s estimate of a training step's FLOPs: 6 N per token."""
    # BEGIN SOLUTION 12.3: 2 FLOPs per weight per token forward, 4 backward
    return 6 * n_params * tokens
    # END SOLUTION


# --- 12.4 achieved FLOP/s and MFU ---------------------------------------------------------

def utilization(model: nn.Module, example_input: torch.Tensor, step_seconds: float,
                peak_flops: float) -> dict:
    """How much of the chip a training step of ``model`` on ``example_input`` used, when one
    step took ``step_seconds`` on a device whose peak is ``peak_flops`` FLOP/s.

    Returns ``{"flops": model FLOPs of one step (forward + backward, :func:`count_flops`),
    "achieved": FLOP/s, "mfu": a fraction of the peak (0.4, not 40)}``. Model FLOPs: what the
    model needs, not what the implementation ran (a recomputed forward is not counted).
    """
    if not step_seconds > 0 or not peak_flops > 0:
        raise ValueError(f"step_seconds and peak_flops must be positive, got {step_seconds} "
                         f"and {peak_flops}")
    # BEGIN SOLUTION 12.4: the step's model FLOPs come from your own count (12.2); FLOP/s is per second of step; MFU compares it with the peak
    flops = count_flops(model, example_input).step
    achieved = flops / step_seconds
    return {"flops": flops, "achieved": achieved, "mfu": achieved / peak_flops}
    # END SOLUTION


# --- given: a timed step, the course's models, the command line --------------------------

def time_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn, steps: int,
              device: torch.device) -> float:
    """Median seconds of a training step (SGD), after one warm-up step."""
    from dpt.device import synchronize

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for i in range(steps + 1):
        synchronize(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        synchronize(device)
        if i:  # the first step warms up (allocations, kernel choice)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def course_model(name: str, batch: int, device: torch.device):
    """``(model, x, y, loss_fn, config)`` of a course model (config: the transformer's)."""
    from dpt.models import MLP, ConvNet, TinyTransformer, token_batch

    g = torch.Generator().manual_seed(0)
    if name == "transformer":
        config = {"vocab": 256, "dim": 64, "layers": 4, "seq_len": 64, "mlp_ratio": 4}
        model = TinyTransformer(heads=4, **config)
        x, y = token_batch(batch, config["seq_len"], config["vocab"])
        return model.to(device), x.to(device), y.to(device), _token_loss, config
    model = {"mlp": MLP, "convnet": ConvNet}[name]()
    x = torch.randn(batch, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return model.to(device), x.to(device), y.to(device), F.cross_entropy, None


MODEL_NAMES = ("mlp", "convnet", "transformer")


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="samples (sequences) per step")
    ap.add_argument("--models", nargs="+", default=list(MODEL_NAMES), choices=MODEL_NAMES)
    ap.add_argument("--device", default="auto",
                    help="where to time the steps: auto (cuda, then mps, then cpu), cpu, cuda, mps")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per model")
    ap.add_argument("--no-timing", dest="timing", action="store_false",
                    help="count only, do not time")
    args = ap.parse_args(argv)
    from dpt.device import DeviceError, pick_device
    from dpt.errors import report_error
    from dpt.flops import count_step, peak_flops

    try:
        if args.batch < 1 or args.steps < 1:
            raise ValueError(f"--batch and --steps must be at least 1, got {args.batch} and "
                             f"{args.steps}")
        device = pick_device(args.device)
        runs = []
        for name in args.models:
            model, x, y, loss_fn, config = course_model(name, args.batch, "cpu")
            run = {"name": name, "model": model, "x": x, "y": y, "loss_fn": loss_fn,
                   "hand": count_flops(model, x), "torch": count_step(model, x)}
            if config is not None:  # the transformer: its step from the config, and 6N
                n = transformer_params(config["layers"], config["dim"], config["vocab"],
                                       config["mlp_ratio"])
                run.update(n=n, exact=transformer_step_flops(args.batch, **config),
                           six_n=six_n_flops(n, x.numel()))
            runs.append(run)
    except (ValueError, DeviceError, NotImplementedError) as exc:
        return report_error(exc)
    print(f"FLOPs of one training step at batch {args.batch}: by hand (this file) and by "
          "torch.utils.flop_counter.FlopCounterMode")
    print(f"{'model':<12}{'fwd hand':>10}{'fwd torch':>11}{'bwd hand':>10}{'bwd torch':>11}"
          f"{'hand/torch':>12}{'bwd/fwd':>9}")
    for r in runs:
        hand, fwd, bwd = r["hand"], r["torch"]["forward"], r["torch"]["backward"]
        print(f"{r['name']:<12}{_si(hand.forward):>10}{_si(fwd):>11}{_si(hand.backward):>10}"
              f"{_si(bwd):>11}{hand.step / (fwd + bwd):>12.4f}{bwd / fwd:>9.3f}")
    for r in runs:
        if "n" in r:
            total = r["torch"]["forward"] + r["torch"]["backward"]
            print(f"{r['name']}: N = {r['n']:,} Linear weights; from the config "
                  f"{_si(r['exact'])} FLOPs a step, 6 N tokens = {_si(r['six_n'])} "
                  f"({(r['six_n'] - total) / total:+.1%} against FlopCounterMode: attention "
                  "is what 6N leaves out)")
    if not args.timing:
        return 0
    peak, label = peak_flops(device, torch.float32)
    print(f"\ntimed on {device} ({args.steps} steps, median), fp32 peak {_si(peak)}FLOP/s: "
          f"{label}")
    print(f"{'model':<12}{'step ms':>9}{'FLOP/s':>9}{'MFU':>8}")
    for r in runs:
        model, x, y = r["model"].to(device), r["x"].to(device), r["y"].to(device)
        seconds = time_step(model, x, y, r["loss_fn"], args.steps, device)
        try:
            u = utilization(model, x, seconds, peak)
        except NotImplementedError as exc:
            return report_error(exc)
        print(f"{r['name']:<12}{seconds * 1e3:>9.2f}{_si(u['achieved']):>9}{u['mfu']:>8.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
