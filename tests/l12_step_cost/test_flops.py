"""Lesson 12, tasks 12.1-12.4: FLOPs counted by hand against torch's own counter, and MFU.

The oracle is ``torch.utils.flop_counter.FlopCounterMode`` (through ``dpt.flops.count_step``,
attention on the MATH path, which the counter sees), run here on the same layer or model. The
layer formulas (12.1) must give its count exactly; a model's forward and backward (12.2) and a
transformer's step from its configuration (12.3) within 2%, at shapes where each usual mistake
(the 2 of a multiply-add, a conv's input size for its output's, attention linear in the
sequence, the first layer's input gradient, embeddings in N) is off by more than that. Every
test of a task puts the solution's code in place of the other tasks it uses
(``tests/references.py``). When a count is wrong, the message names the mistake it matches.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from dpt.flops import count_step
from dpt.models import MLP, ConvNet, TinyTransformer, token_batch
from tests.lessons import load
from tests.references import put, reference

LESSON = "12_step_cost"
REL = 0.02  # the tolerance for a count by hand against FlopCounterMode


@pytest.fixture
def fl():
    return load(LESSON, "flops")


def forward_count(fn, *args) -> int:
    """FlopCounterMode's count of ``fn(*args)`` (no gradients), attention on the MATH path."""
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        fn(*args)
    return counter.get_total_flops()


def near(got: int, want: int) -> bool:
    return abs(got - want) <= REL * want


# --- 12.1 one layer -------------------------------------------------------------------------

@pytest.mark.task("12.1")
def test_linear_flops(fl):
    torch.manual_seed(0)
    layer = nn.Linear(48, 20)
    x = torch.randn(3, 5, 48)  # 15 tokens: every leading dimension counts
    want = forward_count(layer, x)
    got = fl.linear_flops(15, 48, 20)
    if got * 2 == want:
        pytest.fail(f"linear_flops(15, 48, 20) = {got}, FlopCounterMode counts {want}: a "
                    "multiply-add is 2 FLOPs (forgot the 2)", pytrace=False)
    if got == want + 15 * 20:
        pytest.fail(f"linear_flops(15, 48, 20) = {got}, FlopCounterMode counts {want}: the bias "
                    "add (tokens x out) is not counted", pytrace=False)
    assert got == want, (f"linear_flops(15, 48, 20) = {got}, FlopCounterMode counts {want} "
                         "(2 x tokens x in x out)")
    plain = forward_count(nn.Linear(7, 3, bias=False), torch.randn(1, 7))
    assert fl.linear_flops(1, 7, 3) == plain, (
        f"linear_flops(1, 7, 3) = {fl.linear_flops(1, 7, 3)}, FlopCounterMode counts {plain} "
        "for a Linear without bias")


CONVS = {  # id: (batch, in, out, kernel, (H, W), stride, padding, groups)
    "5x5-same": (2, 3, 8, 5, (12, 12), 1, 2, 1),
    "3x3-stride2": (2, 4, 6, 3, (15, 11), 2, 1, 1),
    "grouped-rect": (3, 8, 12, (3, 1), (9, 10), (1, 2), (1, 0), 4),
}


@pytest.mark.task("12.1")
@pytest.mark.parametrize("case", list(CONVS))
def test_conv2d_flops(fl, case):
    b, cin, cout, k, (h, w), s, p, g = CONVS[case]
    layer = nn.Conv2d(cin, cout, k, stride=s, padding=p, groups=g)
    x = torch.randn(b, cin, h, w)
    want = forward_count(layer, x)
    got = fl.conv2d_flops(b, cin, cout, k, (h, w), stride=s, padding=p, groups=g)
    kh, kw = layer.kernel_size
    if got != want:
        h_out, w_out = layer(x).shape[-2:]
        per_out = 2 * b * cout * cin // g * kh * kw
        why = {want // 2: "a multiply-add is 2 FLOPs (forgot the 2)",
               per_out * h * w: f"used the input's {h}x{w} where the output's {h_out}x{w_out} "
                                "counts: (H + 2 padding - kernel) // stride + 1",
               want * g: f"each output channel sees in_channels / groups = {cin // g} input "
                         f"channels, not all {cin}"}.get(got, "")
        pytest.fail(f"conv2d_flops{CONVS[case]} = {got}, FlopCounterMode counts {want} "
                    f"(2 x batch x C_out x H_out x W_out x C_in/groups x kh x kw) {why}",
                    pytrace=False)


