"""Small helpers shared by the references and the Triton kernels' launchers."""

from __future__ import annotations

import contextlib
import functools

import torch

# Device types torch.autocast accepts; others (meta, used for shape inference) have no autocast to turn off.
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def no_autocast(device: torch.device):
    """Disable autocast inside a reference: the GPU kernels ignore it and compute in float32 themselves."""
    if device.type in _AUTOCAST_DEVICES:
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def can_inspect_values(t: torch.Tensor) -> bool:
    """Whether a data-dependent check may read t's values (not on meta tensors, not while tracing for compile)."""
    return t.device.type != "meta" and not torch.compiler.is_compiling()


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere: Triton's interpreter on the CPU), asked once."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def warps_for_row(block: int, elems_per_thread: int) -> int:
    """Warps of a program that spreads a row block of `block` elements over its threads, `elems_per_thread` each
    (1 to 16): the norms' launch shape."""
    return min(max(block // (32 * elems_per_thread), 1), 16)


def rows_in_flight(row_bytes: int, fixed: int | None = None) -> int:
    """Software-pipelining stages of a loop over rows that loads `row_bytes` per row (the norms' backwards): `fixed`
    where given (a module's tuning override), else about 72 KB in flight, 2 to 4 rows (H100, gated norm: 3 at the
    1.3B's 24 KB rows, 0.292 ms against 0.301 with 4; 4 at the 370M's 12 KB, 0.155 ms against 0.173 with 3; without
    pipelining ~0.39 ms at the 1.3B), or 1 (none) when two rows would not fit in shared memory."""
    if fixed is not None:
        return fixed
    if 2 * row_bytes > 160 * 1024:
        return 1
    return min(4, max(2, 72 * 1024 // row_bytes))
