"""Our Triton SSD kernels (models/kernels/ssd_triton) on the CPU, through Triton's interpreter.

Forward and every gradient (x, dt, A, B, C, D, dt_bias, z, initial states; final states as an
output with its own cotangent) against the float64 PyTorch reference, with documents (seq_idx,
including a boundary exactly at a chunk start and a one-token document), initial states, lengths
that are not a multiple of the chunk, ngroups 1 and 2, D of shape [H] and [H, P], and chunk sizes
that are not powers of two. Each case runs in an interpreter worker (tests/ssd_interpreter.py) and checks what
tests/ssd_checks.py says.
"""

import pytest
import torch

pytest.importorskip("triton")

from tests.ssd_checks import make_inputs  # noqa: E402
from tests.ssd_interpreter import interpret, interpret_all  # noqa: E402

CUTS = [[5, 16, 30, 31], [21]]


def test_documents_initial_states_two_groups_remainder():
    """seq_idx + initial states + final states, ngroups 2, D [H], L = 2 chunks + a remainder."""
    interpret(b=2, L=40, H=4, P=16, G=2, N=16, seed=0, seq_cuts=CUTS, call=dict(chunk_size=16))


def test_odd_heads_per_group_one_head_per_dx_program():
    """3 heads per group (H 6, ngroups 2): dx, the chunk scan and the chunk states (asked for pairs here) cannot pair
    heads within a group and run one head per program; every other case here has an even count and pairs them in
    the chunk scan (config scan_heads 2; dx pairs them in test_dx_term_order_heads_and_chunk_major_grids). Pairing
    across groups here fails this test (checked by forcing it)."""
    interpret(
        b=1,
        L=40,
        H=6,
        P=16,
        G=2,
        N=16,
        seed=6,
        seq_cuts=[[9, 30]],
        call=dict(chunk_size=16),
        config=dict(state_heads=2, chained_heads=2, chained_bwd_heads=2, dx_heads=2),
    )


def test_chunk_states_one_and_two_heads_per_program():
    """The chunk states and dS_in, chained (the default, chained_states.py) and staged (chunk_state.py, then
    state_passing.py), with one head per program (config state_heads / chained_heads 1; also the fallback for odd
    heads per group) and two: documents, initial and final states, two groups, several position blocks per chunk, a
    remainder; and whole tiles without documents (the kernels' EVEN path)."""
    cases = []
    for chained in (True, False):
        for heads in (1, 2):
            cfg = dict(state_heads=heads, chained_heads=heads, chained_bwd_heads=heads, chained=chained)
            cases += [
                dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=7, seq_cuts=CUTS, call=dict(chunk_size=16),
                     config=dict(cfg, state_k=8)),
                dict(b=1, L=64, H=4, P=16, G=1, N=16, seed=8, call=dict(chunk_size=32), config=cfg),
            ]  # fmt: skip
    interpret_all(*cases)


def test_entering_states_kept_for_the_backward():
    """config keep_states: the forward's entering states go to the backward, which recomputes only CB (float32 x
    here: one slab, S_in itself; the test below takes the two parts of 16-bit x), chained and staged, with documents
    across chunk ends, initial and final states, two groups, a remainder; the default recomputes them (every other
    test). Also through
    the mixer's two backward paths (autograd inside, and the kernel halves), which carry them in their own saved
    tensors. Handing the backward the states one chunk off fails it (checked by mutation)."""
    kept = dict(keep_states=True)
    interpret_all(
        *(dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=7, seq_cuts=CUTS, call=dict(chunk_size=16),
               config=dict(keep_states=True, chained=chained)) for chained in (True, False)),
        dict(b=2, L=40, H=4, P=16, G=1, N=16, seed=4, chunk_size=16, split_path=True, config=kept),
        dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=7, chunk_size=16, split_path=True, halves=True, init_final=True,
             config=kept),
    )  # fmt: skip


