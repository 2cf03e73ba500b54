"""The pure-PyTorch kernel references against naive per-token loops (float64), forward and gradients."""

import pytest
import torch
import torch.nn.functional as F

from models.kernels import (
    add_rmsnorm_ref,
    causal_conv1d_ref,
    mamba_split_conv1d_scan,
    mamba_split_conv1d_scan_ref,
    rmsnorm_gated_ref,
    ssd_chunk_scan_ref,
)

F64 = torch.float64
INF = float("inf")


# ----------------------------------------------------------------------------- naive implementations


def naive_dt(dt, dt_bias, dt_softplus, dt_limit):
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(dt_limit[0], dt_limit[1])


def naive_ssd(
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    dt_limit=(0.0, INF),
    seq_idx=None,
    initial_states=None,
):
    """Token-by-token recurrence; the state resets where the document id changes (initial state = doc 0)."""
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    dt = naive_dt(dt, dt_bias, dt_softplus, dt_limit)
    h = initial_states if initial_states is not None else x.new_zeros(b, H, P, N)
    prev = torch.zeros(b, dtype=torch.long)
    ys = []
    for t in range(L):
        Bt = B[:, t].repeat_interleave(H // G, dim=1)  # [b, H, N]
        Ct = C[:, t].repeat_interleave(H // G, dim=1)
        decay = torch.exp(dt[:, t] * A)  # [b, H]
        if seq_idx is not None:
            decay = decay * (seq_idx[:, t].long() == prev).to(x.dtype)[:, None]
            prev = seq_idx[:, t].long()
        h = decay[..., None, None] * h + dt[:, t, :, None, None] * x[:, t, :, :, None] * Bt[:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ct))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + x * (D if D.dim() == 2 else D[:, None])
    if z is not None:
        y = y * F.silu(z)
    return y, h


def naive_conv(x, w, bias=None, seq_idx=None, activation=None):
    b, d, L = x.shape
    W = w.shape[1]
    out = torch.zeros_like(x)
    for t in range(L):
        acc = bias.clone().expand(b, d) if bias is not None else x.new_zeros(b, d)
        for k in range(W):
            s = t - (W - 1) + k
            if s < 0:
                continue
            keep = torch.ones(b, dtype=x.dtype) if seq_idx is None else (seq_idx[:, s] == seq_idx[:, t]).to(x.dtype)
            acc = acc + w[:, k] * x[:, :, s] * keep[:, None]
        out[:, :, t] = acc
    return F.silu(out) if activation in ("silu", "swish") else out


def naive_rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


# ----------------------------------------------------------------------------- inputs


def make_seq_idx(b, L, boundaries_per_row):
    rows = []
    for starts in boundaries_per_row:
        row = torch.zeros(L, dtype=torch.int32)
        for s in starts:
            row[s:] += 1
        rows.append(row)
    return torch.stack(rows)[:b]


def ssd_inputs(b=2, L=24, H=4, P=3, G=1, N=5, D_shape="H", with_z=True, with_init=True, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g, dtype=F64) * scale).requires_grad_(requires_grad)

    inp = dict(
        x=r(b, L, H, P),
        dt=r(b, L, H, scale=0.5),
        A=(-torch.exp(torch.rand(H, generator=g, dtype=F64))),
        B=r(b, L, G, N),
        C=r(b, L, G, N),
        D={"H": r(H), "HP": r(H, P), None: None}[D_shape],
        z=r(b, L, H, P) if with_z else None,
        dt_bias=r(H, scale=0.5),
        initial_states=r(b, H, P, N) if with_init else None,
    )
    inp["A"].requires_grad_(requires_grad)
    # Row 0: a document boundary exactly at 8 (a chunk start for chunk 8), a 1-token doc at 13, more docs.
    inp["seq_idx"] = make_seq_idx(b, L, [[8, 13, 14, 19], [5]])
    return inp


def ssd_call(fn, inp, chunk_size=None, **kw):
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    kwargs = dict(
        D=inp["D"],
        z=inp["z"],
        dt_bias=inp["dt_bias"],
        seq_idx=inp["seq_idx"],
        initial_states=inp["initial_states"],
        **kw,
    )
    if chunk_size is None:
        return fn(*args, **kwargs)
    return fn(*args, chunk_size, **kwargs, return_final_states=True)


# ----------------------------------------------------------------------------- (a) SSD vs recurrence


