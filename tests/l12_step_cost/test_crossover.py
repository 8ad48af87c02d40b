"""Lesson 12: the crossover, when each collective of a step runs and its seconds (12.9),
compute against exposed communication and the batch that hides it (12.10).

Pure arithmetic, one process: links and models made up so that every figure is solved by hand
here (a 1e9-parameter model, a 100 GB/s link without latency, a 1e15 FLOP/s device at 50%),
plus sanity laws that hold for any answer (more bandwidth never exposes more; the hiding batch
hides, one token fewer does not). The bytes are 12.8's (``memory_calc.bytes_per_step``): 12.9's
tests put its reference in place, and check with marked byte counts that ``collectives`` takes
them from there; 12.10's tests put the references 12.8 and 12.9 in place, so each task is
graded alone. Each failure names the mistake it found.
"""

from __future__ import annotations

import math

import pytest

from dpt.interconnects import PRESETS, Interconnect
from tests.lessons import load
from tests.references import put

LESSON = "12_step_cost"
P = 1e9  # parameters
FAST = Interconnect("test link 100 GB/s", 100.0, "GB/s", 0.0)  # 1e11 B/s, no latency


@pytest.fixture
def co(monkeypatch):
    """The lesson module with the reference 12.8 (``bytes_per_step``; its 12.9 is the tree's
    own)."""
    put(LESSON, ["12.8"], monkeypatch.setattr)
    return load(LESSON, "crossover")


@pytest.fixture
def co8(co, monkeypatch):
    """The lesson module with the references 12.8 and 12.9 (its 12.10 is the tree's own)."""
    put(LESSON, ["12.9"], monkeypatch.setattr)
    return co


def setup(co, n=2, link=FAST, calls=1, **kw):
    return co.Setup(params=P, n=n, link=link, peak_flops=1e15, mfu=0.5, bytes_per_elem=2,
                    calls=calls, **kw)


# --- 12.9 ----------------------------------------------------------------------------------

@pytest.mark.task("12.9")
def test_link_bandwidth_from_its_unit(co):
    got = co.link_bytes_per_s(Interconnect("a network", 80.0, "Gb/s", 0.0))
    if got == pytest.approx(80e9):
        pytest.fail("80 Gb/s read as 80e9 bytes/s: a network's rate is in bits per second, "
                    "8 bits to the byte (10e9 bytes/s)", pytrace=False)
    assert got == pytest.approx(10e9), f"80 Gb/s gave {got:.4g} bytes/s, expected 1e10"
    got = co.link_bytes_per_s(Interconnect("a GPU link", 450.0, "GB/s", 0.0))
    assert got == pytest.approx(450e9), (
        f"450 GB/s gave {got:.4g} bytes/s, expected 4.5e11: GB/s is already bytes")


# Byte counts no ring formula gives for P = 1e9 on 4 ranks: a collective that shows them took
# its bytes from bytes_per_step. ZeRO-3's all_gather is its two gathers together.
MARKED = {"ddp": {"all_reduce": 1_234_567},
          "zero1": {"reduce_scatter": 555_001, "all_gather": 333_007},
          "zero2": {"reduce_scatter": 555_003, "all_gather": 333_009},
          "zero3": {"reduce_scatter": 555_011, "all_gather": 2 * 444_013}}
WHEN = {"ddp": [("all_reduce", "backward")],
        "zero1": [("reduce_scatter", "backward"), ("all_gather", "after_step")],
        "zero2": [("reduce_scatter", "backward"), ("all_gather", "after_step")],
        "fsdp": [("all_gather", "forward"), ("all_gather", "backward"),
                 ("reduce_scatter", "backward")]}
WHY_WHEN = {"ddp": "DDP's all-reduce runs during backward, as gradients appear",
            "zero1": "ZeRO-1/2: reduce-scatter of the gradients in backward, all-gather of the "
                     "updated parameters after the optimizer step",
            "fsdp": "FSDP: all-gather in forward, then (the parameters were freed) all-gather "
                    "and reduce-scatter in backward"}
WHY_WHEN["zero2"] = WHY_WHEN["zero1"]