def test_dt_kernels_several_head_blocks():
    """The dt kernels (dt.py) with programs of 32 elements, so a chunk of 16 positions takes 2 heads per program and
    4 heads run as 2 head blocks: dA and d dt_bias summed over each block's programs by its last one (one counter per
    block), dD over the dx kernel's parts; documents, initial states, a remainder. (At the model's shapes the blocks
    are 8 heads of 256 positions: 8 blocks at the 1.3B, 4 at the 370M.)"""
    interpret(
        b=2, L=40, H=4, P=16, G=1, N=16, seed=9, seq_cuts=CUTS, call=dict(chunk_size=16),
        constants={"models.kernels.ssd_triton.dt._ELEMENTS_PER_PROGRAM": 32},
    )  # fmt: skip


def test_chained_states_several_tiles_per_head():
    """The chained kernels with four [P, N] tiles per head (P 32, N 32 in 16 x 16 tiles): one chain per tile, and
    dtot summed from one partial per tile; documents that cross chunk ends (so the hand-offs carry state), initial
    and final states, five chunks. bc_finish runs in two blocks of N here (bcf_n 16). Whole chunks and blocks of P
    that divide P: the unmasked (EVEN) loads at a P offset, also in the staged kernels (chained False)."""
    case = dict(b=2, L=80, H=2, P=32, G=1, N=32, seed=11, seq_cuts=[[20, 50], [70]], call=dict(chunk_size=16))
    interpret_all(
        dict(case, config=dict(state_p=16, chained_fwd_n=16, chained_bwd_n=16, chained_heads=2, chained_bwd_heads=2,
                               bcf_n=16)),
        dict(case, config=dict(state_p=16, state_n=16, chained=False, bcf_n=16, pass_block=256)),
    )  # fmt: skip


def test_chunk_scan_over_two_blocks_of_p():
    """The chunk scan over two blocks of P (P 32 in blocks of 16: config scan_p), so each program's columns start at
    its block's offset: documents, initial states, two groups, a remainder; whole tiles (the EVEN loads, unmasked
    at that offset since whole_tiles takes blocks that divide P); and with the gate, whose rows' sums of squares
    then come in one part per block of P. (Session 73 timed P in halves on an H100: slower, docs/ssd_sessions.md.)"""
    halves = dict(scan_p=16)
    interpret_all(
        dict(b=2, L=40, H=4, P=32, G=2, N=16, seed=31, seq_cuts=CUTS, call=dict(chunk_size=16), config=halves),
        dict(b=2, L=64, H=4, P=32, G=1, N=16, seed=32, D_shape="HP", seq_cuts=[[9, 40], [33]],
             call=dict(chunk_size=32), config=halves),
        dict(fused_gate=True, b=1, L=50, H=2, P=32, N=16, seed=33, chunk_size=32, kept_states=True, config=halves),
    )  # fmt: skip


# 16-wide tiles over chunk positions: several blocks per chunk, so every kernel's loops over blocks below the
# diagonal run (with the default tiles a chunk of 32 or less is one block, and only the diagonal one would).
SMALL_TILES = dict(cb_m=16, cb_s=16, state_k=16, scan_m=16, scan_k=16, dx_k=16, dx_m=16, dc_m=16, db_k=16)


def test_one_group_D_per_channel_z_odd_chunk():
    """No documents, ngroups 1, D [H, P], z gating, dt limits, chunk 24 (not a power of two; two position blocks,
    the second partial), remainder 2."""
    interpret(
        b=2,
        L=50,
        H=4,
        P=16,
        G=1,
        N=16,
        seed=1,
        D_shape="HP",
        with_z=True,
        with_init=False,
        call=dict(chunk_size=24, dt_limit=(0.01, 1.5)),
        config=SMALL_TILES,
    )


def test_whole_tiles_documents_initial_states():
    """L a multiple of the chunk and P filling its block: the kernels' EVEN (mask-free) loads, with documents and
    two position blocks per chunk; two heads per dC / dB program, so their partial sums over head blocks are
    reduced (the default sums all 4 at once)."""
    interpret(
        b=2,
        L=64,
        H=4,
        P=16,
        G=1,
        N=16,
        seed=5,
        seq_cuts=CUTS,
        call=dict(chunk_size=32),
        config=dict(SMALL_TILES, heads_per_prog=2),
    )


