"""Every Triton kernel of ours compiles for the GPU (sm_90: H100 / H200) with the argument patterns the interpreter
tests launch, on a CPU-only machine (tests/triton_sm90.py says why and how).

A selection of the interpreter cases (the SSD with documents, initial and final states, two groups and a ragged last
chunk; the model's fused path with the kernel halves; P and N that are not powers of two; the conv with and without
documents; the residual add + RMSNorm, also rewriting its normed rows (norm_linear.py); the gated norm on dense rows
and on CP's column blocks; the fused loss; the optimizer's AdamW and sum of squares) records each launch's dtypes,
scalars and constexprs; this process compiles each distinct pattern for sm_90. The selection must launch every kernel
of ours at least once, so a new kernel without a case here fails too. Those cases are tests of their own modules too:
conftest.py runs this file after them, and what they launched (tests/triton_sm90.py's SESSION_LAUNCHES) is compiled
here without running them again; the cases the session did not run (this file alone, or -k) run here in interpreter
children.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import pkgutil

import pytest

from tests.interpreter_child import LAUNCHES, finish_child, run_checks, start_child

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
    results.pop(LAUNCHES)  # this process records them itself (check_record)
    failed = {k: r["out"][-2000:] for k, r in results.items() if not r["ok"]}
    assert not failed, failed


SSD_KEY = "tests/test_ssd_triton.py::{}"  # SESSION_LAUNCHES' key of an SSD test (ssd_interpreter.current_test)


def session_key(part: str) -> str:
    """Where the session's record (tests/triton_sm90.py's SESSION_LAUNCHES) files the launches of one part of the
    selection: an SSD_TESTS name or a CHILD_MODULES module."""
    return SSD_KEY.format(part) if part in SSD_TESTS else f"module:{part}"


def check_record(parts: list[str]) -> list[dict]:
    """The launches of these SSD_TESTS' cases and CHILD_MODULES' checks, run in this (interpreter) process (child():
    run_checks has patched the interpreter)."""
    from tests.triton_sm90 import record_launches

    with record_launches() as launches:
        for part in parts:
            if part in SSD_TESTS:
                _run_ssd_test(part)
            else:
                _run_child_module(part)
    return launches


def child(parts: list[str]) -> None:
    run_checks({"record": lambda: check_record(parts)})


def selection_launches(run_missing) -> list[dict]:
    """The launches of the whole selection: each part's from the session's record where an earlier test of this
    session ran it (conftest.py runs this file last), the others from run_missing(parts). A launch whose arguments
    could not be recorded fails here (record_launches)."""
    from tests.triton_sm90 import SESSION_LAUNCHES

    parts = list(SSD_TESTS) + list(CHILD_MODULES)
    missing = [p for p in parts if session_key(p) not in SESSION_LAUNCHES]
    launches = [x for p in parts if p not in missing for x in SESSION_LAUNCHES[session_key(p)]]
    if missing:
        launches += run_missing(missing)
    unrecorded = [x for x in launches if "error" in x]
    assert not unrecorded, f"launches whose arguments could not be recorded: {unrecorded[:5]}"
    return launches


def _run_in_children(parts: list[str]) -> list[dict]:
    """The parts in two interpreter children side by side (the CI has two cores)."""
    shares = [parts[i::2] for i in range(2) if parts[i::2]]
    children = [start_child("tests.test_kernels_compile_sm90", f"child({share!r})") for share in shares]
    recorded = []
    for proc in children:
        r = finish_child(proc, timeout=900)["record"]
        assert r["ok"], r["out"]
        recorded += r["out"]
    return recorded


@pytest.fixture(scope="module")
def launches():
    # Run alone, this file runs the whole selection under the interpreter itself (~130 s on the CI's two cores);
    # after test_ssd_triton and the CHILD_MODULES in one session, nothing.
    return selection_launches(_run_in_children)


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


def test_the_selection_takes_the_sessions_record_and_runs_only_the_rest(monkeypatch):
    """selection_launches: the parts an earlier test recorded come from the session's record, only the others are
    run (here: the first SSD test), and a launch recorded without its arguments fails."""
    from tests import triton_sm90

    def fake(part):
        return dict(module="m", name=part, args=[], kwargs={}, grid=[1])

    parts = list(SSD_TESTS) + list(CHILD_MODULES)
    record = {session_key(p): [fake(p)] for p in parts[1:]}
    monkeypatch.setattr(triton_sm90, "SESSION_LAUNCHES", record)
    asked = []

    def run_missing(missing):
        asked.append(missing)
        return [fake(p) for p in missing]

    assert sorted(x["name"] for x in selection_launches(run_missing)) == sorted(parts)
    assert asked == [[SSD_TESTS[0]]]
    record[session_key(CHILD_MODULES[0])].append(dict(module="m", name="k", error="cannot be recorded"))
    with pytest.raises(AssertionError, match="could not be recorded"):
        selection_launches(run_missing)


def test_interpreter_children_file_their_launches_in_the_sessions_record():
    """What lets the compile tests skip the selection's cases: an SSD case run by test_ssd_triton's workers files its
    launches under the running test, a module's child() checks under the module (tests/triton_sm90.py)."""
    from tests.interpreter_child import child_results
    from tests.ssd_interpreter import current_test, interpret
    from tests.triton_sm90 import SESSION_LAUNCHES

    key = current_test()
    SESSION_LAUNCHES.pop(key, None)
    interpret(b=1, L=32, H=2, P=16, G=1, N=16, seed=0, call=dict(chunk_size=16))
    names = {x["name"] for x in SESSION_LAUNCHES[key]}
    assert {"cb_fwd_kernel", "chunk_scan_fwd_kernel", "chunk_scan_bwd_dx_kernel"} <= names, names
    SESSION_LAUNCHES.pop("module:tests.test_sumsq_triton", None)
    assert child_results("tests.test_sumsq_triton")["sumsq"]["ok"]
    names = {x["name"] for x in SESSION_LAUNCHES["module:tests.test_sumsq_triton"]}
    assert "_sumsq_kernel" in names, names
