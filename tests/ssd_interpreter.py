"""SSD cases run under Triton's interpreter in worker processes (tests/test_ssd_triton.py's interpret and
interpret_all).

Triton reads TRITON_INTERPRET when it is first imported (its own helpers such as tl.zeros are defined then), so the
cases run in separate Python processes with the variable set: workers that take them one after another, restoring
the tile shapes a case overrides, one per core and at most two, so that a test's independent cases run side by side
through interpret_all. Nothing leaks into other tests (mamba_ssm's kernels on a GPU machine). A case is a dict: the
arguments of a check in tests/ssd_checks.py (run_case_in_child says which), its config overrides and call options.
"""

import ast
import atexit
import contextlib
import importlib
import json
import os
import select
import subprocess
import sys
import tempfile

import torch

from tests.interpreter_child import ROOT, patch_interpreter
from tests.ssd_checks import (
    check_against_reference,
    check_decay_through_initial_states,
    check_final_state_only_halves,
    check_fp16_decay_gradient,
    check_fp16_gate_dD,
    check_fused_gate,
    check_keep_conv,
    check_kept_matches_recomputed,
    check_split_path,
    kernel_halves_from_references,
    make_inputs,
)
from tests.triton_sm90 import add_session_launches, record_launches

_SET_CONSTANTS: list = []  # (module, name, value before) of the module constants the running case set


def run_case_in_child(**case):
    """Entry point of the child process: kernels under the interpreter, checked against the reference."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_interpreter()
    from models.kernels.ssd_triton import autograd
    from models.kernels.ssd_triton.autograd import ssd_chunk_scan_triton

    overrides = case.pop("config", {})
    if overrides:  # other tile shapes / backward modes than the defaults
        import dataclasses

        default = autograd.block_config
        autograd.block_config = lambda q, p, n: dataclasses.replace(default(q, p, n), **overrides)
    call = case.pop("call", {})
    # Module constants set for this case ("package.module.NAME": value; e.g. the dt kernels' program size), restored
    # by serve() after it
    for name, value in case.pop("constants", {}).items():
        module_name, attr = name.rsplit(".", 1)
        module = importlib.import_module(module_name)
        _SET_CONSTANTS.append((module, attr, getattr(module, attr)))
        setattr(module, attr, value)
    if case.pop("poison_empty", False):
        # Every float buffer from torch.empty / empty_like starts as NaN: a kernel that reads what no kernel wrote
        # (CB's unstored tiles, chunk_cb.py) then fails the comparison.
        for name in ("empty", "empty_like"):
            original = getattr(torch, name)

            def poisoned(*args, _original=original, **kwargs):
                t = _original(*args, **kwargs)
                return t.fill_(float("nan")) if t.is_floating_point() else t

            setattr(torch, name, poisoned)
    if case.pop("split_path", False):
        with kernel_halves_from_references() if case.pop("halves", False) else contextlib.nullcontext():
            print(json.dumps(check_split_path(**case, kept_states=overrides.get("keep_states", False))))
        return
    # A case flag names its check (the rest of the case are the check's arguments); without one, the SSD itself.
    checks = {
        "final_only_halves": check_final_state_only_halves,
        "fp16_gate": check_fp16_gate_dD,
        "carried_decay": check_decay_through_initial_states,
        "fp16_decay": check_fp16_decay_gradient,
        "kept_vs_recomputed": check_kept_matches_recomputed,
        "fused_gate": check_fused_gate,
        "keep_conv": check_keep_conv,
    }
    for flag, check in checks.items():
        if case.pop(flag, False):
            print(json.dumps(check(**case)))
            return
    inp = make_inputs(**case)
    errors = check_against_reference(ssd_chunk_scan_triton, inp, **call)
    print(json.dumps(errors))


def current_test() -> str:
    """The running test's node id ("tests/test_ssd_triton.py::test_name[param]"), "" outside pytest."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]


