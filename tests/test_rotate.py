"""attention/kernels/rotate.py: rows times a square fp32 matrix, plus an addend, against torch (under the
Triton interpreter on CPU; conftest)."""

import pytest
import torch

from attention.kernels.rotate import rotate_rows
from cache import kvarn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 17, 40])
def test_rotate_rows_is_x_times_the_matrix_plus_the_base(rows):
    """Rows in several programs, the last one part-filled; a transposed view of the matrix; the addend and a
    narrower output dtype."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2, 32, generator=g).to(DEVICE)
    base = torch.randn(rows, 2, 32, generator=g).to(DEVICE)
    matrix = torch.randn(32, 32, generator=g).to(DEVICE)
    torch.testing.assert_close(rotate_rows(x, matrix), x @ matrix, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotate_rows(x, matrix.T, base), base + x @ matrix.T, rtol=1e-5, atol=1e-5)
    half = rotate_rows(x, matrix, base, torch.float16)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), base + x @ matrix, rtol=2e-3, atol=2e-3)


def test_a_hadamard_rotation_turns_back():
    x = torch.randn(5, 64).to(DEVICE)
    h = kvarn.hadamard(64, device=DEVICE)
    torch.testing.assert_close(rotate_rows(rotate_rows(x, h), h.T), x, rtol=1e-5, atol=1e-5)


def test_rotate_rows_refuses_what_it_cannot_index():
    x = torch.randn(4, 32).to(DEVICE)
    with pytest.raises(ValueError, match="matrix must be fp32"):
        rotate_rows(x, torch.randn(32, 16).to(DEVICE))
    with pytest.raises(ValueError, match="must be contiguous"):
        rotate_rows(x.T.contiguous().T, torch.randn(32, 32).to(DEVICE))