def test_dx_term_order_heads_and_chunk_major_grids():
    """dx's non-default forms: its chunk-state term after the intra-chunk loop (config dx_state_first False: the
    state term in accumulators of its own, q from them) and two heads per program (dx_heads 2: the group's CBᵀ and B
    tiles shared), each way round (the default, state term first, takes q from that term alone: a wrong q fails,
    checked by mutation); and the chunk scan / dx / dCB / dB grids with the chunk index first (inner_first False;
    the default decodes one axis, launch.program_ids); dx's row sums (q, ddt) as 1-D tensors (dx_row_sums_2d False,
    the form before session 25), with each term order. All with documents, initial states and four position blocks
    per chunk."""
    configs = (
        dict(dx_state_first=False),
        dict(dx_heads=2),
        dict(dx_heads=2, dx_state_first=False),
        dict(inner_first=False),
        dict(dx_row_sums_2d=False),
        dict(dx_row_sums_2d=False, dx_state_first=False, dx_heads=2),
    )
    interpret_all(*(
        dict(b=2, L=100, H=4, P=16, G=1, N=16, seed=12, seq_cuts=[[30, 70], [50]], call=dict(chunk_size=64),
             config=dict(SMALL_TILES, **config))
        for config in configs
    ))  # fmt: skip


def test_steep_decay():
    """Decay so steep (dt |A| ~ 30 per step) that exp(a_l - a_s) spans more than float32's range inside one tile: the
    clamped per-element exponents stay finite and every output matches the reference; documents, initial states,
    four position blocks per chunk, a remainder. dA's error is 4.4e-4 here (tol 1e-3): the float32 cumsum a_l ~ -1e3
    keeps ~1e-4 of a_l - a_s. (A split of the decay into row and column factors, bounded by 1 on either side of a
    tile's edge, passed this too but ran slower on the GPU: docs/ssd_sessions.md, sessions 13 and 71.)"""
    interpret(
        b=1, L=100, H=2, P=16, G=1, N=16, seed=13, seq_cuts=[[45]], A_scale=30.0,
        call=dict(chunk_size=64, tol=1e-3), config=SMALL_TILES,
    )  # fmt: skip


def test_dt_folded_into_the_decay_exponent():
    """config fold_dt (the default since session 42; the other tests run it too): the chunk scan and dCB take
    exp(a_l - a_s) dt_s as 2^(a_l log2(e) - a2dt_s), with a2dt from the dt kernel (dt.py). Every output and gradient
    against the reference: with documents, initial states and a remainder (the masked loads' +inf padding) at four
    position blocks per chunk; whole tiles
    (dCB's unclamped tiles below the diagonal); decay steep enough to overflow an unclamped exponent; dt = 0 at valid
    positions (no softplus, dt's lower limit 0: a2dt = +inf, never log2(0)); kept states; and the fused mixer (its
    backward passes a2dt on). A kernel that still multiplies by dt, or an a2dt without log2(dt), fails (checked by
    mutation). With config fold_dt_states (the default since session 43) the chunk states' scale (chained and staged
    states, forward and the backward's recompute) and dB's take it too. The unfolded path (fold_dt false, still
    selectable; fold_dt_states then has nothing to read) with documents and in the fused mixer."""
    fold = dict(SMALL_TILES, fold_dt=True, fold_dt_states=True)
    docs = dict(b=2, L=100, H=4, P=16, G=1, N=16, seed=21, seq_cuts=[[30, 70], [50]])
    steep = dict(b=1, L=100, H=2, P=16, G=1, N=16, seed=13, seq_cuts=[[45]], A_scale=30.0)
    interpret_all(
        dict(**docs, call=dict(chunk_size=64), config=fold),
        dict(b=1, L=128, H=2, P=16, G=1, N=16, seed=22, with_init=False, call=dict(chunk_size=64), config=fold),
        dict(**steep, call=dict(chunk_size=64, tol=1e-3), config=fold),
        dict(**docs, call=dict(chunk_size=64, dt_softplus=False), config=fold),
        dict(**docs, call=dict(chunk_size=64), config=dict(fold, keep_states=True)),
        dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=23, chunk_size=16, init_final=True, split_path=True,
             config=dict(fold_dt=True, fold_dt_states=True)),
        dict(**docs, call=dict(chunk_size=64), config=dict(fold, chained=False)),
        dict(**docs, call=dict(chunk_size=64), config=dict(fold, fold_dt=False)),
        dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=23, chunk_size=16, init_final=True, split_path=True,
             config=dict(fold_dt=False)),
    )  # fmt: skip


