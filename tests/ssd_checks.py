"""The checks an SSD interpreter case runs (tests/ssd_interpreter.py's run_case_in_child): inputs, our kernels
against the float64 reference (forward and every gradient), and the mixer's fused path. They run under Triton's
interpreter in a worker process; benchmarks/ssd_numerics_cpu.py uses fp16_model_inputs and gradients too.
"""

import contextlib
import math

import torch

from models.kernels.ssd_reference import ssd_chunk_scan_ref

# The interpreter runs the kernels in float32 numpy, so errors sit near 1e-7: this leaves room for long reductions
# and fails on any real indexing error.
TOL = 2e-5


def make_inputs(b, L, H, P, G, N, seed, D_shape="H", with_z=False, with_init=True, seq_cuts=None, A_scale=1.0):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g, dtype=torch.float64) * scale

    inp = dict(
        x_BLHP=r(b, L, H, P),
        dt_BLH=r(b, L, H, scale=0.5),
        A_H=-(torch.rand(H, generator=g, dtype=torch.float64) * 2 + 0.3) * A_scale,
        B_BLGN=r(b, L, G, N),
        C_BLGN=r(b, L, G, N),
        D={"H": r(H), "HP": r(H, P), None: None}[D_shape],
        z=r(b, L, H, P) if with_z else None,
        dt_bias=r(H, scale=0.3),
        initial_states=r(b, H, P, N) if with_init else None,
        seq_idx=None,
    )
    if seq_cuts is not None:
        seq = torch.zeros(b, L, dtype=torch.int32)
        for row, cuts in enumerate(seq_cuts[:b]):
            for cut in cuts:
                seq[row, cut:] += 1
        inp["seq_idx"] = seq
    return inp


def check_against_reference(
    fn, inp, chunk_size, dt_softplus=True, dt_limit=(0.0, float("inf")), tol=TOL, use=("y", "final")
):
    """Run fn in float32 and the reference in float64 on the same inputs; compare outputs and all gradients, with
    the outputs in `use` feeding the loss (the other reaching the backward without a gradient)."""
    g = torch.Generator().manual_seed(123)
    results = {}
    for name, f, dtype in (("kernel", fn, torch.float32), ("ref", ssd_chunk_scan_ref, torch.float64)):
        leaves = {
            k: (v.detach().clone().to(dtype).requires_grad_() if v is not None and v.is_floating_point() else v)
            for k, v in inp.items()
        }
        y, final = f(
            **leaves, chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=True
        )
        results[name] = (y, final, leaves)
    gy = torch.randn(results["ref"][0].shape, generator=g, dtype=torch.float64)
    gf = torch.randn(results["ref"][1].shape, generator=g, dtype=torch.float64)
    for y, final, _ in results.values():
        loss = (y.double() * gy).sum() if "y" in use else 0
        loss = loss + ((final.double() * gf).sum() if "final" in use else 0)
        loss.backward()

    def rel(a, b):  # (absolute where the reference is all zeros: an input the used outputs do not depend on)
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1.0 if not b.any() else 0.0)).item()

    (yk, fk, lk), (yr, fr, lr) = results["kernel"], results["ref"]
    assert yk.dtype == torch.float32 and fk.dtype == torch.float32
    errors = {"y": rel(yk, yr), "final_states": rel(fk, fr)}
    for k, v in lr.items():
        if isinstance(v, torch.Tensor) and v.requires_grad:
            if v.grad is None:  # an input the used outputs do not depend on (D, z for the final states alone)
                assert lk[k].grad is None or not lk[k].grad.any(), f"a gradient for {k}, which no used output reads"
                continue
            assert lk[k].grad is not None, f"no gradient for {k}"
            errors["d" + k] = rel(lk[k].grad, v.grad)
    bad = {k: e for k, e in errors.items() if not e <= tol}
    assert not bad, f"over {tol}: {bad}; all: {errors}"
    return errors


