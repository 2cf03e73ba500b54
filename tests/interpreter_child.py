"""Cases of a test module run in ONE child process under Triton's interpreter (Triton reads TRITON_INTERPRET when it
is first imported, so the parent pytest process cannot switch it on for some tests only).

    def child():                                    # in the test module: runs in the child
        run_checks({"case_a": check_a, ...})
    @pytest.fixture(scope="module")
    def results():
        return child_results("tests.test_my_kernel")  # {name: {"ok": bool, "out": result or traceback}}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def patch_interpreter_scalar_index():
    """Triton 3.6's interpreter turns scalar kernel arguments into 1-element arrays and calls int() on them
    for Python ``range`` bounds; numpy >= 2.4 refuses int() of a 1-d array. Index the single element."""
    import triton.runtime.interpreter as interp

    if getattr(interp, "_scalar_index_patched", False):  # once per process (the worker runs many cases)
        return
    interp._scalar_index_patched = True

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def run_checks(checks: dict[str, Callable[[], object]]) -> None:
    """In the child: every check, one JSON object {name: {ok, out}} on stdout; a failing check does not stop the
    others (its traceback is its out)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results = {}
    for name, check in checks.items():
        try:
            results[name] = {"ok": True, "out": check()}
        except BaseException:  # a failed check or any error: reported under its case, the others still run
            results[name] = {"ok": False, "out": traceback.format_exc()}
    print(json.dumps(results))


def start_child(module: str, call: str = "child()") -> subprocess.Popen:
    """Starts `module`.`call` in a child process with TRITON_INTERPRET=1 (finish_child collects it), so that
    several children can run side by side."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = f"import {module} as t; t.{call}"
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish_child(proc: subprocess.Popen, timeout: float = 300) -> dict:
    """A started child's JSON results (killed if it outlives timeout)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the interpreter child timed out after {timeout} s:\n{err[-6000:]}") from None
    assert proc.returncode == 0, f"the interpreter child failed:\n{err[-6000:]}"
    return json.loads(out.strip().splitlines()[-1])


def child_results(module: str, timeout: float = 300) -> dict:
    """Runs `module`.child() in a child process with TRITON_INTERPRET=1 and returns its JSON results."""
    return finish_child(start_child(module), timeout)
