"""A prototype for bench_optimizer.py: AdamW and the gradients' sum of squares over MANY tensors in ONE Triton launch
each, through tables of their addresses (what torch's multi-tensor kernels do in CUDA, without their per-launch
limits on tensors and blocks), to measure how close a single-launch step gets to the bandwidth bound before any
of it goes into components/optimizer.py.

    tables = TensorTables([params, grads, exp_avgs, exp_avg_sqs])     # float32 tensors, one list per role
    sumsq = tables.sum_of_squares(role=1)                              # 0-d float32: sum of every gradient squared
    tables.adamw_step(lr, beta1, beta2, eps, weight_decay, step, grad_scale, found_inf)

adamw_step is torch's AdamW update (decoupled weight decay, bias corrections from `step`), the gradient divided by
`grad_scale` (a 0-d device tensor: the clipping divisor) and nothing written where `found_inf` (0-d, 1.0 = skip)
is set; unlike torch's fused kernel it does not write the unscaled gradient back (the trainer zeroes gradients
after the step). Tables hold the tensors' addresses: they stay valid while the same tensors live (rebuild them
when a tensor is replaced). `check()` compares one step with torch's AdamW on small tensors (the CPU test runs it
in Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sumsq_kernel(tab_ptr, numel_ptr, blk_tensor_ptr, blk_start_ptr, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(blk_tensor_ptr + pid)
    offs = tl.load(blk_start_ptr + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numel_ptr + t)
    x_ptr = tl.load(tab_ptr + t).to(tl.pointer_type(tl.float32))
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + pid, tl.sum(x * x, axis=0))


@triton.jit
def _adamw_kernel(p_tab, g_tab, m_tab, v_tab, numel_ptr, blk_tensor_ptr, blk_start_ptr, scale_ptr, skip_ptr,
                  lr, beta1, beta2, eps, decay, step_size, inv_sqrt_bc2, HAS_SCALE: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    if tl.load(skip_ptr) == 0.0:
        pid = tl.program_id(0)
        t = tl.load(blk_tensor_ptr + pid)
        offs = tl.load(blk_start_ptr + pid) + tl.arange(0, BLOCK)
        mask = offs < tl.load(numel_ptr + t)
        p_ptr = tl.load(p_tab + t).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(g_tab + t).to(tl.pointer_type(tl.float32))
        m_ptr = tl.load(m_tab + t).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(v_tab + t).to(tl.pointer_type(tl.float32))
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        if HAS_SCALE:
            g = g / tl.load(scale_ptr)
        p = p * (1.0 - lr * decay)
        m = m + (1.0 - beta1) * (g - m)  # torch: exp_avg.lerp_(grad, 1 - beta1)
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


class TensorTables:
    """Address tables of equally long lists of float32 tensors (one list per role, tensor i of every list the same
    size), and the block -> (tensor, start) map of a launch over all of them in blocks of `block` elements."""

    def __init__(self, roles: list[list[torch.Tensor]], block: int = 2048, num_warps: int = 4):
        sizes = [t.numel() for t in roles[0]]
        for ts in roles:
            if [t.numel() for t in ts] != sizes or any(t.dtype != torch.float32 or not t.is_contiguous() for t in ts):
                raise ValueError("TensorTables takes lists of contiguous float32 tensors, tensor i of one size in all")
        dev = roles[0][0].device
        self.block, self.num_warps = block, num_warps
        self.tabs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev) for ts in roles]
        self.numel = torch.tensor(sizes, dtype=torch.int64, device=dev)
        starts = [(i, s) for i, n in enumerate(sizes) for s in range(0, n, block)]
        self.blk_tensor = torch.tensor([i for i, _ in starts], dtype=torch.int32, device=dev)
        self.blk_start = torch.tensor([s for _, s in starts], dtype=torch.int64, device=dev)
        self.n_blocks = len(starts)
        self.partials = torch.empty(self.n_blocks, dtype=torch.float32, device=dev)

    def sum_of_squares(self, role: int) -> torch.Tensor:
        _sumsq_kernel[(self.n_blocks,)](
            self.tabs[role], self.numel, self.blk_tensor, self.blk_start, self.partials, BLOCK=self.block,
            num_warps=self.num_warps,
        )  # fmt: skip
        return self.partials.sum()

    def adamw_step(self, lr, beta1, beta2, eps, weight_decay, step: int, grad_scale=None, found_inf=None) -> None:
        """Roles 0-3 are parameters, gradients, first and second moments; `step` counts this step (1 first)."""
        skip = found_inf if found_inf is not None else torch.zeros((), device=self.numel.device)
        bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
        _adamw_kernel[(self.n_blocks,)](
            *self.tabs[:4], self.numel, self.blk_tensor, self.blk_start,
            grad_scale if grad_scale is not None else skip, skip,
            lr, beta1, beta2, eps, weight_decay, lr / bc1, 1.0 / bc2**0.5,
            HAS_SCALE=grad_scale is not None, BLOCK=self.block, num_warps=self.num_warps,
        )  # fmt: skip


def check(device: str = "cpu") -> dict:
    """One AdamW step over tensors of several sizes (one of them not a multiple of the block), gradients divided by
    a clipping divisor, against torch's AdamW (fused where the device has it) with the same grad_scale; then a
    skipped step (found_inf 1) that must change nothing. Returns the largest relative differences."""
    gen = torch.Generator().manual_seed(0)
    sizes = [(33,), (16, 5), (300,), (7, 9)]
    params = [torch.randn(s, generator=gen).to(device) for s in sizes]
    grads = [torch.randn(s, generator=gen).to(device) for s in sizes]
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    divisor = torch.tensor(2.5, device=device)
    opt.grad_scale, opt.found_inf = divisor, torch.zeros((), device=device)
    opt.step()
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    tables = TensorTables([params, grads, m, v], block=64, num_warps=1)
    sumsq = tables.sum_of_squares(1)
    tables.adamw_step(1e-2, 0.9, 0.95, 1e-8, 0.1, 1, grad_scale=divisor, found_inf=torch.zeros((), device=device))

    def rel(a, b):
        return max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b))

    out = dict(
        sumsq=abs(sumsq.item() - sum((g * g).sum().item() for g in grads)) / sum((g * g).sum().item() for g in grads),
        params=rel(params, [r.detach() for r in ref]),
        exp_avg=rel(m, [opt.state[r]["exp_avg"] for r in ref]),
        exp_avg_sq=rel(v, [opt.state[r]["exp_avg_sq"] for r in ref]),
    )
    before = [p.clone() for p in params]
    tables.adamw_step(1e-2, 0.9, 0.95, 1e-8, 0.1, 2, grad_scale=divisor, found_inf=torch.ones((), device=device))
    out["skipped_step_changed"] = max((p - b).abs().max().item() for p, b in zip(params, before))
    return out


if __name__ == "__main__":
    print(check("cuda" if torch.cuda.is_available() else "cpu"))
