"""dpt.data: sources in order, clear errors, and the fast path agreeing with the classic one."""

import gzip

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dpt import data


def test_debian_style_gz_files_are_decompressed_into_torchvision_raw(tmp_path, monkeypatch):
    debian = tmp_path / "debian"
    data.write_fake_dataset(debian, gz=True, n_train=20, n_test=10)
    monkeypatch.setenv("DPT_DEBIAN_DIR", str(debian))
    monkeypatch.setenv("DPT_OFFLINE", "1")
    root = data.prepare("fashion-mnist", tmp_path / "data", quiet=True)
    assert data.is_present("fashion-mnist", root)
    x, y = data.load_tensors("fashion-mnist", train=True, root=root)
    assert x.shape == (20, 1, 28, 28) and x.dtype == torch.float32 and y.shape == (20,)
    with gzip.open(debian / "t10k-labels-idx1-ubyte.gz") as f:
        assert f.read()[8:] == bytes(data.load_tensors("fashion-mnist", False, root)[1].tolist())


def test_files_already_present_are_used_as_they_are(tmp_path, monkeypatch):
    data.write_fake_dataset(tmp_path, "mnist", n_train=12, n_test=6)
    monkeypatch.setenv("DPT_OFFLINE", "1")
    assert data.prepare("mnist", tmp_path, quiet=True) == tmp_path
    assert len(data.torchvision_dataset("mnist", train=False, root=tmp_path)) == 6


def test_missing_data_offline_raises_with_instructions(tmp_path, monkeypatch):
    monkeypatch.setenv("DPT_DEBIAN_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("DPT_OFFLINE", "1")
    with pytest.raises(data.DataError) as info:
        data.prepare("fashion-mnist", tmp_path, quiet=True)
    assert "apt-get install dataset-fashion-mnist" in str(info.value)
    assert "make data" in str(info.value)


def test_unknown_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown dataset 'cifar'"):
        data.prepare("cifar")


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_bad_batch_size_is_refused(bad):
    with pytest.raises(ValueError, match="positive integer"):
        data.TensorLoader(torch.zeros(4), batch_size=bad)


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
    data.write_fake_dataset(tmp_path, n_train=16, n_test=8)
    fast = data.make_loader(train=False, batch_size=8, fast=True, root=tmp_path)
    classic = data.make_loader(train=False, batch_size=8, fast=False, root=tmp_path)
    (fx, fy), (cx, cy) = next(iter(fast)), next(iter(classic))
    torch.testing.assert_close(fx, cx)
    assert torch.equal(fy, cy)