@pytest.mark.task("12.1")
def test_attention_flops(fl):
    torch.manual_seed(0)
    b, heads, tq, tk, d = 2, 3, 10, 14, 8
    q, k, v = torch.randn(b, heads, tq, d), torch.randn(b, heads, tk, d), torch.randn(b, heads, tk, d)
    want = forward_count(F.scaled_dot_product_attention, q, k, v)
    got = fl.attention_flops(b, heads, tq, tk, d)
    if got in (want // tk, want // tq):
        pytest.fail(f"attention_flops{(b, heads, tq, tk, d)} = {got}, FlopCounterMode counts "
                    f"{want}: every query meets every key, q_len x kv_len scores (t^2, not t)",
                    pytrace=False)
    assert got != want // 2, (f"attention_flops = {got}, FlopCounterMode counts {want}: two "
                              "matmuls, Q K^T and A V, 2 q_len kv_len head_dim each")
    assert got == want, (f"attention_flops{(b, heads, tq, tk, d)} = {got}, FlopCounterMode "
                         f"counts {want} (Q K^T and A V: 2 x 2 x batch x heads x q_len x kv_len "
                         "x head_dim)")
    t = 12
    qc = torch.randn(b, heads, t, d)
    causal = forward_count(lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True), qc)
    assert fl.attention_flops(b, heads, t, t, d) == causal, (
        f"causal attention over {t} tokens: FlopCounterMode counts {causal}, the full t x t "
        "square (the MATH path masks after multiplying); attention_flops gives "
        f"{fl.attention_flops(b, heads, t, t, d)}")


def test_conv2d_flops_rejects_bad_groups(fl):
    with pytest.raises(ValueError, match="groups=3 must divide"):
        fl.conv2d_flops(1, 4, 6, 3, (8, 8), groups=3)


# --- 12.2 a model's forward and backward ------------------------------------------------------

class StridedNet(nn.Module):
    """Strided convolutions: output sizes differ from the inputs'. (Not grouped: torch 2.14's
    FlopCounterMode counts a grouped conv's weight gradient `groups` times over, pytorch#183405.)"""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, stride=2, padding=0)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        return self.fc(F.relu(self.c2(F.relu(self.c1(x)))).flatten(1))