def check_final_state_only_halves(b, L, H, P, G, N, seed, chunk_size):
    """The mixer's kernel-halves backward when only the final state is used (out's gradient None, as in a chunked
    prefill's carried state): every gradient equals the autograd path's (the same function, float32)."""
    from models.kernels import ops

    g = torch.Generator().manual_seed(seed)
    dim, conv_dim = H * P, H * P + 2 * G * N
    tensors = dict(
        zxbcdt=torch.randn(b, L, 2 * dim + 2 * G * N + H, generator=g),
        conv1d_weight=torch.randn(conv_dim, 4, generator=g) * 0.3,
        conv1d_bias=torch.randn(conv_dim, generator=g) * 0.1,
        dt_bias=torch.randn(H, generator=g) * 0.3 - 1,
        A=-(torch.rand(H, generator=g) + 0.5),
        D=torch.randn(H, generator=g),
        rmsnorm_weight=1 + 0.1 * torch.randn(dim, generator=g),
        outproj_weight=torch.randn(24, dim, generator=g) * dim**-0.5,
        initial_states=torch.randn(b, H, P, N, generator=g) * 0.5,
    )
    cot = torch.randn(b, H, P, N, generator=g)
    grads = {}
    for name, ctx in (("halves", kernel_halves_from_references()), ("autograd", contextlib.nullcontext())):
        leaves = {k: v.clone().requires_grad_() for k, v in tensors.items()}
        with ctx:
            _, final = ops.mamba_split_conv1d_scan(
                **leaves, chunk_size=chunk_size, headdim=P, ngroups=G, rmsnorm_eps=1e-5, return_final_states=True,
                backend="triton",
            )  # fmt: skip
            (final * cot).sum().backward()
        grads[name] = {k: v.grad for k, v in leaves.items()}
    errors = {}
    for k, ref in grads["autograd"].items():
        got = grads["halves"][k]
        if ref is None or got is None:  # no path from the final state (out_proj) on both sides, or a zero one
            assert (got is None or not got.any()) and (ref is None or not ref.any()), k
            continue
        errors[k] = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    bad = {k: e for k, e in errors.items() if not e <= 1e-5}
    assert not bad, f"over 1e-5: {bad}; all: {errors}"
    return errors


