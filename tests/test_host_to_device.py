"""runner/host_to_device.py: one buffer per dtype, views in each part's shape, each 16-byte aligned."""

import pytest
import torch

from runner.host_to_device import upload


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_upload_gives_each_part_back_in_its_shape_and_aligned(dtype):
    table = torch.arange(15, dtype=dtype).view(3, 5)[:, :3]  # a non-contiguous slice, as BlockTables gives
    parts = [[1, 2, 3], table, [], [7], torch.tensor([[9]], dtype=dtype), list(range(5))]
    views = upload(parts, dtype, torch.device("cpu"))
    assert len(views) == len(parts)
    for part, view in zip(parts, views):
        expected = part if isinstance(part, torch.Tensor) else torch.tensor(part, dtype=dtype)
        assert view.dtype == dtype and view.shape == expected.shape
        assert torch.equal(view, expected)
        assert view.data_ptr() % 16 == 0
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1  # one buffer, one copy


def test_upload_of_lists_alone_and_of_nothing():
    a, b = upload([[5], [6, 7]], torch.int64, torch.device("cpu"))
    assert a.tolist() == [5] and b.tolist() == [6, 7]
    assert upload([], torch.int32, torch.device("cpu")) == []