class _InterpreterWorker:
    """One long-lived Python process with TRITON_INTERPRET=1 that runs the cases one after another (serve()), so
    that each case does not pay the ~4 s of importing torch and triton again. A case that kills the process fails
    alone: the next case starts a fresh worker."""

    def __init__(self):
        self.proc = None
        self.log = None

    def _start(self):
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log = tempfile.TemporaryFile(mode="w+")  # stderr (warnings) to a file: a full pipe would block it
        code = "import tests.ssd_interpreter as t; t.serve()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
        )  # fmt: skip
        atexit.register(self.proc.kill)

    def submit(self, case: dict) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(repr(case) + "\n")
        self.proc.stdin.flush()

    def finish(self, case: dict, ready: bool) -> str:
        """The submitted case's output (its result line is ready, else it timed out); fails with its output."""
        line = self.proc.stdout.readline() if ready else ""
        if not line:  # timed out or died: report its stderr, start afresh next time
            self.proc.kill()
            self.log.seek(0)
            raise AssertionError(f"case {case}: the interpreter worker died or timed out:\n{self.log.read()[-6000:]}")
        result = json.loads(line)
        assert result["ok"], f"case {case} failed:\n{result['out'][-6000:]}"
        # the case's kernel launches, filed under the test that ran it (tests/triton_sm90.py's SESSION_LAUNCHES)
        add_session_launches(current_test(), result["launches"])
        return result["out"]

    def run(self, case: dict, timeout: float = 600) -> str:
        self.submit(case)
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.finish(case, bool(ready))


# One worker per core, at most two: a test's independent cases (interpret_all) run side by side, and the pytest
# process only waits (CI has two cores: the interpreter cases are most of this file's time).
_WORKERS = [_InterpreterWorker() for _ in range(max(1, min(2, os.cpu_count() or 1)))]


def counters_left_zero():
    """The kernels leave their counters zero (launch.zeroed_counters keeps them between launches, unzeroed): a
    reset that went missing fails the case that left it, and would fail (or hang) the next launch."""
    from models.kernels.ssd_triton import launch

    dirty = {key[:2]: t.tolist() for key, t in launch._COUNTERS.items() if bool(t.ne(0).any())}
    for t in launch._COUNTERS.values():
        t.zero_()  # so that the next cases run (a stale ticket would make them wait forever)
    assert not dirty, f"counters left non-zero after the case: {dirty}"


def serve():
    """The worker's loop: one case (a dict's repr) per stdin line -> one JSON line {ok, out, launches} on stdout
    (launches: the case's kernel launches, tests/triton_sm90.py's record_launches)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import contextlib
    import io
    import traceback

    from models.kernels.ssd_triton import autograd

    default_config = autograd.block_config
    allocators = {name: getattr(torch, name) for name in ("empty", "empty_like")}  # poison_empty replaces them
    for line in sys.stdin:
        buf = io.StringIO()
        launches = []
        try:
            with contextlib.redirect_stdout(buf), record_launches(strict=False) as launches:
                run_case_in_child(**ast.literal_eval(line))
            counters_left_zero()
            ok, out = True, buf.getvalue()
        except BaseException:  # a failed assertion, or any error: reported, and the worker goes on
            ok, out = False, buf.getvalue() + traceback.format_exc()
        finally:
            autograd.block_config = default_config  # cases may override the tile shapes
            while _SET_CONSTANTS:  # and module constants
                module, attr, value = _SET_CONSTANTS.pop()
                setattr(module, attr, value)
            for name, allocator in allocators.items():
                setattr(torch, name, allocator)
        sys.stdout.write(json.dumps({"ok": ok, "out": out, "launches": launches}) + "\n")
        sys.stdout.flush()


def interpret(**case):
    """Run one case in the interpreter worker; fail with its output if it fails. Returns what the case printed."""
    return _WORKERS[0].run(case)


def interpret_all(*cases: dict, timeout: float = 600) -> list[str]:
    """Independent cases spread over the workers (each case resets what it changes, serve()); fails with the first
    failed case's output once all have finished. Returns what each case printed, in order."""
    outs, failures = [None] * len(cases), []
    queue, busy = list(enumerate(cases)), {}  # busy: worker -> (index, case)
    while queue or busy:
        for worker in _WORKERS:
            if worker not in busy and queue:
                busy[worker] = queue.pop(0)
                worker.submit(busy[worker][1])
        ready, _, _ = select.select([w.proc.stdout for w in busy], [], [], timeout)
        for worker in list(busy):
            if ready and worker.proc.stdout not in ready:
                continue
            i, case = busy.pop(worker)
            try:
                outs[i] = worker.finish(case, bool(ready))
            except AssertionError as e:
                failures.append(e)
    if failures:
        raise failures[0]
    return outs
