"""Compile our Triton SSD, conv, optimizer and norm kernels for Hopper (sm_90) on any machine, GPU or not, and print
what ptxas made of them.

    python3 benchmarks/kernel_resources.py                 # the default tiles at the 1.3B shape (bf16)
    python3 benchmarks/kernel_resources.py --set dx_m=32   # other tiles (BlockConfig fields)
    python3 benchmarks/kernel_resources.py --kernels conv_bwd --loops   # one kernel's loops, instruction by kind
    python3 benchmarks/kernel_resources.py --kernels dx --converts      # its layout conversions (via shared memory)
    python3 benchmarks/kernel_resources.py --kernels adamw --loops      # the optimizer's instructions ("kernel")
    python3 benchmarks/kernel_resources.py --kernels norm --loops       # the norms' (per row; 16 elements a thread)

Per kernel: registers per thread, spill stack bytes, wgmma (Hopper tensor-core) instructions, shared memory, and
the widths of the plain global loads; with --loops, per loop of the machine code (nvdisasm: a branch back to an
earlier label) its instruction count and the kinds that tell where issue slots go (block barriers, register moves,
shuffles, MUFU, loads, stores), and the code after the last loop's global loads, those after its first store
counted apart ("tail": such a load waits a memory round trip of its own, session 62). Session 23 read the conv
backward's ~240 instructions per step and dCB's barriers per head there (docs/performance.md). The code is the
installed Triton's: to read what the GPU machines' Triton 3.6 makes, `pip install --target /tmp/t36 --no-deps
triton==3.6.0` and run this with `PYTHONPATH=/tmp/t36`.

Register pressure and spills are the first thing to read before spending GPU time on a tile change: the chunk scan
went from 179 to 139 registers, and from 0.667 to 0.403 ms, when its triangular load mask on CB became a rectangular
load plus tl.where (docs/performance.md). Triton ships ptxas, so nothing but triton is needed. The compile is
specialised as the JIT would specialise a run at the benchmark shapes: innermost strides are the constant 1, every
other integer and pointer divisible by 16 (but UNALIGNED's).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from models.kernels.fast_launch import FastLaunch
from models.kernels.ssd_triton import (
    bc_finish,
    chained_dstates,
    chained_states,
    chunk_scan,
    chunk_scan_bwd,
    chunk_state,
    db_bwd,
    dcb_bwd,
)
from models.kernels.ssd_triton.config import block_config

BF16 = "*bf16"


def _tool(name: str) -> str:
    """A CUDA binary tool that Triton ships (ptxas, cuobjdump, nvdisasm)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


# Instruction kinds --loops counts in each loop (the opcode before its first dot), by what they cost: block barriers,
# register moves, warp shuffles, the special-function unit, tensor-core issues, global and shared memory, and cache
# control (CCTL: the conv backward's L2 prefetch hints).
LOOP_KINDS = ("BAR", "MOV", "SHFL", "MUFU", "HGMMA", "LDG", "STG", "LDGSTS", "LDS", "STS", "LDL", "STL", "CCTL")


def _kinds(body: list[str]) -> dict:
    return dict(instructions=len(body), **{k: body.count(k) for k in LOOP_KINDS if k in body})


def _parse_sass(sass: str) -> tuple[list[str], list[tuple[int, int]]]:
    """nvdisasm output as its instructions' opcodes (before the first dot, predicates stripped) and its loops' back
    edges (index of the loop's first instruction, index of the branch back to it), in order. A lone branch to
    itself (the kernel's closing trap) is no loop."""
    labels, ops = {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ops)
            continue
        ins = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if ins:
            ops.append(ins.group(1))
    names = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in ops]
    back_edges = []
    for i, text in enumerate(ops):
        target = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
        if target and labels.get(target.group(1), i) < i:
            back_edges.append((labels[target.group(1)], i))
    return names, back_edges


def sass_loops(sass: str) -> list[dict]:
    """The loops of nvdisasm output (a branch to a label at or before it): per loop its instruction count and the
    counts of LOOP_KINDS, innermost and outermost alike, in the order of their back edges; then the whole kernel's
    (as "kernel": for kernels without a loop, such as the conv's forward)."""
    names, back_edges = _parse_sass(sass)
    loops = [_kinds(names[start : i + 1]) for start, i in back_edges]
    return loops + [{"kernel": _kinds(names)}]


