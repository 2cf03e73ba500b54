"""models/kernels/fast_launch.py: which launches reuse a specialisation, in what order the arguments reach the
compiled launcher, and when it falls back to Triton's own path. A stand-in for Triton's JITFunction records what
happens (the real launches are compared with `kernel[grid]` in tests/gpu/test_fast_launch_gpu.py)."""

from __future__ import annotations

import inspect

import pytest
import torch

from models.kernels import fast_launch as fl


class _Param:
    def __init__(self, p: inspect.Parameter):
        self.name, self.default = p.name, p.default


class _Compiled:
    def __init__(self, log, spec):
        self.log, self.spec = log, spec
        self.function, self.packed_metadata = f"function{spec}", f"meta{spec}"

    @property
    def run(self):
        def launcher(g0, g1, g2, stream, function, packed_metadata, launch_metadata, enter, exit_, *args):
            self.log.append(("direct", (g0, g1, g2), stream, function, args))

        return launcher


class _FakeJIT:
    """Enough of a JITFunction: params, device_caches, kernel[grid](...) and run(..., warmup=True)."""

    def __init__(self, fn):
        self.params = [_Param(p) for p in inspect.signature(fn).parameters.values()]
        self.device_caches = {}
        self.log: list = []
        self.specialisations = 0

    def __getitem__(self, grid):
        return lambda *a, **k: self.log.append(("triton", grid, a, k))

    def run(self, *args, grid, warmup, **kwargs):
        assert warmup
        self.specialisations += 1
        return _Compiled(self.log, self.specialisations)


def _kernel(x_ptr, y_ptr, n, eps, BLOCK, FLAG=False, MODE=3):
    pass