@pytest.mark.parametrize("chunk_size", [8, 7, 32])
@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("D_shape", ["H", "HP", None])
def test_ssd_matches_recurrence(chunk_size, G, D_shape):
    inp = ssd_inputs(G=G, D_shape=D_shape, with_z=D_shape != "HP", with_init=G == 1)
    dtkw = dict(dt_softplus=True, dt_limit=(0.05, 2.0))
    y, fin = ssd_call(ssd_chunk_scan_ref, inp, chunk_size, **dtkw)
    y_ref, fin_ref = ssd_call(naive_ssd, inp, **dtkw)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fin, fin_ref, rtol=1e-10, atol=1e-10)
    assert y.dtype == F64 and fin.dtype == F64


@pytest.mark.parametrize("with_seq", [False, True])
def test_ssd_no_seq_idx_no_options(with_seq):
    inp = ssd_inputs(D_shape=None, with_z=False, with_init=False)
    inp["dt_bias"] = None
    inp["dt"] = inp["dt"].abs()  # no softplus: dt used as given (negative dt would be clamped to 0)
    if not with_seq:
        inp["seq_idx"] = None
    y = ssd_call(ssd_chunk_scan_ref, inp, 5)[0]
    torch.testing.assert_close(y, ssd_call(naive_ssd, inp)[0], rtol=1e-10, atol=1e-10)


def test_ssd_negative_dt_clamped_like_kernel():
    inp = ssd_inputs(D_shape=None, with_z=False, with_init=False)
    inp["dt_bias"] = None
    y = ssd_call(ssd_chunk_scan_ref, inp, 8)[0]
    inp2 = dict(inp, dt=inp["dt"].clamp(min=0))
    torch.testing.assert_close(y, ssd_call(naive_ssd, inp2)[0], rtol=1e-10, atol=1e-10)


def test_ssd_initial_state_reaches_only_document_zero():
    inp = ssd_inputs()
    y1, f1 = ssd_call(ssd_chunk_scan_ref, inp, 8, dt_softplus=True)
    inp2 = dict(inp, initial_states=inp["initial_states"] * 3 + 1)
    y2, f2 = ssd_call(ssd_chunk_scan_ref, inp2, 8, dt_softplus=True)
    doc0 = inp["seq_idx"] == 0  # [b, L]
    assert not torch.allclose(y1[doc0], y2[doc0])
    torch.testing.assert_close(y1[~doc0], y2[~doc0], rtol=0, atol=1e-12)
    # Both rows end in a document other than 0, so the final state forgets the initial one.
    torch.testing.assert_close(f1, f2, rtol=0, atol=1e-12)


def test_ssd_low_precision_dtypes():
    inp = ssd_inputs(L=40)
    inp32 = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inp.items()}
    y64, f64 = ssd_call(ssd_chunk_scan_ref, inp, 16, dt_softplus=True)
    y32, f32 = ssd_call(ssd_chunk_scan_ref, inp32, 16, dt_softplus=True)
    assert y32.dtype == torch.float32 and f32.dtype == torch.float32
    torch.testing.assert_close(y32.double(), y64, rtol=1e-4, atol=1e-4)
    inp16 = dict(inp32, x=inp32["x"].bfloat16(), B=inp32["B"].bfloat16(), C=inp32["C"].bfloat16())
    y16, f16 = ssd_call(ssd_chunk_scan_ref, inp16, 16, dt_softplus=True)
    assert y16.dtype == torch.bfloat16 and f16.dtype == torch.float32
    assert (y16.double() - y64).norm() / y64.norm() < 2e-2


# ----------------------------------------------------------------------------- (b) document isolation


def test_ssd_output_ignores_earlier_documents():
    inp = ssd_inputs(G=2, D_shape="HP")
    y1 = ssd_call(ssd_chunk_scan_ref, inp, 8, dt_softplus=True)[0]
    L = inp["x"].shape[1]
    earlier = torch.zeros(2, L, dtype=torch.bool)
    earlier[0, :13] = True  # docs 0 and 1 of row 0
    earlier[1, :5] = True  # doc 0 of row 1
    inp2 = dict(inp)
    for k in ("x", "dt", "B", "C", "z"):
        noise = torch.randn_like(inp[k])
        m = earlier.view(2, L, *([1] * (inp[k].dim() - 2)))
        inp2[k] = torch.where(m, inp[k] + noise, inp[k])
    y2 = ssd_call(ssd_chunk_scan_ref, inp2, 8, dt_softplus=True)[0]
    assert not torch.allclose(y1[earlier], y2[earlier])
    torch.testing.assert_close(y1[~earlier], y2[~earlier], rtol=0, atol=1e-12)


