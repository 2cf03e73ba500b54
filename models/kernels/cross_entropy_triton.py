"""lm_head + summed token cross-entropy as one autograd Function whose forward also makes the gradients (Triton row
kernel, cuBLAS products): model.kernels "auto" / "triton" on CUDA, through ops.linear_cross_entropy_sum.

Contract: models.loss.cross_entropy_sum(F.linear(h, weight), labels) under the caller's autocast: the logits in the
compute dtype (autocast's, else h's), each row's log-sum-exp and loss in float32, labels equal to IGNORE_INDEX not
counted, the sum in float32. Labels must lie in [0, V) (F.cross_entropy asserts on the device; here a label out of
range reads a clamped column: the data pipeline's vocabulary check is what guards it).

How, per chunk of `chunk_rows` rows (all rows when 0): cuBLAS writes the logits [n, V] in the compute dtype; one
program per row reads its row twice: first the log-sum-exp (running maxima and sums per lane, in float32) and the
row's loss, then softmax - onehot (the loss's gradient with respect to the row's logits; 0 on ignored rows) written
over the logits in place. cuBLAS then forms dh = G weight and dweight = G^T h in float32 (mm out_dtype); with
chunks, dh's rows go chunk by chunk into one buffer and dweight is summed over the chunks by cuBLAS itself where
torch's addmm takes a float32 input (autocast_linear.add_mm_float32_), so no [V, D] product is kept beside the sum
and dh is never copied whole. The backward only multiplies them by the incoming gradient (a scalar: the trainer's
1 / tokens).
Against lm_head followed by F.cross_entropy on float32 logits, this never makes the float32 logits, their
log-softmax and its gradient (at the 1.3B's 16384 tokens x 50288 vocabulary three 3 GiB tensors, the step's memory
peak, and ~30 GB of memory traffic), nor a 16-bit weight gradient cast to float32. Measured: docs/ssd_sessions.md,
session 21.
Imports triton at import time: import this module lazily (ops.linear_cross_entropy_sum does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.kernels._utils import no_autocast
from models.kernels.autocast_linear import add_mm_float32_, mm_float32
from models.kernels.fast_launch import cdiv, fast_launch
from models.kernels.pdl import pdl_prologue
from models.kernels.weight_copies import compute_weight

__all__ = ["linear_cross_entropy_triton"]

# Columns per step of a row's loops and warps per program (H100: bench_loss.py --tune in session 21; 16 warps since
# session 57's per-lane sums, .scratch timings in docs/ssd_sessions.md).
BLOCK_V = 4096
WARPS = 16
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # exp(u) as exp2(u * LOG2E): one MUFU.EX2, no range fix-ups


@fast_launch
@triton.jit
def _cross_entropy_rows_kernel(LOGITS, LABELS, LOSS, stride_row, V, ignore_index,
                               WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Row r of LOGITS [n, V]: LOSS[r] = logsumexp(row) - row[label] (0 if the label is ignore_index) in float32;
    with WRITE_GRAD the row becomes softmax(row) - onehot(label) (0 if ignored), in LOGITS' dtype."""
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    # Each lane keeps its own running max m and sum s of exp(x - m) over the row's blocks, combined across the
    # program once at the end: the loop is loads and element-wise work only, with no reduction across warps (two
    # per block before), so more of the row's loads are in flight (H100, 1.3B's 16384 x 50280 rows: 2.36 -> 1.79 ms
    # with 16 warps; docs/ssd_sessions.md, session 57). m starts finite, so a lane that sees only the masked tail
    # (-inf) never subtracts -inf from -inf; its s stays 0 and adds nothing.
    m = tl.full((BLOCK_V,), -1.0e30, tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp2((m - m_new) * LOG2E) + tl.exp2((x - m_new) * LOG2E)
        m = m_new
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(s * tl.exp2((m - m_row) * LOG2E), axis=0))
    label = tl.load(LABELS + row).to(tl.int64)
    valid = label != ignore_index
    column = tl.minimum(tl.maximum(label, 0), V - 1)  # in bounds whatever the label (see the module docstring)
    x_label = tl.load(base + column).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - x_label, 0.0))
    if WRITE_GRAD:
        for start in range(0, V, BLOCK_V):
            c = start + cols
            x = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(c == label, 1.0, 0.0)
            tl.store(base + c, tl.where(valid, g, 0.0).to(LOGITS.dtype.element_ty), mask=c < V)


@fast_launch
@triton.jit
def _scaled_kernel(X, SCALE, OUT, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """OUT = X * SCALE[0] in OUT's dtype (the scale read on the device: no host sync)."""
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0)
    tl.store(OUT + offs, (x * tl.load(SCALE)).to(OUT.dtype.element_ty), mask=mask)


