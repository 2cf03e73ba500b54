"""Compiling our Triton kernels for the GPU (sm_90) on a CPU-only machine, with the argument patterns the interpreter
tests really launch.

Why: Triton's interpreter (TRITON_INTERPRET=1, how the CPU tests run our kernels) executes a kernel as Python, so it
never meets Triton's compiler: session 31 committed a kernel that the interpreter ran bit-exactly and that failed to
compile on the GPU (a constexpr branch returning int64 beside an int32 return after it). Triton compiles for a GPU
target without a GPU (ptxas ships in its wheel): `JITFunction.warmup` binds, specialises and compiles exactly as a
launch would, here against a stand-in driver that reports an sm_90 device.

    with record_launches() as launches:   # in a TRITON_INTERPRET=1 process: every kernel[grid](...) call
        ...                                # run interpreter cases
    json.dumps(launches)                   # -> the parent (no interpreter)
    failures = compile_for_sm90(launches)  # {kernel: error} of the patterns that do not compile
"""

from __future__ import annotations

import contextlib
import importlib

import torch


def _encode(v):
    """A launch argument as JSON: a tensor by its dtype (all warmup needs), a float tagged (1.0 and 1 specialise
    differently), ints, bools, strings and None as they are."""
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype).removeprefix("torch.")}
    if type(v) is float:
        return {"float": v}
    if type(v).__module__.startswith("triton.language"):  # a dtype given as a constexpr (tl.bfloat16)
        return {"tl": v.name}
    if v is None or type(v) in (int, bool, str):
        return v
    raise TypeError(f"launch argument of type {type(v).__name__} cannot be recorded")


def _decode(v):
    if isinstance(v, dict):
        if "tl" in v:
            import triton.language as tl

            return tl.dtype(v["tl"])
        return getattr(torch, v["tensor"]) if "tensor" in v else float(v["float"])
    return v


# The launches the session's interpreter cases made, by where they ran: "tests/test_ssd_triton.py::test_name" for the
# SSD cases of that test (tests/ssd_interpreter.py's workers), "module:tests.test_x" for a module's child() checks
# (tests/interpreter_child.py). test_kernels_compile_sm90 runs last (conftest.py) and compiles the launches of its
# selection from here, instead of running the same cases a second time under the interpreter; what the session did
# not run, it runs itself.
SESSION_LAUNCHES: dict[str, list[dict]] = {}


def add_session_launches(key: str, launches: list[dict]) -> None:
    """Launches recorded in an interpreter child, added under `key` (SESSION_LAUNCHES) in the pytest process."""
    SESSION_LAUNCHES.setdefault(key, []).extend(launches)


@contextlib.contextmanager
def record_launches(strict: bool = True):
    """In the interpreter: every launch of a @triton.jit kernel (through fast_launch or `kernel[grid]`) appended to
    the yielded list as {module, name, args, kwargs, grid}, and then run as before. An argument that cannot be
    recorded raises (strict), else the launch is recorded as {module, name, error} and runs (the children of other
    tests record theirs this way: the compile test fails on such an entry, their own checks do not)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: list[dict] = []
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not callable(grid):
            where = dict(module=self.fn.__module__, name=self.fn.__name__)
            try:
                launches.append(
                    dict(
                        where,
                        args=[_encode(a) for a in args],
                        kwargs={k: _encode(v) for k, v in kwargs.items()},
                        grid=[int(g) for g in grid],
                    )
                )
            except TypeError as e:
                if strict:
                    raise
                launches.append(dict(where, error=str(e)))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield launches
    finally:
        InterpretedFunction.run = original


def _specialisation(v):
    """What Triton compiles a positional argument by: an int by == 1, divisibility by 16 and 32 / 64 bits, a float
    as fp32 whatever its value (the optimizer's learning rate changes every step), the rest by value."""
    if type(v) is int and not isinstance(v, bool):
        return ("int", v == 1, v % 16 == 0, -(2**31) <= v < 2**31)
    if isinstance(v, dict) and "float" in v:
        return "fp32"
    return v


def distinct(launches: list[dict]) -> list[dict]:
    """One launch per pattern that could compile differently: the same kernel, dtypes, specialised scalars and
    constexprs (keywords: by value; the grid does not enter the compile)."""
    seen, out = set(), []
    for launch in launches:
        args = [_specialisation(a) for a in launch["args"]]
        key = repr((launch["module"], launch["name"], args, sorted(launch["kwargs"].items())))
        if key not in seen:
            seen.add(key)
            out.append(launch)
    return out


class _Sm90Driver:
    """What JITFunction.warmup asks of the active driver: a device, a stream and the target (an H100 / H200)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def kernel_of(module: str, name: str):
    """The @triton.jit function a recorded launch ran (unwrapping fast_launch)."""
    from models.kernels.fast_launch import FastLaunch

    kernel = getattr(importlib.import_module(module), name)
    return kernel.kernel if isinstance(kernel, FastLaunch) else kernel


def _compile_patterns(patterns: list[tuple[int, dict]]) -> dict[str, str]:
    """Compile (index, launch) patterns for sm_90 in this process; {"module.name (pattern #: constexprs)": error}."""
    from triton.runtime import driver

    failures = {}
    previous = driver._active  # not reset_active(): on a machine without a GPU there is no default driver to make
    driver.set_active(_Sm90Driver())
    try:
        for i, launch in patterns:
            kernel = kernel_of(launch["module"], launch["name"])
            args = [_decode(a) for a in launch["args"]]
            kwargs = {k: _decode(v) for k, v in launch["kwargs"].items()}
            try:
                kernel.warmup(*args, grid=tuple(launch["grid"]), **kwargs)
            except Exception as e:  # noqa: BLE001 - every compile error is reported with its kernel
                cause = f"\n  caused by {type(e.__cause__).__name__}: {e.__cause__}" if e.__cause__ else ""
                where = f"{launch['module']}.{launch['name']} (pattern {i}: {kwargs})"
                failures[where] = f"{type(e).__name__}: {e}{cause}"
    finally:
        driver._active = previous
    return failures


def compile_for_sm90(launches: list[dict], workers: int = 1) -> dict[str, str]:
    """Compile every distinct pattern for sm_90 (not in the interpreter), over `workers` processes (Triton's
    compile is one thread's work); {"module.name (pattern #: constexprs)": error}."""
    patterns = list(enumerate(distinct(launches)))
    if workers <= 1 or len(patterns) < 2:
        return _compile_patterns(patterns)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    shares = [patterns[w::workers] for w in range(workers)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        failures: dict[str, str] = {}
        for part in pool.map(_compile_patterns, shares):
            failures.update(part)
    return failures
