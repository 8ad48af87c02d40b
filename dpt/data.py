"""Datasets for the course: where they come from, and two ways to batch them.

Sources, tried in order by :func:`prepare` (and ``make data``):

1. files already under ``data/`` in torchvision's layout;
2. Debian's ``dataset-fashion-mnist`` package (installed with apt-get when we are root),
   decompressed into torchvision's ``raw/`` folder (its checksums differ from torchvision's
   list, so we never hand the .gz files to torchvision's downloader);
3. torchvision's own download, when online.

Two loaders:

- the classic path: ``torchvision.datasets.*`` + ``DataLoader`` with a per-sample transform;
- the fast path: the whole split as one normalized tensor, batched by index
  (:class:`TensorLoader`). It accepts any sampler, including ``DistributedSampler``.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler

REPO_ROOT = Path(__file__).resolve().parent.parent
DEBIAN_PACKAGE = "dataset-fashion-mnist"
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")


def debian_dir() -> Path:
    """Where Debian's package puts the .gz files (``$DPT_DEBIAN_DIR`` overrides, for tests)."""
    return Path(os.environ.get("DPT_DEBIAN_DIR", DEBIAN_DIR))


def offline() -> bool:
    """``DPT_OFFLINE=1`` skips torchvision's download (no network, or a test of that case)."""
    return os.environ.get("DPT_OFFLINE", "") not in ("", "0")

RAW_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    folder: str  # torchvision's class name, which is also its folder under root
    mean: float
    std: float
    classes: tuple[str, ...]


DATASETS: dict[str, DatasetInfo] = {
    "fashion-mnist": DatasetInfo(
        "fashion-mnist",
        "FashionMNIST",
        0.2860,
        0.3530,
        ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"),
    ),
    "mnist": DatasetInfo("mnist", "MNIST", 0.1307, 0.3081, tuple(str(i) for i in range(10))),
}
DEFAULT_DATASET = "fashion-mnist"


class DataError(RuntimeError):
    """The data is missing or broken; the message says how to get it."""


def data_root() -> Path:
    """``$DPT_DATA`` if set, else the repository's ``data/`` folder."""
    return Path(os.environ.get("DPT_DATA", REPO_ROOT / "data"))


def dataset_info(name: str) -> DatasetInfo:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    return DATASETS[name]


def raw_dir(name: str, root: Path | str | None = None) -> Path:
    return Path(root or data_root()) / dataset_info(name).folder / "raw"


def is_present(name: str, root: Path | str | None = None) -> bool:
    raw = raw_dir(name, root)
    return all((raw / f).is_file() and (raw / f).stat().st_size > 0 for f in RAW_FILES)


def _how_to_get(name: str, root: Path) -> str:
    raw = raw_dir(name, root)
    steps = [f"dataset {name!r} is missing from {raw}."]
    if name == "fashion-mnist":
        steps.append(
            f"Offline: `sudo apt-get install {DEBIAN_PACKAGE}` then `make data`;"
        )
    steps.append(
        f"online: `make data` (torchvision downloads it); or copy the four files "
        f"{', '.join(RAW_FILES)} (or their .gz) into {raw}."
    )
    return " ".join(steps)


def _decompress_into(src_dir: Path, raw: Path) -> None:
    raw.mkdir(parents=True, exist_ok=True)
    for f in RAW_FILES:
        gz, plain = src_dir / (f + ".gz"), src_dir / f
        tmp = raw / (f + ".part")
        if gz.is_file():
            with gzip.open(gz, "rb") as fin, open(tmp, "wb") as fout:
                shutil.copyfileobj(fin, fout)
        elif plain.is_file():
            shutil.copyfile(plain, tmp)
        else:
            raise FileNotFoundError(gz)
        os.replace(tmp, raw / f)


