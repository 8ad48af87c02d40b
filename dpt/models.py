"""The course's models, written once for every lesson.

- :class:`ConvNet`: the two conv blocks (conv, batch norm, ReLU, max-pool) and linear head of
  the tutorial *Distributed data parallel training in PyTorch*. The course's default model.
- :class:`MLP`: the two-layer perceptron (784 -> hidden -> 10) of the PyTorch Lightning
  distributed-training notebook.
- :class:`FashionCNN`: a wider CNN in the spirit of the Fashion-MNIST model of DTU's MLOps
  course, used where a lesson wants more compute per sample (DataParallel timing, benchmarks).
- :class:`LinearRegression`: the ``torch.nn.Linear(20, 1)`` of PyTorch's DDP tutorial series,
  for the toy dataset.
"""

from __future__ import annotations

import torch
from torch import nn


class ConvNet(nn.Module):
    def __init__(self, num_classes: int = 10, batch_norm: bool = True):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            norm = nn.BatchNorm2d(cout) if batch_norm else nn.Identity()
            return nn.Sequential(nn.Conv2d(cin, cout, kernel_size=5, padding=2), norm,
                                 nn.ReLU(), nn.MaxPool2d(2))

        self.layer1 = block(1, 16)
        self.layer2 = block(16, 32)
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(x))
        return self.fc(x.flatten(1))


class MLP(nn.Module):
    def __init__(self, hidden_dim: int = 128, num_classes: int = 10):
        super().__init__()
        self.l1 = nn.Linear(28 * 28, hidden_dim)
        self.l2 = nn.Linear(hidden_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x.flatten(1))))


class FashionCNN(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * 6 * 6, 600), nn.ReLU(), nn.Dropout(0.25),
            nn.Linear(600, 120), nn.ReLU(),
            nn.Linear(120, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class LinearRegression(nn.Linear):
    def __init__(self, in_features: int = 20, out_features: int = 1):
        super().__init__(in_features, out_features)


MODELS = {"convnet": ConvNet, "mlp": MLP, "fashioncnn": FashionCNN}


def build_model(name: str = "convnet", **kwargs) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    return MODELS[name](**kwargs)


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
