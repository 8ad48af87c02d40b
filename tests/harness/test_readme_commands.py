"""Every command of every lesson README's "How to run", run as written (``make check-readme``).

Each lesson's commands run in order, from the repository root of one fresh copy of the working
tree per lesson (tracked and untracked files; ``.venv`` and ``data`` linked, so nothing in the
repository changes), with ``exercises/`` read as ``solutions/``: a command in the student's tree
must work there once the tasks are done, and the solutions are that tree. A path under ``/tmp/``
goes to the copy's own temporary folder, ``make grade`` grades ``TARGET=solutions``. Where the
README's "What to expect" quotes a figure that a command prints, ``EXPECT`` checks it within the
tolerance it states.

A command is skipped, with its reason printed, when its line (or a comment line above it in the
same paragraph of the block) carries a tag comment: ``# long: ...`` (an optional longer run),
``# GPU: ...``, ``# cluster: ...`` (several machines or a scheduler), ``# by hand: ...`` (a
second terminal, a kill, or an illustration): see docs/maintainers.md. Deselected from
``make test`` (marker ``readme``); about 6-8 min on two cores with ``-n 2``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.lessons import REPO

# `slow` too: the nested runs that select "not slow" (make grade, the class grader) leave them out.
pytestmark = [pytest.mark.readme, pytest.mark.slow]

TAGS = {
    "long": "an optional longer run",
    "GPU": "needs CUDA GPUs",
    "cluster": "needs several machines or a scheduler",
    "by hand": "needs a person (a second terminal, a kill) or only illustrates",
}
TAG = re.compile(r"(?:^|\s)#\s*(" + "|".join(TAGS) + r"):\s*(.*)$")
LIMIT_S = 150  # per command; the quick ones take 2-25 s on two idle cores


@dataclass
class Command:
    lesson: str
    index: int
    text: str
    skip: str | None = None

    @property
    def id(self) -> str:
        short = re.sub(r"\.venv/bin/|exercises/\d\d_\w+/|\s+#.*$", "", self.text)
        short = " ".join(short.split())
        return f"{self.lesson[:2]}.{self.index:02d} {short[:70]}"


def readme_commands(readme: Path) -> list[Command]:
    """The commands of one README's "How to run" section (``bash`` blocks, its subsections
    included), continuation lines joined, with their skip reasons."""
    text = readme.read_text()
    m = re.search(r"^## How to run\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"{readme.relative_to(REPO)} has no '## How to run' section"
    lesson = readme.parent.name
    commands: list[Command] = []
    for block in re.findall(r"^```bash\n(.*?)^```", m.group(1), re.M | re.S):
        block = re.sub(r"\\\n\s*", "", block)
        heading = None  # a tag comment on its own line: the commands below it, to a blank line
        for line in block.splitlines():
            stripped = line.strip()
            if not stripped:
                heading = None
                continue
            tag = TAG.search(stripped)
            if stripped.startswith("#"):
                if tag and stripped.startswith(f"# {tag.group(1)}:"):
                    heading = tag
                continue
            tag = tag or heading
            skip = f"{tag.group(1)}: {tag.group(2) or TAGS[tag.group(1)]}" if tag else None
            commands.append(Command(lesson, len(commands) + 1, stripped, skip))
    return commands


READMES = sorted((REPO / "solutions").glob("[0-9][0-9]_*/README.md"))
COMMANDS = [c for r in READMES for c in readme_commands(r)]


# ---- figures quoted in "What to expect", checked against what the command prints ----------

@dataclass
class Expect:
    """In the output of the command that ends with ``command`` (its comment left out):
    ``pattern`` matches, and ``check`` holds for its groups (floats); ``quote`` is the README's
    words, with the tolerance checked."""
    command: str
    pattern: str
    check: object = None
    quote: str = ""
    status: int = 0  # the command's exit status (1: a command meant to stop with an error)


def _acc(lo: float, hi: float = 1.0):
    return lambda g: lo <= g[0] <= hi


EXPECT: dict[str, list[Expect]] = {
    "01_single_device": [
        Expect("--dataset fashion-mnist --limit-batches 60", r"test accuracy: ([\d.]+)",
               lambda g: g[0] > 0.60, "On Fashion-MNIST, 60 batches already give more than 60%"),
    ],
    "02_data_parallel": [
        Expect("--repeats 5 --out /tmp/t",
               r"batch\s+1\s+1 device \(1 thread\)\s+([\d.]+) ms\s*\n"
               r"\s*batch\s+1\s+DP by hand[^\n]*?([\d.]+) ms",
               lambda g: g[1] > 2 * g[0],
               "DP by hand 7 to 11x slower at batch 1 on an idle VM (checked: more than 2x, "
               "as the check shares the cores; the batch-256 gain is not checked here)"),
    ],
    "03_ddp_spawn": [
        Expect("--limit-batches 100 --no-progress",
               r"test accuracy: ([\d.]+) \((\d+)/(\d+)\)",
               lambda g: g[0] > 0.90 and g[2] == 10000,
               "above 0.90 (about 0.95), out of 10000"),
    ],
    "06_mixed_precision": [
        Expect("--opt-level 01", r"O1", None, "error: letter O, not digit 0; write 'O1'",
               status=1),
    ],
    "08_sharding": [
        Expect("fsdp2_train.py --steps 100", r"fsdp2 on 2 rank\(s\): loss ([\d.]+) -> ([\d.]+)",
               lambda g: 1.1 <= g[0] <= 1.7 and g[1] <= 0.75,
               "the loss falls from about 1.4 to 0.5 (checked: 1.1-1.7, then at most 0.75)"),
        Expect("--save fsdp_full.pt", r"full state dict \((\d+) tensors\)",
               lambda g: g[0] == 16, "the saved full state dict has 16 tensors"),
    ],
    "09_fsdp": [
        Expect("fsdp_by_hand.py", r"prefetch on: loss ([\d.]+) -> ([\d.]+)",
               lambda g: abs(g[0] - 5.7) <= 0.1 and g[1] < g[0],
               "the loss falls from about 5.7 over 30 steps (checked: 5.6-5.8, then lower)"),
    ],
    "11_time_to_accuracy": [
        Expect("global_batch.py --nproc 2",
               r"largest weight difference: A-C ([\d.e+-]+), B-C ([\d.e+-]+)",
               lambda g: max(g) < 1e-6,
               "the three ways end within about 1e-7 of each other (checked: below 1e-6)"),
        Expect("sync_bn.py --nproc 3",
               r"per-rank BatchNorm: outputs differ by up to ([\d.e+-]+).*\n"
               r"\s*SyncBatchNormByHand: outputs differ by up to ([\d.e+-]+)",
               lambda g: 0.1 < g[0] < 0.5 and g[1] < 1e-5,
               "per-rank BatchNorm's outputs differ by about 0.25; the hand SyncBN's by about "
               "1e-6 (checked: 0.1-0.5, below 1e-5)"),
        Expect("large_batch.py --nproc 2", r"largest weight difference ([\d.e+-]+)",
               lambda g: g[0] < 1e-6, "LAMB and ShardedLAMB end within about 1e-8"),
        Expect("batch_sweep.py --quick",
               r"(?m)^sgd\s+linear\s+1024\s+\S+\s+1/1\s+(\d+).*\n(?:.*\n)*?"
               r"^sgd\s+none\s+1024\s+\S+\s+1/1\s+(\d+)",
               lambda g: g[0] < g[1],
               "batch 1024 reaches 84% in about 70 steps with the lr scaled, about 120 without"),
    ],
    "10_inside_a_step": [
        Expect("--methods naive bucketed torch_ddp", r"(?m)^naive \(05\)\s.*?\s(\d+)%$",
               lambda g: g[0] == 0, "The naive DDP hides 0% of its communication, always"),
        Expect("compile_ddp.py",
               r"(?s)bucket_cap_mb=None: (\d+) graphs.*?; (\d+) buckets[^\n]*\n.*?"
               r"bucket_cap_mb=1: (\d+) graphs.*?; (\d+) buckets[^\n]*\n.*?"
               r"bucket_cap_mb=2: (\d+) graphs.*?; (\d+) buckets",
               lambda g: g == [2, 2, 6, 6, 4, 3],
               "6 graphs and 6 buckets at 1 MiB; 2 and 2 at the default; 4 against 3 at 2"),
        Expect("powersgd --seeds 1 --epochs 0.1",
               r"(?m)^none\s+([\d.]+) \(([\d.]+)\).*\n^bf16_by_hand\s+([\d.]+) \(([\d.]+)\)"
               r".*\n^powersgd\s+([\d.]+) \(([\d.]+)\)",
               lambda g: g[:4] == [397.5, 397.5, 198.8, 198.8] and g[4] == g[5] == 4.6,
               "fp32 397.5 KiB; bf16 198.8 KiB; PowerSGD 4.6 KiB at rank 1, measured equal to "
               "predicted"),
    ],
    "12_step_cost": [
        Expect("flops.py",
               r"(?m)^transformer\s+252M\s+252M\s+503M\s+503M\s+1\.0000\s+2\.000$(?:.*\n)*?"
               r".*6 N tokens = 654M \((-?[\d.]+)% against",
               lambda g: g[0] == -13.3,
               "TinyTransformer 252M and 503M, hand/torch 1.0000; 6N is -13.3%"),
        Expect("memory_calc.py --params 7.5e9 --nproc 64 --dtype fp16",
               r"(?m)^DDP\s.*\s([\d.]+)\s+([\d.]+)$\n^ZeRO-1\s.*\s([\d.]+)\s+[\d.]+$\n"
               r"^ZeRO-2\s.*\s([\d.]+)\s+[\d.]+$\n^ZeRO-3 / FSDP\s.*\s([\d.]+)\s+([\d.]+)$",
               lambda g: g == [120.0, 29.531, 31.406, 16.641, 1.875, 44.297],
               "DDP 120.000, ZeRO-1 31.406, ZeRO-2 16.641, ZeRO-3 1.875; 29.531 and 44.297 GB"),
        Expect("crossover.py --plot /tmp/crossover.svg",
               r"(?m)^Llama-3\.1-8B\s+\S+\s+nvlink4\s+ddp\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
               r"\s+([\d,]+)\s.*\n(?:.*\n)*?^Llama-3\.1-8B\s+\S+\s+pcie4x16\s+ddp\s+([\d.]+)"
               r"\s+([\d.]+)\s+([\d.]+)\s+([\d,]+)\s",
               lambda g: (round(g[0]) == 499 and round(g[1]) == 69 and g[2] == 0
                          and g[3] == 846 and round(g[5]) == 1136 and round(g[6]) == 804
                          and g[7] == 14003),
               "Llama-3.1-8B: 499 ms, 69 ms over NVLink 4 hidden from 846 tokens; 1,136 ms "
               "over PCIe with 804 exposed, hidden from 14,003"),
    ],
    "13_local_sgd": [
        Expect("streaming.py --nproc 3",
               r"(?m)^\s*Streaming, F=3\s+(\d+)\s+([\d,]+)\s+([\d,]+)\s.*\n"
               r"^\s*DiLoCo \(F=1\)\s+(\d+)\s+([\d,]+)\s+([\d,]+)\s",
               lambda g: g == [12, 33280, 399360, 4, 99840, 399360],
               "peak per sync 33,280 bytes against DiLoCo's 99,840, the same total 399,360"),
        Expect("compress.py --nproc 3",
               r"(?m)^\s*fp32\s+all_reduce\s+([\d,]+)\s+\S+\s+([\d,]+)\s.*\n"
               r"^\s*fp16\s+all_reduce\s+([\d,]+)\s+\S+\s+([\d,]+)\s.*\n"
               r"^\s*bf16\s+all_reduce\s+([\d,]+)\s+\S+\s+([\d,]+)\s.*\n"
               r"^\s*int8\s+all_gather\s+([\d,]+)\s+\S+\s+([\d,]+)\s",
               lambda g: g == [407080, 542773, 203540, 271387, 203540, 271387, 103362, 206724],
               "payload 407,080 / 203,540 / 103,362; on the wire 542,773, 271,387, 206,724"),
        Expect("supervisor.py --policy ft",
               r"steps lost \(ft\): (\d+) replica-steps.*final weights equal on every replica: "
               r"yes",
               lambda g: g == [2], "the survivors lose 2 replica-steps; all final weights equal"),
        Expect("supervisor.py --policy restart", r"steps lost \(restart\): (\d+) replica-steps",
               lambda g: g == [14], "14 replica-steps lost"),
    ],
}


def _bare(text: str) -> str:
    return " ".join(re.sub(r"\s#.*$", "", text).split())


def _expectations(cmd: Command) -> list[Expect]:
    return [e for e in EXPECT.get(cmd.lesson, []) if _bare(cmd.text).endswith(e.command)]


def test_every_quoted_figure_names_a_command_that_is_run():
    for lesson, expects in EXPECT.items():
        texts = [_bare(c.text) for c in COMMANDS if c.lesson == lesson and not c.skip]
        for e in expects:
            assert sum(t.endswith(e.command) for t in texts) == 1, (
                f"EXPECT[{lesson!r}] checks the output of the command ending {e.command!r}, "
                f"and not exactly one command the check runs in that README ends so")


def test_the_readmes_have_commands_and_tags_the_check_knows():
    lessons = {c.lesson for c in COMMANDS}
    assert lessons == {r.parent.name for r in READMES}, "a README's How to run has no command"
    for c in COMMANDS:
        assert not re.search(r"#\s*(?:long|gpu|GPUs?|cluster|by hand)\s*:", c.text) or c.skip, (
            f"{c.id}: a tag comment the check does not read")


# ---- running them -------------------------------------------------------------------------

@dataclass
class Tree:
    root: Path
    env: dict
    done: dict = field(default_factory=dict)  # command index -> exit status


def _copy_tree(dest: Path) -> None:
    """The working tree as a fresh clone sees it (tracked and untracked, not ignored), mtimes
    kept (make's stamps), ``.venv`` and ``data`` linked."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in files:
        src = REPO / name
        if not name or name.startswith("data/") or not src.is_file():
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name)
    (dest / ".venv").symlink_to(REPO / ".venv")
    (dest / "data").symlink_to(REPO / "data")