def test_dcb_tiles_and_column_sums_in_parts():
    """dCB's grid of one program per tile of [l, s] (and one per head block for the state term), with four blocks
    per chunk, so that tiles off the diagonal have several columns to choose from (a wrong column block fails:
    checked by mutation), documents and whole tiles, at 1 and at 2 heads per program. Per-head column sums below the
    diagonal as one sum reduced across the warps (dcb_col_parts 1) and as 2 or 4 partial sums over row groups (the
    default is 4: a part written to another block's extra slot, or dt_bwd adding an extra slot at the positions of
    its own block or later, fails: checked by mutation); on the diagonal too (dcb_diag_col_parts: r alone, the parts
    in slots of their own), also at one block per chunk (chunk 16: no tiles below the diagonal, only the diagonal's
    slots). The state term runs in a launch of its own before the tiles' (config dcb_state_apart, the default since
    session 58; dcb_bwd.py's PART: a tiles launch one block short fails, checked by mutation), and, with one head
    block and with two, in the tiles' launch (dcb_state_apart False, PART 0)."""
    base = dict(b=1, L=128, H=2, P=16, G=1, N=16, seed=9, seq_cuts=[[40, 100]])
    cases = [
        dict(**base, call=dict(chunk_size=chunk),
             config=dict(SMALL_TILES, dcb_col_parts=parts, dcb_diag_col_parts=diag, heads_per_prog=heads))
        for parts, diag, chunk, heads in ((1, False, 64, 64), (2, False, 64, 1), (4, True, 64, 64), (4, True, 16, 1))
    ]  # fmt: skip
    # The heads loop pipelined as Triton decides (dcb_heads_stages None; the default is 3): the same code to the
    # interpreter, which ignores num_stages; on the GPU the compiled loop differs (kernel_resources.py --loops).
    one_launch = [
        dict(**base, call=dict(chunk_size=64), config=dict(SMALL_TILES, dcb_state_apart=False, heads_per_prog=heads))
        for heads in (64, 1)
    ]
    interpret_all(
        *cases, *one_launch, dict(**base, call=dict(chunk_size=64), config=dict(SMALL_TILES, dcb_heads_stages=None))
    )


def test_dcb_col_parts_refused_unless_a_power_of_two_dividing_the_rows():
    """BlockConfig.dcb_col_parts splits dc_m rows into equal groups: 3, 0 or more parts than rows are refused where
    the config is made, naming the field and what to set; 1 and 4 are taken."""
    import dataclasses

    from models.kernels.ssd_triton.config import block_config

    cfg = block_config(256, 64, 128)
    for bad in (3, 0, 2 * cfg.dc_m):
        with pytest.raises(ValueError, match="dcb_col_parts .* must be a power of two dividing dc_m"):
            dataclasses.replace(cfg, dcb_col_parts=bad)
    assert dataclasses.replace(cfg, dcb_col_parts=1).dcb_col_parts == 1 and cfg.dcb_col_parts == 4


def test_no_kernel_reads_unwritten_memory():
    """Every float buffer allocated empty starts as NaN (poison_empty): CB's tiles past its consumers' diagonal
    blocks are not stored (chunk_cb.py), so a consumer reading one, or any kernel reading what no kernel wrote,
    fails. Default tiles, small tiles (four row blocks per chunk), kept states, and the staged states at 2 heads per
    dCB program (a CB read block one step too small fails it: checked by mutation)."""
    configs = (
        {},
        SMALL_TILES,
        dict(SMALL_TILES, keep_states=True),
        dict(SMALL_TILES, scan_m=32, dx_k=32, dc_m=32),
        dict(heads_per_prog=2, chained=False),
        dict(keep_states=True),
    )
    interpret_all(*(
        dict(b=1, L=128, H=4, P=16, G=1, N=16, seed=3, seq_cuts=[[40, 100]], call=dict(chunk_size=64),
             config=config, poison_empty=True)
        for config in configs
    ))  # fmt: skip


def test_staged_states_two_heads_per_program():
    """The staged forward / state recurrence (config chained False; the default chains them: chained_states.py)
    with 2 heads per dCB / dB program (2 head blocks whose partial sums bc_finish adds)."""
    interpret(
        b=2,
        L=40,
        H=4,
        P=16,
        G=1,
        N=16,
        seed=5,
        seq_cuts=CUTS,
        call=dict(chunk_size=16),
        config=dict(heads_per_prog=2, chained=False),
    )