@pytest.mark.task("12.9")
def test_collectives_take_their_bytes_from_bytes_per_step(co, monkeypatch):
    mc = load(LESSON, "memory_calc")
    calls = []

    def marked(num_params, world_size, strategy, param_dtype="fp32", grad_dtype=None):
        calls.append((num_params, world_size, strategy, param_dtype, grad_dtype))
        sent = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, **MARKED[strategy]}
        total = sum(sent.values())
        return {**sent, "sent": total, "received": total}

    monkeypatch.setattr(mc, "bytes_per_step", marked)
    s = setup(co, n=4)
    for strategy, zero_name in (("ddp", "ddp"), ("zero1", "zero1"), ("zero2", "zero2"),
                                ("fsdp", "zero3"), ("zero3", "zero3")):
        calls.clear()
        colls = co.collectives(strategy, s)
        name = "fsdp" if strategy == "zero3" else strategy
        got = [(c.op, c.when) for c in colls]
        assert got == WHEN[name], (
            f"{strategy}'s collectives are {got}, expected {WHEN[name]}: {WHY_WHEN[name]}")
        if not calls:
            ring = 2 * 3 / 4 * P * 2
            pytest.fail(f"{strategy}: collectives never asked 12.8's bytes_per_step (through "
                        f"ring_bytes) and sent {sum(c.sent_bytes for c in colls):.4g} bytes of "
                        f"its own count (DDP's ring: {ring:.4g}): the bytes of a step are "
                        "written once, in memory_calc.bytes_per_step", pytrace=False)
        assert calls[0][:3] == (int(P), 4, zero_name), (
            f"{strategy}: bytes_per_step was asked {calls[0][:3]}, expected (1000000000, 4, "
            f"{zero_name!r})")
        want = dict(MARKED[zero_name])
        if name == "fsdp":
            gathers = [c.sent_bytes for c in colls if c.op == "all_gather"]
            if gathers == [want["all_gather"]] * 2:
                pytest.fail(f"{strategy}: each of the two all-gathers sent bytes_per_step's whole "
                            f"all_gather ({want['all_gather']} bytes): that count is both "
                            "gathers together, forward and backward: half each",
                            pytrace=False)
        for c in colls:
            share = want[c.op] / [op for op, _ in WHEN[name]].count(c.op)
            assert c.sent_bytes == pytest.approx(share, rel=1e-12), (
                f"{strategy}: its {c.op} in {c.when} sends {c.sent_bytes:.10g} bytes, but "
                f"bytes_per_step gave {want[c.op]} for its {c.op}"
                + (" (two gathers: half each)" if name == "fsdp" and c.op == "all_gather"
                   else "") + ": take the bytes from 12.8's answer (ring_bytes)")


@pytest.mark.task("12.9")
def test_bytes_one_rank_sends_per_strategy(co):
    """With 12.8's reference bytes: the ZeRO paper's totals, N = 4, P = 1e9 bf16."""
    s = setup(co, n=4)
    buffer = P * 2
    want = {"ddp": 2 * 3 / 4 * buffer, "zero1": 2 * 3 / 4 * buffer, "zero2": 2 * 3 / 4 * buffer,
            "fsdp": 3 * 3 / 4 * buffer, "zero3": 3 * 3 / 4 * buffer}
    for strategy, expected in want.items():
        got = sum(c.sent_bytes for c in co.collectives(strategy, s))
        if strategy in ("fsdp", "zero3") and got == pytest.approx(4 * 3 / 4 * buffer):
            pytest.fail("FSDP sends 4(N-1)/N·P·b: each gather took bytes_per_step's whole "
                        "all_gather, which is both of them (forward and backward)",
                        pytrace=False)
        assert got == pytest.approx(expected, rel=1e-12), (
            f"{strategy}, N=4, P=1e9 bf16: one rank sends {got:.4g} bytes in all, expected "
            f"{expected:.4g} (what bytes_per_step gives, each byte in one collective)")