@pytest.fixture(scope="session")
def trees(tmp_path_factory):
    made: dict[str, Tree] = {}

    def get(lesson: str) -> Tree:
        if lesson not in made:
            root = tmp_path_factory.mktemp(f"readme-{lesson[:2]}")
            _copy_tree(root)
            (root / "tmp").mkdir()
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("DPT_", "PYTEST_", "COV_"))}
            env.update(PYTHONPATH=str(root), TMPDIR=str(root / "tmp"), PYTHONUNBUFFERED="1")
            made[lesson] = Tree(root, env)
        return made[lesson]

    return get


def _run(cmd: Command, tree: Tree, limit: float) -> tuple[int, str]:
    text = cmd.text.replace("exercises/", "solutions/").replace("/tmp/", f"{tree.root}/tmp/")
    if text.startswith("make grade"):
        text = re.sub(r"^make grade", "make grade TARGET=solutions", text)
    # `export` lines above it in the README hold for it too (one shell per command).
    exports = [c.text for c in COMMANDS if c.lesson == cmd.lesson and c.index < cmd.index
               and c.text.startswith("export ")]
    script = "set -e\n" + "".join(e + "\n" for e in exports) + text + "\n"
    proc = subprocess.Popen(["bash", "-c", script], cwd=tree.root, env=tree.env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"`{cmd.text}` ran past {limit:.0f} s (README commands must be quick: tag a "
                    f"long one `# long: ...`)\n{out[-3000:]}")
    return proc.returncode, out


