"""torch's fused AdamW step (grad_scale and found_inf included) as ONE Triton launch over every tensor of a parameter
group, through device tables of the tensors' addresses: optimizer.implementation "triton" (ShardLocalAdamW).

Same update, state and checkpoints as torch's fused AdamW (the optimizer is built with fused=True, so its state,
per-parameter float32 step tensors on the device, is exactly fused AdamW's): per tensor, unless found_inf is set,
g = grad / grad_scale, param -= lr * weight_decay * param, exp_avg = beta1 exp_avg + (1 - beta1) g, exp_avg_sq =
beta2 exp_avg_sq + (1 - beta2) g^2, param -= lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 -
beta2^step) + eps), step += 1 (torch's _fused_adamw_ formulas; the bias corrections 1 - beta^step in float64, where
torch's float32 power loses up to ~1e-4 of them at beta2 0.999, and the divisions by grad_scale and sqrt(1 -
beta2^step) as products with reciprocals). Unlike
torch's kernel it does not write the unscaled gradient back (the trainer drops the gradients after the step).

Why: torch's multi-tensor kernels launch per group of ~100 tensors with per-launch limits, and at the 1.3B's 435
tensors the step ran at 2.1 TB/s (17.6 ms) against a 13.4 ms bound; one launch over block tables ran 15.5 ms
(benchmarks/bench_optimizer.py, docs/ssd_sessions.md session 21). The tables of parameters, moments and steps are built
once per set of tensors (rebuilt when an address changes, e.g. after load_state_dict); the gradients, reallocated
every step, go to the device each step through pinned host buffers (a ring, so the host never waits for the GPU).
Gradients stored in bf16 (training.grad_dtype, components/gradient_dtype.py) are read as they are, in a launch of
their own (GRAD_BYTES), and upcast in registers: the update is the float32 one on their values.
With weight copies (optimizer.weight_copies), the same launch writes each updated weight's current bf16 copy
(models/kernels/weight_copies.py), so that the next step's products need no cast kernels; the tables hold the
copies' addresses too (0 for a weight without a current copy, which is then left alone).
Per-tensor scalars: a first launch (_step_scalars_kernel, one lane per tensor) increments each tensor's step and
writes its step size lr / (1 - beta1^step) and 1 / sqrt(1 - beta2^step) (float64 math, once per tensor), which the
update kernel loads as two floats per program. Taken inside the update kernel, that float64 math (two exp, two log)
ran once per program of 2048 elements, ~100 float64 instructions per thread: 56 sm_90 instructions per element in
all, against 24 now (Triton 3.6, `benchmarks/kernel_resources.py --kernels adamw --loops`), with the
reciprocal of the denominator from one MUFU (models/kernels/fast_math.py) and the bf16 copies stored 4 elements per
thread, the float32 stores' layout (at 8 per thread, Triton 3.6 moved the three float32 results through shared
memory to another layout first: 24 shared-memory instructions and 11 barriers per program).
Imports triton at import time: import lazily (components/optimizer.py does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from components.address_table import DeviceAddressTable, addresses
from models.kernels import fast_math, weight_copies

__all__ = ["TableAdamW"]

# Elements per program. H100, session 21: 2048 x 4 warps 17.3 ms, 4096 x 8 17.8, 8192 x 8 44.5 (an earlier kernel).
# H200, 1.3B's parameters (bench_optimizer.py --adamw_tiles): session 34 2048 x 4 11.33 ms, 1024 x 4 10.88; session 54
# 11.19 against 10.88 (1024 x 2 10.86; the copy bound 9.50).
BLOCK = 1024
WARPS = 4
# The gradients' dtypes the kernel reads, and their bytes per element: float32, and bf16 (training.grad_dtype)
_GRAD_BYTES = {torch.float32: 4, torch.bfloat16: 2}


@triton.jit
def _adamw_kernel(p_tab, g_tab, m_tab, v_tab, scal_ptr, c_tab, numel_ptr, blk_tensor_ptr, blk_start_ptr, scale_ptr,
                  skip_ptr, base32, base16, grad_base, lr, beta1, beta2, eps, decay, HAS_SCALE: tl.constexpr,
                  HAS_COPIES: tl.constexpr, COPY_DTYPE: tl.constexpr, GRAD_BYTES: tl.constexpr, BLOCK: tl.constexpr,
                  ALIGNED: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """Program pid updates elements [start, start + BLOCK) of tensor blk_tensor[pid] (see the module docstring), and
    with HAS_COPIES the tensor's 16-bit copy where c_tab holds one (address 0: none). scal_ptr: the tensors' step
    sizes and 1 / sqrt(1 - beta2^step), interleaved (_step_scalars_kernel).
    Each tensor is addressed as base32 (base16 for the copies: any tensor of that dtype) plus its element offset
    from it, not through a pointer made from its address: Triton knows nothing of such a pointer's alignment and
    loads it 4 bytes at a time, while from an aligned base and offsets that are multiples of 4 elements (ALIGNED:
    the host checked every address for 16-byte alignment and every size for a multiple of 4) it loads 16 bytes
    per instruction (Triton 3.6 for sm_90: 64 scalar loads per thread -> 16 vector loads). The gradients are
    addressed the same way from grad_base, one of them (the launch's gradients share a dtype): float32 (GRAD_BYTES
    4) or bf16 (2; training.grad_dtype), read as float32."""
    # Always a skip flag (a zero one without found_inf): a version compiling the flag away ran at half the speed
    # (H100, session 21: 30.3 against 16.0 ms at 1.3B).
    if tl.load(skip_ptr) == 0.0:
        pid = tl.program_id(0)
        t = tl.load(blk_tensor_ptr + pid)
        start = tl.load(blk_start_ptr + pid)
        numel = tl.load(numel_ptr + t)
        b32 = base32.to(tl.int64, bitcast=True)
        p_off = (tl.load(p_tab + t) - b32) // 4
        g_off = (tl.load(g_tab + t) - grad_base.to(tl.int64, bitcast=True)) // GRAD_BYTES
        m_off, v_off = (tl.load(m_tab + t) - b32) // 4, (tl.load(v_tab + t) - b32) // 4
        if ALIGNED:
            start, numel = tl.multiple_of(start, BLOCK), tl.multiple_of(numel, 4)
            p_off, g_off = tl.multiple_of(p_off, 4), tl.multiple_of(g_off, 4)
            m_off, v_off = tl.multiple_of(m_off, 4), tl.multiple_of(v_off, 4)
        offs = start + tl.arange(0, BLOCK)
        mask = offs < numel
        p_ptr, g_ptr, m_ptr, v_ptr = base32 + p_off, grad_base + g_off, base32 + m_off, base32 + v_off
        step_size, inv_sqrt_bc2 = tl.load(scal_ptr + 2 * t), tl.load(scal_ptr + 2 * t + 1)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        # One reciprocal per element (of the denominator): the scalars' are taken once per program. With three
        # per-element divisions the kernel ran at half the speed (H100, session 21: 33.9 against 15.5 ms at 1.3B).
        if HAS_SCALE:
            g = g * (1.0 / tl.load(scale_ptr))
        p = p - lr * decay * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * m * fast_math.rcp(tl.sqrt(v) * inv_sqrt_bc2 + eps, FAST)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if HAS_COPIES:  # models/kernels/weight_copies.py: the weight in the compute dtype, rounded to nearest even
            c_addr = tl.load(c_tab + t)
            if c_addr != 0:
                c_off = (c_addr - base16.to(tl.int64, bitcast=True)) // 2
                if ALIGNED:
                    # 4, not the 8 that 16-byte alignment allows: 8-element stores would give the copy a layout of
                    # its own and move p, m and v through shared memory to it (module docstring).
                    c_off = tl.multiple_of(c_off, 4)
                tl.store(base16 + c_off + offs, p.to(COPY_DTYPE), mask=mask)


@triton.jit
def _step_scalars_kernel(step_tab, scal_ptr, n, skip_ptr, lr, beta1, beta2, BLOCK: tl.constexpr):
    """Unless found_inf is set, per tensor i: step += 1, then scal[2 i] = lr / (1 - beta1^step) and scal[2 i + 1] =
    1 / sqrt(1 - beta2^step), 1 - beta^step in float64 and then float32: no cancellation (beta2 0.999: 1 - beta2^step
    is ~1e-3, and a float32 power's last bit would be 1e-4 of it)."""
    if tl.load(skip_ptr) == 0.0:
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ptrs = tl.load(step_tab + i, mask=i < n, other=0).to(tl.pointer_type(tl.float32))
        step = tl.load(ptrs, mask=i < n, other=0.0) + 1.0
        tl.store(ptrs, step, mask=i < n)
        zero64 = tl.zeros((BLOCK,), dtype=tl.float64)  # + a float32 (or the interpreter's Python float): float64
        step64 = zero64 + step
        bc1 = (1.0 - tl.exp(step64 * tl.log(zero64 + beta1))).to(tl.float32)
        bc2 = (1.0 - tl.exp(step64 * tl.log(zero64 + beta2))).to(tl.float32)
        tl.store(scal_ptr + 2 * i, lr / bc1, mask=i < n)
        tl.store(scal_ptr + 2 * i + 1, 1.0 / tl.sqrt(bc2), mask=i < n)


class _GroupTables:
    """Tables of one parameter group: addresses of parameters, moments and steps, sizes, and the block map."""

    def __init__(self, key: tuple[tuple[int, ...], ...], params, exp_avgs, exp_avg_sqs, copies_dtype=None):
        dev = params[0].device
        for role in (params, exp_avgs, exp_avg_sqs):
            if any(t.dtype != torch.float32 or not t.is_contiguous() for t in role):
                raise ValueError(
                    "optimizer.implementation 'triton' takes float32 contiguous parameters and moments; use 'fused'"
                )
        self.key = key  # the addresses of parameters, moments, steps and weight copies (0: none) the tables hold
        self.tabs = [torch.tensor(k, dtype=torch.int64, device=dev) for k in self.key]
        sizes = [t.numel() for t in params]
        self.numel = torch.tensor(sizes, dtype=torch.int64, device=dev)
        starts = [(i, s) for i, n in enumerate(sizes) for s in range(0, n, BLOCK)]
        self.blk_tensor = torch.tensor([i for i, _ in starts], dtype=torch.int32, device=dev)
        self.blk_start = torch.tensor([s for _, s in starts], dtype=torch.int64, device=dev)
        self.n_blocks = len(starts)
        self.grads = DeviceAddressTable(len(params), dev)
        # _adamw_kernel's ALIGNED, but for the gradients (new tensors every step, checked per step): every address in
        # the tables 16-byte aligned (a copy's address 0 means none) and every size a multiple of 4.
        # (The step counts, read as scalars, need no alignment.)
        tensors = (self.key[0], self.key[1], self.key[2], self.key[4])
        self.aligned = all(a % 16 == 0 for k in tensors for a in k) and all(n % 4 == 0 for n in sizes)
        self.base32 = params[0]  # _adamw_kernel addresses every tensor from one of these by its element offset
        self.base16 = torch.empty(8, device=dev, dtype=copies_dtype or torch.bfloat16)
        self.no_skip = torch.zeros((), device=dev, dtype=torch.float32)  # found_inf when none is given
        self.scalars = torch.empty(2 * len(params), device=dev, dtype=torch.float32)  # _step_scalars_kernel's


class TableAdamW:
    """The step of each parameter group of a fused-AdamW optimizer in two launches (see the module docstring).
    copies_dtype: also write the weights' current 16-bit copies (models/kernels/weight_copies.py, switched on here)."""

    def __init__(self, copies_dtype: torch.dtype | None = None):
        self.groups: dict[tuple, _GroupTables] = {}  # (group index, gradient dtype) -> tables
        self.copies_dtype = copies_dtype
        if copies_dtype is not None:
            weight_copies.enable(copies_dtype)

    def step(self, index: int, group: dict, params, grads, exp_avgs, exp_avg_sqs, steps, grad_scale, found_inf):
        if not params:
            return
        if any(g.dtype not in _GRAD_BYTES or not g.is_contiguous() for g in grads):
            raise ValueError(
                "optimizer.implementation 'triton' takes contiguous float32 or bfloat16 gradients; use 'fused'"
            )
        # One launch per gradient dtype: float32, and bf16 where training.grad_dtype stores them so.
        for dtype in _GRAD_BYTES:
            picked = [i for i, g in enumerate(grads) if g.dtype == dtype]
            if len(picked) == len(params):  # all of one dtype: the lists as they are
                self._step_part((index, dtype), group, params, grads, exp_avgs, exp_avg_sqs, steps, grad_scale,
                                found_inf)  # fmt: skip
                return
            if picked:
                lists = ([ts[i] for i in picked] for ts in (params, grads, exp_avgs, exp_avg_sqs, steps))
                self._step_part((index, dtype), group, *lists, grad_scale, found_inf)

    def _step_part(self, key_: tuple, group: dict, params, grads, exp_avgs, exp_avg_sqs, steps, grad_scale, found_inf):
        """The two launches over `params`, whose gradients share one dtype (key_: the group's index and that dtype)."""
        tables = self.groups.get(key_)
        # Rebuilt whenever an address moved (a state reload, a parameter set that changed): the tables stay valid as
        # long as every address they hold is the same.
        # The weights' copies that are current now (a stale one is remade by its next use, not written here).
        copies = weight_copies.current_copies(params) if self.copies_dtype is not None else [None] * len(params)
        copy_addresses = tuple(0 if c is None else c.data_ptr() for c in copies)
        key = (addresses(params), addresses(exp_avgs), addresses(exp_avg_sqs), addresses(steps), copy_addresses)
        if tables is None or tables.key != key:
            tables = self.groups[key_] = _GroupTables(key, params, exp_avgs, exp_avg_sqs, self.copies_dtype)
        grad_addresses = addresses(grads)
        g_tab = tables.grads.update(grad_addresses)
        aligned = tables.aligned and all(a % 16 == 0 for a in grad_addresses)
        beta1, beta2 = group["betas"]
        skip = found_inf if found_inf is not None else tables.no_skip
        scale = grad_scale if grad_scale is not None else tables.no_skip  # any pointer: unused without HAS_SCALE
        p_tab, m_tab, v_tab, s_tab, c_tab = tables.tabs
        n, lr = len(params), float(group["lr"])
        _step_scalars_kernel[(triton.cdiv(n, 1024),)](s_tab, tables.scalars, n, skip, lr, beta1, beta2, BLOCK=1024)
        _adamw_kernel[(tables.n_blocks,)](
            p_tab, g_tab, m_tab, v_tab, tables.scalars, c_tab, tables.numel, tables.blk_tensor, tables.blk_start,
            scale, skip, tables.base32, tables.base16, grads[0], lr, beta1, beta2, group["eps"],
            group["weight_decay"], HAS_SCALE=grad_scale is not None, HAS_COPIES=any(copy_addresses),
            COPY_DTYPE=tl.float16 if self.copies_dtype == torch.float16 else tl.bfloat16,
            GRAD_BYTES=_GRAD_BYTES[grads[0].dtype], BLOCK=BLOCK, ALIGNED=aligned,
            FAST=fast_math.fast_on_this_backend(), num_warps=WARPS,
        )  # fmt: skip
