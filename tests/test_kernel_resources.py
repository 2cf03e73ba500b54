"""benchmarks/kernel_resources.py on the CPU: our kernels compiled for sm_90 with the installed Triton's ptxas (no GPU
needed), and what the compiled code shows: register caps, layout conversions, loops by instruction kind, and the
instruction counts that sessions' kernel changes were made for."""

from __future__ import annotations


def test_kernel_resources_register_cap_reaches_ptxas():
    """benchmarks/kernel_resources.py compiles for sm_90 without a GPU (Triton's ptxas): dB uncapped takes more than
    168 registers, and with BlockConfig's db_maxnreg (the default cap, 168) ptxas holds it there, so the config field
    reaches the compile (session 13: dB 0.112 -> 0.097 ms on an H100 with it)."""
    from benchmarks import kernel_resources as kr
    from models.kernels.ssd_triton.config import block_config

    cfg = block_config(256, 64, 128)
    assert cfg.db_maxnreg == 168
    for name, kernel, ptrs, consts, warps, stages in kr.kernels(cfg, 64, 128, True):
        if name == "chunk_state_bwd_db":
            capped = kr.compile_sm90(kernel, ptrs, consts, warps, stages, kr.register_cap(cfg, name))
            free = kr.compile_sm90(kernel, ptrs, consts, warps, stages, None)
            break
    assert capped["registers"] <= 168 < free["registers"], (capped, free)


def test_kernel_resources_register_caps_set_programs_per_sm():
    """With documents and ngroups 1 (Triton compiles G as the constant 1, as kernel_resources.py now does) the chained
    states' forward and (in N tiles of 64) the chained dstates take more than 128 registers uncapped, at most three
    4-warp programs per SM; BlockConfig's caps (chained_fwd_maxnreg, chained_bwd_maxnreg: 128) reach ptxas and hold
    them at 128, four per SM (session 26, H100 with documents at the 1.3B shape: the chained states 0.407 -> 0.363 ms
    for their two launches, the chained dstates 0.208 -> 0.190). dx the same with one head per program (128:
    0.368 -> 0.327 ms then); with two (the default since session 57) it takes more than 168 uncapped and 168 capped
    with no spills, three per SM (0.330 -> 0.314 ms against one head at 128). The chained states' forward the same
    since session 58: a pair of heads a program at 168 (chained_fwd_pair_maxnreg; one head keeps 128). It needs its
    cap only without fold_dt_states (the default since session 43: one head took 114 registers uncapped, Triton 3.9),
    so its uncapped count is taken on that path, and its capped one on both."""
    import dataclasses

    import triton

    from benchmarks import kernel_resources as kr
    from models.kernels.ssd_triton.config import block_config

    base = block_config(256, 64, 128)
    assert base.dx_heads == 2 and base.dx_register_cap(2) == 168 and base.dx_register_cap(1) == 128
    assert base.chained_heads == 2 and base.chained_fwd_register_cap(2) == 168
    assert base.chained_fwd_register_cap(1) == 128
    regs = {}
    for fold_states, dx_heads in ((True, 2), (True, 1), (False, 2)):
        cfg = dataclasses.replace(base, fold_dt_states=fold_states, dx_heads=dx_heads)
        for name, kernel, ptrs, consts, warps, stages in kr.kernels(cfg, 64, 128, True):
            chained = name == "chained_dstates_bwd" and fold_states or name == "chained_states_fwd" and dx_heads == 2
            if chained or name == "chunk_scan_bwd_dx" and fold_states:
                assert warps == 4, (name, warps)
                capped = kr.compile_sm90(kernel, ptrs, consts, warps, stages, kr.register_cap(cfg, name),
                                         ones=frozenset({"G"}))  # fmt: skip
                free = kr.compile_sm90(kernel, ptrs, consts, warps, stages, None, ones=frozenset({"G"}))
                capped_regs, spills = capped["registers"], capped["spill_stack_bytes"]
                regs[name, fold_states, dx_heads] = (capped_regs, spills, free["registers"])
    assert len(regs) == 6, regs
    gpu_triton = triton.__version__.startswith("3.6.")  # the GPU machines' Triton; others may spill a few bytes
    for (name, fold, heads), (capped, spills, free) in regs.items():
        limit = 168 if name in ("chunk_scan_bwd_dx", "chained_states_fwd") and heads == 2 else 128
        assert capped <= limit and (spills == 0 or not gpu_triton), (name, fold, heads, regs)
        if name != "chained_states_fwd" or not fold:
            assert free > limit, (name, fold, heads, regs)


