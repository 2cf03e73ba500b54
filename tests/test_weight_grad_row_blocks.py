"""Which weight gradients autocast_linear.weight_grad runs in row blocks (WEIGHT_GRAD_ROW_BLOCK): a tall one whose
rows are not a multiple of the block, as blocks then the rest. The products themselves run on CUDA only
(tests/gpu/test_products_gpu.py checks their values against the one product)."""

import pytest

from models.kernels import autocast_linear


@pytest.mark.parametrize(
    ("rows", "blocks"),
    [(8512, [(0, 8192), (8192, 8512)]), (20000, [(0, 8192), (8192, 16384), (16384, 20000)]), (8192, None),
     (16384, None), (4384, None)],
)  # fmt: skip
def test_a_tall_weight_gradient_runs_in_row_blocks(rows, blocks):
    assert autocast_linear._row_blocks(rows) == blocks


def test_no_row_blocks_where_the_option_is_off(monkeypatch):
    monkeypatch.setattr(autocast_linear, "WEIGHT_GRAD_ROW_BLOCK", None)
    assert autocast_linear._row_blocks(8512) is None
    monkeypatch.setattr(autocast_linear, "WEIGHT_GRAD_ROW_BLOCK", 1000)
    assert autocast_linear._row_blocks(2500) == [(0, 1000), (1000, 2000), (2000, 2500)]