@pytest.fixture
def cuda_stand_ins(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(fl, "_launch_hooks_set", lambda: False)


def test_arguments_reach_the_launcher_in_the_kernels_order_with_its_defaults(cuda_stand_ins):
    jit = _FakeJIT(_kernel)
    k = fl.fast_launch(jit)
    x, y = torch.zeros(8), torch.zeros(8)
    k[(4, 2)](x, y, 8, 1e-5, BLOCK=16, MODE=5)
    k[(4,)](x, y, 8, 1e-5, BLOCK=16, MODE=5)
    assert jit.specialisations == 1  # the second call reused the first one's specialisation
    (_, grid1, stream, function, args1), (_, grid2, _, _, args2) = jit.log
    assert grid1 == (4, 2, 1) and grid2 == (4, 1, 1) and stream == 1234 and function == "function1"
    assert args1[:4] == (x, y, 8, 1e-5) and args1[4:] == (16, False, 5)  # BLOCK, FLAG's default, MODE
    assert args2 == args1


@pytest.mark.parametrize(
    "change",
    ["dtype", "misaligned", "int_value", "int_one", "constexpr", "float_value"],
)
def test_a_new_argument_pattern_is_specialised_by_triton_again(cuda_stand_ins, change):
    jit = _FakeJIT(_kernel)
    k = fl.fast_launch(jit)
    base = torch.zeros(16)
    args, kw = [base, base, 32, 1e-5], {"BLOCK": 16}
    k[(1,)](*args, **kw)
    if change == "dtype":
        args[0] = torch.zeros(16, dtype=torch.bfloat16)
    elif change == "misaligned":
        args[1] = base[1:]  # 4 bytes past a 16-byte boundary: Triton compiles it without the alignment hint
        assert args[1].data_ptr() % 16 != 0
    elif change == "int_value":
        args[2] = 48
    elif change == "int_one":
        args[2] = 1
    elif change == "constexpr":
        kw["BLOCK"] = 32
    else:
        args[3] = 1e-6
    k[(1,)](*args, **kw)
    assert jit.specialisations == 2
    assert [e[0] for e in jit.log] == ["direct", "direct"]
    assert jit.log[1][3] == "function2"  # launched with the new specialisation's binary


def test_falls_back_to_tritons_path_where_the_shortcut_could_differ(cuda_stand_ins, monkeypatch):
    jit = _FakeJIT(_kernel)
    k = fl.fast_launch(jit)
    x = torch.zeros(4)
    k[lambda meta: (1,)](x, x, 4, 0.0, BLOCK=16)  # a grid function
    k[(1,)](x, x, [4], 0.0, BLOCK=16)  # an unhashable argument
    monkeypatch.setattr(fl, "_launch_hooks_set", lambda: True)
    k[(1,)](x, x, 4, 0.0, BLOCK=16)  # a launch hook (a profiler) wants Triton's launch metadata
    monkeypatch.setattr(fl, "_launch_hooks_set", lambda: False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    k[(1,)](x, x, 4, 0.0, BLOCK=16)  # torch.compile traces the launch: it must see `kernel[grid]`
    monkeypatch.undo()
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(fl, "_launch_hooks_set", lambda: False)
    assert [e[0] for e in jit.log] == ["triton"] * 4 and jit.specialisations == 0
    monkeypatch.setattr(fl, "MAX_KEYS", 2)
    for n in range(4):  # a scalar that changes every call: at most MAX_KEYS specialisations are kept
        k[(1,)](x, x, n, 0.0, BLOCK=16)
    assert [e[0] for e in jit.log[4:]] == ["direct", "direct", "triton", "triton"]


def test_compile_options_are_in_the_key_not_in_the_launch(cuda_stand_ins):
    jit = _FakeJIT(_kernel)
    k = fl.fast_launch(jit)
    x = torch.zeros(1)
    k[(1,)](x, x, 1, 0.0, BLOCK=16, num_warps=4)
    k[(1,)](x, x, 1, 0.0, BLOCK=16, num_warps=8)
    assert jit.specialisations == 2
    assert jit.log[0][4] == (x, x, 1, 0.0, 16, False, 3) == jit.log[1][4]


def test_under_the_interpreter_every_launch_is_tritons(monkeypatch):
    """TRITON_INTERPRET=1 (the CPU tests of the kernels): no compiled launcher, so the wrapper only forwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @fl.fast_launch
    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    assert not add_one.enabled
    x = torch.zeros(5)
    add_one[(1,)](x, 5, BLOCK=8)
    assert x.tolist() == [1.0] * 5
    assert add_one.arg_names == ["x_ptr", "n", "BLOCK"]  # the kernel's own attributes stay reachable


def test_an_empty_hook_chain_is_no_hook():
    """Triton 3.6 keeps launch hooks in HookChain objects that are never None: only a chain with calls is a hook
    (taking the empty chain for a hook sent every launch through Triton's path, on the H100)."""

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not fl._hook_set(None) and not fl._hook_set(Chain([]))
    assert fl._hook_set(Chain([print])) and fl._hook_set(print)


def test_the_environment_switch_sends_every_launch_through_triton(cuda_stand_ins, monkeypatch):
    monkeypatch.setenv("MAMBATITAN_FAST_LAUNCH", "0")
    jit = _FakeJIT(_kernel)
    k = fl.fast_launch(jit)
    k[(1,)](torch.zeros(1), torch.zeros(1), 1, 0.0, BLOCK=16)
    assert [e[0] for e in jit.log] == ["triton"]


def test_equal_scalars_of_different_types_are_different_patterns(cuda_stand_ins):
    """1, 1.0 and True hash alike, yet Triton types them i32, fp32 and i1: each is specialised by Triton."""
    jit = _FakeJIT(_kernel)
    k = fl.fast_launch(jit)
    x = torch.zeros(1)
    for n in (1, 1.0, True, 1):
        k[(1,)](x, x, n, None, BLOCK=16)
    assert jit.specialisations == 3


def test_tensors_are_keyed_by_dtype_and_alignment_never_held(cuda_stand_ins):
    """New tensors of the same dtype and alignment, positional or keyword, reuse the specialisation, and the cache
    keeps no tensor alive (a key holding the tensor would pin a step's activations and miss on every call)."""
    import gc
    import weakref

    jit = _FakeJIT(_kernel)
    k = fl.fast_launch(jit)
    refs = []
    for _ in range(3):
        x, y = torch.zeros(8), torch.zeros(8)
        refs.append(weakref.ref(y))
        k[(1,)](x, y=y, n=8, eps=0.0, BLOCK=16, MODE="fast")
    assert jit.specialisations == 1
    del x, y
    jit.log.clear()  # the stand-in's own record of the launches holds them
    gc.collect()
    assert all(r() is None for r in refs)