def _try_debian(name: str, root: Path, log) -> bool:
    if name != "fashion-mnist":
        return False
    src = debian_dir()
    if (not src.is_dir() and src == DEBIAN_DIR and hasattr(os, "geteuid")
            and os.geteuid() == 0):
        if shutil.which("apt-get"):
            log(f"installing Debian's {DEBIAN_PACKAGE} with apt-get ...")
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            ok = subprocess.run(["apt-get", "install", "-y", "-q", DEBIAN_PACKAGE],
                                env=env, capture_output=True).returncode == 0
            if not ok:  # the package lists may be missing on a fresh machine
                subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
                subprocess.run(["apt-get", "install", "-y", "-q", DEBIAN_PACKAGE],
                               env=env, capture_output=True)
    if not src.is_dir():
        return False
    try:
        _decompress_into(src, raw_dir(name, root))
    except (OSError, EOFError) as exc:
        log(f"Debian files unusable: {exc}")
        return False
    log(f"decompressed {src} into {raw_dir(name, root)}")
    return True


def _try_download(name: str, root: Path, log) -> bool:
    import torchvision

    cls = getattr(torchvision.datasets, dataset_info(name).folder)
    log(f"trying torchvision's download of {name} ...")
    try:
        for train in (True, False):
            cls(str(root), train=train, download=True)
    except Exception as exc:  # noqa: BLE001 - any network failure means "not this way"
        log(f"download failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        return False
    return is_present(name, root)


def prepare(name: str = DEFAULT_DATASET, root: Path | str | None = None,
            download: bool = True, quiet: bool = False) -> Path:
    """Make sure ``name`` is on disk in torchvision's layout; return the root folder.

    Raises :class:`DataError` with instructions when every source fails.
    """
    dataset_info(name)
    root = Path(root or data_root())

    def log(msg: str) -> None:
        if not quiet:
            print(f"[data] {msg}", file=sys.stderr)

    if is_present(name, root):
        return root
    if _try_debian(name, root, log) and is_present(name, root):
        return root
    if download and not offline() and _try_download(name, root, log):
        return root
    raise DataError(_how_to_get(name, root))


def prepare_distributed(name: str = DEFAULT_DATASET, root: Path | str | None = None,
                        local_rank: int | None = None) -> Path:
    """One process per machine prepares the data; the others wait at a barrier.

    Call it after the process group is up. If the preparing rank fails, it still reaches
    the barrier, so the other ranks do not hang, and every rank raises the same error.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return prepare(name, root)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    error = None
    if local_rank == 0:
        try:
            prepare(name, root)
        except DataError as exc:
            error = exc
    dist.barrier()
    if error is not None:
        raise error
    return prepare(name, root, download=False, quiet=True)


# ---------------------------------------------------------------------------- datasets


def torchvision_dataset(name: str = DEFAULT_DATASET, train: bool = True,
                        root: Path | str | None = None, transform=None) -> Dataset:
    """The classic path: a torchvision dataset with a per-sample transform."""
    import torchvision
    import torchvision.transforms as T

    info = dataset_info(name)
    root = Path(root or data_root())
    if not is_present(name, root):
        raise DataError(_how_to_get(name, root))
    if transform is None:
        transform = T.Compose([T.ToTensor(), T.Normalize((info.mean,), (info.std,))])
    cls = getattr(torchvision.datasets, info.folder)
    return cls(str(root), train=train, download=False, transform=transform)


def load_tensors(name: str = DEFAULT_DATASET, train: bool = True,
                 root: Path | str | None = None, limit: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast path: the whole split as ``(N, 1, 28, 28)`` float32, normalized, and labels."""
    ds = torchvision_dataset(name, train, root, transform=lambda x: x)
    info = dataset_info(name)
    images, labels = ds.data, ds.targets
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    x = images.unsqueeze(1).float().div_(255.0).sub_(info.mean).div_(info.std)
    return x.contiguous(), labels.long().clone()


class TensorLoader:
    """Batches in-memory tensors by index: no per-sample transform, no worker processes.

    It draws indices from ``sampler`` (a ``RandomSampler`` when ``shuffle``, a
    ``DistributedSampler`` in multi-process lessons), so it behaves like a ``DataLoader``
    built from the same sampler, including ``set_epoch``.
    """

    def __init__(self, *tensors: torch.Tensor, batch_size: int, shuffle: bool = False,
                 sampler: Sampler | None = None, drop_last: bool = False,
                 generator: torch.Generator | None = None):
        check_batch_size(batch_size)
        if not tensors or any(len(t) != len(tensors[0]) for t in tensors):
            raise ValueError("TensorLoader needs tensors of the same length")
        self.tensors = tensors
        self.batch_size = batch_size
        self.drop_last = drop_last
        if sampler is None:
            sampler = (RandomSampler(range(len(tensors[0])), generator=generator) if shuffle
                       else SequentialSampler(range(len(tensors[0]))))
        self.sampler = sampler

    @property
    def dataset(self):
        return self.tensors

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        idx = torch.as_tensor(list(iter(self.sampler)), dtype=torch.long)
        for start in range(0, len(idx), self.batch_size):
            batch = idx[start:start + self.batch_size]
            if self.drop_last and len(batch) < self.batch_size:
                return
            yield tuple(t[batch] for t in self.tensors)


def check_batch_size(batch_size: int) -> int:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch size must be a positive integer, got {batch_size!r}")
    return batch_size


def make_loader(name: str = DEFAULT_DATASET, train: bool = True, batch_size: int = 64,
                fast: bool = True, shuffle: bool | None = None, sampler: Sampler | None = None,
                root: Path | str | None = None, limit: int | None = None,
                num_workers: int = 0, seed: int | None = None):
    """A loader over ``name``'s train or test split, fast (tensors) or classic (DataLoader)."""
    check_batch_size(batch_size)
    shuffle = train if shuffle is None else shuffle
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    if fast:
        x, y = load_tensors(name, train, root, limit)
        return TensorLoader(x, y, batch_size=batch_size, shuffle=shuffle and sampler is None,
                            sampler=sampler, generator=generator)
    ds = torchvision_dataset(name, train, root)
    if limit is not None:
        ds = torch.utils.data.Subset(ds, range(min(limit, len(ds))))
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle and sampler is None,
                      sampler=sampler, num_workers=num_workers, generator=generator)