def test_conv_output_ignores_earlier_documents():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 20, generator=g, dtype=F64)
    w, bias = torch.randn(6, 4, generator=g, dtype=F64), torch.randn(6, generator=g, dtype=F64)
    seq = make_seq_idx(2, 20, [[3, 9, 10], [12]])
    y1 = causal_conv1d_ref(x, w, bias, seq, "silu")
    earlier = torch.zeros(2, 20, dtype=torch.bool)
    earlier[0, :10] = True
    earlier[1, :12] = True
    x2 = torch.where(earlier[:, None], x + 1.0, x)
    y2 = causal_conv1d_ref(x2, w, bias, seq, "silu")
    torch.testing.assert_close(y1.transpose(1, 2)[~earlier], y2.transpose(1, 2)[~earlier], rtol=0, atol=0)


# ----------------------------------------------------------------------------- (c) conv


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("with_seq", [False, True])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_matches_naive(width, with_seq, activation):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(2, 5, 17, generator=g, dtype=F64)
    w = torch.randn(5, width, generator=g, dtype=F64)
    bias = torch.randn(5, generator=g, dtype=F64) if with_seq else None
    seq = make_seq_idx(2, 17, [[1, 2, 9], [16]]) if with_seq else None
    out = causal_conv1d_ref(x, w, bias, seq, activation)
    torch.testing.assert_close(out, naive_conv(x, w, bias, seq, activation), rtol=1e-12, atol=1e-12)


def test_conv_dtype_and_bad_activation():
    x = torch.randn(1, 4, 9).bfloat16()
    out = causal_conv1d_ref(x, torch.randn(4, 4), torch.randn(4), make_seq_idx(1, 9, [[4]]), "swish")
    assert out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_ref(x, torch.randn(4, 4), activation="relu")


# ----------------------------------------------------------------------------- (d) norms