def models():
    """(id, model, input): the course's models and two more shapes."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    return {
        "mlp": (MLP(), torch.randn(8, 1, 28, 28, generator=g)),
        "convnet": (ConvNet(), torch.randn(4, 1, 28, 28, generator=g)),
        "transformer": (TinyTransformer(), token_batch(2)[0]),
        "transformer-wide-short": (TinyTransformer(vocab=50, dim=96, heads=3, layers=2,
                                                   seq_len=24, mlp_ratio=2),
                                   token_batch(3, 24, 50)[0]),
        "strided-conv": (StridedNet(), torch.randn(2, 3, 32, 32, generator=g)),
    }


def first_layer_forward(fl, model, x) -> int:
    """Forward FLOPs of the layers whose input is the data (no gradient), by the reference."""
    layer_flops = reference(LESSON, "12.2")
    return sum(layer_flops(layer)[0] for layer in fl.record_layers(model, x)
               if layer.kind in ("linear", "conv2d") and not layer.input_needs_grad)


@pytest.mark.task("12.2")
@pytest.mark.parametrize("name", ["mlp", "convnet", "transformer", "transformer-wide-short",
                                  "strided-conv"])
def test_count_flops_matches_flop_counter(fl, monkeypatch, name):
    put(LESSON, ["12.1"], monkeypatch.setattr)
    model, x = models()[name]
    want = count_step(model, x)
    got = fl.count_flops(model, x)
    kinds = sorted({k for _, k, _, _ in got.layers})
    if not near(got.forward, want["forward"]):
        pytest.fail(f"{name}: forward by hand {got.forward:,}, FlopCounterMode {want['forward']:,}"
                    f" (layers counted: {', '.join(kinds) or 'none'}): each Linear, Conv2d and "
                    "attention call counts by 12.1's formula from its recorded shapes, every "
                    "other layer 0", pytrace=False)
    if not near(got.backward, want["backward"]):
        extra = got.backward - want["backward"]
        first = first_layer_forward(fl, model, x)
        why = ("the first layer's input is the data and needs no gradient: its backward is "
               "the weight's gradient only, 1x forward, not 2x"
               if first and abs(extra - first) <= REL * want["backward"] else
               "backward is one forward's worth per gradient computed: the weight's, and the "
               "input's when input_needs_grad (attention: 2x forward)")
        pytest.fail(f"{name}: backward by hand {got.backward:,}, FlopCounterMode "
                    f"{want['backward']:,}: {why}", pytrace=False)


# --- 12.3 a transformer from its configuration, and 6N ---------------------------------------

CONFIGS = {  # long sequences on a narrow model, and the other way round
    "narrow-long": {"vocab": 64, "dim": 32, "heads": 2, "layers": 2, "seq_len": 96,
                    "mlp_ratio": 4},
    "wide-short": {"vocab": 64, "dim": 128, "heads": 4, "layers": 2, "seq_len": 8,
                   "mlp_ratio": 2},
}
BATCH = 2


def config_args(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "heads"}


def linear_weights(model: nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.task("12.3")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformer_params_are_the_linear_weights(fl, monkeypatch, name):
    put(LESSON, ["12.1"], monkeypatch.setattr)
    c = CONFIGS[name]
    model = TinyTransformer(**c)
    want = linear_weights(model)
    got = fl.transformer_params(c["layers"], c["dim"], c["vocab"], c["mlp_ratio"])
    if got - want in (c["vocab"] * c["dim"], (c["vocab"] + c["seq_len"]) * c["dim"]):
        pytest.fail(f"{name}: N = {got:,}, the Linear weights are {want:,}: N counts the "
                    "embedding tables, which are a lookup (no multiply, no FLOPs); N is the "
                    "non-embedding weights", pytrace=False)
    biases = sum(m.bias.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert got != want + biases, (f"{name}: N = {got:,} counts the biases; N is the Linear "
                                  f"weights ({want:,})")
    assert got == want, (f"{name}: N = {got:,}, the model's Linear weights are {want:,} "
                         "(per block qkv, proj, fc1, fc2; then the head)")


@pytest.mark.task("12.3")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformer_step_flops_from_config(fl, monkeypatch, name):
    put(LESSON, ["12.1"], monkeypatch.setattr)
    c = CONFIGS[name]
    torch.manual_seed(0)
    model = TinyTransformer(**c)
    counts = count_step(model, token_batch(BATCH, c["seq_len"], c["vocab"])[0])
    want = counts["forward"] + counts["backward"]
    got = fl.transformer_step_flops(BATCH, **config_args(c))
    if near(got * 3, want * 2) or near(got * 3, want):
        pytest.fail(f"{name}: step {got:,} FLOPs from the config, FlopCounterMode {want:,}: a "
                    "step is forward + backward, and backward is 2x forward here (3x in all)",
                    pytrace=False)
    assert near(got, want), (
        f"{name}: step {got:,} FLOPs from the config, FlopCounterMode counts {want:,} "
        f"({got / want - 1:+.1%}): 3 x (2 x tokens x N + layers x attention over the full "
        "seq_len square)")


def counter_with_attention(model, x) -> tuple[int, int]:
    """FlopCounterMode's step FLOPs, and the part of them in attention (its ``bmm``s: the
    transformer's Linear layers run as ``addmm``/``mm``)."""
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        model(x).sum().backward()
    per_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return counter.get_total_flops(), per_op.get("aten.bmm", 0)


@pytest.mark.task("12.3")
def test_six_n_holds_when_the_width_is_large_next_to_the_sequence(fl, monkeypatch):
    put(LESSON, ["12.1"], monkeypatch.setattr)
    assert fl.six_n_flops(1000, 7) == 42_000, "6 N tokens: 6 FLOPs per weight per token"
    errors = {}
    for name, c in CONFIGS.items():
        torch.manual_seed(0)
        model = TinyTransformer(**c)
        total, attention = counter_with_attention(
            model, token_batch(BATCH, c["seq_len"], c["vocab"])[0])
        n = fl.transformer_params(c["layers"], c["dim"], c["vocab"], c["mlp_ratio"])
        six_n = fl.six_n_flops(n, BATCH * c["seq_len"])
        assert near(six_n, total - attention), (
            f"{name}: 6 N tokens = {six_n:,}; FlopCounterMode counts {total - attention:,} "
            f"outside attention ({total:,} in all): 6N with N the Linear weights is exactly the "
            "matmuls of the weights")
        errors[name] = (total - six_n) / total
    narrow, wide = errors["narrow-long"], errors["wide-short"]
    assert wide < REL < narrow, (
        f"6N misses {narrow:.1%} of the step at dim 32, seq 96 and {wide:.1%} at dim 128, seq "
        "8: attention's share grows as seq / (6 dim)")


# --- 12.4 achieved FLOP/s and MFU --------------------------------------------------------------

