"""Launchers of the backward kernels: the chunked SSD's gradients, up to what dt.py's backward kernel turns into
those of dt, A and dt_bias (autograd.py's ssd_backward_pass calls both).

Order (forward.py's recompute first): CB and CBᵀ, and the states entering each chunk S_in (recomputed, or the
forward's with config keep_states) -> dS_in and the reverse recurrence between chunks, chained in one kernel
(chained_dstates.py; or staged, state_passing.py) -> dx / ddt / dD (chunk_scan_bwd.py) ->
dC's state term, the decay terms O and R, and dCB summed over the heads of each group (dcb_bwd.py; on a second
stream beside the recurrence, dx and dB with config overlap_dcb) -> dB's state term (db_bwd.py) -> dC, dB += dCB B,
dCBᵀ C in one kernel per group (bc_finish.py).
"""

from __future__ import annotations

import functools

import torch

from models.kernels.fast_launch import cdiv, next_power_of_2
from models.kernels.ssd_triton.bc_finish import bc_finish_kernel
from models.kernels.ssd_triton.chained_dstates import chained_dstates
from models.kernels.ssd_triton.chunk_scan_bwd import chunk_scan_bwd_dx_kernel
from models.kernels.ssd_triton.config import BlockConfig, heads_per_program, whole_tiles
from models.kernels.ssd_triton.db_bwd import chunk_state_bwd_db_kernel
from models.kernels.ssd_triton.dcb_bwd import chunk_scan_bwd_dcb_kernel
from models.kernels.ssd_triton.dt import ColumnParts
from models.kernels.ssd_triton.forward import cb_and_entering_states, cb_for_backward, states_a2dt
from models.kernels.ssd_triton.launch import dot_precision, dummy, grid
from models.kernels.ssd_triton.state_passing import staged_dstates

