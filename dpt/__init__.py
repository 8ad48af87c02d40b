"""dpt: the small package every lesson of Data-Parallel PyTorch shares.

- ``dpt.data``: Fashion-MNIST / MNIST on disk, the classic ``DataLoader`` path and a fast
  in-memory path, plus a toy regression set.
- ``dpt.models``: the models the lessons train (ConvNet, MLP, FashionCNN, linear
  regression).
- ``dpt.device``: device and backend choice (cuda, then mps, then cpu).
- ``dpt.dist``: process-group setup on a free port, per-rank thread budgets, teardown.
- ``dpt.checkpoint``: atomic save and careful load.
- ``dpt.precision``: the ``--precision`` flag, and the autocast dtype each device gets.
- ``dpt.ranks``: run a function on N ranks with a hard timeout (tests, notebooks, benchmarks).
- ``dpt.stats``: means with their 95% t-intervals (benchmarks, lesson measurements).
- ``dpt.timing``: clocks that time collectives where they run (CUDA events on a GPU).
- ``dpt.interconnects``: the links between GPUs (NVLink, PCIe, InfiniBand, Ethernet) as
  their specifications state them, for the benchmark's cost model and lesson 12.
- ``dpt.flops``: a step's model FLOPs (FlopCounterMode), GPUs' datasheet peaks and a matmul
  probe, for MFU in lesson 12 and the benchmark.
"""

__all__ = ["checkpoint", "data", "device", "dist", "flops", "models", "precision", "ranks",
           "stats", "timing"]

import importlib.util as _util
import sys as _sys

# A python that finds dpt but no torch (PYTHONPATH set by hand, a venv whose torch install
# failed) stops at its first `import dpt` with one line instead of a traceback. A lesson file's
# first import is `import dpt`; a python without dpt at all stops there with Python's own
# "No module named 'dpt'".
if _util.find_spec("torch") is None:
    _sys.exit(f"error: {_sys.executable} has no torch; use the course's venv: .venv/bin/python "
              f"{_sys.argv[0]} (or `source .venv/bin/activate` first; `make setup` creates it)")