def sass_tail(sass: str) -> dict:
    """The code after the kernel's last loop (its epilogue: the outputs): how many global loads (LDG) it issues, and
    how many of those come after its first global store (STG). The compiler cannot move a load above a store (the
    pointers might alias), so each such load waits a memory round trip of its own after the stores before it: dx and
    the chunk scan load both heads' inputs before either head's stores since session 62 (chunk_scan_bwd.py). In code
    with branches after the last loop the count also takes in a later branch's loads laid out after an earlier
    branch's stores (the conv forward's two document paths: 7 of 21 with documents, 0 of 12 without)."""
    names, back_edges = _parse_sass(sass)
    start = back_edges[-1][1] + 1 if back_edges else 0
    tail = names[start:]
    first_store = tail.index("STG") if "STG" in tail else len(tail)
    return dict(loads=tail.count("LDG"), loads_after_first_store=tail[first_store:].count("LDG"))


# Integer arguments not divisible by 16 at the benchmark shapes (no divisibility hint): the batch size, and the
# conv weight's row stride (its width, 4).
UNALIGNED = frozenset(("BATCH", "s_w_d"))


def layout_conversions(ttgir: str) -> list[str]:
    """Each `ttg.convert_layout` of the Triton GPU IR as 'type -> type': a tile that crosses shared memory between
    two register layouts (session 25 found dx converting whole float32 products before reducing them)."""
    found = re.findall(r"ttg\.convert_layout %\S+ : (.*?) loc\(", ttgir)
    return [re.sub(r"\s+", " ", f) for f in found]


def compile_sm90(
    kernel,
    ptr_types: dict,
    consts: dict,
    num_warps: int,
    num_stages: int,
    maxnreg=None,
    loops: bool = False,
    converts: bool = False,
    ones=frozenset(),
) -> dict:
    if isinstance(kernel, FastLaunch):  # compile the @triton.jit function itself
        kernel = kernel.kernel
    names = kernel.arg_names
    # constexprs the caller leaves out take their defaults (the kernels' optional paths: GATE, PDL, X_SCALED, ...)
    consts = {**{q.name: q.default for q in kernel.params if q.is_constexpr and q.has_default}, **consts}
    # Triton specialises an integer argument equal to 1 as the constant 1: the innermost strides, and `ones` (the
    # group count G at ngroups 1, which changed dx's registers from 116 to 132 with documents: session 26).
    unit_strides = {n for n in names if (re.fullmatch(r"s_\w+_[pn]", n) or n in ones) and n not in consts}
    sig, constexprs = {}, {}
    for i, n in enumerate(names):
        if n in consts or n in unit_strides:
            sig[n] = "constexpr"
            constexprs[(i,)] = consts.get(n, 1)
        else:
            # ptr_types names any argument's type (the optimizer's tables and float scalars too); else *_ptr is a
            # float32 pointer and the rest int32
            sig[n] = ptr_types.get(n, "*fp32" if n.endswith("_ptr") else "i32")
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if sig[n] not in ("constexpr", "fp32") and n not in UNALIGNED
    }
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg),
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True)
        sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout if loops else ""
    usage = usage.stdout
    ptx = compiled.asm["ptx"]
    loads: dict[str, int] = {}
    for m in re.finditer(r"ld\.global(?:\.\w+)*", ptx):
        loads[m.group(0)[len("ld.global.") :]] = loads.get(m.group(0)[len("ld.global.") :], 0) + 1
    reg, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return dict(
        registers=int(reg.group(1)) if reg else None,
        spill_stack_bytes=int(stack.group(1)) if stack else None,
        wgmma=ptx.count("wgmma.mma_async"),
        mma_sync=ptx.count("mma.sync"),
        shared_bytes=compiled.metadata.shared,
        global_loads=loads,
        **({"loops": sass_loops(sass), "tail": sass_tail(sass)} if loops else {}),
        **({"layout_conversions": layout_conversions(compiled.asm["ttgir"])} if converts else {}),
    )


