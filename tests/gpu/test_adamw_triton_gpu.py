"""optimizer.implementation "triton" compiled on a GPU: five steps equal to torch's fused AdamW (two groups, a skipped
step, the clipping divisor, a changing learning rate, a state reload, a tensor of hundreds of blocks): the CPU test's
check (tests/test_adamw_triton.py) on CUDA tensors."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("triton")


def test_triton_adamw_equals_fused_adamw_on_cuda():
    from tests.test_adamw_triton import check

    check("cuda")


def test_triton_adamw_writes_current_weight_copies_on_cuda():
    from tests.test_adamw_triton import check_weight_copies

    check_weight_copies("cuda")
