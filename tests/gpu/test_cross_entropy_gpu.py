"""The fused lm_head + cross-entropy (models/kernels/cross_entropy_triton.py) compiled, in bfloat16 under autocast:
its loss, dh and dweight no further from float64 (on the same bf16-rounded operands) than the unfused path's
(lm_head's bf16 logits + cross_entropy_sum in float32), at the real vocabulary (50288 columns: 13 blocks per row, a
masked tail), with ignored labels, in one pass and in chunks; and a CUDA graph replay equal to the eager call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("triton")

from models.kernels import ops  # noqa: E402
from models.loss import cross_entropy_sum  # noqa: E402

N, D, V = 2048, 512, 50288


def _inputs(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(2, N // 2, D, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(V, D, device="cuda", generator=g) * 0.05
    labels = torch.randint(0, V, (2, N // 2), device="cuda", generator=g)
    labels[:, ::13] = -100
    return h, w, labels


def _grads(fn, h, w, scale):
    h_in, w_in = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = fn(h_in, w_in)
    (loss * scale).backward()
    return loss.detach(), h_in.grad, w_in.grad


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("chunk", [0, 700])
def test_fused_loss_as_accurate_as_the_unfused_path(chunk):
    h, w, labels = _inputs()
    scale = 1.0 / (labels != -100).sum()
    h64, w64 = h.double().requires_grad_(), w.to(torch.bfloat16).double().requires_grad_()
    ref = F.cross_entropy((h64 @ w64.t()).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    (ref * scale.double()).backward()
    ours = _grads(lambda a, b: ops.linear_cross_entropy_sum(a, b, labels, chunk), h, w, scale)
    plain = _grads(lambda a, b: cross_entropy_sum(F.linear(a, b), labels), h, w, scale)
    for name, o, p, r in zip(("loss", "dh", "dw"), ours, plain, (ref.detach(), h64.grad, w64.grad)):
        e_ours, e_plain = _rel(o, r), _rel(p, r)
        assert e_ours <= 1.1 * e_plain + 1e-6, f"{name}: ours {e_ours:.3e} against the unfused path's {e_plain:.3e}"
    assert ours[1].dtype == torch.bfloat16 and ours[2].dtype == torch.float32


def test_chunked_loss_holds_one_chunk_of_logits_and_the_gradients_only():
    """With chunks, the forward's peak above its inputs is one [chunk, V] bf16 logits buffer, the float32 dh [N, D]
    and dweight [V, D], and one chunk's dh rows on their way in (cuBLAS adds each chunk's dweight into its buffer where
    torch's addmm takes a float32 input; else one [V, D] float32 product at a time more): no copy of dh whole."""
    from models.kernels.autocast_linear import adds_into_float32

    h, w, labels = _inputs(2)
    h_in, w_in = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    chunk = 512
    ops.linear_cross_entropy_sum(h_in, w_in, labels, chunk)  # first call: Triton's compile, the addmm probe
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = ops.linear_cross_entropy_sum(h_in, w_in, labels, chunk)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    bound = chunk * V * 2 + N * D * 4 + V * D * 4 + V * D * 2 + chunk * D * 4  # logits, dh, dw, bf16 weight, rows
    if not adds_into_float32(h.device):
        bound += V * D * 4
    assert peak <= bound + 2**20, (peak, bound)
    loss.backward()


def test_fused_loss_in_a_cuda_graph():
    h, w, labels = _inputs(1)
    w = w.requires_grad_()
    h_static = h.clone().requires_grad_()
    eager = _grads(lambda a, b: ops.linear_cross_entropy_sum(a, b, labels, 0), h, w, 0.5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the side stream: compile, allocate
        for _ in range(2):
            w.grad, h_static.grad = None, None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                (ops.linear_cross_entropy_sum(h_static, w, labels, 0) * 0.5).backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    w.grad, h_static.grad = None, None
    with torch.cuda.graph(graph):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ops.linear_cross_entropy_sum(h_static, w, labels, 0)
        (loss * 0.5).backward()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip((loss, h_static.grad, w.grad), eager):
        torch.testing.assert_close(got, want)


def test_tied_embedding_grad_added_in_place_matches_torch():
    """The tied embedding's rows added into the loss's weight gradient (models/kernels/embedding_triton.py), compiled,
    at the 1.3B's shape (16,384 tokens, 2,048 wide, 50,288 rows; a token taking ~5% of the positions): within
    float32 rounding of a float64 index_add, no further than torch's embedding backward + autograd's add, and the
    same bits on a second call (no atomics)."""
    from models.kernels.embedding_triton import embedding_grad_add_

    g = torch.Generator(device="cuda").manual_seed(3)
    ids = torch.randint(0, V, (4, 4096), device="cuda", generator=g)
    ids[torch.rand(4, 4096, device="cuda", generator=g) < 0.05] = 11
    grad = torch.randn(4, 4096, 2048, device="cuda", generator=g)
    start = torch.randn(V, 2048, device="cuda", generator=g)
    want = start.double().index_add(0, ids.reshape(-1), grad.reshape(-1, 2048).double())
    ours = embedding_grad_add_(start.clone(), ids, grad)
    assert torch.equal(ours, embedding_grad_add_(start.clone(), ids, grad))
    w = start.clone().requires_grad_()
    torch.nn.functional.embedding(ids, w).backward(grad)
    theirs = start + w.grad
    assert _rel(ours, want) <= 1.5 * _rel(theirs, want) + 1e-12, (_rel(ours, want), _rel(theirs, want))
