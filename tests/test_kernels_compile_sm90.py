"""Every Triton kernel of ours compiles for the GPU (sm_90: H100 / H200) with the argument patterns the interpreter
tests launch, on a CPU-only machine (tests/triton_sm90.py says why and how).

A child process under TRITON_INTERPRET=1 runs a selection of the interpreter cases (the SSD with documents, initial
and final states, two groups and a ragged last chunk; the model's fused path with the kernel halves; P and N that
are not powers of two; the conv with and without documents; the residual add + RMSNorm, also rewriting its normed rows
(norm_linear.py); the gated norm on dense rows and on CP's column blocks; the fused loss; the optimizer's AdamW and sum
of squares) and records each launch's dtypes, scalars and constexprs; this process compiles each distinct pattern for
sm_90. The selection must launch every kernel of ours at least once, so a new kernel without a case here fails too.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import pkgutil

import pytest

from tests.interpreter_child import finish_child, run_checks, start_child

pytest.importorskip("triton")

# test_ssd_triton cases (their functions call `interpret(**case)` / `interpret_all(*cases)`, run here in this process
# one after another) that together launch every SSD kernel
SSD_TESTS = (
    "test_documents_initial_states_two_groups_remainder",
    "test_one_group_D_per_channel_z_odd_chunk",
    "test_fused_path_contract_under_triton_backend",
    "test_fused_path_kernel_halves_wiring",
    "test_fused_path_kernel_halves_final_state_only",
    "test_chained_states_several_tiles_per_head",
    "test_headdim_and_state_size_not_powers_of_two",
    "test_staged_states_two_heads_per_program",
    "test_fused_gate_into_the_chunk_scan",
    "test_dcb_tiles_and_column_sums_in_parts",  # dCB's launches apart (config dcb_state_apart)
)
# modules whose child() runs their interpreter cases through tests/interpreter_child.py
CHILD_MODULES = (
    "tests.test_conv_triton",
    "tests.test_add_rmsnorm_triton",
    "tests.test_norm_linear",
    "tests.test_gated_rmsnorm_triton",
    "tests.test_cross_entropy_triton",
    "tests.test_adamw_triton",
    "tests.test_sumsq_triton",
    "tests.test_tied_embedding",
)
# kernels launched with kernel[grid] rather than through fast_launch (the optimizer's, once per step)
PLAIN_KERNELS = (
    ("components.adamw_triton", "_adamw_kernel"),
    ("components.adamw_triton", "_step_scalars_kernel"),
    ("components.sumsq_triton", "_sumsq_kernel"),
)


def _run_ssd_test(name: str) -> None:
    """One test_ssd_triton test with its cases run in this (interpreter) process instead of its worker."""
    import tests.test_ssd_triton as t
    from models.kernels.ssd_triton import autograd
    from tests.ssd_interpreter import run_case_in_child

    def interpret(**case):
        default = autograd.block_config
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                run_case_in_child(**case)
        finally:
            autograd.block_config = default  # a case may override the tile shapes
        return out.getvalue()

    def interpret_all(*cases):
        return [interpret(**case) for case in cases]

    saved = t.interpret, t.interpret_all
    t.interpret, t.interpret_all = interpret, interpret_all
    try:
        getattr(t, name)()
    finally:
        t.interpret, t.interpret_all = saved


def _run_child_module(module: str) -> None:
    """A module's child(): its checks under the interpreter; their JSON line must say every one passed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        importlib.import_module(module).child()
    results = json.loads(out.getvalue().strip().splitlines()[-1])
    failed = {k: r["out"][-2000:] for k, r in results.items() if not r["ok"]}
    assert not failed, failed


def check_record(part: str) -> list[dict]:
    """The launches of SSD_TESTS' cases (part "ssd") or of CHILD_MODULES' checks (part "modules")."""
    from tests.interpreter_child import patch_interpreter_scalar_index
    from tests.triton_sm90 import record_launches

    patch_interpreter_scalar_index()
    with record_launches() as launches:
        if part == "ssd":
            for name in SSD_TESTS:
                _run_ssd_test(name)
        else:
            for module in CHILD_MODULES:
                _run_child_module(module)
    return launches


def child(part: str) -> None:
    run_checks({"record": lambda: check_record(part)})