@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("group_size", [None, 4])
def test_rmsnorm_gated_matches_formula(norm_before_gate, group_size):
    g = torch.Generator().manual_seed(2)
    x, z = torch.randn(3, 5, 8, generator=g, dtype=F64), torch.randn(3, 5, 8, generator=g, dtype=F64)
    w = torch.randn(8, generator=g, dtype=F64)
    out = rmsnorm_gated_ref(x, w, z, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    gs = group_size or 8
    xin = x if norm_before_gate else x * z * torch.sigmoid(z)
    xg = xin.view(3, 5, 8 // gs, gs)
    ref = (xg / torch.sqrt(xg.pow(2).mean(-1, keepdim=True) + 1e-5)).view(3, 5, 8) * w
    if norm_before_gate:
        ref = ref * z * torch.sigmoid(z)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # No gate: plain (grouped) RMSNorm.
    torch.testing.assert_close(rmsnorm_gated_ref(x, w, eps=1e-5), naive_rms(x, w, 1e-5), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="group_size"):
        rmsnorm_gated_ref(x, w, z, group_size=3)


def test_add_rmsnorm_matches_formula_and_dtypes():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 16, generator=g)
    res = torch.randn(2, 3, 16, generator=g)
    w = torch.randn(16, generator=g)
    normed, new_res = add_rmsnorm_ref(x.double(), res.double(), w.double(), eps=1e-6)
    torch.testing.assert_close(new_res, x.double() + res.double())
    torch.testing.assert_close(normed, naive_rms(x.double() + res.double(), w.double(), 1e-6))

    xb = x.bfloat16()
    # First block: no residual yet; residual_in_fp32 keeps the stream in fp32.
    n1, r1 = add_rmsnorm_ref(xb, None, w, residual_in_fp32=True)
    assert n1.dtype == torch.bfloat16 and r1.dtype == torch.float32
    torch.testing.assert_close(r1, xb.float(), rtol=0, atol=0)
    n1b, r1b = add_rmsnorm_ref(xb, None, w, residual_in_fp32=False)
    assert r1b.dtype == torch.bfloat16
    torch.testing.assert_close(n1b.float(), naive_rms(xb.float(), w, 1e-5).bfloat16().float(), rtol=0, atol=0)
    # With an fp32 residual the residual's dtype wins; the norm uses the unrounded fp32 sum.
    n2, r2 = add_rmsnorm_ref(xb, res, w)
    assert n2.dtype == torch.bfloat16 and r2.dtype == torch.float32
    torch.testing.assert_close(r2, xb.float() + res, rtol=0, atol=0)
    torch.testing.assert_close(n2, naive_rms(xb.float() + res, w, 1e-5).bfloat16(), rtol=0, atol=0)
    n3, r3 = add_rmsnorm_ref(xb, res.bfloat16(), w)
    s = xb.float() + res.bfloat16().float()
    assert r3.dtype == torch.bfloat16
    torch.testing.assert_close(n3, naive_rms(s, w, 1e-5).bfloat16(), rtol=0, atol=0)


# ----------------------------------------------------------------------------- (e) fused split path


def naive_split_conv1d_scan(
    zxbcdt,
    cw,
    cb,
    dt_bias,
    A,
    D,
    seq_idx,
    headdim,
    ngroups,
    dstate,
    d_nonssm,
    rms_w,
    eps,
    norm_before_gate,
    wo,
    bo,
    init,
    dt_limit,
):
    b, L, _ = zxbcdt.shape
    H = A.shape[0]
    dim = H * headdim
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, H], dim=-1)
    xBC = naive_conv(xBC.transpose(1, 2), cw, cb, seq_idx, "silu").transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    zz = z.reshape(b, L, H, headdim)
    y, fin = naive_ssd(
        x.reshape(b, L, H, headdim),
        dt,
        A,
        B.reshape(b, L, ngroups, dstate),
        C.reshape(b, L, ngroups, dstate),
        D=D,
        z=None if rms_w is not None else zz,
        dt_bias=dt_bias,
        dt_softplus=True,
        dt_limit=dt_limit,
        seq_idx=seq_idx,
        initial_states=init,
    )
    y = y.reshape(b, L, dim)
    if rms_w is not None:
        gate = F.silu(z)
        yg = (y if norm_before_gate else y * gate).view(b, L, ngroups, dim // ngroups)
        y = (yg / torch.sqrt(yg.pow(2).mean(-1, keepdim=True) + eps)).view(b, L, dim) * rms_w
        if norm_before_gate:
            y = y * gate
    if d_nonssm:
        a0, a1 = zx0.chunk(2, dim=-1)
        y = torch.cat([F.silu(a0) * a1, y], dim=-1)
    if wo is not None:
        y = F.linear(y, wo, bo)
    return y, fin


@pytest.mark.parametrize(
    "ngroups,D_hdim,use_norm,norm_before_gate,use_outproj,d_nonssm,use_init",
    [
        (1, False, True, False, True, 0, False),
        (2, True, True, True, False, 0, True),
        (2, False, False, False, True, 0, False),
        (1, True, True, False, True, 3, True),
    ],
)
def test_split_conv1d_scan_matches_composed(
    ngroups, D_hdim, use_norm, norm_before_gate, use_outproj, d_nonssm, use_init
):
    g = torch.Generator().manual_seed(4)
    b, L, H, P, N, W = 2, 22, 4, 3, 4, 4
    dim = H * P
    conv_dim = dim + 2 * ngroups * N

    def r(*s):
        return torch.randn(*s, generator=g, dtype=F64)

    zxbcdt = r(b, L, 2 * d_nonssm + dim + conv_dim + H)
    cw, cb, dt_bias = r(conv_dim, W), r(conv_dim), r(H) * 0.5
    A = -torch.exp(torch.rand(H, generator=g, dtype=F64))
    D = r(H, P) if D_hdim else r(H)
    rms_w = r(dim) if use_norm else None
    wo, bo = (r(7, d_nonssm + dim), r(7)) if use_outproj else (None, None)
    init = r(b, H, P, N) if use_init else None
    seq = make_seq_idx(b, L, [[6, 11], [16]])
    out, fin = mamba_split_conv1d_scan_ref(
        zxbcdt,
        cw,
        cb,
        dt_bias,
        A,
        D,
        8,
        seq_idx=seq,
        dt_limit=(0.0, 3.0),
        activation="silu",
        rmsnorm_weight=rms_w,
        rmsnorm_eps=1e-5,
        outproj_weight=wo,
        outproj_bias=bo,
        headdim=P,
        ngroups=ngroups,
        norm_before_gate=norm_before_gate,
        initial_states=init,
        return_final_states=True,
    )
    ref, fin_ref = naive_split_conv1d_scan(
        zxbcdt,
        cw,
        cb,
        dt_bias,
        A,
        D,
        seq,
        P,
        ngroups,
        N,
        d_nonssm,
        rms_w,
        1e-5,
        norm_before_gate,
        wo,
        bo,
        init,
        (0.0, 3.0),
    )
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fin, fin_ref, rtol=1e-10, atol=1e-10)


def test_split_conv1d_scan_bad_sizes():
    with pytest.raises(ValueError, match="zxbcdt last dim"):
        mamba_split_conv1d_scan_ref(
            torch.randn(1, 4, 27), torch.randn(16, 4), None, torch.zeros(2), -torch.ones(2), torch.ones(2), 4, headdim=4
        )
    with pytest.raises(ValueError, match="headdim"):
        mamba_split_conv1d_scan_ref(
            torch.randn(1, 4, 26), torch.randn(16, 4), None, torch.zeros(2), -torch.ones(2), torch.ones(2), 4
        )