def _run_and_check(cmd: Command, trees) -> None:
    if cmd.skip:
        pytest.skip(f"{cmd.lesson}: `{cmd.text.split(' #')[0]}`: {cmd.skip}")
    tree = trees(cmd.lesson)
    # The commands above it first (a checkpoint before its resume), when not run already
    # (this one chosen alone with -k, or another worker ran them).
    for before in COMMANDS:
        if before.lesson == cmd.lesson and before.index < cmd.index and not before.skip \
                and before.index not in tree.done:
            tree.done[before.index] = None  # tried: not again, even when it times out
            status, out = _run(before, tree, LIMIT_S)
            tree.done[before.index] = status
    expects = _expectations(cmd)
    want = expects[0].status if expects else 0
    tree.done[cmd.index] = None
    status, out = _run(cmd, tree, LIMIT_S)
    tree.done[cmd.index] = status
    assert (status == 0) if want == 0 else (status != 0), (
        f"{cmd.lesson}/README.md: `{cmd.text}` exited with status {status} (expected "
        f"{'0' if want == 0 else 'an error'}), run from the repository root of a fresh copy "
        f"with exercises/ read as solutions/:\n{out[-4000:]}")
    for e in expects:
        m = re.search(e.pattern, out)
        assert m, (f"{cmd.lesson}/README.md quotes {e.quote!r}; `{cmd.text}` printed nothing "
                   f"matching {e.pattern!r}:\n{out[-3000:]}")
        if e.check is not None:
            values = [float(v.replace(",", "")) for v in m.groups()]
            assert e.check(values), (
                f"{cmd.lesson}/README.md quotes {e.quote!r}; `{cmd.text}` printed "
                f"{m.group(0)!r}")


def _lesson_class(lesson: str) -> type:
    """One class per lesson: `--dist loadscope` (make check-readme) keeps a lesson's commands
    on one worker, in order, in one copy of the tree."""

    @pytest.mark.timeout(3 * LIMIT_S)  # its own command has LIMIT_S; more if it runs those above
    @pytest.mark.parametrize("cmd", [pytest.param(c, id=c.id) for c in COMMANDS
                                     if c.lesson == lesson])
    def test_readme_command_runs_as_written(self, cmd, trees):
        _run_and_check(cmd, trees)

    return type(f"TestReadme{lesson[:2]}", (), {
        "__doc__": f"The commands of solutions/{lesson}/README.md's How to run.",
        "test_readme_command_runs_as_written": test_readme_command_runs_as_written})


for _lesson in dict.fromkeys(c.lesson for c in COMMANDS):
    globals()[f"TestReadme{_lesson[:2]}"] = _lesson_class(_lesson)


if __name__ == "__main__":  # list the commands: python tests/harness/test_readme_commands.py
    for c in COMMANDS:
        print(f"{c.id:80s} {c.skip or ''}", file=sys.stdout)