@pytest.mark.task("12.9")
def test_alpha_beta_seconds(co):
    link = Interconnect("1 GB/s, 10 us", 1.0, "GB/s", 10.0)
    colls = co.collectives("ddp", setup(co, n=4, link=link, calls=5))
    got = colls[0].seconds
    want = 5 * 10e-6 + 2 * 3 / 4 * 2e9 / 1e9
    if got == pytest.approx(want - 4 * 10e-6):
        pytest.fail("5 calls paid the latency once: every collective call (bucket, unit) pays "
                    "alpha", pytrace=False)
    assert got == pytest.approx(want, rel=1e-9), (
        f"DDP all-reduce, N=4, 4 GB of bf16 gradients, 1 GB/s, 5 calls of 10 us: {got:.6g} s, "
        f"expected calls·alpha + sent/bandwidth = {want:.6g} s")
    net = Interconnect("8 Gb/s", 8.0, "Gb/s", 0.0)
    got = co.collectives("zero2", setup(co, n=2, link=net))[0].seconds
    assert got == pytest.approx(1e9 * 2 / 2 / 1e9, rel=1e-9), (
        f"reduce-scatter of 2 GB on 2 ranks over 8 Gb/s (1 GB/s): {got:.4g} s, expected 1 s: "
        "a Gb/s link moves an eighth as many bytes")
    fsdp = co.collectives("fsdp", setup(co, n=4, link=link, calls=3))
    each = 3 * 10e-6 + 3 / 4 * 2e9 / 1e9
    assert [c.seconds for c in fsdp] == pytest.approx([each] * 3, rel=1e-9), (
        f"FSDP, N=4, 2 GB of bf16 parameters, 1 GB/s, 3 calls of 10 us: each collective "
        f"{[round(c.seconds, 6) for c in fsdp]} s, expected {each:.6g} s each (its own share "
        "of the bytes, its own latencies)")
    for strategy in ("ddp", "zero2", "fsdp"):
        alone = co.collectives(strategy, setup(co, n=1, link=link))
        assert alone and all(c.sent_bytes == 0 and c.seconds == 0 for c in alone), (
            f"{strategy} on one rank sends nothing and waits for nothing (a ring of one)")


def test_strategy_and_setup_reject_bad_input(co):
    with pytest.raises(ValueError, match="unknown strategy 'zero4'"):
        co.strategy_name("zero4")
    with pytest.raises(ValueError, match="mfu is a fraction"):
        setup(co).__class__(P, 2, FAST, 1e15, mfu=40)
    with pytest.raises(ValueError, match="at least 1"):
        setup(co).__class__(P, 0, FAST, 1e15)


# --- 12.10 ----------------------------------------------------------------------------------
# c = 6·1e9 / (1e15·0.5) = 1.2e-5 s per token; at 1000 tokens forward 4 ms, backward 8 ms.
# Each collective over 2 GB of bf16 on 2 ranks: (1/2)·2e9 / 1e11 = 10 ms (all-reduce 20 ms).

@pytest.mark.task("12.10")
def test_step_split_by_hand(co8):
    got = {s: co8.step_split(s, setup(co8), 1000) for s in ("ddp", "zero2", "fsdp")}
    ddp = got["ddp"]
    if ddp.compute_s == pytest.approx(0.004):
        pytest.fail("compute of 1000 tokens is 2·P·tokens / (peak·MFU): that is forward "
                    "only; a training step is 6 FLOPs per parameter per token (forward 2, "
                    "backward 4)", pytrace=False)
    assert ddp.compute_s == pytest.approx(0.012, rel=1e-9), (
        f"compute {ddp.compute_s:.4g} s, expected 6·P·tokens / (peak·MFU) = 0.012 s")
    assert (ddp.forward_s, ddp.backward_s) == pytest.approx((0.004, 0.008), rel=1e-9), (
        f"forward {ddp.forward_s:.4g} s, backward {ddp.backward_s:.4g} s: expected a third and "
        "two thirds of the compute (backward does twice forward's matmuls)")
    assert ddp.comm_s == pytest.approx(0.020, rel=1e-9), (
        f"DDP's communication {ddp.comm_s:.4g} s, expected the whole all-reduce, 0.020 s")
    if ddp.exposed_s == pytest.approx(0.008):
        pytest.fail("DDP's exposed communication hid behind forward too (20 ms - 12 ms): the "
                    "all-reduce waits for gradients, so only backward hides it",
                    pytrace=False)
    assert ddp.exposed_s == pytest.approx(0.012, rel=1e-9), (
        f"DDP exposed {ddp.exposed_s:.4g} s, expected max(0, all-reduce - backward) = 0.012 s")
    assert ddp.step_s == pytest.approx(0.024, rel=1e-9)
    zero = got["zero2"]
    assert zero.exposed_s == pytest.approx(0.002 + 0.010, rel=1e-9), (
        f"ZeRO-2 exposed {zero.exposed_s:.4g} s, expected 0.012 s: the reduce-scatter (10 ms) "
        "hides under backward (8 ms) but 2 ms; the all-gather after the step (10 ms) is exposed")
    overlapped = co8.step_split("zero2", setup(co8), 1000, overlap_next_forward=True)
    assert overlapped.exposed_s == pytest.approx(0.002 + 0.006, rel=1e-9), (
        f"ZeRO-2 with its all-gather under the next forward: exposed {overlapped.exposed_s:.4g}"
        " s, expected 2 ms (backward) + 6 ms (10 ms gather - 4 ms forward)")
    fsdp = got["fsdp"]
    assert fsdp.exposed_s == pytest.approx(0.006 + 0.012, rel=1e-9), (
        f"FSDP exposed {fsdp.exposed_s:.4g} s, expected 18 ms: its forward gather (10 ms) "
        "under forward (4 ms), its backward gather and reduce-scatter (20 ms) under backward "
        "(8 ms)")
    given = co8.step_split("ddp", setup(co8, flops_per_token=3e9), 1000)
    assert given.compute_s == pytest.approx(0.006, rel=1e-9), (
        "a given flops_per_token replaces 6·P (the course's ConvNet does far more)")