def test_split_conv1d_scan_takes_A_or_A_log():
    """ops.mamba_split_conv1d_scan takes the model's A_log in place of A (A = -exp(A_log); our kernels take the
    exponential inside, the other backends before the call): the same output and gradients as A given; A and A_log
    both or neither is refused before anything runs."""
    g = torch.Generator().manual_seed(3)
    b, L, H, P, N = 1, 12, 2, 4, 4
    conv_dim = H * P + 2 * N
    zxbcdt = torch.randn(b, L, H * P + conv_dim + H, generator=g, dtype=F64)
    cw, D = torch.randn(conv_dim, 4, generator=g, dtype=F64), torch.randn(H, generator=g, dtype=F64)
    a_log = torch.rand(H, generator=g, dtype=F64)
    outs = {}
    for name in ("A", "A_log"):
        leaf = a_log.clone().requires_grad_()
        A, kw = (-torch.exp(leaf), {}) if name == "A" else (None, {"A_log": leaf})
        out = mamba_split_conv1d_scan(
            zxbcdt, cw, None, torch.zeros(H, dtype=F64), A, D, 4, headdim=P, backend="reference", **kw
        )
        outs[name] = (out, *torch.autograd.grad(out.square().sum(), leaf))
    for got, want in zip(outs["A_log"], outs["A"]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for A, kw in ((-torch.ones(H), {"A_log": torch.zeros(H)}), (None, {})):
        with pytest.raises(ValueError, match="give A or A_log"):
            mamba_split_conv1d_scan(zxbcdt, cw, None, torch.zeros(H), A, D, 4, headdim=P, backend="reference", **kw)


# ----------------------------------------------------------------------------- (f) gradients


def _grads(out_tensors, inputs, seed=7):
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in out_tensors)
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("chunk_size,G,D_shape", [(8, 1, "H"), (5, 2, "HP")])
def test_ssd_gradients_match_recurrence(chunk_size, G, D_shape):
    inp = ssd_inputs(L=20, G=G, D_shape=D_shape, requires_grad=True)
    names = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"]
    leaves = [inp[n] for n in names]
    kw = dict(dt_softplus=True, dt_limit=(0.0, 5.0))
    g1 = _grads(ssd_call(ssd_chunk_scan_ref, inp, chunk_size, **kw), leaves)
    g2 = _grads(ssd_call(naive_ssd, inp, **kw), leaves)
    for n, a, e in zip(names, g1, g2):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9, msg=lambda m, n=n: f"grad of {n}: {m}")


def test_conv_gradients_match_naive():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 13, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(5, 4, generator=g, dtype=F64, requires_grad=True)
    bias = torch.randn(5, generator=g, dtype=F64, requires_grad=True)
    seq = make_seq_idx(2, 13, [[2, 7], [12]])
    g1 = _grads([causal_conv1d_ref(x, w, bias, seq, "silu")], [x, w, bias])
    g2 = _grads([naive_conv(x, w, bias, seq, "silu")], [x, w, bias])
    for a, e in zip(g1, g2):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_norm_gradients_match_formula():
    g = torch.Generator().manual_seed(6)
    x, z, res = (torch.randn(2, 3, 8, generator=g, dtype=F64, requires_grad=True) for _ in range(3))
    w = torch.randn(8, generator=g, dtype=F64, requires_grad=True)
    g1 = _grads([rmsnorm_gated_ref(x, w, z, group_size=4)], [x, w, z])
    xg = (x * F.silu(z)).view(2, 3, 2, 4)
    g2 = _grads([(xg / torch.sqrt(xg.pow(2).mean(-1, keepdim=True) + 1e-5)).view(2, 3, 8) * w], [x, w, z])
    for a, e in zip(g1, g2):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    g1 = _grads(list(add_rmsnorm_ref(x, res, w)), [x, res, w])
    g2 = _grads([naive_rms(x + res, w, 1e-5), x + res], [x, res, w])
    for a, e in zip(g1, g2):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_ssd_chunked_memory_is_per_chunk():
    # A long sequence with a small chunk must not build [L, L] matrices: L=4096 would need 128 MiB per
    # head for one; the chunked form needs L * chunk per head.
    x = torch.randn(1, 4096, 2, 4)
    dt = torch.rand(1, 4096, 2) * 0.1
    B = C = torch.randn(1, 4096, 1, 4)
    y = ssd_chunk_scan_ref(x, dt, -torch.ones(2), B, C, 64)
    assert y.shape == x.shape and torch.isfinite(y).all()
