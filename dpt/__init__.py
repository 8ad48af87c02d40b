"""dpt: the small package every lesson of Data-Parallel PyTorch shares.

- ``dpt.data``: Fashion-MNIST / MNIST on disk, the classic ``DataLoader`` path and a fast
  in-memory path, plus a toy regression set.
- ``dpt.models``: the models the lessons train (ConvNet, MLP, FashionCNN, linear
  regression).
- ``dpt.device``: device and backend choice (cuda, then mps, then cpu).
- ``dpt.dist``: process-group setup on a free port, per-rank thread budgets, teardown.
- ``dpt.checkpoint``: atomic save and careful load.
- ``dpt.precision``: the ``--precision`` flag, and the autocast dtype each device gets.
- ``dpt.testing``: run a function on N ranks with a hard timeout (tests and notebooks).
"""

__all__ = ["checkpoint", "data", "device", "dist", "models", "precision", "testing"]