@contextlib.contextmanager
def kernel_halves_from_references():
    """The fused mixer's kernel-halves path (split_conv1d_scan._backward_with_kernel_halves, CUDA only) on the CPU:
    the conv's and the gated norm's GPU halves are replaced by the references (forward) and autograd through them
    (backward), with the halves' contracts (dx / dz written into the given buffers, the normed output recomputed on
    request), so the interpreter checks how the path wires them against the float64 reference."""
    from models.kernels import cuda
    from models.kernels import split_conv1d_scan as scs
    from models.kernels.reference import causal_conv1d_ref, rmsnorm_gated_ref

    def conv_forward(x, w, bias, seq, silu):
        return causal_conv1d_ref(x, w, bias, seq, "silu" if silu else None)

    def conv_backward(x, w, bias, dout, seq, silu, dx):
        x_, w_ = x.detach().requires_grad_(), w.detach().requires_grad_()
        b_ = None if bias is None else bias.detach().requires_grad_()
        with torch.enable_grad():  # called inside a backward
            out = conv_forward(x_, w_, b_, seq, silu)
        grads = torch.autograd.grad(out, [t for t in (x_, w_, b_) if t is not None], dout)
        dx.copy_(grads[0])
        return grads[1], None if bias is None else grads[2]

    def norm_forward(y, w, z, eps, group_size, norm_before_gate):
        rstd = torch.empty(y.shape[0] * y.shape[1] // group_size)  # the kernel's [groups * M]; unused here
        return rmsnorm_gated_ref(y, w, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate), rstd

    def norm_backward(dout, y, w, z, rstd, eps, group_size, norm_before_gate, dz, recompute):
        y_, w_, z_ = (t.detach().requires_grad_() for t in (y, w, z))
        with torch.enable_grad():
            out, _ = norm_forward(y_, w_, z_, eps, group_size, norm_before_gate)
        dy, dw, gz = torch.autograd.grad(out, (y_, w_, z_), dout)
        dz.copy_(gz)
        return dy, dw, out.detach() if recompute else None

    stand_ins = dict(
        conv_forward=conv_forward, conv_backward=conv_backward,
        gated_rmsnorm_forward=norm_forward, gated_rmsnorm_backward=norm_backward,
    )  # fmt: skip
    saved = {k: getattr(cuda, k) for k in stand_ins} | {"on": scs._kernel_halves_on}
    try:
        for k, f in stand_ins.items():
            setattr(cuda, k, f)
        scs._kernel_halves_on = lambda zxbcdt, s: True
        yield
    finally:
        scs._kernel_halves_on = saved.pop("on")
        for k, f in saved.items():
            setattr(cuda, k, f)


def check_split_path(
    b, L, H, P, G, N, seed, chunk_size, d_nonssm=0, norm=True, outproj=True, init_final=False, kept_states=False,
    a_log=False,
):  # fmt: skip
    """ops.mamba_split_conv1d_scan(backend="triton") (conv + our SSD + gated norm + out_proj in one Function that
    recomputes the conv and the norm in its backward; conv and norm run their references on the CPU) against
    mamba_split_conv1d_scan_ref in float64, output (and final states) and all gradients. Also what its backward keeps:
    the bytes saved for backward must be those of zxbcdt and the SSD output plus [B, H, L]-sized extras, not the
    conv output or out_proj's input (each as large as the SSD output); with kept_states (config keep_states) also
    the float32 entering states [B, NC, H, P, N], which must then be there. a_log: ours takes the model's A_log
    (A=None, A_log=log(-A)) and its gradient, compared as dA = dA_log / A (the dt kernels take the exponential)."""
    from models.kernels import ops
    from models.kernels.reference import mamba_split_conv1d_scan_ref

    g = torch.Generator().manual_seed(seed)
    dim, conv_dim = H * P, H * P + 2 * G * N

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g, dtype=torch.float64) * scale

    tensors = dict(
        zxbcdt=r(b, L, 2 * d_nonssm + 2 * dim + 2 * G * N + H),
        conv1d_weight=r(conv_dim, 4, scale=0.3),
        conv1d_bias=r(conv_dim, scale=0.1),
        dt_bias=r(H, scale=0.3) - 1,
        A=-(torch.rand(H, generator=g) + 0.5).double(),
        D=r(H),
    )
    if norm:
        tensors["rmsnorm_weight"] = 1 + r(dim, scale=0.1)
    if outproj:
        tensors["outproj_weight"] = r(24, d_nonssm + dim, scale=dim**-0.5)
        tensors["outproj_bias"] = r(24, scale=0.1)
    if init_final:
        tensors["initial_states"] = r(b, H, P, N, scale=0.5)
    seq = torch.zeros(b, L, dtype=torch.int32)
    seq[:, L // 3 :] = 1
    cot = r(b, L, 24 if outproj else d_nonssm + dim)
    cot_final = r(b, H, P, N)
    res, saved_bytes = {}, {}
    for name, fn, dtype, kw in (
        ("ours", ops.mamba_split_conv1d_scan, torch.float32, dict(backend="triton")),
        ("ref", mamba_split_conv1d_scan_ref, torch.float64, {}),
    ):
        leaves = {k: v.detach().clone().to(dtype).requires_grad_() for k, v in tensors.items()}
        if a_log and name == "ours":
            leaves["A_log"] = torch.log(-leaves.pop("A").detach()).requires_grad_()
            kw = dict(kw, A=None)
        sizes = []

        def pack(t):
            sizes.append((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(
                **leaves,
                chunk_size=chunk_size,
                seq_idx=seq,
                headdim=P,
                ngroups=G,
                rmsnorm_eps=1e-5,
                return_final_states=init_final,
                **kw,
            )
        saved_bytes[name] = sum(dict(sizes).values()) // dtype.itemsize  # distinct storages, in elements
        out, final = out if init_final else (out, None)
        loss = (out.double() * cot).sum() + (0 if final is None else (final.double() * cot_final).sum())
        loss.backward()
        res[name] = {"out": out.double(), **{"d" + k: v.grad.double() for k, v in leaves.items()}}
        if "A_log" in leaves:  # d/dA_log = d/dA * A, with A = -exp(A_log) in float64 here
            res[name]["dA"] = res[name].pop("dA_log") / -torch.exp(leaves["A_log"].detach().double())
        if final is not None:
            res[name]["final"] = final.double()
    errors = {k: ((res["ours"][k] - v).norm() / v.norm()).item() for k, v in res["ref"].items()}
    bad = {k: e for k, e in errors.items() if not e <= TOL}
    assert not bad, f"over {TOL}: {bad}; all: {errors}"
    params = sum(v.numel() for k, v in tensors.items() if k != "zxbcdt")
    # + the norm's 1 / rms per row and group when the kernel halves run (G * b * L float32)
    allowed = tensors["zxbcdt"].numel() + b * L * dim * (1 if norm else 2) + params + 4 * b * H * L + b * L + G * b * L
    states = b * -(-L // chunk_size) * H * P * N if kept_states else 0
    assert saved_bytes["ours"] <= allowed + states, (saved_bytes, allowed, states)
    assert saved_bytes["ours"] > allowed or not kept_states, (saved_bytes, allowed, "the states are not kept")
    errors["saved_elements"] = saved_bytes["ours"]
    return errors


def check_fp16_gate_dD(b, L, H, P, G, N, seed, chunk_size):
    """float16 inputs with z and D of [H, P]: dD must be the float32 sum of the gated dy times x, not of dy rounded
    to float16 first (the kernels' operand dtype). Against the float64 reference given the same (float16-rounded)
    output cotangent, so the only error left is float32 arithmetic (< 1e-5); rounding dy first gave 2.1e-4 here."""
    from models.kernels.ssd_triton.autograd import ssd_chunk_scan_triton

    inp = make_inputs(b, L, H, P, G, N, seed, D_shape="HP", with_z=True, with_init=False)
    gy = torch.randn(b, L, H, P, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    gy16 = gy.to(torch.float16)
    grads = {}
    for name, fn, dtype in (("ours", ssd_chunk_scan_triton, torch.float16), ("ref", ssd_chunk_scan_ref, torch.float64)):
        leaves = {}
        for k, v in inp.items():
            if v is not None and v.is_floating_point():
                # D stays float32 (a float32 parameter in the model; a float16 leaf would round its own gradient).
                v = v.detach().to(torch.float16).to(torch.float32 if k == "D" and name == "ours" else dtype)
                v.requires_grad_()
            leaves[k] = v
        y = fn(**leaves, chunk_size=chunk_size, dt_softplus=True)
        y.backward(gy16.to(y.dtype))
        grads[name] = leaves["D"].grad.double()
    err = ((grads["ours"] - grads["ref"]).norm() / grads["ref"].norm()).item()
    assert err < 1e-5, f"dD relative error {err:.2e} (float32 sums of the float32 gated dy give ~1e-7)"
    return {"dD": err}


def fp16_model_inputs(b, L, H, P, N, seq: bool, seed: int, dtype=torch.float16, init: bool = False):
    """Inputs as the model draws them (dt around softplus^-1 of [1e-3, 0.1], A in [-16, -1]), rounded to ``dtype``,
    with documents (seq) and a float64 output cotangent gy. Also benchmarks/ssd_numerics_cpu.py's inputs."""
    gen = torch.Generator().manual_seed(seed)
    dt0 = torch.exp(torch.rand(H, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    inp = dict(
        x=torch.randn(b, L, H, P, generator=gen),
        dt=torch.randn(b, L, H, generator=gen) * 0.5,
        A=-torch.empty(H).uniform_(1, 16, generator=gen),
        B=torch.randn(b, L, 1, N, generator=gen),
        C=torch.randn(b, L, 1, N, generator=gen),
        D=torch.randn(H, generator=gen),
        dt_bias=dt0 + torch.log(-torch.expm1(-dt0)),
    )
    inp = {k: v.to(dtype) for k, v in inp.items()}
    if init:  # initial states (float32 in the model: CP's carried states), drawn after everything else
        inp["initial_states"] = torch.randn(b, H, P, N, generator=gen)
    seq_idx = None
    if seq:
        seq_idx = torch.zeros(b, L, dtype=torch.int32)
        for row, cuts in enumerate([[17, 64, 65, 150], [40, 90]]):
            for cut in cuts:
                if cut < L:
                    seq_idx[row, cut:] += 1
    gy = torch.randn(b, L, H, P, generator=gen, dtype=torch.float64)
    return inp, seq_idx, gy


def gradients(fn, inp, seq_idx, gy, chunk: int, dtype, device="cpu", gf=None):
    """Gradients of sum(y * gy) (+ sum(final_states * gf) when gf is given); x, dt, B, C in ``dtype``, the
    parameters in float32 (float64 for the reference)."""
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = {
        k: v.detach().clone().to(device, dtype if k in ("x", "dt", "B", "C") else param_dtype).requires_grad_()
        for k, v in inp.items()
    }  # fresh leaves per run: .to() of a tensor already in dtype would hand back the shared input itself
    seq_idx, gy = (None if seq_idx is None else seq_idx.to(device)), gy.to(device)
    y = fn(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk,
        D=leaves["D"], dt_bias=leaves["dt_bias"], dt_softplus=True, seq_idx=seq_idx,
        initial_states=leaves.get("initial_states"), return_final_states=gf is not None,
    )  # fmt: skip
    y, final = y if gf is not None else (y, None)
    loss = (y.double() * gy).sum()
    if gf is not None:
        loss = loss + (final.double() * gf.to(device)).sum()
    loss.backward()
    missing = [k for k, v in leaves.items() if v.grad is None]
    assert not missing, f"no gradient for {missing}"
    return {k: v.grad.double().cpu() for k, v in leaves.items()}


def check_fp16_decay_gradient(L, chunk_size, bound):
    """float16, whole chunks, documents, dt / A as the model draws them: dA's error against float64 on the same
    (float16-rounded) inputs. The chunk states must scale B, not x, before rounding the operand to float16: rounding
    the scaled x left an error in the states that dA picks up coherently (9.7e-4 here; 7.3e-4 with B scaled, as
    mamba_ssm does, whose kernels give 7.2e-4 on these inputs in the same interpreter)."""
    from models.kernels.ssd_triton.autograd import ssd_chunk_scan_triton

    inp, seq_idx, gy = fp16_model_inputs(2, L, 4, 16, 32, seq=True, seed=0)
    ours = gradients(ssd_chunk_scan_triton, inp, seq_idx, gy, chunk_size, torch.float16)["A"]
    ref = gradients(ssd_chunk_scan_ref, inp, seq_idx, gy, chunk_size, torch.float64)["A"]
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < bound, f"dA relative error {err:.2e} >= {bound:.1e} (float16, whole chunks)"
    return {"dA": err}


def check_kept_matches_recomputed(L, chunk_size):
    """float16 with documents, initial and final states: keep_states (the states kept as high + low parts, the
    chains handing them on) against the default path's recompute, every gradient. They differ only by the chains'
    ~16-bit hand-offs (~1e-7 here); the backward handed the wrong chunk's kept states gives ~1 (by mutation)."""
    import functools

    from models.kernels.ssd_triton import autograd

    inp, seq_idx, gy = fp16_model_inputs(2, L, 4, 16, 32, seq=True, seed=3, init=True)
    gf = torch.randn(2, 4, 16, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grads = {}
    for keep in (False, True):
        fn = functools.partial(autograd.ssd_chunk_scan_triton, keep_states=keep)
        grads[keep] = gradients(fn, inp, seq_idx, gy, chunk_size, torch.float16, gf=gf)
    diffs = {k: ((grads[True][k] - v).norm() / v.norm()).item() for k, v in grads[False].items()}
    assert all(d < 1e-5 for d in diffs.values()), diffs
    return diffs


def check_decay_through_initial_states(bound):
    """float16, the state carried across chunks dominating dA: large initial states, small x, slow decay, and only
    a final-state cotangent. dA is then the chunk-end terms exp(a_last) * sum(dS * S_in), sums over P * N products
    of both signs that keep their terms' relative error: S_in must be float32 there (the backward's recompute), not
    rounded to the operand dtype (float16 rounding gave ~1e-4 here; bf16 on the GPU gave 30x mamba_ssm's dA error)."""
    from models.kernels.ssd_triton.autograd import ssd_chunk_scan_triton

    inp, _, gy = fp16_model_inputs(2, 64, 2, 16, 16, seq=False, seed=1, init=True)
    inp["x"] = (inp["x"].float() * 0.01).half()
    inp["A"] = -torch.ones(2)
    inp["dt_bias"] = torch.full((2,), math.log(math.expm1(1e-3)))
    gf = torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    zero = torch.zeros_like(gy)
    ours = gradients(ssd_chunk_scan_triton, inp, None, zero, 16, torch.float16, gf=gf)["A"]
    ref = gradients(ssd_chunk_scan_ref, inp, None, zero, 16, torch.float64, gf=gf)["A"]
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < bound, f"dA relative error {err:.2e} >= {bound:.1e} (decay through the carried states)"
    return {"dA": err}


# Row 0: a boundary exactly at a chunk start (16), a one-token document (at 30), a short one; row 1: one cut.


def _gated_mixer_inputs(b, L, H, P, N, seed, d_model):
    """The fused mixer's inputs as the model passes them (ngroups 1, A_log, a norm weight, out_proj to d_model), and
    the generator's draw function r(*shape, scale) for the caller's further tensors (drawn after these)."""
    g = torch.Generator().manual_seed(seed)
    dim, conv_dim = H * P, H * P + 2 * N

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    tensors = dict(
        zxbcdt=r(b, L, 2 * dim + 2 * N + H),
        conv1d_weight=r(conv_dim, 4, scale=0.3),
        conv1d_bias=r(conv_dim, scale=0.1),
        dt_bias=r(H, scale=0.3) - 1,
        A_log=torch.log(torch.rand(H, generator=g) + 0.5),
        D=r(H),
        rmsnorm_weight=1 + r(dim, scale=0.1),
        outproj_weight=r(d_model, dim, scale=dim**-0.5),
    )
    return tensors, r


def check_fused_gate(b, L, H, P, N, seed, chunk_size, kept_states=False):
    """model.fuse_gate_into_scan (row_scale.py) on the kernel-halves path: mamba_split_conv1d_scan with fuse_gate
    (the chunk scan writing out_proj's input before the gated norm's division by the rows' rms, that scale applied
    by the next add + RMSNorm) followed by add_rmsnorm_triton, against the same two ops without it, in float32 with
    A_log as the model passes it: the next norm's outputs (normed, new residual) and every gradient (the mixer's
    inputs and parameters, the residual, the next norm's weight). Also: the output is a RowScaled whose
    materialize() is the unfused output, and without a norm weight, with ngroups 2 or with out_proj's bias the
    option leaves a plain tensor."""
    from models.kernels import ops
    from models.kernels.add_rmsnorm_triton import add_rmsnorm_triton
    from models.kernels.row_scale import RowScaled

    d_model = 24
    tensors, r = _gated_mixer_inputs(b, L, H, P, N, seed, d_model)
    tensors.update(residual=r(b, L, d_model), next_norm_weight=1 + r(d_model, scale=0.1))
    seq = torch.zeros(b, L, dtype=torch.int32)
    seq[:, L // 3 :] = 1
    cot_normed, cot_res = r(b, L, d_model), r(b, L, d_model)
    res = {}
    for fuse in (False, True):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in tensors.items()}
        mixer_args = {k: v for k, v in leaves.items() if k not in ("residual", "next_norm_weight")}
        with kernel_halves_from_references():
            out = ops.mamba_split_conv1d_scan(
                **mixer_args, A=None, chunk_size=chunk_size, seq_idx=seq, headdim=P, ngroups=1, rmsnorm_eps=1e-5,
                norm_before_gate=False, backend="triton", keep_states=kept_states, fuse_gate=fuse,
            )  # fmt: skip
            assert isinstance(out, RowScaled) == fuse, type(out)
            if fuse:
                res["materialized"] = out.materialize().detach()
            else:
                res["plain"] = out.detach()
            normed, new_res = add_rmsnorm_triton(out, leaves["residual"], leaves["next_norm_weight"], eps=1e-5)
            ((normed * cot_normed).sum() + (new_res * cot_res).sum()).backward()
        res[fuse] = {"normed": normed.detach(), "new_res": new_res.detach()}
        res[fuse].update({"d" + k: v.grad.detach() for k, v in leaves.items()})
    errors = {
        k: ((res[True][k] - res[False][k]).abs().max() / res[False][k].abs().max().clamp_min(1e-30)).item()
        for k in res[False]
    }
    errors["materialize"] = ((res["materialized"] - res["plain"]).abs().max() / res["plain"].abs().max()).item()
    # Where the option does not apply: a plain tensor as before.
    with kernel_halves_from_references():
        for change in (dict(outproj_bias=torch.zeros(d_model)), dict(rmsnorm_weight=None)):
            kw = dict({k: v.detach() for k, v in tensors.items() if k not in ("residual", "next_norm_weight")})
            kw.update(change)
            out = ops.mamba_split_conv1d_scan(
                **kw, A=None, chunk_size=chunk_size, seq_idx=seq, headdim=P, ngroups=1, rmsnorm_eps=1e-5,
                norm_before_gate=False, backend="triton", fuse_gate=True,
            )  # fmt: skip
            assert not isinstance(out, RowScaled), change
    bad = {k: e for k, e in errors.items() if not e < 2e-5}
    assert not bad, errors
    return errors


def check_keep_conv(b, L, H, P, N, seed, chunk_size, fuse_gate=False):
    """model.ssd_keep_conv_layers on the kernel-halves path: the fused mixer keeping its conv output for the backward
    gives the outputs and every gradient of the mixer recomputing it, bit for bit (the same conv, once instead of
    twice), with documents and A_log as the model passes them. The conv's forward runs twice per forward + backward
    without the option and once with it."""
    from models.kernels import ops
    from models.kernels import split_conv1d_scan as scs
    from models.kernels.row_scale import materialize

    d_model = 24
    tensors, r = _gated_mixer_inputs(b, L, H, P, N, seed, d_model)
    seq = torch.zeros(b, L, dtype=torch.int32)
    seq[:, L // 3 :] = 1
    cot = r(b, L, d_model)
    conv_calls, results = [], {}
    real_conv = scs._conv_forward_halves

    def counted(*args, **kwargs):
        conv_calls.append(1)
        return real_conv(*args, **kwargs)

    scs._conv_forward_halves = counted
    try:
        for keep in (False, True):
            leaves = {k: v.detach().clone().requires_grad_() for k, v in tensors.items()}
            conv_calls.clear()
            with kernel_halves_from_references():
                out = ops.mamba_split_conv1d_scan(
                    **leaves, A=None, chunk_size=chunk_size, seq_idx=seq, headdim=P, ngroups=1, rmsnorm_eps=1e-5,
                    norm_before_gate=False, backend="triton", fuse_gate=fuse_gate, keep_conv=keep,
                )  # fmt: skip
                out = materialize(out)
                (out * cot).sum().backward()
            results[keep] = {"out": out.detach(), **{"d" + k: v.grad for k, v in leaves.items()}}
            results[keep, "convs"] = len(conv_calls)
    finally:
        scs._conv_forward_halves = real_conv
    assert results[False, "convs"] == 2 and results[True, "convs"] == 1, results
    differ = [k for k in results[False] if not torch.equal(results[False][k], results[True][k])]
    assert not differ, differ
    return {"compared": sorted(results[False])}