def test_headdim_and_state_size_not_powers_of_two():
    """P = 24 and N = 20, padded to blocks of 32 in the backward (config.py), with 16-wide P tiles in the forward's
    states and chunk scan (a full block of 16 and a partial one of 8): the chained and the staged states, with
    documents, initial states, 2 groups and a remainder chunk. (This case once ran the removed fused_scan, and caught
    Triton 3.9's removal of the block pointers it used.)"""
    case = dict(b=2, L=40, H=4, P=24, G=2, N=20, seed=6, seq_cuts=CUTS, call=dict(chunk_size=16))
    interpret_all(dict(case, config=dict(state_p=16, scan_p=16)), dict(case, config=dict(chained=False, state_p=16)))


def test_fused_path_contract_under_triton_backend():
    """ops.mamba_split_conv1d_scan(backend='triton'): the model's fused-path call, with our SSD; also given A_log (the
    model's parameter, A = -exp(A_log) inside the dt kernels) through the autograd and the kernel-halves backward:
    A_log's gradient must be dA times A (dA alone, or A not negated, fails: checked by mutation)."""
    interpret_all(
        dict(b=2, L=40, H=4, P=16, G=1, N=16, seed=4, chunk_size=16, split_path=True),
        dict(b=2, L=40, H=4, P=16, G=1, N=16, seed=9, chunk_size=16, split_path=True, a_log=True),
        dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=10, chunk_size=16, split_path=True, halves=True, a_log=True),
    )


def test_fused_path_kernel_halves_wiring():
    """The GPU path that calls the conv's and the norm's forward / backward halves directly (no autograd inside the
    mixer's backward; dz and dxBC written into dzxbcdt in place), with reference stand-ins for the halves (but the
    conv's forward with documents, which is our Triton kernel there): documents, initial / final states, two groups,
    against the float64 reference."""
    interpret_all(
        dict(b=2, L=40, H=4, P=16, G=1, N=16, seed=6, chunk_size=16, split_path=True, halves=True),
        dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=7, chunk_size=16, split_path=True, halves=True, init_final=True),
    )


def test_fused_path_kernel_halves_final_state_only():
    """The kernel-halves backward with no gradient for the output, only for the final state."""
    interpret(final_only_halves=True, b=2, L=40, H=4, P=16, G=1, N=16, seed=8, chunk_size=16)


def test_fused_path_contract_states_nonssm_no_norm():
    """The same with initial / final states (the CP path), a non-SSM part (d_nonssm), the plain z gate instead of
    the norm, no out_proj, two groups, and the staged states."""
    interpret(
        b=2, L=40, H=4, P=16, G=2, N=16, seed=5, chunk_size=16, split_path=True,
        d_nonssm=8, norm=False, outproj=False, init_final=True, config=dict(chained=False),
    )  # fmt: skip


def test_fp16_z_gate_dD_from_float32_dy():
    """With z, dD comes from the float32 gated dy (the bf16 GPU case noseq_Dhdim_z's suspect; docs/performance.md)."""
    interpret(b=2, L=40, H=4, P=16, G=1, N=16, seed=3, chunk_size=16, fp16_gate=True)


def test_fp16_decay_gradient_whole_chunks():
    interpret(L=256, chunk_size=64, bound=8.5e-4, fp16_decay=True)


def test_decay_gradient_through_carried_states():
    """(check_decay_through_initial_states.) With float16 dy the backward's chain hands dH on as high + low parts
    (chained_dstates._dh_chain_step): handing on the high part alone fails this (dA 9.6e-5; checked by mutation)."""
    interpret(bound=1e-5, carried_decay=True)


