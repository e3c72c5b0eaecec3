"""engine.model.linear.Linear on CPU against F.linear on both of its paths: row blocks and packed oneDNN."""

import pytest
import torch
import torch.nn.functional as F

from engine.model.linear import _MIN_PACKED_ROWS, Linear


@pytest.mark.parametrize("num_rows", [1, 2, _MIN_PACKED_ROWS, 5, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear_at_every_row_count(num_rows, with_bias):
    generator = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 40, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(num_rows, 40, generator=generator)
    linear = Linear(weight, bias)
    torch.testing.assert_close(linear(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    # Strided rows (a slice of a wider activation) read the same.
    wide = torch.randn(num_rows, 80, generator=generator)[:, ::2]
    torch.testing.assert_close(linear(wide), F.linear(wide, weight, bias), rtol=1e-5, atol=1e-5)


def test_float32_weights_are_packed_and_other_dtypes_are_not():
    weight = torch.randn(64, 32)
    linear = Linear(weight)
    if torch.backends.mkldnn.is_available():
        assert linear.packed is not None and linear.packed.is_mkldnn
    assert linear.row_blocks.data_ptr() == weight.data_ptr()  # the row blocks share the weight
    half = Linear(weight.bfloat16())
    assert half.packed is None
    x = torch.randn(8, 32).bfloat16()
    torch.testing.assert_close(half(x), F.linear(x, weight.bfloat16()), rtol=1e-2, atol=1e-2)
