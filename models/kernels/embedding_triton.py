"""The token embedding's weight gradient added into an existing [V, D] tensor, deterministically: target[ids[n]] +=
grad[n] for every row n.

Why: with tied embeddings (the 1.3B) the fused loss's backward already makes the head's float32 weight gradient
(cross_entropy_triton.py); torch's embedding backward then zero-fills a second [V, D] float32 tensor (412 MB at the
1.3B's 50,288 x 2,048), scatters the rows' gradients into it, and autograd adds the two: 124 + 266 + 398 us of an
H100 step (docs/ssd_sessions.md, session 51). Adding the rows into the loss's gradient in place reads the rows once
and touches only the rows of tokens that occur (models/kernels/tied_embedding.py hands the tensor over).

Deterministic like torch's (no float atomics): the positions are sorted by token id (stable), so each token's
occurrences form one run; programs take CHUNK consecutive sorted positions and sum each run inside their chunk with
a segmented scan. A run that begins and ends in one chunk is added by that chunk's program (no other program touches
that token's row). A run that crosses chunks is finished by a second launch: the chunk where it begins left its part
in `tails`, each chunk it continues into its part in `heads`, and the owner sums them in chunk order. The order of
every sum is fixed by the sort: run to run the same bits.

Imports triton at import time: import this module lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.kernels.fast_launch import cdiv, fast_launch
from models.kernels.pdl import pdl_prologue

__all__ = ["embedding_grad_add_"]

# Sorted positions per program (the scan's length) and columns per program.
_CHUNK = 32
_BLOCK_D = 128


@triton.jit
def _segmented_add(v1, start1, v2, start2):
    """Combine of a segmented inclusive sum: a segment start resets the running sum."""
    return tl.where(start2 != 0, v2, v1 + v2), start1 | start2


@fast_launch
@triton.jit
def _embedding_grad_chunks_kernel(
    TARGET, GRAD, SORTED_IDS, ORDER, HEADS, TAILS, N, D, stride_t, stride_g,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Per chunk of sorted positions: runs wholly inside it added to TARGET; the part of a run continued from the
    previous chunk to HEADS[chunk], of a run that continues into the next chunk (and began here) to TAILS[chunk]."""
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = cols < D
    rows = tl.arange(0, CHUNK)
    pos = chunk * CHUNK + rows
    valid = pos < N
    ids = tl.load(SORTED_IDS + pos, mask=valid, other=-1)
    prev_ids = tl.load(SORTED_IDS + pos - 1, mask=valid & (pos > 0), other=-1)
    next_ids = tl.load(SORTED_IDS + pos + 1, mask=pos + 1 < N, other=-1)
    src = tl.load(ORDER + pos, mask=valid, other=0)
    g = tl.load(GRAD + src.to(tl.int64)[:, None] * stride_g + cols[None, :], mask=valid[:, None] & mask_d[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    starts = (ids != prev_ids) | (rows == 0)  # a run's first row within this chunk
    flags = tl.broadcast_to(starts.to(tl.int32)[:, None], (CHUNK, BLOCK_D))
    sums, _ = tl.associative_scan((g, flags), 0, _segmented_add)
    ends = valid & ((ids != next_ids) | (rows == CHUNK - 1))  # a run's last row within this chunk
    before_id = tl.load(SORTED_IDS + chunk * CHUNK - 1, mask=chunk > 0, other=-1)
    continued = ids == before_id  # the run began in an earlier chunk (only the first run can)
    continues = ids == next_ids  # at an end row: the run goes on in the next chunk
    whole = ends & ~continued & ~continues
    t_ptrs = TARGET + ids.to(tl.int64)[:, None] * stride_t + cols[None, :]
    m_whole = whole[:, None] & mask_d[None, :]
    old = tl.load(t_ptrs, mask=m_whole, other=0.0).to(tl.float32)
    tl.store(t_ptrs, (old + sums).to(TARGET.dtype.element_ty), mask=m_whole)
    out = chunk.to(tl.int64) * D + cols[None, :]
    tl.store(HEADS + out + rows[:, None] * 0, sums, mask=(ends & continued)[:, None] & mask_d[None, :])
    tl.store(TAILS + out + rows[:, None] * 0, sums, mask=(ends & ~continued & continues)[:, None] & mask_d[None, :])


@fast_launch
@triton.jit
def _embedding_grad_runs_kernel(
    TARGET, SORTED_IDS, HEADS, TAILS, N, D, stride_t,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Per chunk whose last run began in it and continues: that run's parts summed in chunk order, added to TARGET."""
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    chunk = tl.program_id(0)
    last = chunk * CHUNK + CHUNK - 1
    if last + 1 < N:
        run_id = tl.load(SORTED_IDS + last)
        first_id = tl.load(SORTED_IDS + chunk * CHUNK)
        before_id = tl.load(SORTED_IDS + chunk * CHUNK - 1, mask=chunk > 0, other=-1)
        began_here = (run_id != first_id) | (first_id != before_id)
        if began_here & (tl.load(SORTED_IDS + last + 1) == run_id):
            cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
            mask_d = cols < D
            acc = tl.load(TAILS + chunk.to(tl.int64) * D + cols, mask=mask_d, other=0.0)
            k = chunk + 1
            going = chunk >= 0  # (true; a tensor, as the loop keeps it)
            while going:  # the run's part in chunk k, then on while it fills chunk k and continues after it
                acc += tl.load(HEADS + k.to(tl.int64) * D + cols, mask=mask_d, other=0.0)
                k_last = k * CHUNK + CHUNK - 1
                going = (k_last + 1 < N) & (tl.load(SORTED_IDS + k_last, mask=k_last < N, other=-1) == run_id)
                going = going & (tl.load(SORTED_IDS + k_last + 1, mask=k_last + 1 < N, other=-1) == run_id)
                k += 1
            t_ptrs = TARGET + run_id.to(tl.int64) * stride_t + cols
            old = tl.load(t_ptrs, mask=mask_d, other=0.0).to(tl.float32)
            tl.store(t_ptrs, (old + acc).to(TARGET.dtype.element_ty), mask=mask_d)


def embedding_grad_add_(target_VD: torch.Tensor, ids: torch.Tensor, grad_ND: torch.Tensor) -> torch.Tensor:
    """target[ids[n]] += grad[n] for n over the flattened ids (float32 sums; target and grad of any float dtype,
    each row contiguous); returns target. Ids must lie in [0, V) (torch.nn.Embedding's forward checked them)."""
    ids_N = ids.reshape(-1)
    grad_ND = grad_ND.reshape(ids_N.shape[0], -1)
    N, D = grad_ND.shape
    if target_VD.dim() != 2 or target_VD.shape[1] != D or target_VD.stride(1) != 1 or grad_ND.stride(1) != 1:
        raise ValueError(
            f"embedding_grad_add_: target [V, {D}] and grad [N, {D}] with contiguous rows expected, got "
            f"{tuple(target_VD.shape)} (strides {target_VD.stride()}) and {tuple(grad_ND.shape)}"
        )
    if N == 0:
        return target_VD
    sorted_ids, order = torch.sort(ids_N, stable=True)
    chunks = cdiv(N, _CHUNK)
    heads = torch.empty(chunks, D, device=grad_ND.device, dtype=torch.float32)
    tails = torch.empty(chunks, D, device=grad_ND.device, dtype=torch.float32)
    grid = (chunks, cdiv(D, _BLOCK_D))
    _embedding_grad_chunks_kernel[grid](
        target_VD, grad_ND, sorted_ids, order, heads, tails, N, D, target_VD.stride(0), grad_ND.stride(0),
        CHUNK=_CHUNK, BLOCK_D=_BLOCK_D, num_warps=4,
    )  # fmt: skip
    _embedding_grad_runs_kernel[grid](
        target_VD, sorted_ids, heads, tails, N, D, target_VD.stride(0), CHUNK=_CHUNK, BLOCK_D=_BLOCK_D, num_warps=4
    )
    return target_VD
