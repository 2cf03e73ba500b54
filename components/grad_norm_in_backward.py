"""training.grad_norm_in_backward: the global gradient norm's sums of squares taken DURING the step's last backward
(one process on CUDA), on a side stream, as autograd writes each gradient.

Why: after the backward the norm reads every gradient once more before AdamW can start (parallelisms/grad_norm.py,
one Triton launch: ~1.8 ms of the 1.3B's step on an H100, all of it exposed). Read as they arrive, in groups of
~`bucket_bytes`, those reads run beside the backward's compute-bound products; what stays exposed is the last group
(the embedding's gradient, written last) and the reduction of the partial sums.

Bit for bit `global_grad_norm`: every block's partial sum lands in the slot that the one launch over all the
gradients gives it (components/sumsq_triton.py `partials_into`), and after the backward the same sums reduce the same
buffers. The slots follow the previous step's gradients (which parameters have one, their dtypes and sizes, in
parameter order): the first step, and a step whose gradients differ from the last one's (or arrive unusable:
non-contiguous, another dtype), takes `global_grad_norm` instead and learns the new layout. The gradients must not
change after autograd writes them: one process, no DDP / FSDP reduction, no pipeline (train.py builds this only there;
configs/job_config.py's field says so).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

from parallelisms.grad_norm import global_grad_norm, is_counted_in_norm, sum_of_dtype_sums

__all__ = ["GradNormInBackward"]

BUCKET_BYTES = 64 << 20  # gradient bytes per side-stream launch: ~60 launches at the 1.3B
# Programs per side-stream launch, each summing every SIDE_PROGRAMS-th block: a full grid (a program a block) fills
# every SM's free slots and delayed the backward's own kernels by more than it saved (1.3B on an H100: -0.44%, session
# 66); the backward needs only ~15 GB/s of the gradients' reads. The last group, after the backward, takes a full grid.
SIDE_PROGRAMS = 32


class _Layout:
    """Where each counted gradient's partial sums go: one float32 buffer per gradient dtype (dtypes in the order of
    their first gradient, as global_grad_norm groups them), a parameter's blocks from its first slot on."""

    def __init__(self, params: list[torch.Tensor], block: int, device: torch.device):
        from components.sumsq_triton import programs

        self.key = _grads_key(params)
        self.slot: dict[int, tuple[torch.dtype, int, int]] = {}  # id(param) -> (dtype, numel, first slot)
        used: dict[torch.dtype, int] = defaultdict(int)
        for p in params:
            g = p.grad
            if g is None or not is_counted_in_norm(p):
                continue
            self.slot[id(p)] = (g.dtype, g.numel(), used[g.dtype])
            used[g.dtype] += programs(g.numel(), block)
        self.partials = {dtype: torch.empty(n, dtype=torch.float32, device=device) for dtype, n in used.items()}


def _grads_key(params: list[torch.Tensor]) -> tuple:
    """What the layout depends on: each counted parameter's gradient dtype and size (None without one)."""
    return tuple(
        (p.grad.dtype, p.grad.numel()) if p.grad is not None and is_counted_in_norm(p) else None for p in params
    )


class GradNormInBackward:
    """`arm()` before the step's last backward, `norm()` after it: the global gradient norm (a 0-d float32 device
    tensor, no host sync), its sums of squares taken on `stream` as the gradients arrive (CPU tensors: on the one
    stream, for the tests under Triton's interpreter)."""

    def __init__(self, params: list[torch.Tensor], device: torch.device, bucket_bytes: int = BUCKET_BYTES,
                 side_programs: int = SIDE_PROGRAMS, block: int | None = None,
                 num_warps: int | None = None):  # fmt: skip
        from components import sumsq_triton  # lazy: imports triton

        self.params = [p for p in params if p.requires_grad]
        if device.type == "cuda" and device.index is None:  # "cuda": the gradients' device reads "cuda:<index>"
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.side_programs = side_programs
        self.sumsq = sumsq_triton.TableSumOfSquares(
            block=block or sumsq_triton.BLOCK, num_warps=num_warps or sumsq_triton.WARPS
        )
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.layout: _Layout | None = None
        self.armed = False
        self.launches = 0  # side-stream launches in the last armed backward (for tests and benchmarks)
        self.in_backward = False  # whether the last norm() came from the backward's sums (else global_grad_norm's)
        self._pending: dict[torch.dtype, list[tuple[torch.Tensor, int]]] = defaultdict(list)
        self._pending_bytes = 0
        self._arrived = 0
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.params]

    def arm(self) -> None:
        """The next backward writes the step's final gradients: take their sums of squares as they arrive."""
        self.armed = self.layout is not None
        self.launches = 0
        self._arrived = 0
        self._pending.clear()
        self._pending_bytes = 0

    def _on_gradient(self, p: torch.Tensor) -> None:
        if not self.armed or not is_counted_in_norm(p):
            return
        g = p.grad
        slot = self.layout.slot.get(id(p))
        if slot is None or slot[:2] != (g.dtype, g.numel()) or not g.is_contiguous() or g.device != self.device:
            self.armed = False  # not the layout's gradients: norm() takes global_grad_norm
            return
        self._arrived += 1
        self._pending[g.dtype].append((g, slot[2]))
        self._pending_bytes += g.numel() * g.element_size()
        if self._pending_bytes >= self.bucket_bytes:
            self._launch()

    def _launch(self, whole_gpu: bool = False) -> None:
        """The pending gradients' partial sums into their slots, on the side stream once the gradients are written:
        in `side_programs` programs during the backward, a program a block after it (`whole_gpu`)."""
        if not self._pending:
            return
        max_programs = None if whole_gpu else self.side_programs
        ctx = contextlib.nullcontext()
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the gradients are written
            ctx = torch.cuda.stream(self.stream)
        with ctx:
            for dtype, items in self._pending.items():
                self.sumsq.partials_into(
                    [g for g, _ in items],
                    self.layout.partials[dtype],
                    tuple(first for _, first in items),
                    max_programs,
                )
                self.launches += 1
        self._pending.clear()
        self._pending_bytes = 0

    def norm(self) -> torch.Tensor:
        """After the backward: the global gradient norm, as parallelisms.grad_norm.global_grad_norm gives it."""
        armed, self.armed = self.armed, False
        if armed:
            self._launch(whole_gpu=True)  # the last group, the backward done: the whole GPU
            if self.stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
        layout = self.layout
        if armed and layout.slot and self._arrived == len(layout.slot) and _grads_key(self.params) == layout.key:
            self.in_backward = True
            local_sq = sum_of_dtype_sums([buf.sum() for buf in layout.partials.values()])
            return (torch.zeros((), dtype=torch.float32, device=self.device) + local_sq).sqrt()
        self.in_backward = False
        self.layout = _Layout(self.params, self.sumsq.block, self.device)  # for the next step
        return global_grad_norm(self.params)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
