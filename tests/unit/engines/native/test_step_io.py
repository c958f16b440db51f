"""Host lists on their way to a decode step: `to_device` gives what `torch.tensor` gives, through a cheaper path."""

from __future__ import annotations

import pytest
import torch

from hybridrl.engines.native.step_io import to_device

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.long, torch.int32])
@pytest.mark.parametrize(
    "values",
    [[7], [3, -1, 2**31 - 1, 0], [[1, 2, 3], [4, 5, 6]], [[9]], [], [[], []], list(range(5000))],
    ids=["one", "flat", "matrix", "1x1", "empty", "empty rows", "long"],
)
def test_to_device_is_torch_tensor(values, dtype):
    got = to_device(values, dtype, CPU)
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_to_device_floats_and_ragged_rows():
    assert torch.equal(to_device([0.5, 2.0], torch.float32, CPU), torch.tensor([0.5, 2.0]))
    with pytest.raises(ValueError, match="rows of 2 and 1 values"):
        to_device([[1, 2], [3]], torch.long, CPU)
    with pytest.raises(OverflowError):
        to_device([2**31], torch.int32, CPU)
