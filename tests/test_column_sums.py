"""models/kernels/column_sums.py (the backward kernels' partial weight-gradient sums) on the CPU, through Triton's
interpreter: one buffer and two buffers in one launch against float64 sums, at the norms' and the conv's layouts
(rows of a width that is and is not a multiple of the column block, more rows than one step of the row loop, a
[R, d, 4] buffer), bit-for-bit the same result on a second call (a fixed summation order), and the checks."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter_child import child_results, run_checks

pytest.importorskip("triton")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def check() -> dict:
    from models.kernels.column_sums import column_sums

    gen = torch.Generator().manual_seed(0)
    errors = {}
    for rows, cols in ((3, 40), (37, 300), (33, 2048)):  # fewer rows than a step, several steps, a partial step
        part = torch.randn(rows, cols, generator=gen)
        got = column_sums(part)
        assert got.shape == (cols,) and got.dtype == torch.float32, (got.shape, got.dtype)
        errors[f"{rows}x{cols}"] = _rel(got, part.double().sum(0))
        assert torch.equal(got, column_sums(part)), "not deterministic"
    # The conv's pair: [R, d, 4] and [R, d] in one launch.
    dw_part, db_part = torch.randn(19, 70, 4, generator=gen), torch.randn(19, 70, generator=gen)
    dw, db = column_sums(dw_part, db_part)
    assert dw.shape == (70, 4) and db.shape == (70,)
    errors["pair dw"] = _rel(dw, dw_part.double().sum(0))
    errors["pair db"] = _rel(db, db_part.double().sum(0))
    assert all(e < 1e-6 for e in errors.values()), errors
    with pytest.raises(ValueError, match="float32"):
        column_sums(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="same rows"):
        column_sums(torch.randn(4, 4), torch.randn(5, 4))
    with pytest.raises(ValueError, match="contiguous"):
        column_sums(torch.randn(8, 6)[:, ::2])
    return errors


def child() -> None:
    run_checks({"column_sums": check})


def test_column_sums_in_the_interpreter():
    r = child_results("tests.test_column_sums")["column_sums"]
    assert r["ok"], r["out"]