def kernels(cfg, P: int, N: int, has_seq: bool):
    """(name, kernel, pointer dtypes, constexprs, warps, stages) of each kernel at these tiles."""
    bp, bn = max(16, triton.next_power_of_2(P)), max(16, triton.next_power_of_2(N))  # as autograd.py pads them
    fold_states = cfg.fold_dt and cfg.fold_dt_states  # the chunk states' and dB's scale from a2dt
    seq = dict(HAS_SEQ=has_seq, PREC="tf32")
    ptrs = dict(
        x_ptr=BF16,
        B_ptr=BF16,
        C_ptr=BF16,
        y_ptr=BF16,
        dy_ptr=BF16,
        dx_ptr=BF16,
        S_in_ptr=BF16,
        dH_ptr=BF16,
        seq_ptr="*i32",
    )
    yield (
        "chunk_state_fwd",
        chunk_state.chunk_state_fwd_kernel,
        ptrs,
        dict(
            **seq,
            EVEN=True,
            HEADS=cfg.state_heads,
            BLOCK_P=cfg.state_p,
            BLOCK_N=cfg.state_n,
            BLOCK_K=cfg.state_k,
            FOLD_DT=fold_states,
        ),
        cfg.state_warps,
        cfg.state_stages,
    )
    chain = dict(**seq, EVEN=True, BLOCK_P=cfg.state_p, BLOCK_K=cfg.state_k)
    yield (
        "chained_states_fwd",
        chained_states.chained_states_fwd_kernel,
        dict(ptrs, sync_ptr="*i32", S_lo_ptr=BF16),  # (keep_states: S_in's high and low parts in x's dtype)
        dict(
            **chain,
            HEADS=cfg.chained_heads,
            HAS_INIT=False,
            CARRY_IS_S32=False,
            CARRY_IS_KEPT=cfg.keep_states,
            BLOCK_N=min(cfg.chained_fwd_n, N),
            FOLD_DT=fold_states,
        ),
        cfg.state_warps,
        cfg.chained_stages,
    )
    yield (
        "chained_dstates_bwd",
        chained_dstates.chained_dstates_bwd_kernel,
        # bf16 dy: the chain's hand-off is dH's low part (carry); keep_states: S_in as high and low parts
        dict(ptrs, sync_ptr="*i32", carry_ptr=BF16, S_lo_ptr=BF16, **(dict(S32_ptr=BF16) if cfg.keep_states else {})),
        dict(
            **chain,
            HEADS=cfg.chained_bwd_heads,
            HAS_DFINAL=False,
            SPLIT=cfg.keep_states,
            CARRY_IS_DH=True,
            BLOCK_N=min(cfg.chained_bwd_n, N),
        ),
        cfg.state_warps,
        cfg.chained_stages,
    )
    scan = dict(
        **seq,
        HAS_D=True,
        D_HAS_HDIM=False,
        EVEN=True,
        HEADS=cfg.scan_heads,
        FOLD_DT=cfg.fold_dt,
        BLOCK_M=cfg.scan_m,
        BLOCK_K=cfg.scan_k,
        BLOCK_P=cfg.scan_p,
        BLOCK_N=cfg.scan_n,
        INNER_FIRST=cfg.inner_first,
    )
    yield "chunk_scan_fwd", chunk_scan.chunk_scan_fwd_kernel, ptrs, scan, cfg.scan_warps, cfg.scan_stages
    # ... with the gated norm's first half (the 1.3B config's fuse_gate_into_scan)
    gate_ptrs = dict(ptrs, z_ptr=BF16, w_ptr=BF16, g_ptr=BF16)
    gate = dict(scan, GATE=True, FAST=True)
    yield "chunk_scan_fwd_gate", chunk_scan.chunk_scan_fwd_kernel, gate_ptrs, gate, cfg.scan_warps, cfg.scan_stages
    yield (
        "chunk_scan_bwd_dx",
        chunk_scan_bwd.chunk_scan_bwd_dx_kernel,
        ptrs,
        dict(
            **seq,
            HAS_D=True,
            D_HAS_HDIM=False,
            EVEN=True,
            HEADS=cfg.dx_heads,
            BLOCK_K=cfg.dx_k,
            BLOCK_M=cfg.dx_m,
            BLOCK_P=bp,
            BLOCK_N=cfg.dx_n,
            INNER_FIRST=cfg.inner_first,
            DX_STATE_FIRST=cfg.dx_state_first,
            SUMS_2D=cfg.dx_row_sums_2d,
        ),
        cfg.dx_warps,
        cfg.dx_stages,
    )
    dcb_consts = dict(
        **seq,
        EVEN=True,
        BLOCK_M=cfg.dc_m,
        BLOCK_P=bp,
        BLOCK_N=bn,
        INNER_FIRST=cfg.inner_first,
        HEADS_STAGES=cfg.dcb_heads_stages,
        COL_PARTS=cfg.dcb_col_parts,
        DIAG_PARTS=cfg.dcb_diag_col_parts,
        FOLD_DT=cfg.fold_dt,
    )
    # config dcb_state_apart: the state term's launch and the tiles' (dcb_bwd.py's PART), else one launch
    dcb_parts = (("_state", 2), ("_tiles", 1)) if cfg.dcb_state_apart else (("", 0),)
    for suffix, part in dcb_parts:
        yield (
            "chunk_scan_bwd_dcb" + suffix,
            dcb_bwd.chunk_scan_bwd_dcb_kernel,
            ptrs,
            dict(dcb_consts, PART=part),
            cfg.dc_warps,
            cfg.dc_stages,
        )
    yield (
        "chunk_state_bwd_db",
        db_bwd.chunk_state_bwd_db_kernel,
        ptrs,
        dict(
            **seq,
            BLOCK_K=cfg.db_k,
            BLOCK_P=bp,
            BLOCK_N=bn,
            INNER_FIRST=cfg.inner_first,
            FOLD_DT=fold_states,
        ),
        cfg.db_warps,
        cfg.db_stages,
    )
    n_hb = max(1, 64 // cfg.heads_per_prog)  # head blocks at the 1.3B shape (64 heads, one group)
    yield (
        "bc_finish",
        bc_finish.bc_finish_kernel,
        ptrs,
        dict(
            N_HB=n_hb,
            PREC="tf32",
            BLOCK_M=cfg.dc_m,
            BLOCK_K=cfg.dc_m,
            BLOCK_N=min(bn, cfg.bcf_n),
        ),
        cfg.bcf_warps,
        2,
    )


def conv_kernels(has_seq: bool):
    """(name, kernel, pointer dtypes, constexprs, warps, stages) of the causal conv's kernels (conv_triton.py) at its
    module's tiles: width 4, silu, bias, bf16 data."""
    from models.kernels import conv_triton as ct

    ptrs = dict(x_ptr=BF16, out_ptr=BF16, dout_ptr=BF16, dx_ptr=BF16, seq_ptr="*i32")
    common = dict(HAS_BIAS=True, HAS_SEQ=has_seq, SILU=True, W=4, FAST=ct._FAST_SIGMOID, s_w_k=1)
    fwd = dict(
        common,
        BLOCK_L=ct._FWD_BLOCK_L,
        BLOCK_D=ct._FWD_BLOCK_D,
        CHANNELS_FASTEST=ct._FWD_CHANNELS_FASTEST,
        ONE_DOC_BRANCH=ct._FWD_ONE_DOC_BRANCH,
    )
    bwd = dict(
        common,
        ROWS=ct._BWD_ROWS,
        BLOCK_D=ct._BWD_BLOCK_D,
        PREFETCH=ct._BWD_PREFETCH,
        UNROLL=ct._BWD_UNROLL,
        ONE_DOC_BRANCH=ct._BWD_ONE_DOC_BRANCH,
        L2_AHEAD=ct._BWD_L2_AHEAD,
        STAGES=ct._BWD_STAGES,
    )
    yield "conv_fwd", ct.conv_fwd_kernel, ptrs, fwd, ct._FWD_WARPS, 1
    yield "conv_bwd", ct.conv_bwd_kernel, ptrs, bwd, ct._BWD_WARPS, ct._BWD_STAGES


def optimizer_kernels():
    """(name, kernel, argument types, constexprs, warps, stages) of the optimizer's kernels (components/adamw_triton.py,
    components/sumsq_triton.py) at their modules' blocks: float32 weights and moments, aligned, bf16 weight copies,
    no grad_scale (the trainer's clipping divides by a scale only when it clips); float32 gradients, and as
    "adamw_bf16_grads" / "sumsq_bf16" the launches over bf16 ones (training.grad_dtype)."""
    import triton.language as tl

    from components import adamw_triton, sumsq_triton

    i64, f32 = "*i64", "fp32"
    tables = dict(p_tab=i64, g_tab=i64, m_tab=i64, v_tab=i64, c_tab=i64, step_tab=i64, numel_ptr=i64)
    adamw = dict(tables, blk_tensor_ptr="*i32", blk_start_ptr=i64, base16=BF16, base32="*fp32", lr=f32, beta1=f32)
    adamw.update(beta2=f32, eps=f32, decay=f32, grad_base="*fp32")
    copies = dict(HAS_SCALE=False, HAS_COPIES=True, COPY_DTYPE=tl.bfloat16, ALIGNED=True, FAST=True)
    update = dict(copies, BLOCK=adamw_triton.BLOCK, GRAD_BYTES=4)
    yield "adamw", adamw_triton._adamw_kernel, adamw, update, adamw_triton.WARPS, 1
    yield "adamw_bf16_grads", adamw_triton._adamw_kernel, dict(adamw, grad_base=BF16), dict(update, GRAD_BYTES=2), \
        adamw_triton.WARPS, 1  # fmt: skip
    yield "adamw_step_scalars", adamw_triton._step_scalars_kernel, adamw, dict(BLOCK=1024), 4, 1
    sumsq = dict(tab_ptr=i64, numel_ptr=i64, blk_tensor_ptr="*i32", blk_start_ptr=i64, base="*fp32")
    sums = dict(BLOCK=sumsq_triton.BLOCK, ALIGNED=True, ELEM_BYTES=4)
    yield "sumsq", sumsq_triton._sumsq_kernel, sumsq, sums, sumsq_triton.WARPS, 1
    yield "sumsq_bf16", sumsq_triton._sumsq_kernel, dict(sumsq, base=BF16), dict(sums, ELEM_BYTES=2), \
        sumsq_triton.WARPS, 1  # fmt: skip


def norm_kernels(d_model: int = 2048, d_inner: int = 4096):
    """(name, kernel, argument types, constexprs, warps, stages) of the norms' kernels (add_rmsnorm_triton.py,
    gated_rmsnorm_triton.py) at their modules' launch shapes, for rows of d_model (the block's pre-norm: bf16 x, a
    float32 residual as residual_in_fp32 keeps it) and groups of d_inner (the gated norm, norm_before_gate false,
    bf16; its backward recomputes the output, as the fused mixer asks)."""
    from models.kernels import add_rmsnorm_triton as an
    from models.kernels import gated_rmsnorm_triton as gn
    from models.kernels._utils import rows_in_flight, warps_for_row

    f32p, f32 = "*fp32", "fp32"
    block = triton.next_power_of_2(d_model)
    add_fwd = dict(X=BF16, RES=f32p, W=f32p, Y=BF16, RES_OUT=f32p, RSTD=f32p, eps=f32)
    add_bwd = dict(DY=BF16, S=f32p, W=f32p, RSTD=f32p, DRES_OUT=f32p, DX=BF16, DRES=f32p, DW_PART=f32p)
    stages = rows_in_flight(d_model * (2 + 4 + 4), an._BWD_STAGES)
    yield (
        "add_rmsnorm_fwd",
        an._add_rmsnorm_fwd_kernel,
        add_fwd,
        dict(HAS_RES=True, BLOCK=block),
        warps_for_row(block, an._FWD_ELEMS_PER_THREAD),
        1,
    )
    consts = dict(HAS_DRES_OUT=True, HAS_RES=True, BLOCK=block, STAGES=stages)
    yield (
        "add_rmsnorm_bwd",
        an._add_rmsnorm_bwd_kernel,
        add_bwd,
        consts,
        warps_for_row(block, an._BWD_ELEMS_PER_THREAD),
        1,
    )
    block = triton.next_power_of_2(d_inner)
    gated = dict(Y=BF16, Z=BF16, W=f32p, OUT=BF16, RSTD=f32p, DOUT=BF16, DY=BF16, DZ=BF16, DW_PART=f32p, eps=f32)
    common = dict(NORM_BEFORE_GATE=False, Y_COLS=0, BLOCK=block, FAST=gn._FAST_SIGMOID)
    yield (
        "gated_norm_fwd",
        gn._gated_rmsnorm_fwd_kernel,
        gated,
        common,
        warps_for_row(block, gn._FWD_ELEMS_PER_THREAD),
        1,
    )
    stages = rows_in_flight(block * 6, gn._BWD_STAGES)
    consts = dict(common, RECOMPUTE=True, STAGES=stages)
    yield (
        "gated_norm_bwd",
        gn._gated_rmsnorm_bwd_kernel,
        gated,
        consts,
        warps_for_row(block, gn._BWD_ELEMS_PER_THREAD),
        1,
    )


# Kernels whose register cap (ptxas .maxnreg) a BlockConfig field sets (dx's and the chained forward's, which
# depend on their heads per program: register_cap).
MAXNREG = {
    "chunk_scan_bwd_dcb": "dc_maxnreg",
    "chunk_scan_bwd_dcb_tiles": "dc_maxnreg",
    "chunk_scan_bwd_dcb_state": "dc_state_maxnreg",
    "chunk_state_bwd_db": "db_maxnreg",
    "chained_dstates_bwd": "chained_bwd_maxnreg",
    "chunk_scan_fwd": "scan_maxnreg",
    "chunk_scan_fwd_gate": "scan_maxnreg",
}


def register_cap(cfg, name: str) -> int | None:
    """The register cap the launchers give kernel `name` under cfg (None: ptxas's choice); dx's and the chained
    forward's depend on their heads per program (BlockConfig.dx_register_cap, chained_fwd_register_cap)."""
    if name == "chunk_scan_bwd_dx":
        return cfg.dx_register_cap(cfg.dx_heads)
    if name == "chained_states_fwd":
        return cfg.chained_fwd_register_cap(cfg.chained_heads)
    return getattr(cfg, MAXNREG.get(name, ""), None)


def _parse_value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(v.lower(), v)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--dstate", type=int, default=128)
    ap.add_argument(
        "--ngroups",
        type=int,
        default=1,
        help="B / C groups (1 at every config's shape: Triton then compiles G as the constant 1)",
    )
    ap.add_argument("--no_seq", action="store_true", help="compile without seq_idx (documents)")
    ap.add_argument(
        "--set",
        nargs="*",
        action="extend",
        default=[],
        help="BlockConfig overrides, e.g. dx_m=32 dc_warps=8 (repeatable, as the other benchmarks' --set)",
    )
    ap.add_argument("--kernels", default="", help="only the kernels whose name matches this regular expression")
    ap.add_argument("--loops", action="store_true", help="also each loop's instructions by kind (nvdisasm)")
    ap.add_argument("--converts", action="store_true", help="also the IR's layout conversions (via shared memory)")
    args = ap.parse_args()
    try:
        re.compile(args.kernels)
    except re.error as e:
        ap.error(f"--kernels {args.kernels!r} is no regular expression ({e}); e.g. --kernels 'dcb|conv'")
    if args.ngroups < 1:
        ap.error(f"--ngroups {args.ngroups}: the number of B / C groups is at least 1")
    cfg = block_config(args.chunk, args.headdim, args.dstate)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or key not in cfg.__dataclass_fields__:
            ap.error(
                f"--set {item!r}: expected FIELD=VALUE with FIELD one of BlockConfig's: "
                + ", ".join(cfg.__dataclass_fields__)
            )
        overrides[key] = _parse_value(value)
    cfg = dataclasses.replace(cfg, **overrides)
    every = [
        *kernels(cfg, args.headdim, args.dstate, not args.no_seq),
        *conv_kernels(not args.no_seq),
        *optimizer_kernels(),
        *norm_kernels(),
    ]
    for name, kernel, ptrs, consts, warps, stages in every:
        if not re.search(args.kernels, name):
            continue
        cap = register_cap(cfg, name)
        ones = frozenset({"G"} if args.ngroups == 1 else ())
        info = compile_sm90(kernel, ptrs, consts, warps, stages, cap, args.loops, args.converts, ones)
        print(f"{name:28s} warps {warps} stages {stages}: {info}", flush=True)


if __name__ == "__main__":
    main()