def test_kept_states_carry_the_decay_gradient_in_two_parts():
    """config keep_states with float16 x: the forward keeps S_in as a high part (S_in rounded, what the chunk scan and
    dC read) and the low part it left out; the chunk-end terms of dA need both (the case above), chained and staged.
    Keeping only the high part fails this (dA error ~1e-4; checked by mutation); and the kept path against the
    recomputing one, every gradient (check_kept_matches_recomputed)."""
    cases = []
    for chained in (True, False):
        cases += [
            dict(bound=1e-5, carried_decay=True, config=dict(keep_states=True, chained=chained)),
            dict(L=256, chunk_size=64, bound=8.5e-4, fp16_decay=True, config=dict(keep_states=True, chained=chained)),
            dict(L=200, chunk_size=32, kept_vs_recomputed=True, config=dict(SMALL_TILES, chained=chained)),
        ]
    # Two heads per chained program: both heads' high / low parts, forward and backward; and the forward with one
    # (config chained_heads apart from chained_bwd_heads; the forward's pair is the default since session 58).
    interpret_all(
        *cases,
        dict(bound=1e-5, carried_decay=True, config=dict(keep_states=True, chained_heads=2, chained_bwd_heads=2)),
        dict(bound=1e-5, carried_decay=True, config=dict(keep_states=True, chained_heads=1)),
    )


def test_bad_input_raises_before_compute():
    # Checked before any kernel runs, so no interpreter is needed.
    from models.kernels.ssd_triton import ssd_chunk_scan_triton

    inp = make_inputs(b=1, L=8, H=4, P=16, G=3, N=16, seed=2, with_init=False)
    with pytest.raises(ValueError, match="ngroups=3 must divide nheads=4"):
        ssd_chunk_scan_triton(**inp, chunk_size=16)
    inp = make_inputs(b=1, L=8, H=4, P=16, G=1, N=16, seed=2, with_init=False, seq_cuts=[[3]])
    inp["seq_idx"][0, 5:] = 0  # a document id that goes back down
    with pytest.raises(ValueError, match="non-decreasing"):
        ssd_chunk_scan_triton(**inp, chunk_size=16)
    # A negative dt (no softplus, a lower limit below 0): every decay is clamped at 1 in the kernels, as in
    # mamba_ssm's, so they would differ from the reference (they did, by 60% of y, before this check).
    with pytest.raises(ValueError, match=r"dt_limit's lower bound -0.2 lets dt be negative"):
        ssd_chunk_scan_triton(**inp, chunk_size=16, dt_softplus=False, dt_limit=(-0.2, 0.4))
    # The mixer (backend "triton") names a bad seq_idx or initial state before its conv runs.
    from models.kernels.split_conv1d_scan import mamba_split_conv1d_scan_triton

    H, P, N = 4, 16, 16
    args = dict(
        zxbcdt=torch.randn(2, 8, 2 * H * P + 2 * N + H),
        conv1d_weight=torch.randn(H * P + 2 * N, 4),
        conv1d_bias=None,
        dt_bias=torch.zeros(H),
        A=-torch.ones(H),
        D=torch.ones(H),
        chunk_size=4,
        headdim=P,
    )
    with pytest.raises(ValueError, match=r"seq_idx must be an integer \[batch, seqlen\] = \(2, 8\)"):
        mamba_split_conv1d_scan_triton(**args, seq_idx=torch.zeros(2, 7, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"initial_states must be \[batch, nheads, headdim, dstate\]"):
        mamba_split_conv1d_scan_triton(**args, initial_states=torch.zeros(2, H, P, N + 1))


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [16, 32, 20])
@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("variant", ["seq_init", "seq_noinit_noD", "noseq_init_z", "exact_multiple_no_softplus"])
@pytest.mark.parametrize("states", ["chained", "staged"])
def test_sweep(chunk_size, G, variant, states):
    L = 64 if variant == "exact_multiple_no_softplus" else 45
    interpret(
        b=2,
        L=L,
        H=4,
        P=16,
        G=G,
        N=32,
        seed=chunk_size * 10 + G,
        D_shape=None if variant == "seq_noinit_noD" else "H",
        with_z=variant == "noseq_init_z",
        with_init=variant in ("seq_init", "noseq_init_z"),
        seq_cuts=CUTS if variant.startswith("seq") else None,
        call=dict(chunk_size=chunk_size, dt_softplus=variant != "exact_multiple_no_softplus"),
        # Both forward / recurrence paths in every variant, at 2 head blocks and at 1.
        config=dict(heads_per_prog=2 if states == "chained" else 8, chained=states == "chained"),
    )


