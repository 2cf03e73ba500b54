"""Tensors' addresses in a device table, refreshed per call without the host waiting for the GPU: what our
multi-tensor Triton kernels (components/adamw_triton.py, components/sumsq_triton.py) read to find tensors that are new
every step (the gradients)."""

from __future__ import annotations

import torch

__all__ = ["DeviceAddressTable", "addresses"]


def addresses(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in tensors)


class DeviceAddressTable:
    """n addresses on the device, refreshed by `update` from pinned host buffers taken in turn; a buffer is reused only
    after its copy (`slots` calls ago) has run, which the host checks with an event, not a sync. The device table is
    one buffer, rewritten in stream order: a kernel launched after `update` on the same stream reads that call's
    addresses."""

    def __init__(self, n: int, device: torch.device, slots: int = 3):
        self.device = device
        self.table = torch.empty(n, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self.host = [torch.empty(n, dtype=torch.int64, pin_memory=pin) for _ in range(slots)]
        self.copied: list[torch.cuda.Event | None] = [None] * slots
        self.turn = 0

    def update(self, values: tuple[int, ...]) -> torch.Tensor:
        """Writes `values` (the tensors' addresses, in table order) and returns the device table."""
        k = self.turn % len(self.host)
        self.turn += 1
        if self.copied[k] is not None:
            self.copied[k].synchronize()  # that copy ran calls ago: returns at once unless the GPU is far behind
        self.host[k].copy_(torch.tensor(values, dtype=torch.int64))
        self.table.copy_(self.host[k], non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            self.copied[k] = torch.cuda.Event()
            self.copied[k].record()
        return self.table
