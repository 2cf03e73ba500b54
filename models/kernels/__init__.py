"""Kernels: mamba_ssm / causal_conv1d on CUDA (imported lazily), pure-PyTorch references elsewhere."""

from models.kernels.cuda import cuda_kernels_available
from models.kernels.ops import (
    BACKENDS,
    add_rmsnorm,
    causal_conv1d,
    mamba_split_conv1d_scan,
    rmsnorm_gated,
    ssd_chunk_scan,
    use_cuda_kernels,
)
from models.kernels.reference import (
    add_rmsnorm_ref,
    causal_conv1d_ref,
    mamba_split_conv1d_scan_ref,
    rmsnorm_gated_ref,
    ssd_chunk_scan_ref,
)

__all__ = [
    "BACKENDS",
    "cuda_kernels_available",
    "use_cuda_kernels",
    "ssd_chunk_scan",
    "causal_conv1d",
    "rmsnorm_gated",
    "add_rmsnorm",
    "mamba_split_conv1d_scan",
    "ssd_chunk_scan_ref",
    "causal_conv1d_ref",
    "rmsnorm_gated_ref",
    "add_rmsnorm_ref",
    "mamba_split_conv1d_scan_ref",
]
