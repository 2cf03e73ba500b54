"""The CPU side of the padded products (the GPU side: tests/gpu/test_products_gpu.py): weight copies kept with rows
zero-padded to weight_copies.ROW_PAD, autocast_linear.input_grad's product over the padded reduction only where dy
is marked padded to the same width, and the row blocks a tall weight gradient runs in."""

import pytest
import torch

from models.kernels import autocast_linear, weight_copies


def test_padded_rows_rounds_up_to_row_pad(monkeypatch):
    assert weight_copies.padded_rows(8512) == 8576 and weight_copies.padded_rows(8576) == 8576
    assert weight_copies.padded_rows(4384) == 4480 and weight_copies.padded_rows(1) == 128
    monkeypatch.setattr(weight_copies, "ROW_PAD", None)
    assert weight_copies.padded_rows(8512) == 8512


def _padded_copy(rows=200, cols=24, dtype=torch.float64):
    w = torch.nn.Parameter(torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)))
    return w, weight_copies._new_copy(w, dtype)


def test_a_new_copy_is_the_first_rows_of_a_zero_padded_matrix():
    w, copy = _padded_copy()
    assert copy.is_contiguous() and torch.equal(copy, w.detach().double())
    padded = weight_copies.zero_padded_rows(copy)
    assert padded is not None and padded.shape == (256, 24) and not padded[200:].any()
    assert weight_copies.zero_padded_rows(w.detach().double()) is None  # a plain cast
    assert weight_copies.zero_padded_rows(copy[1:]) is None  # not the first rows
    assert weight_copies.zero_padded_rows(copy[:, :12]) is None  # not whole rows


def test_no_padded_copy_where_rows_need_none_or_padding_is_off(monkeypatch):
    _, copy = _padded_copy(rows=256)
    assert weight_copies.zero_padded_rows(copy) is None
    monkeypatch.setattr(weight_copies, "ROW_PAD", None)
    _, copy = _padded_copy(rows=200)
    assert weight_copies.zero_padded_rows(copy) is None


def test_input_grad_reads_the_padding_only_where_dy_is_marked_to_the_same_width():
    _, w16 = _padded_copy()
    buf = torch.randn(32, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dy = buf[:, :200]
    plain = dy @ w16
    buf[:, 200:] = float("nan")  # NaN x 0 = NaN: shows the padded product ran
    assert torch.equal(autocast_linear.input_grad(dy, w16, None), plain)  # not marked
    assert torch.equal(autocast_linear.input_grad(dy, w16, 320), plain)  # marked to another width
    assert torch.equal(autocast_linear.input_grad(dy.contiguous(), w16, 256), plain)  # rows not 256 apart
    assert autocast_linear.input_grad(dy, w16, 256).isnan().all()
    buf[:, 200:] = 0
    torch.testing.assert_close(autocast_linear.input_grad(dy, w16, 256), plain, rtol=1e-12, atol=1e-12)
    assert torch.equal(autocast_linear.input_grad(dy, w16.clone(), 256), plain)  # the weight not padded


@pytest.mark.parametrize(
    ("rows", "blocks"),
    [(8512, [(0, 8192), (8192, 8512)]), (20000, [(0, 8192), (8192, 16384), (16384, 20000)]), (8192, None),
     (16384, None), (4384, None)],
)  # fmt: skip
def test_a_tall_weight_gradient_runs_in_row_blocks(rows, blocks):
    assert autocast_linear._row_blocks(rows) == blocks