# ------------------------------------------------------------------ toy data (seed 004)


class ToyRegression(Dataset):
    """Seed 004's ``MyTrainDataset``: random inputs of size 20 and targets of size 1,
    here drawn from a fixed generator so every rank and every run sees the same data."""

    def __init__(self, size: int = 2048, in_features: int = 20, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, in_features, generator=g)
        w = torch.randn(in_features, 1, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


# ------------------------------------------------------------------- tiny IDX fixtures


def write_idx(path: Path, array: torch.Tensor) -> None:
    """Write a uint8 tensor as an IDX file (the format of the MNIST family)."""
    import struct

    array = array.to(torch.uint8).contiguous()
    header = struct.pack(">HBB", 0, 0x08, array.dim()) + struct.pack(
        f">{array.dim()}I", *array.shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(header + array.numpy().tobytes())


def write_fake_dataset(root: Path | str, name: str = DEFAULT_DATASET, n_train: int = 64,
                       n_test: int = 32, seed: int = 0, gz: bool = False) -> Path:
    """A tiny dataset in torchvision's layout (or as .gz files in ``root`` when ``gz``),
    for tests that must not depend on the real data."""
    g = torch.Generator().manual_seed(seed)
    root = Path(root)
    out = root if gz else raw_dir(name, root)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = torch.randint(0, 10, (n,), generator=g)
        images = torch.randint(0, 256, (n, 28, 28), generator=g)
        for kind, arr in (("images-idx3", images), ("labels-idx1", labels)):
            p = out / f"{prefix}-{kind}-ubyte"
            write_idx(p, arr)
            if gz:
                with open(p, "rb") as fin, gzip.open(str(p) + ".gz", "wb") as fout:
                    shutil.copyfileobj(fin, fout)
                p.unlink()
    return root


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Put the course's datasets under data/.")
    ap.add_argument("names", nargs="*", default=[DEFAULT_DATASET],
                    help=f"datasets to prepare (default: {DEFAULT_DATASET}); 'all' for every one")
    ap.add_argument("--optional", nargs="*", default=[],
                    help="datasets whose absence is a warning, not an error")
    ap.add_argument("--root", default=None)
    args = ap.parse_args(argv)
    names = list(DATASETS) if args.names == ["all"] else args.names
    status = 0
    for name in names + [n for n in args.optional if n not in names]:
        try:
            root = prepare(name, args.root)
            print(f"[data] {name}: ready in {raw_dir(name, root)}")
        except (DataError, ValueError) as exc:
            if name in args.optional and name not in names:
                print(f"[data] {name}: not available (optional). {exc}", file=sys.stderr)
            else:
                print(f"[data] error: {exc}", file=sys.stderr)
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