def scaled(x32: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(x32 * scale).to(dtype) for a contiguous float32 x32 and a one-element float32 scale, in one pass. PyTorch's
    product with a 0-dim CUDA tensor runs its unvectorised kernel, and the cast is a second pass over the result: at
    the 1.3B's dh and lm_head weight gradient 0.52 ms a step against ~0.33 here (docs/ssd_sessions.md, session 51)."""
    if x32.dtype != torch.float32 or not x32.is_contiguous() or scale.numel() != 1:
        return (x32 * scale).to(dtype)
    out = torch.empty(x32.shape, device=x32.device, dtype=dtype)
    block = 4096
    _scaled_kernel[(cdiv(x32.numel(), block),)](
        x32, scale.to(torch.float32).reshape(1), out, x32.numel(), BLOCK=block, num_warps=8
    )
    return out


def cross_entropy_rows(logits_NV: torch.Tensor, labels_N: torch.Tensor, ignore_index: int, write_grad: bool):
    """Each row's float32 loss [N] (see the kernel); with write_grad, logits_NV (last dim contiguous) is overwritten
    by the loss's gradient with respect to it."""
    N, V = logits_NV.shape
    loss_N = torch.empty(N, device=logits_NV.device, dtype=torch.float32)
    if N:
        _cross_entropy_rows_kernel[(N,)](
            logits_NV, labels_N, loss_N, logits_NV.stride(0), V, ignore_index,
            WRITE_GRAD=write_grad, BLOCK_V=min(BLOCK_V, triton.next_power_of_2(V)), num_warps=WARPS,
        )  # fmt: skip
    return loss_N


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, weight_VD, labels_N, chunk_rows, compute_dtype, ignore_index, want_dh, want_dw, handoff):
        N, V = h_ND.shape[0], weight_VD.shape[0]
        h, w = h_ND.to(compute_dtype), compute_weight(weight_VD, compute_dtype)  # a current copy, else a cast
        want_grad = want_dh or want_dw
        rows_per_chunk = min(chunk_rows, N) if chunk_rows > 0 else N
        logits_buf = torch.empty(rows_per_chunk, V, device=h.device, dtype=compute_dtype)
        # dh's float32 rows written chunk by chunk into one buffer, lm_head's weight gradient summed over the chunks
        # in its own (add_mm_float32_: cuBLAS adds into it where it can), so chunks keep no [V, D] product beside the
        # sum and no copies of dh's parts; one chunk (the default) makes both as single products
        chunked = rows_per_chunk < N
        dh32 = torch.empty(N, h.shape[1], device=h.device, dtype=torch.float32) if want_dh and chunked else None
        dw32 = None
        losses, logits = [], None
        for start in range(0, N, max(rows_per_chunk, 1)):
            rows = slice(start, min(N, start + rows_per_chunk))
            logits = logits_buf[: rows.stop - rows.start]
            torch.mm(h[rows], w.t(), out=logits)
            losses.append(cross_entropy_rows(logits, labels_N[rows], ignore_index, want_grad))
            if want_dh:  # G w: [n, V] @ [V, D]
                if chunked:
                    dh32[rows] = mm_float32(logits, w)
                else:
                    dh32 = mm_float32(logits, w)
            if want_dw:  # G^T h: [V, n] @ [n, D]
                dw32 = mm_float32(logits.t(), h[rows]) if dw32 is None else add_mm_float32_(dw32, logits.t(), h[rows])
        del logits_buf, logits  # the buffer freed before the backward
        if not losses:  # no rows: a zero loss and zero gradients
            losses = [torch.zeros(0, device=h.device, dtype=torch.float32)]
            dh32 = torch.zeros(0, h.shape[1], device=h.device, dtype=torch.float32) if want_dh else None
            dw32 = torch.zeros(V, h.shape[1], device=h.device, dtype=torch.float32) if want_dw else None
        ctx.save_for_backward(dh32, dw32)
        ctx.dtypes = (h_ND.dtype, weight_VD.dtype)
        ctx.handoff = handoff
        loss_N = losses[0] if len(losses) == 1 else torch.cat(losses)
        return loss_N.sum()

    @staticmethod
    def backward(ctx, dloss):
        dh32, dw32 = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        dh = None if dh32 is None else scaled(dh32, dloss, h_dtype)
        dw = None if dw32 is None else scaled(dw32, dloss, w_dtype)
        if dw is not None and ctx.handoff is not None:
            ctx.handoff.give(dw)  # the tied embedding's backward adds its rows into it (tied_embedding.py)
        return dh, dw, None, None, None, None, None, None, None


def linear_cross_entropy_triton(
    h_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor,
    chunk_rows: int,
    ignore_index: int,
    grad_handoff=None,
) -> torch.Tensor:
    """sum over labelled rows of CE(h @ weight^T, label), a float32 scalar; h [N, D], weight [V, D], labels [N]
    (int). chunk_rows > 0 bounds the logits buffer to [chunk_rows, V]; 0 = all rows at once. grad_handoff: a
    tied_embedding.GradHandoff that the backward gives the weight's gradient to (the tied embedding's rows are then
    added into it in place)."""
    if h_ND.dim() != 2 or weight_VD.dim() != 2 or h_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(f"h [N, D] and weight [V, D] expected, got {tuple(h_ND.shape)} and {tuple(weight_VD.shape)}")
    if labels_N.shape != h_ND.shape[:1]:
        raise ValueError(f"labels must be [N] = [{h_ND.shape[0]}], got {tuple(labels_N.shape)}")
    dev = h_ND.device
    autocast = dev.type == "cuda" and torch.is_autocast_enabled("cuda")
    compute_dtype = torch.get_autocast_dtype("cuda") if autocast else h_ND.dtype
    grad_on = torch.is_grad_enabled()
    want_dh, want_dw = grad_on and h_ND.requires_grad, grad_on and weight_VD.requires_grad
    with no_autocast(dev):
        return _LinearCrossEntropy.apply(
            h_ND, weight_VD, labels_N.contiguous(), int(chunk_rows), compute_dtype, int(ignore_index), want_dh, want_dw,
            grad_handoff,
        )  # fmt: skip