@pytest.fixture(scope="module")
def launches():
    # The two parts in two children side by side (~30 s each under the interpreter on the CI's two cores).
    children = [start_child("tests.test_kernels_compile_sm90", f"child({part!r})") for part in ("ssd", "modules")]
    recorded = []
    for proc in children:
        r = finish_child(proc, timeout=900)["record"]
        assert r["ok"], r["out"]
        recorded += r["out"]
    return recorded


def _our_kernels() -> set[tuple[str, str]]:
    """Every kernel launched through fast_launch in models/kernels, and the optimizer's plain ones."""
    import models.kernels as package
    from models.kernels.fast_launch import FastLaunch

    found = set(PLAIN_KERNELS)
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if isinstance(obj, FastLaunch) and obj.kernel.fn.__module__ == info.name:
                found.add((info.name, name))
    return found


def test_the_cases_launch_every_kernel(launches):
    launched = {(x["module"], x["name"]) for x in launches}
    missing = _our_kernels() - launched
    assert not missing, f"no case here launches {sorted(missing)}: add one that does to SSD_TESTS / CHILD_MODULES"


def test_every_launched_pattern_compiles_for_sm90(launches):
    from tests.triton_sm90 import compile_for_sm90, distinct

    patterns = distinct(launches)
    assert len(patterns) >= len(_our_kernels())
    failures = compile_for_sm90(patterns, workers=min(2, os.cpu_count() or 1))
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())


PROBE = """
import triton
import triton.language as tl


@triton.jit
def _offsets(cols, stride, BLOCKS: tl.constexpr):
    if BLOCKS > 0:
        return (cols // BLOCKS).to(tl.int64) * stride + cols % BLOCKS
    return cols


@triton.jit
def _offsets_one_return(cols, stride, BLOCKS: tl.constexpr):
    if BLOCKS > 0:
        offs = (cols // BLOCKS).to(tl.int64) * stride + cols % BLOCKS
    else:
        offs = cols
    return offs


@triton.jit
def broken_kernel(X, OUT, stride, BLOCKS: tl.constexpr, N: tl.constexpr):
    cols = tl.arange(0, N)
    tl.store(OUT + cols, tl.load(X + _offsets(cols, stride, BLOCKS)))


@triton.jit
def fixed_kernel(X, OUT, stride, BLOCKS: tl.constexpr, N: tl.constexpr):
    cols = tl.arange(0, N)
    tl.store(OUT + cols, tl.load(X + _offsets_one_return(cols, stride, BLOCKS)))
"""


def test_a_compile_error_the_interpreter_cannot_see_is_caught(tmp_path, monkeypatch):
    """The check itself: a kernel with a constexpr branch returning int64 beside an int32 return after it (session
    31's bug, which the interpreter runs) fails to compile here; its one-return form compiles."""
    from tests.triton_sm90 import compile_for_sm90

    (tmp_path / "sm90_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    launch = dict(module="sm90_probe", args=[{"tensor": "float32"}, {"tensor": "float32"}, 64],
                  kwargs={"BLOCKS": 8, "N": 16}, grid=[1])  # fmt: skip
    broken = compile_for_sm90([dict(launch, name="broken_kernel")])
    fixed = compile_for_sm90([dict(launch, name="fixed_kernel")])
    assert len(broken) == 1 and "return types" in next(iter(broken.values())), broken
    assert fixed == {}, fixed


def test_programmatic_dependent_launch_variants_compile_for_sm90(launches):
    """Each kernel with a PDL constexpr (fast_launch.py: MAMBATITAN_PDL=1) also compiles with it on and Triton's
    launch_pdl option, at its first recorded pattern: the grid dependency instructions are PTX the interpreter never
    runs."""
    from tests.triton_sm90 import compile_for_sm90, distinct

    firsts = {}
    for launch in distinct(launches):
        module = importlib.import_module(launch["module"])
        names = [p.name for p in getattr(getattr(module, launch["name"]), "params", [])]
        if "PDL" in names:
            firsts.setdefault((launch["module"], launch["name"]), launch)
    assert len(firsts) >= 20, sorted(firsts)  # the SSD's, the norms', the conv's, the loss's and column_sums' kernels
    variants = [dict(launch, kwargs=dict(launch["kwargs"], PDL=True, launch_pdl=True)) for launch in firsts.values()]
    failures = compile_for_sm90(variants, workers=min(2, os.cpu_count() or 1))
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())