def test_kernel_resources_layout_conversions_of_dx_sums():
    """kernel_resources.py --converts lists the IR's convert_layout ops; compiled for sm_90, dx with its row sums kept
    2-D (config dx_row_sums_2d, the default) converts no float32 [dx_k, P] tile, and with 1-D sums it converts two
    per head of a program (the products Triton 3.6 moves through shared memory before reducing: chunk_scan_bwd.py)."""
    import dataclasses

    from benchmarks import kernel_resources as kr
    from models.kernels.ssd_triton.config import block_config

    ir = "%y = ttg.convert_layout %x : tensor<64x64xf32, #mma> -> tensor<64x64xf32, #blocked> loc(#loc3)"
    assert kr.layout_conversions(ir) == ["tensor<64x64xf32, #mma> -> tensor<64x64xf32, #blocked>"]
    tiles = []
    for sums_2d in (True, False):
        cfg = dataclasses.replace(block_config(256, 64, 128), dx_row_sums_2d=sums_2d)
        for name, kernel, ptrs, consts, warps, stages in kr.kernels(cfg, 64, 128, True):
            if name == "chunk_scan_bwd_dx":
                info = kr.compile_sm90(kernel, ptrs, consts, warps, stages, converts=True)
                tiles.append([c for c in info["layout_conversions"] if c.startswith("tensor<64x64xf32, #mma")])
    heads = block_config(256, 64, 128).dx_heads
    assert len(tiles[0]) == 0 and len(tiles[1]) == 2 * heads, tiles


def test_kernel_resources_loops_from_disassembly():
    """kernel_resources.py --loops: a loop is a branch back to a label at or before it (a forward branch or a lone
    branch to itself is none); its instructions counted by kind, predicates and modifiers stripped. And on a real
    compile for sm_90, the conv backward's stream loops are found with their loads and stores: at the defaults
    (positions loaded at their step, four steps an iteration, conv_triton._BWD_STAGES) software-pipelined by Triton,
    the loads as cp.async (LDGSTS) into shared memory; at two steps an iteration the loop carries a loaded value
    through two iterations and Triton leaves it unpipelined (plain LDG), whatever STAGES says (Triton 3.6 and 3.9);
    with L2 hints (conv_triton._BWD_L2_AHEAD, off by default) one CCTL per stream line of x and dout and step."""
    from benchmarks import kernel_resources as kr

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.64 R2, desc[UR4][R4.64] ;
        /*0020*/              @!P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   SHFL.BFLY PT, R3, R2, 0x1, 0x1f ;
        /*0040*/                   MOV R5, R3 ;
        /*0050*/               @P1 BRA `(.L_x_1) ;
        /*0060*/                   MUFU.EX2 R6, R5 ;
.L_x_1:
        /*0070*/                   STG.E desc[UR4][R8.64], R6 ;
        /*0080*/               @P2 BRA `(.L_x_0) ;
