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

from tests.triton_sm90 import add_session_launches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def patch_interpreter():
    """What our interpreter cases need of Triton's interpreter, patched once per process (each patch says why)."""
    patch_interpreter_scalar_index()
    patch_interpreter_scan()
    patch_interpreter_device_calls()
    patch_interpreter_overflow_checks()
    patch_interpreter_dtype_lookup()


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


def patch_interpreter_scan():
    """Triton's interpreter runs tl.associative_scan with a combine function of ours one element at a time (a Python
    call per element: ~2 s per launch of embedding_triton's [32, 128] scan); combine functions are element-wise, so
    this runs them on whole slices across the scan axis, one call per position along it: the same values."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    scan_ops = getattr(interp, "ScanOps", None)
    if scan_ops is None or getattr(scan_ops, "_sliced", False):  # another Triton's interpreter, or patched already
        return
    scan_ops._sliced = True

    def generic_scan(self, input):
        datas = [arg.handle.data for arg in input]
        outs = [np.empty_like(d) for d in datas]
        axis = self.axis

        def at(i):
            return (slice(None),) * axis + (slice(i, i + 1),)

        acc = [d[at(0)] for d in datas]
        for o, a in zip(outs, acc):
            o[at(0)] = a
        for i in range(1, datas[0].shape[axis]):
            args = [self.to_tensor(a, arg.dtype) for a, arg in zip(acc, input)]
            args += [self.to_tensor(d[at(i)], arg.dtype) for d, arg in zip(datas, input)]
            ret = self.combine_fn.fn(*args)
            ret = ret if isinstance(ret, tuple) else (ret,)
            acc = [r.handle.data if isinstance(r, tl.core.tensor) else r for r in ret]
            for o, a in zip(outs, acc):
                o[at(i)] = a
        return [self.to_tensor(o, arg.dtype) for o, arg in zip(outs, input)]

    scan_ops.generic_scan = generic_scan


def patch_interpreter_device_calls():
    """Triton's interpreter patches triton.language for the interpreter at each launch (undone after it), and again at
    every call of a @triton.jit helper inside it: an inspect.getmembers of the language's modules per call, ~20% of
    an SSD case's time (our kernels call helpers per loop iteration). Inside a launch, a call whose language modules
    (those of its function's globals, as the interpreter picks them) this launch has patched already returns an empty
    patch instead: patching them again would set the same attributes."""
    import inspect

    import triton.language as tl
    import triton.runtime.interpreter as interp

    executor, scope_type = getattr(interp, "GridExecutor", None), getattr(interp, "_LangPatchScope", None)
    if executor is None or scope_type is None or getattr(interp, "_device_calls_patched", False):
        return  # another Triton's interpreter, or patched already
    interp._device_calls_patched = True
    patched: list[set] = []  # per running launch: the language modules (ids) patched in it
    patch_lang, launch = interp._patch_lang, executor.__call__
    module_langs: dict[int, frozenset] = {}  # a module's globals (id) -> its language modules (ids): found once

    def patch_once(fn):
        langs = module_langs.get(id(fn.__globals__))
        if langs is None:
            langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
            module_langs[id(fn.__globals__)] = langs
        if patched and langs <= patched[-1]:
            return scope_type()
        scope = patch_lang(fn)
        if patched:
            patched[-1] |= langs
        return scope

    def launch_patching_once(self, *args, **kwargs):
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    interp._patch_lang = patch_once
    executor.__call__ = launch_patching_once


def patch_interpreter_overflow_checks():
    """Triton's interpreter builds an integer-overflow check around every int32 add, sub and mul (the operands cast to
    int64, the operation again, two comparisons and an and) and then drops it: device_assert emits nothing unless
    the debug option is on, which it is not, here as on the GPU. That dead work is ~36% of an SSD case (8.7 -> 5.5 s,
    the same errors to every digit). With debug off this skips the build; with debug on, the checks stay."""
    import dataclasses

    import triton.runtime.interpreter as interp

    builder = getattr(interp, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not hasattr(options, "sanitize_overflow") or getattr(options, "debug", True):
        return  # another Triton's interpreter, or its checks would run
    builder.options = dataclasses.replace(options, sanitize_overflow=False)


def patch_interpreter_dtype_lookup():
    """Triton's interpreter maps a Triton dtype to numpy's by building a dict of every dtype at each call (~90k calls
    an SSD case); the same mapping, remembered per dtype: ~10% of an SSD case (5.5 -> 5.0 s)."""
    import triton.runtime.interpreter as interp

    lookup = getattr(interp, "_get_np_dtype", None)
    if lookup is None or getattr(lookup, "remembers", False):
        return  # another Triton's interpreter, or patched already
    known = {}

    def remembered(tt_dtype):
        try:
            return known[tt_dtype]
        except KeyError:
            known[tt_dtype] = lookup(tt_dtype)
            return known[tt_dtype]
        except TypeError:  # unhashable: as before
            return lookup(tt_dtype)

    remembered.remembers = True
    interp._get_np_dtype = remembered


# The key of the child's JSON that carries its kernel launches (finish_child takes it out)
LAUNCHES = "__launches__"


def run_checks(checks: dict[str, Callable[[], object]]) -> None:
    """In the child: every check, one JSON object {name: {ok, out}} on stdout; a failing check does not stop the
    others (its traceback is its out). The kernel launches they made go along (tests/triton_sm90.py's
    SESSION_LAUNCHES: what the sm_90 compile test compiles)."""
    from tests.triton_sm90 import record_launches

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_interpreter()
    results = {}
    with record_launches(strict=False) as launches:
        for name, check in checks.items():
            try:
                results[name] = {"ok": True, "out": check()}
            except BaseException:  # a failed check or any error: reported under its case, the others still run
                results[name] = {"ok": False, "out": traceback.format_exc()}
    print(json.dumps({**results, LAUNCHES: launches}))


def start_child(module: str, call: str = "child()") -> subprocess.Popen:
    """Starts `module`.`call` in a child process with TRITON_INTERPRET=1 (finish_child collects it), so that
    several children can run side by side."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = f"import {module} as t; t.{call}"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc.test_module = module  # finish_child files its launches under it
    return proc


def finish_child(proc: subprocess.Popen, timeout: float = 300) -> dict:
    """A started child's JSON results (killed if it outlives timeout); its kernel launches go to the session's record
    (tests/triton_sm90.py) under "module:<its module>"."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the interpreter child timed out after {timeout} s:\n{err[-6000:]}") from None
    assert proc.returncode == 0, f"the interpreter child failed:\n{err[-6000:]}"
    results = json.loads(out.strip().splitlines()[-1])
    add_session_launches(f"module:{proc.test_module}", results.pop(LAUNCHES, []))
    return results


def child_results(module: str, timeout: float = 300) -> dict:
    """Runs `module`.child() in a child process with TRITON_INTERPRET=1 and returns its JSON results."""
    return finish_child(start_child(module), timeout)
