"""The course's models, written once for every lesson.

- :class:`ConvNet`: the ConvNet of the "Distributed data parallel training in PyTorch"
  tutorial: two conv blocks (conv, batch norm, ReLU, max-pool) and a linear head. The
  course's default model.
- :class:`MLP`: the two-layer perceptron of the PyTorch Lightning MNIST notebook
  (784 -> hidden -> 10).
- :class:`FashionCNN`: a wider CNN in the spirit of the Fashion-MNIST model of the DTU MLOps
  course's distributed-training module, used where a lesson wants more compute per sample
  (DataParallel timing, benchmarks).
- :class:`LinearRegression`: ``torch.nn.Linear(20, 1)`` on the toy dataset, as in PyTorch's
  DDP tutorial series.
- :class:`TinyTransformer`: a small decoder-only transformer (pre-norm blocks of causal
  attention and an MLP) on synthetic tokens (:func:`token_batch`), for lesson 09: a stack of
  equal blocks is what FSDP shards unit by unit, and its activations grow with the sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be a multiple of heads {heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (b, heads, t, d / heads)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyTransformer(nn.Module):
    """Token and position embeddings, ``layers`` equal :class:`Block` s, a norm and a head.

    ``forward(tokens)`` takes (batch, seq) token ids and returns (batch, seq, vocab) logits.
    The blocks are ``self.blocks`` (an ``nn.ModuleList``): the units a sharding wrapper
    gathers one at a time.
    """

    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 4,
                 seq_len: int = 64, mlp_ratio: int = 4):
        super().__init__()
        self.seq_len = seq_len
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.seq_len}")
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def token_batch(batch: int, seq_len: int = 64, vocab: int = 256, seed: int = 0,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic (inputs, targets) token ids with a learnable rule, the same on any machine.

    Each sequence starts at a random token and steps by a random stride (mod ``vocab``); the
    target is the next token, so a model can learn it from the context and the loss falls.
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


MODELS = {"convnet": ConvNet, "mlp": MLP, "fashioncnn": FashionCNN}


def build_model(name: str = "convnet", **kwargs) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    return MODELS[name](**kwargs)


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