def test_model_option_keeps_states_in_the_kernels_config(monkeypatch):
    """model.ssd_keep_states reaches our kernels' config (config.py's keep_states) through the mixer and ops, for the
    unfused and the fused mixer; off by default. (What keeping does is tested above under the interpreter.)"""
    from models.args import ModelArgs
    from models.kernels import ops
    from models.kernels.ssd_triton import autograd
    from models.mamba2 import mixer as mixer_module

    inp = make_inputs(b=1, L=8, H=4, P=16, G=1, N=16, seed=2, with_init=False)
    args = [inp[k] for k in ("x_BLHP", "dt_BLH", "A_H", "B_BLGN", "C_BLGN")]
    for keep in (False, True):
        assert autograd.prepare_inputs(*args, 16, inp["D"], None, None, None, None, keep)[-1].keep_states is keep
    assert autograd.prepare_inputs(*args, 16, inp["D"], None, None, None, None)[-1].keep_states is False

    class Seen(Exception):
        pass

    def stand_in(*a, **kw):
        raise Seen(kw["keep_states"])

    seen = []
    for keep in (False, True):
        margs = ModelArgs(d_model=32, n_layers=1, vocab_size=16, d_state=16, headdim=16, ssd_keep_states=keep)
        mixer = mixer_module.Mamba2Mixer(margs, 0, 1)
        zxbcdt = torch.randn(1, 8, mixer.in_proj.out_features)
        with monkeypatch.context() as m:  # the mixer -> ops, unfused and fused
            m.setattr(ops, "ssd_chunk_scan", stand_in)
            m.setattr(ops, "mamba_split_conv1d_scan", stand_in)
            for call in (lambda: mixer._forward(zxbcdt, None), lambda: mixer._fused_forward(zxbcdt, None, False)):
                with pytest.raises(Seen) as e:
                    call()
                seen.append(e.value.args[0])
        with monkeypatch.context() as m:  # ops -> our kernels
            m.setattr(ops, "use_triton_ssd", lambda backend, t: True)
            m.setattr(ops._ssd_triton, "ssd_chunk_scan_triton", stand_in)
            m.setattr(ops, "mamba_split_conv1d_scan_triton", stand_in)
            for call in (
                lambda: ops.ssd_chunk_scan(*args, 16, keep_states=keep),
                lambda: ops.mamba_split_conv1d_scan(
                    zxbcdt, None, None, None, -torch.ones(2), None, 16, keep_states=keep
                ),
            ):
                with pytest.raises(Seen) as e:
                    call()
                seen.append(e.value.args[0])
    assert seen == [False] * 4 + [True] * 4


def test_fused_gate_into_the_chunk_scan():
    """model.fuse_gate_into_scan (models/kernels/row_scale.py): the mixer's output with its rows' 1 / rms left to the
    next add + RMSNorm equals the unfused pair, outputs and every gradient (tests/ssd_checks.check_fused_gate), with
    the entering states recomputed and kept, a ragged last chunk and two heads per chunk-scan program (partial sums
    per head pair)."""
    interpret_all(
        dict(fused_gate=True, b=2, L=40, H=4, P=16, N=16, seed=3, chunk_size=16),
        dict(fused_gate=True, b=1, L=50, H=2, P=16, N=16, seed=4, chunk_size=32, kept_states=True),
    )


def test_kept_conv_output_equals_the_recomputed_one():
    """model.ssd_keep_conv_layers: the fused mixer keeping its conv output gives every output and gradient of the
    one recomputing it, bit for bit, with one conv forward fewer (tests/ssd_checks.check_keep_conv); also with the
    fused gate."""
    interpret_all(
        dict(keep_conv=True, b=2, L=40, H=4, P=16, N=16, seed=11, chunk_size=16),
        dict(keep_conv=True, b=1, L=50, H=2, P=16, N=16, seed=12, chunk_size=32, fuse_gate=True),
    )


def test_one_output_unused():
    """Only y or only the final states feed the loss: the other output's gradient reaches the backward as None (no
    zero tensor filled: context parallel's unused final states), and every gradient still matches the reference."""
    case = dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=5, seq_cuts=CUTS, with_init=True)
    interpret_all(
        dict(case, call=dict(chunk_size=16, use=("y",))), dict(case, call=dict(chunk_size=16, use=("final",)))
    )
