"""models/kernels/fast_launch.py on a GPU: a launch through the compiled kernel's launcher computes what
`kernel[grid]` computes, for every argument pattern that changes Triton's specialisation (dtype, a pointer off a
16-byte boundary, an int equal to 1 or not a multiple of 16, constexprs, defaults), on the current stream, and
inside a CUDA graph capture."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from models.kernels.fast_launch import fast_launch  # noqa: E402


@triton.jit
def _axpy(x_ptr, y_ptr, out_ptr, n, stride, a, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i * stride, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + i * stride, mask=m, other=0.0).to(tl.float32)
    r = a * x + y
    if SQUARE:
        r = r * r
    tl.store(out_ptr + i * stride, r.to(out_ptr.dtype.element_ty), mask=m)


_fast_axpy = fast_launch(_axpy)


def _both(x, y, n, stride, a, **constexprs):
    want, got = torch.full_like(x, -7), torch.full_like(x, -7)
    grid = (triton.cdiv(n, constexprs["BLOCK"]),)
    _axpy[grid](x, y, want, n, stride, a, **constexprs)
    _fast_axpy[grid](x, y, got, n, stride, a, **constexprs)
    torch.cuda.synchronize()
    return want, got


@pytest.mark.parametrize("case", ["aligned", "misaligned", "bf16", "n_is_one", "stride_two", "square", "again_aligned"])
def test_fast_launch_computes_what_tritons_launch_computes(case):
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    base_x = torch.randn(1030, device="cuda", generator=gen).to(dtype)
    base_y = torch.randn(1030, device="cuda", generator=gen).to(dtype)
    x, y, n, stride, kw = base_x[:1024], base_y[:1024], 1000, 1, {"BLOCK": 128}
    if case == "misaligned":  # 4 bytes past the allocation: Triton must not assume 16-byte aligned loads
        x, y = base_x[1:1025], base_y[1:1025]
        assert x.data_ptr() % 16 != 0
    elif case == "n_is_one":
        n = 1
    elif case == "stride_two":
        stride, n = 2, 500
    elif case == "square":
        kw["SQUARE"] = True
    want, got = _both(x, y, n, stride, 1.5, **kw)
    assert torch.equal(want, got)
    assert not torch.equal(got, torch.full_like(got, -7))


def test_a_repeated_launch_skips_tritons_path(monkeypatch):
    """After the first launch of an argument pattern, Triton's own launch path is not entered again."""
    x, y = torch.randn(512, device="cuda"), torch.randn(512, device="cuda")
    out = torch.zeros_like(x)
    _fast_axpy[(4,)](x, y, out, 512, 1, 2.0, BLOCK=128)

    def tritons_path(*args, **kwargs):
        raise AssertionError("Triton's launch path was entered for a pattern launched before")

    monkeypatch.setattr(_axpy, "run", tritons_path)  # kernel[grid](...) and kernel.run(warmup=True) both go here
    out.zero_()
    _fast_axpy[(4,)](x, y, out, 512, 1, 2.0, BLOCK=128)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 2.0 * x + y, rtol=0, atol=0)  # 2x is exact: no fma rounding


def test_fast_launch_runs_on_the_current_stream_and_in_a_cuda_graph():
    x = torch.randn(4096, device="cuda")
    y = torch.randn(4096, device="cuda")
    out = torch.zeros_like(x)
    _fast_axpy[(32,)](x, y, out, 4096, 1, 2.0, BLOCK=128)  # specialised outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the side stream is busy: a launch on another stream would finish first
        out.zero_()
        _fast_axpy[(32,)](x, y, out, 4096, 1, 2.0, BLOCK=128)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(out, 2.0 * x + y, rtol=0, atol=0)

    graph = torch.cuda.CUDAGraph()
    out.zero_()
    with torch.cuda.graph(graph):
        _fast_axpy[(32,)](x, y, out, 4096, 1, 2.0, BLOCK=128)
    x.mul_(3)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 2.0 * x + y, rtol=0, atol=0)


def test_torch_compile_captures_the_launch_without_a_graph_break():
    """Under torch.compile the wrapper hands Dynamo the plain `kernel[grid]` launch, which it turns into a graph node
    (fullgraph: any graph break fails). Every constexpr is passed: torch 2.11's capture of a Triton kernel (plain
    `kernel[grid]` as well) fails on a defaulted one left out ("Incorrect number of arguments passed to kernel",
    H100, session 20)."""
    x, y = torch.randn(512, device="cuda"), torch.randn(512, device="cuda")

    @torch.compile(fullgraph=True)
    def axpy_then_double(x, y):
        out = torch.empty_like(x)
        _fast_axpy[(4,)](x, y, out, 512, 1, 2.0, BLOCK=128, SQUARE=False)
        return out * 2

    torch.testing.assert_close(axpy_then_double(x, y), (2.0 * x + y) * 2, rtol=0, atol=0)


def test_programmatic_dependent_launch_computes_the_same(monkeypatch):
    """MAMBATITAN_PDL=1 (fast_launch.py): the SSD's forward and backward with documents and kept states, the chain of
    our kernels launched with programmatic dependent launch, give bitwise the outputs and gradients of the plain
    launches, eagerly and replayed from a CUDA graph (Hopper or newer; elsewhere the option is off and so is this)."""
    from models.kernels import fast_launch as fl
    from models.kernels.ssd_triton.autograd import ssd_chunk_scan_triton

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    gen = torch.Generator().manual_seed(0)
    b, L, H, P, N = 2, 1000, 8, 64, 64
    x = torch.randn(b, L, H, P, generator=gen).cuda().bfloat16().requires_grad_()
    dt = (torch.randn(b, L, H, generator=gen) * 0.5).cuda().bfloat16().requires_grad_()
    A = (-(torch.rand(H, generator=gen) + 0.5)).cuda().requires_grad_()  # a leaf: the minus before requires_grad_
    B = torch.randn(b, L, 1, N, generator=gen).cuda().bfloat16().requires_grad_()
    C = torch.randn(b, L, 1, N, generator=gen).cuda().bfloat16().requires_grad_()
    seq = torch.zeros(b, L, dtype=torch.int32)
    seq[:, 300:] = 1
    seq[1, 777:] = 2
    seq = seq.cuda()
    cot = torch.randn(b, L, H, P, generator=gen).cuda().bfloat16()
    leaves = (x, dt, A, B, C)

    def step():
        for t in leaves:
            t.grad = None
        y = ssd_chunk_scan_triton(x, dt, A, B, C, chunk_size=256, seq_idx=seq, dt_softplus=True, keep_states=True)
        (y.float() * cot.float()).sum().backward()
        return [y.detach().clone()] + [t.grad.clone() for t in leaves]

    plain = step()
    monkeypatch.setattr(fl, "_PDL_ENV", True)
    monkeypatch.setattr(fl, "_PDL_DEVICES", {})
    with_pdl = step()
    assert all(torch.equal(a, b) for a, b in zip(plain, with_pdl))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(plain, captured))