@pytest.mark.task("12.4")
def test_utilization_numbers(fl, monkeypatch):
    put(LESSON, ["12.1", "12.2"], monkeypatch.setattr)
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 1, 28, 28)
    counts = count_step(model, x)
    flops = counts["forward"] + counts["backward"]
    seconds, peak = 0.004, 2e9
    u = fl.utilization(model, x, seconds, peak)
    assert set(u) >= {"flops", "achieved", "mfu"}, f"utilization returned keys {sorted(u)}"
    assert u["flops"] != counts["forward"], (
        f"flops {u['flops']:,} is the forward only: a step is forward + backward ({flops:,})")
    assert u["flops"] == pytest.approx(flops, rel=REL), (
        f"flops {u['flops']:,}, FlopCounterMode counts {flops:,} for the step")
    achieved = u["flops"] / seconds
    assert u["achieved"] == pytest.approx(achieved, rel=1e-9), (
        f"achieved {u['achieved']:.4g} FLOP/s, expected {achieved:.4g}: the step's FLOPs over "
        "its seconds")
    mfu = achieved / peak
    if u["mfu"] == pytest.approx(1 / mfu, rel=1e-6):
        pytest.fail(f"MFU {u['mfu']:.4g} is peak / achieved: MFU inverted, it is achieved / peak "
                    f"({mfu:.4g})", pytrace=False)
    assert u["mfu"] != pytest.approx(100 * mfu, rel=1e-6), (
        f"MFU {u['mfu']:.4g} is a percentage: return the fraction {mfu:.4g}")
    assert u["mfu"] == pytest.approx(mfu, rel=1e-9), (
        f"MFU {u['mfu']:.4g}, expected achieved / peak = {mfu:.4g}")


class CheckpointedTransformer(TinyTransformer):
    """A TinyTransformer whose blocks recompute their forward in backward (activation
    checkpointing): more work for the chip, the same model FLOPs."""

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.norm(x))


@pytest.mark.task("12.4")
def test_utilization_counts_model_flops_not_recomputation(fl, monkeypatch):
    put(LESSON, ["12.1", "12.2"], monkeypatch.setattr)
    torch.manual_seed(0)
    config = {"dim": 32, "heads": 2, "layers": 2, "seq_len": 16}
    ckpt, plain = CheckpointedTransformer(**config), TinyTransformer(**config)
    plain.load_state_dict(ckpt.state_dict())
    x = token_batch(2, 16)[0]
    model_flops = count_step(plain, x)
    model_flops = model_flops["forward"] + model_flops["backward"]
    hardware = count_step(ckpt, x)
    hardware = hardware["forward"] + hardware["backward"]
    assert hardware > model_flops * (1 + 2 * REL)  # the premise: recomputation shows
    u = fl.utilization(ckpt, x, 0.01, 1e12)
    assert not near(u["flops"], hardware), (
        f"flops {u['flops']:,} counts the forward that checkpointing recomputes in backward "
        f"(hardware FLOPs, HFU): MFU uses model FLOPs, {model_flops:,} here")
    assert near(u["flops"], model_flops), (
        f"flops {u['flops']:,}, the model's step is {model_flops:,} FLOPs")


def test_utilization_rejects_bad_input(fl):
    with pytest.raises(ValueError, match="must be positive"):
        fl.utilization(MLP(), torch.randn(1, 784), 0.0, 1e9)


# --- the command line ---------------------------------------------------------------------------

TASKS = ["12.1", "12.2", "12.3", "12.4"]


def test_cli_counts_by_hand_and_with_torch(fl, capsys, monkeypatch):
    put(LESSON, TASKS, monkeypatch.setattr)  # the given code, the tasks' references
    assert fl.main(["--batch", "2", "--models", "mlp", "transformer", "--no-timing"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:4]}
    assert set(rows) == {"mlp", "transformer"}, out
    assert rows["mlp"][5] == rows["transformer"][5] == "1.0000", out  # hand / torch
    assert "6 N tokens" in out and "attention is what 6N leaves out" in out, out


def test_cli_times_a_step(fl, capsys, monkeypatch):
    import dpt.flops

    put(LESSON, TASKS, monkeypatch.setattr)
    monkeypatch.setattr(dpt.flops, "peak_flops", lambda device, dtype: (1e12, "a test's peak"))
    assert fl.main(["--batch", "2", "--models", "mlp", "--steps", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "a test's peak" in out and "MFU" in out, out
    assert out.strip().splitlines()[-1].split()[0] == "mlp", out


@pytest.mark.parametrize("argv, message", [(["--batch", "0"], "--batch and --steps must be at "
                                            "least 1"),
                                           (["--steps", "0"], "--batch and --steps must be at "
                                            "least 1"),
                                           (["--device", "tpu"], "unknown device 'tpu'")])
def test_cli_bad_input_is_one_line(fl, capsys, argv, message):
    assert fl.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