@pytest.mark.task("12.10")
def test_more_bandwidth_never_exposes_more(co8):
    links = sorted(PRESETS.values(), key=lambda link: (co8.link_bytes_per_s(link),
                                                       -link.latency_us))
    for strategy in ("ddp", "zero1", "fsdp"):
        for tokens in (10, 1000, 30000):
            exposed = [co8.step_split(strategy, setup(co8, n=8, link=link, calls=4),
                                      tokens).exposed_s for link in links]
            for slow, fast, a, b in zip(links, links[1:], exposed, exposed[1:]):
                assert b <= a + 1e-15, (
                    f"{strategy}, {tokens} tokens: {fast.label} exposes {b:.4g} s, more than "
                    f"the slower {slow.label} ({a:.4g} s)")
            more = co8.step_split(strategy, setup(co8, n=8, calls=4), tokens * 2).exposed_s
            assert more <= co8.step_split(strategy, setup(co8, n=8, calls=4),
                                          tokens).exposed_s + 1e-15, (
                f"{strategy}: doubling the tokens per rank exposed more communication: "
                "compute grows with the batch, communication does not")


@pytest.mark.task("12.10")
def test_hiding_batch_hides_and_one_token_less_does_not(co8):
    lag = Interconnect("100 GB/s, 10 us", 100.0, "GB/s", 10.0)  # no round numbers
    s = setup(co8, link=lag)
    c = 1.2e-5
    want = math.ceil(3 * (0.020 + 10e-6) / (2 * c))
    for strategy, overlap in (("ddp", False), ("fsdp", False), ("zero2", True)):
        t = co8.hiding_tokens(strategy, s, overlap)
        assert isinstance(t, int) and t > 1, (
            f"{strategy}: hiding_tokens gave {t!r}, expected a whole number of tokens")
        at = co8.step_split(strategy, s, t, overlap)
        below = co8.step_split(strategy, s, t - 1, overlap)
        if strategy == "ddp" and t == math.ceil((0.020 + 10e-6) / c):
            pytest.fail(f"DDP hides at {t} tokens: that is the batch whose whole compute "
                        "equals the all-reduce, but only backward (2/3 of it) hides it",
                        pytrace=False)
        assert at.exposed_s <= 1e-9 * at.comm_s, (
            f"{strategy}: at the hiding batch {t} tokens, {at.exposed_s:.3g} s of "
            f"{at.comm_s:.3g} s are still exposed: solve against the phase the collectives "
            "overlap (backward: 2/3 of compute; forward: 1/3)")
        assert below.exposed_s > 0, (
            f"{strategy}: {t - 1} tokens already hide all communication, so {t} is not the "
            "fewest (round the closed form up, not further)")
        if strategy == "ddp":
            assert t == want, f"DDP hides at {t} tokens, expected 3·t_allreduce / (2c) = {want}"
    assert co8.hiding_tokens("zero2", s) == math.inf, (
        "ZeRO-2's all-gather after the step hides behind nothing unless it overlaps the next "
        "forward: no batch hides it (math.inf)")
    assert co8.hiding_tokens("ddp", setup(co8, n=1)) == 0, "one rank has nothing to hide"


def test_cli_prints_the_table_and_rejects_bad_flags(co, monkeypatch, tmp_path, capsys):
    put(LESSON, ["12.9", "12.10"], monkeypatch.setattr)  # and 12.8, by the fixture
    assert co.main(["--links", "warp-drive"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown interconnect(s) warp-drive") and "\n" not in err, err
    assert co.main(["--mfu", "40"]) == 2
    assert "--mfu is a fraction" in capsys.readouterr().err
    figure = tmp_path / "crossover.png"
    assert co.main(["--links", "nvlink4", "ethernet-10g", "--plot", str(figure)]) == 0
    out = capsys.readouterr().out
    for name in ("GPT 125M", "GPT 1.3B", "Llama-3.1-8B", "never"):
        assert name in out, f"{name!r} missing from the table:\n{out}"
    assert figure.stat().st_size > 0