.L_x_2:
        /*0090*/                   BRA `(.L_x_2);
"""
    assert kr.sass_loops(sass) == [
        dict(instructions=8, BAR=1, MOV=1, SHFL=1, MUFU=1, LDG=1, STG=1),
        {"kernel": dict(instructions=10, BAR=1, MOV=2, SHFL=1, MUFU=1, LDG=1, STG=1)},
    ]
    from models.kernels import conv_triton as ct

    assert ct._BWD_PREFETCH == 0 and ct._BWD_STAGES > 1 and ct._BWD_UNROLL == 4 and ct._BWD_L2_AHEAD == 0

    def stream_loops(**settings) -> list[dict]:
        """The conv backward's stream loops (the one-document branch's and the other, both with the sigmoid's MUFU)
        compiled with conv_triton's settings changed as given; checks the kernel's own count comes last."""
        saved = {k: getattr(ct, k) for k in settings}
        try:
            for k, v in settings.items():
                setattr(ct, k, v)
            for name, kernel, ptrs, consts, warps, stages in kr.conv_kernels(True):
                if name == "conv_bwd":
                    loops = kr.compile_sm90(kernel, ptrs, consts, warps, stages, loops=True)["loops"]
        finally:
            for k, v in saved.items():
                setattr(ct, k, v)
        stream = [x for x in loops[:-1] if x.get("MUFU")]
        assert len(loops) == 3 and len(stream) == 2, loops
        assert loops[-1]["kernel"]["instructions"] > sum(x["instructions"] for x in stream), loops
        return stream

    pipelined = stream_loops()
    assert all(x.get("LDGSTS", 0) >= 2 and x.get("LDS", 0) >= 2 and "LDG" not in x for x in pipelined), pipelined
    assert all(x["STG"] >= 1 for x in pipelined), pipelined
    two_steps = stream_loops(_BWD_UNROLL=2)
    assert all(x.get("LDG", 0) >= 2 and "LDGSTS" not in x for x in two_steps), two_steps
    hinted = stream_loops(_BWD_L2_AHEAD=3)
    assert all(x.get("CCTL") == 2 * ct._BWD_UNROLL for x in hinted), hinted


def test_kernel_resources_folded_dt_drops_a_multiply_per_element():
    """config fold_dt (dt in the decay's exponent, dt.py's a2dt): compiled for sm_90 at the 1.3B tiles with documents,
    every per-head loop of the chunk scan and of dCB (those with 32 MUFU.EX2: one per element and head) runs at least
    one instruction per element fewer than without it (Triton 3.6: 334 -> 273, 584 -> 509, 615 -> 540; the multiply
    by dt and the a_s loads gone), with no more registers or spills."""
    import dataclasses

    from benchmarks import kernel_resources as kr
    from models.kernels.ssd_triton.config import block_config

    found = {}
    for fold in (False, True):
        cfg = dataclasses.replace(block_config(256, 64, 128), fold_dt=fold, dcb_state_apart=False)  # one dCB launch
        for name, kernel, ptrs, consts, warps, stages in kr.kernels(cfg, 64, 128, True):
            if name in ("chunk_scan_fwd", "chunk_scan_bwd_dcb"):
                cap = kr.register_cap(cfg, name)
                info = kr.compile_sm90(kernel, ptrs, consts, warps, stages, cap, loops=True, ones=frozenset({"G"}))
                per_head = sorted(loop["instructions"] for loop in info["loops"][:-1] if loop.get("MUFU") == 32)
                found[name, fold] = (per_head, info["registers"], info["spill_stack_bytes"])
    for name in ("chunk_scan_fwd", "chunk_scan_bwd_dcb"):
        (plain, regs, spills), (folded, regs_f, spills_f) = found[name, False], found[name, True]
        assert len(plain) == len(folded) >= 1, found
        assert all(f <= p - 32 for p, f in zip(plain, folded)), (name, plain, folded)
        assert regs_f <= regs + 2 and spills_f <= spills, found


def test_kernel_resources_folded_dt_in_the_chunk_states():
    """config fold_dt_states (the chunk states' scale exp(a_last - a_s) dt_s as 2^(a_last log2(e) - a2dt_s)):
    compiled for sm_90 at the 1.3B tiles with documents, the product loop of the chained states' forward and of dB
    runs at least 16 instructions fewer per iteration (Triton 3.6: 307 -> 273, 251 -> 230; 3.9: 290 -> 271, 256 ->
    236: dt's load and multiply gone), with no more registers or spills."""
    import dataclasses

    from benchmarks import kernel_resources as kr
    from models.kernels.ssd_triton.config import block_config

    found = {}
    for fold in (False, True):
        # one head a chained program (the counts above; the pair is the default since session 58)
        cfg = dataclasses.replace(block_config(256, 64, 128), fold_dt=True, fold_dt_states=fold, chained_heads=1)
        for name, kernel, ptrs, consts, warps, stages in kr.kernels(cfg, 64, 128, True):
            if name in ("chained_states_fwd", "chunk_state_bwd_db"):
                cap = kr.register_cap(cfg, name)
                info = kr.compile_sm90(kernel, ptrs, consts, warps, stages, cap, loops=True, ones=frozenset({"G"}))
                product_loop = next(loop for loop in info["loops"][:-1] if loop.get("HGMMA"))
                found[name, fold] = (product_loop["instructions"], info["registers"], info["spill_stack_bytes"])
    for name in ("chained_states_fwd", "chunk_state_bwd_db"):
        (plain, regs, spills), (folded, regs_f, spills_f) = found[name, False], found[name, True]
        assert folded <= plain - 16, found
        assert regs_f <= regs and spills_f <= spills, found


def test_kernel_resources_norms_instructions_per_element():
    """kernel_resources.py compiles the norms too (norm_kernels: the block's add + RMSNorm, the gated norm) for
    sm_90 at the 1.3B widths, without spills, and their instructions per element of a row stay near what session 38
    chose them for (Triton 3.6 / 3.9: add + RMSNorm forward 17.5 / 18.0 per element of the kernel, backward 18.9 per
    element of the rows loop; gated norm forward 30, backward 36.3 / 36.3): at 8 elements per thread instead of 16
    the add + RMSNorm ran 26 and drew 6% more joules (docs/ssd_sessions.md, session 38)."""
    from benchmarks import kernel_resources as kr
    from models.kernels import add_rmsnorm_triton as an
    from models.kernels import gated_rmsnorm_triton as gn

    per_element = {}
    elements = dict(add_rmsnorm_fwd=an._FWD_ELEMS_PER_THREAD, add_rmsnorm_bwd=an._BWD_ELEMS_PER_THREAD,
                    gated_norm_fwd=gn._FWD_ELEMS_PER_THREAD, gated_norm_bwd=gn._BWD_ELEMS_PER_THREAD)  # fmt: skip
    for name, kernel, ptrs, consts, warps, stages in kr.norm_kernels():
        info = kr.compile_sm90(kernel, ptrs, consts, warps, stages, loops=True)
        assert info["spill_stack_bytes"] == 0, (name, info)
        rows_loop = [loop for loop in info["loops"] if "kernel" not in loop]
        count = rows_loop[0]["instructions"] if rows_loop else info["loops"][-1]["kernel"]["instructions"]
        per_element[name] = count / elements[name]
    limits = dict(add_rmsnorm_fwd=20, add_rmsnorm_bwd=21, gated_norm_fwd=32, gated_norm_bwd=40)
    assert all(per_element[k] <= limit for k, limit in limits.items()), per_element


def test_kernel_resources_conv_one_document_branch(monkeypatch):
    """conv_triton's one-document branch compiled for sm_90 (1.3B tiles, documents): the backward then holds two
    stream loops, the one-document loop within a few instructions of the loop compiled without documents (Triton 3.6:
    301 against 377 instructions per two steps in session 41, 304 against 300 without documents in session 54) and
    the other within a few of before (373; Triton 3.9: 300 / 381 against 376); with int32 row offsets (session 60,
    per four steps) Triton 3.6 544 / 717 against 575 without documents and 736 unbranched, Triton 3.9 554 / 761
    against 576 and 731: the other loop within 5% of the unbranched one;
    the forward holds two bodies (twice the MUFU); registers within a few (Triton 3.6: 128 and 127 against 128 and
    126, so four programs per SM stay; 3.9: 132 and 136). Whether it pays is a GPU measurement (docs/ssd_sessions.md,
    session 41)."""
    from benchmarks import kernel_resources as kr
    from models.kernels import conv_triton as ct

    def compiled(has_seq: bool, branch: bool) -> dict:
        monkeypatch.setattr(ct, "_FWD_ONE_DOC_BRANCH", branch)
        monkeypatch.setattr(ct, "_BWD_ONE_DOC_BRANCH", branch)
        return {
            name: kr.compile_sm90(kernel, ptrs, consts, warps, stages, loops=True)
            for name, kernel, ptrs, consts, warps, stages in kr.conv_kernels(has_seq)
        }

    masked, plain, branched = compiled(True, False), compiled(False, False), compiled(True, True)
    step_loops = {k: sorted(x["instructions"] for x in v["conv_bwd"]["loops"][:-1]) for k, v in
                  dict(masked=masked, plain=plain, branched=branched).items()}  # fmt: skip
    assert len(step_loops["masked"]) == len(step_loops["plain"]) == 1 and len(step_loops["branched"]) == 2, step_loops
    (one_doc, tested), (before,), (without,) = step_loops["branched"], step_loops["masked"], step_loops["plain"]
    assert one_doc <= without + 4 and tested <= 1.05 * before and one_doc < tested, step_loops
    fwd_mufu = {
        k: v["conv_fwd"]["loops"][-1]["kernel"]["MUFU"] for k, v in dict(masked=masked, branched=branched).items()
    }
    assert fwd_mufu["branched"] == 2 * fwd_mufu["masked"], fwd_mufu
    for name in ("conv_fwd", "conv_bwd"):
        assert branched[name]["registers"] <= masked[name]["registers"] + 10, (name, branched, masked)


def test_kernel_resources_optimizer_update_without_shared_memory():
    """kernel_resources.py compiles the optimizer's kernels too; for sm_90 our AdamW's update moves nothing through
    shared memory (the bf16 copies stored in the float32 results' layout: with 8-element copy stores Triton moved
    p, m and v to another layout through shared memory, 11 barriers per program) and takes under 32 instructions
    per element (56 with the float64 bias corrections per program, 24 after the cuts: components/adamw_triton.py),
    with float32 gradients, and one more with bf16 ones (training.grad_dtype: their conversion)."""
    from benchmarks import kernel_resources as kr
    from components import adamw_triton

    found = {}
    for name, kernel, arg_types, consts, warps, stages in kr.optimizer_kernels():
        found[name] = kr.compile_sm90(kernel, arg_types, consts, warps, stages, loops=True, converts=True)
    assert set(found) == {"adamw", "adamw_bf16_grads", "adamw_step_scalars", "sumsq", "sumsq_bf16"}, found
    per_element = {}
    for name in ("adamw", "adamw_bf16_grads"):  # float32 gradients, and bf16 ones (training.grad_dtype)
        update = found[name]
        per_element[name] = update["loops"][-1]["kernel"]["instructions"] / (
            adamw_triton.BLOCK / (32 * adamw_triton.WARPS)
        )
        assert update["layout_conversions"] == [] and update["shared_bytes"] == 0, (name, update)
        assert "BAR" not in update["loops"][-1]["kernel"], (name, update)
    # bf16 gradients: one conversion per element more (Triton 3.6: 31 and 32)
    assert per_element["adamw"] < 32 and per_element["adamw_bf16_grads"] <= per_element["adamw"] + 1, per_element


def test_kernel_resources_epilogue_loads_before_stores():
    """kernel_resources.sass_tail: after the last loop's back edge, the global loads and those after the first global
    store. Compiled for sm_90 at the 1.3B tiles with documents, dx and the chunk scan (with the gated norm's first
    half, as the 1.3B config runs it, and without) load both heads' inputs (x, dy or z, D, the norm's weight) before
    either head's stores (session 62: the compiler keeps a load behind any store before it, a memory round trip of
    its own; before, dx issued 14 of its 18 epilogue loads after a store and the gated scan 15 of 20), and the gated
    scan stays at <= 168 registers (config scan_maxnreg: three programs per SM; 176 uncapped, Triton 3.6)."""
    import triton

    from benchmarks import kernel_resources as kr
    from models.kernels.ssd_triton.config import block_config

    sass = """
        /*0000*/                   LDG.E R2, desc[UR4][R4.64] ;
.L_x_0:
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0020*/               @P0 BRA `(.L_x_0) ;
        /*0030*/                   LDG.E.128 R8, desc[UR4][R6.64] ;
        /*0040*/                   STG.E desc[UR4][R10.64], R8 ;
        /*0050*/                   LDG.E R12, desc[UR4][R14.64] ;
        /*0060*/                   STG.E desc[UR4][R16.64], R12 ;
.L_x_1:
        /*0070*/                   BRA `(.L_x_1);
"""
    assert kr.sass_tail(sass) == dict(loads=2, loads_after_first_store=1)
    cfg = block_config(256, 64, 128)
    found = {}
    for name, kernel, ptrs, consts, warps, stages in kr.kernels(cfg, 64, 128, True):
        if name in ("chunk_scan_bwd_dx", "chunk_scan_fwd", "chunk_scan_fwd_gate"):
            info = kr.compile_sm90(kernel, ptrs, consts, warps, stages, kr.register_cap(cfg, name), loops=True,
                                   ones=frozenset({"G"}))  # fmt: skip
            found[name] = (info["tail"], info["registers"], info["spill_stack_bytes"])
    assert len(found) == 3, found
    assert all(tail["loads"] >= 10 and tail["loads_after_first_store"] == 0 for tail, _, _ in found.values()), found
    _, regs, spills = found["chunk_scan_fwd_gate"]
    assert regs <= 168 and (spills == 0 or not triton.__version__.startswith("3.6.")), found
