"""Launching our Triton kernels with less host time: Triton's own specialisation once per argument pattern, then the
compiled kernel's launcher directly.

Why: the 370M's training step is host-bound (docs/performance.md): ~770 Triton launches per step, each of which
costs ~35 us of host in `kernel[grid](...)` with our 20-60 arguments (Triton 3.6 on an H100: binding and
specialising every argument, the cache key, the launch metadata), against ~12 us for the compiled kernel's
launcher alone. `fast_launch(kernel)[grid](*args, **constexprs)` takes the same arguments as `kernel[grid]`; it
keys its cache on what Triton specialises on, or more: the exact value of every scalar and constexpr, and each
tensor's dtype and 16-byte alignment. The first call with a new key goes through Triton (which compiles or finds
the specialisation and returns the compiled kernel without launching it); later calls with that key call the
compiled kernel's launcher with the arguments in the kernel's own order. So a launch through it runs the very
binary `kernel[grid]` would, on the current device and stream.

Falls back to `kernel[grid]` (every call) where the shortcut could differ from Triton's path: Triton's
interpreter (TRITON_INTERPRET=1: the CPU tests), launch hooks set (a profiler such as proton), tracing by
torch.compile (which turns `kernel[grid]` launches into graph nodes of its own), a grid given as a function, an
unhashable argument, or a kernel that has seen more argument patterns than MAX_KEYS (a scalar that changes every
call). `MAMBATITAN_FAST_LAUNCH=0` in the environment sends every launch through Triton's path (to compare the two,
or to rule the shortcut out). Measured: docs/ssd_sessions.md, "Session 19".

Programmatic dependent launch (PDL, Hopper and newer; `MAMBATITAN_PDL=1`, off: within noise at the 1.3B, session 52):
a kernel that declares a `PDL: tl.constexpr` parameter starts with `pdl.pdl_prologue(PDL)` (wait until the kernel
before it on the stream has finished and its writes are visible, then let the next kernel launch once all of this
one's programs have started). Launched here with `PDL=True` and Triton's `launch_pdl`
option, the next kernel's programs are placed on the SMs this one's last programs leave idle and its launch
latency is hidden, instead of a 1-2 us gap between two kernels (docs/ssd_sessions.md, session 51). Kernels
without the parameter, the interpreter and the fallback path launch as before.
"""

from __future__ import annotations

import os

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # no Triton (or an older one): nothing is launched through here
    _knobs = None

MAX_KEYS = 64
_PDL_ENV = os.environ.get("MAMBATITAN_PDL", "0") == "1"
_PDL_DEVICES: dict[int, bool] = {}


def _pdl_on(device: int) -> bool:
    """MAMBATITAN_PDL=1 and a device of compute capability 9.0 or newer (asked once per device)."""
    on = _PDL_DEVICES.get(device)
    if on is None:
        on = _PDL_DEVICES[device] = _PDL_ENV and torch.cuda.get_device_capability(device)[0] >= 9
    return on


def _hook_set(hook) -> bool:
    # Triton 3.6 keeps its launch hooks in HookChain objects that are never None: a chain without calls is no hook.
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else len(calls) > 0


def _launch_hooks_set() -> bool:
    runtime = getattr(_knobs, "runtime", None)
    if runtime is None:  # no Triton, or one without knobs: no hooks to honour here
        return False
    return _hook_set(getattr(runtime, "launch_enter_hook", None)) or _hook_set(
        getattr(runtime, "launch_exit_hook", None)
    )


# The key of an argument: an int by its value (Triton's specialisation, == 1, divisibility by 16 and int32 / int64
# range, follows from it); a float, bool, str or None by its type and value (1, 1.0 and True are equal keys
# otherwise, yet Triton types them i32, fp32, i1); anything else positional is taken for a tensor, keyed by what
# Triton specialises a tensor on: its dtype and whether its address is 16-byte aligned (never the tensor itself,
# which the cache would keep alive). Inlined in FastLaunch.launch, since a function call per argument costs more
# host time than the key itself. Keyword arguments (constexprs, compile options, the odd tensor) by _keyword_key.
_TYPED = frozenset((float, bool, str, type(None)))