__all__ = ["ssd_backward_kernels", "side_stream"]


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream dCB runs on with config overlap_dcb (one per device, made once)."""
    return torch.cuda.Stream(device)


def ssd_backward_kernels(dy, dfinal, x, dt_p, dA_cs, B, C, D, seq, init, Q: int, cfg: BlockConfig, dy_exact=None,
                         out=None, S_kept=None, a2dt=None):  # fmt: skip
    """The chunked SSD's gradients from its kernels (module docstring): (dx, ddt_p, the decay gradient's parts for
    dt.dt_backward, dB, dC, (dD, dD's partial sums), dinit). dy_exact: dy before its rounding to x's dtype (the
    kernels' operands), when it was more precise; dD is then summed from it (D of [H, P] sums few terms per entry,
    so that rounding would show). out: (dx, dB, dC) to write into (any strides; the mixer's views of one buffer),
    else they are allocated. S_kept: the forward's entering states (config keep_states; [K, B, NC, H, P, N],
    state_passing.kept_states_buffer), else they are recomputed.
    a2dt: dt folded into the decay's exponent for dCB (dt.py; config fold_dt), else None."""
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    NC = dt_p.shape[2]
    dev = x.device
    has_seq = seq is not None
    seq_arg = seq if has_seq else dummy(dev)
    BP, BN = max(16, next_power_of_2(P)), max(16, next_power_of_2(N))
    S_lo = None  # the low part of kept states; S_in32 then holds their high part, S_in
    if S_kept is None:
        CB, CBT, S_in, S_in32 = cb_and_entering_states(x, dt_p, dA_cs, B, C, seq, init, cfg, a2dt)
    else:
        CB, CBT = cb_for_backward(x, B, C, seq, Q, NC, cfg)
        S_in = S_in32 = S_kept[0]
        S_lo = S_kept[1] if S_kept.shape[0] == 2 else None
    # dC (and the per-head a_l gradient), then dB; summed over head blocks.
    R = H // G
    hpp = heads_per_program(R, cfg.heads_per_prog)
    n_hb = R // hpp
    dC_part = torch.empty(n_hb, b, L, G, N, device=dev, dtype=torch.float32)  # dC's state term per head block
    O = torch.empty_like(dt_p)  # noqa: E741 - the docstring's O (and R)
    n_m = cdiv(Q, cfg.dc_m)
    col_parts = cfg.dcb_col_parts  # column sums below (and on) the diagonal in partial sums over row groups
    # Tiles above the diagonal are not written: bc_finish reads the tiles on and below it only.
    dCB_part = torch.empty(n_hb, b, NC, G, Q, Q, device=dev, dtype=torch.float32)
    # Row and column sums of the intra-chunk decay terms, every entry written once (dcb_bwd.py), and the column
    # sums' extra partial-sum slots.
    n_diag = col_parts if cfg.dcb_diag_col_parts and col_parts > 1 else 0  # the diagonal's parts
    n_slots = n_m + (n_m - 1) * (col_parts - 1) + n_diag
    R_part = torch.empty(n_slots, *dt_p.shape, device=dev, dtype=torch.float32)

    # One launch for the tiles and the state term's programs, or (config dcb_state_apart) the state term first and
    # the tiles after it, each with its own register cap (dcb_bwd.py's PART): (PART, grid's last axis, cap).
    if cfg.dcb_state_apart:
        dcb_parts = ((2, 1, cfg.dc_state_maxnreg), (1, n_m, cfg.dc_maxnreg))
    else:
        dcb_parts = ((0, n_m + 1, cfg.dc_maxnreg),)

    def launch_dcb():
        for part, n_k, maxnreg in dcb_parts:
            dcb_grid = grid(b * NC * G * n_hb, n_m, n_k, cfg.inner_first)
            chunk_scan_bwd_dcb_kernel[dcb_grid](
                dy,
                x,
                dt_p if a2dt is None else a2dt,
                dA_cs,
                C,
                CB,
                S_in,
                seq_arg,
                dC_part,
                dCB_part,
                O,
                R_part,
                L,
                Q,
                NC,
                H,
                G,
                P,
                N,
                hpp,
                b,
                *x.stride(),
                *C.stride(),
                *dy.stride(),
                HAS_SEQ=has_seq,
                EVEN=whole_tiles(L, Q, P, BP, cfg.dc_m),
                PREC=dot_precision(x),
                BLOCK_M=cfg.dc_m,
                BLOCK_P=BP,
                BLOCK_N=BN,
                INNER_FIRST=cfg.inner_first,
                HEADS_STAGES=cfg.dcb_heads_stages,
                COL_PARTS=col_parts,
                DIAG_PARTS=cfg.dcb_diag_col_parts,
                FOLD_DT=a2dt is not None,
                PART=part,
                num_warps=cfg.dc_warps,
                maxnreg=maxnreg,
                num_stages=cfg.dc_stages,
            )

    # dCB needs neither dH nor dx: with config overlap_dcb it runs on a second stream beside the chained dstates
    # (latency-bound, below the power limit), dx and dB, and the stream joins before bc_finish. Every tensor it
    # reads or writes is referenced by launch_dcb until after the join, so none is freed while it runs. Also while a
    # CUDA graph is captured (training.cuda_graph): the fork and join are captured as the graph's edges (session 43's
    # test_dcb_on_a_second_stream_inside_a_cuda_graph). Launching the chained dstates first and dCB after it (from the
    # same fork point) was no faster: SSD 1.398-1.401 against 1.391-1.401 ms (H100, session 50). Session 60 (H100,
    # 1.3B end to end, three alternating rounds, medians): this fork 49,013 tokens/s; one stream 48,778 (-0.48%);
    # dCB forked after dx and launched after dB, so that dx runs alone and dB beside dCB, 48,911 (-0.21%); the
    # dstates, dx and dB on a priority -1 stream with dCB forked here 48,760 (-0.52%). Results bit for bit equal.
    side = None
    if cfg.overlap_dcb and dev.type == "cuda":
        side = side_stream(dev)
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            launch_dcb()
    # dH (gradient of each chunk's end state), dinit, and the a_last terms dtot (partial sums per block; from the
    # float32 S_in, state_passing.py says why).
    if cfg.chained:
        dH, dinit, dtot = chained_dstates(dy, dfinal, dA_cs, C, seq, S_in32, cfg, S_lo)
    else:
        dH, dinit, dtot = staged_dstates(dy, dfinal, dA_cs, C, seq, S_in32, cfg, S_lo)
    del S_in32, S_lo

    # dx, ddt, dD.
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out[0]
    ddt = torch.empty_like(dt_p)
    q = torch.empty_like(dt_p)
    n_k = cdiv(Q, cfg.dx_k)
    dD_part = torch.empty(b * NC * n_k, *D.shape, device=dev, dtype=torch.float32) if D is not None else dummy(dev)
    dx_heads = heads_per_program(H // G, min(cfg.dx_heads, 2))
    chunk_scan_bwd_dx_kernel[grid(b * NC * H // dx_heads, n_k, 1, cfg.inner_first)](
        CBT,
        x,
        dt_p,
        dA_cs,
        B,
        dy,
        dH,
        D if D is not None else dummy(dev),
        seq_arg,
        dx,
        ddt,
        q,
        dD_part,
        L,
        Q,
        NC,
        H,
        G,
        P,
        N,
        *x.stride(),
        *B.stride(),
        *dy.stride(),
        *dx.stride(),
        HAS_SEQ=has_seq,
        HAS_D=D is not None,
        D_HAS_HDIM=D is not None and D.dim() == 2,
        EVEN=whole_tiles(L, Q, P, BP, cfg.dx_k, cfg.dx_m),
        HEADS=dx_heads,
        BLOCK_K=cfg.dx_k,
        BLOCK_M=cfg.dx_m,
        BLOCK_P=BP,
        BLOCK_N=cfg.dx_n,
        INNER_FIRST=cfg.inner_first,
        DX_STATE_FIRST=cfg.dx_state_first,
        SUMS_2D=cfg.dx_row_sums_2d,
        PREC=dot_precision(x),
        num_warps=cfg.dx_warps,
        maxnreg=cfg.dx_register_cap(dx_heads),
        num_stages=cfg.dx_stages,
    )
    # dD: from dy_exact here, or from the dx kernel's partial sums: D of [H, P] summed here, of [H] by dt_bwd_kernel
    # (dD_parts, [blocks, H]: one reduction kernel fewer).
    dD = dD_parts = None
    if D is not None:
        if dy_exact is not None:
            dD = torch.einsum("blhp,blhp->hp" if D.dim() == 2 else "blhp,blhp->h", dy_exact.float(), x.float())
        elif D.dim() == 2:
            dD = dD_part.sum(dim=0)
        else:
            dD_parts = dD_part

    if side is None:
        launch_dcb()
    dB_part = torch.empty(n_hb, b, L, G, N, device=dev, dtype=torch.float32)
    db_a2dt = states_a2dt(a2dt, cfg)  # the chunk states' scale, as the forward's
    chunk_state_bwd_db_kernel[grid(b * NC * G * n_hb, cdiv(Q, cfg.db_k), 1, cfg.inner_first)](
        x,
        dt_p if db_a2dt is None else db_a2dt,
        dA_cs,
        dH,
        seq_arg,
        dB_part,
        L,
        Q,
        NC,
        H,
        G,
        P,
        N,
        hpp,
        b,
        *x.stride(),
        HAS_SEQ=has_seq,
        FOLD_DT=db_a2dt is not None,
        BLOCK_K=cfg.db_k,
        BLOCK_P=BP,
        BLOCK_N=BN,
        INNER_FIRST=cfg.inner_first,
        PREC=dot_precision(x),
        num_warps=cfg.db_warps,
        maxnreg=cfg.db_maxnreg,
        num_stages=cfg.db_stages,
    )
    if side is not None:
        torch.cuda.current_stream(dev).wait_stream(side)
    # Head blocks summed and the intra-chunk parts added once per group, dC += dCB B, dB += dCBᵀ C (bc_finish.py).
    if out is None:
        dB = torch.empty(b, L, G, N, device=dev, dtype=B.dtype)
        dC = torch.empty(b, L, G, N, device=dev, dtype=C.dtype)
    else:
        dB, dC = out[1], out[2]
    bcf_n = min(BN, cfg.bcf_n)
    bc_finish_kernel[(b * NC * G, cdiv(Q, cfg.dc_m), 2 * cdiv(N, bcf_n))](
        dCB_part,
        dC_part,
        dB_part,
        B,
        C,
        dB,
        dC,
        L,
        Q,
        NC,
        G,
        N,
        b,
        *B.stride(),
        *C.stride(),
        *dB.stride(),
        *dC.stride(),
        N_HB=n_hb,
        PREC=dot_precision(x),
        BLOCK_M=cfg.dc_m,
        BLOCK_K=cfg.dc_m,
        BLOCK_N=bcf_n,
        num_warps=cfg.bcf_warps,
        num_stages=2,
    )

    # The decay gradient's parts, combined with dt's own gradient by dt_bwd_kernel (dt.py): later side (dCB's
    # kernel: O, and R as per-position row minus column sums, whose reverse cumsum is the decay term with O's, in
    # slots that go to dt_bwd_kernel unsummed), earlier side q, chunk ends dtot (state passing).
    col_extra = None  # the column sums' extra slots (col_parts > 1)
    if R_part.shape[0] > n_m:
        col_extra = ColumnParts(R_part[n_m:], col_parts - 1, cfg.dc_m, n_diag)
    return dx, ddt, (O, R_part[:n_m], q, dtot, col_extra), dB, dC, (dD, dD_parts), dinit