def _keyword_key(v):
    if type(v) is int:
        return v
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() % 16 == 0
    return type(v), v


class FastLaunch:
    """`kernel[grid](...)` through the compiled kernel's launcher once Triton has specialised the kernel for the
    call's argument pattern (module docstring)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict = {}  # key -> (launcher, function, packed_metadata, (name, default) after the
        # positional arguments, the compiled kernel)
        params = getattr(kernel, "params", None)
        # Triton's interpreter hands out InterpretedFunctions (no compiled launcher): always its own path.
        self._names = [p.name for p in params] if params is not None and hasattr(kernel, "device_caches") else None
        self.enabled = self._names is not None and os.environ.get("MAMBATITAN_FAST_LAUNCH", "1") != "0"
        self.pdl_capable = self.enabled and "PDL" in self._names

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def __getattr__(self, name):  # the kernel's own attributes (arg_names, fn, warmup, ...) for tools and tests
        if name == "kernel":  # not yet set (copy / pickle build the object without __init__): no recursion
            raise AttributeError(name)
        return getattr(self.kernel, name)

    def launch(self, grid, args: tuple, kwargs: dict):
        if torch.compiler.is_compiling() or not self.enabled or callable(grid) or _launch_hooks_set():
            return self.kernel[grid](*args, **kwargs)  # (torch.compile captures `kernel[grid]` launches itself)
        device = torch._C._cuda_getDevice()
        if self.pdl_capable and _pdl_on(device):
            kwargs = dict(kwargs, PDL=True, launch_pdl=True)
        try:
            key = (
                device,
                *[
                    a if type(a) is int else (type(a), a) if type(a) in _TYPED else (a.dtype, a.data_ptr() % 16 == 0)
                    for a in args
                ],
                *[(k, _keyword_key(v)) for k, v in kwargs.items()],
            )
            hit = self._compiled.get(key)
        except (TypeError, AttributeError):  # an unhashable argument, or neither a scalar nor a tensor
            return self.kernel[grid](*args, **kwargs)
        if hit is None:
            hit = self._specialise(key, grid, args, kwargs)
            if hit is None:
                return self.kernel[grid](*args, **kwargs)
        run, function, packed_metadata, tail, _ = hit
        ordered = args + tuple(kwargs[n] if n in kwargs else d for n, d in tail)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        run(grid[0], g1, g2, stream, function, packed_metadata, None, None, None, *ordered)

    def _specialise(self, key, grid, args: tuple, kwargs: dict):
        """Triton binds, specialises and compiles (or finds) the kernel for these arguments without launching it;
        kept under `key` with the order of the arguments not given positionally (their defaults where absent)."""
        if len(self._compiled) >= MAX_KEYS:
            return None
        compiled = self.kernel.run(*args, grid=grid, warmup=True, **kwargs)
        if compiled is None or not hasattr(compiled, "packed_metadata"):  # a compile hook or an async compile
            return None
        # The launcher takes every parameter, constexprs included, in the kernel's order; keywords that are no
        # parameter (num_warps, num_stages, maxnreg: compile options) are in the key, not in the launch.
        defaults = {p.name: p.default for p in self.kernel.params}
        tail = tuple((n, defaults[n]) for n in self._names[len(args) :])
        run = compiled.run  # loads the binary on first access
        # The compiled kernel rides along: the launcher and the function handle must not outlive its module.
        hit = (run, compiled.function, compiled.packed_metadata, tail, compiled)
        self._compiled[key] = hit
        return hit


def fast_launch(kernel) -> FastLaunch:
    """Wrap a @triton.jit kernel: `fast_launch(k)[grid](*args, **constexprs)` launches what `k[grid](...)` would."""
    return FastLaunch(kernel)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids: `triton.cdiv` is a constexpr function whose every host call costs a few us
    (Triton 3.6), ~1800 calls per 370M step."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1), without `triton.next_power_of_2`'s constexpr-function call."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
