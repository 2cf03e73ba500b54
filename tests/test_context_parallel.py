"""All-to-all context parallel: collectives, load balance, sharding and a whole Mamba mixer core vs cp = 1.

The mixer-core check runs pre_conv_ssm -> causal conv -> SSD -> post_conv_ssm under cp ranks (gloo) and
compares outputs and gradients (conv1d weight / bias, dt_bias, A_log, D, inputs) with the same core on
the full sequence in one process, in float64. It uses models.kernels.ops when that exists, else the
naive conv / recurrence written below (which are also a check of the seq_idx semantics).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallelisms.context_parallel import (
    MambaContextParallel,
    all_to_all_heads_to_seq,
    all_to_all_heads_to_seq_blocks,
    all_to_all_seq_to_heads,
    validate_cp_mamba,
)
from parallelisms.sequence_sharding import (
    load_balance_order,
    redo_load_balance,
    shard_sequence,
    undo_load_balance,
    validate_cp_shapes,
)
from tests.dist_utils import FakeGroup, run_distributed

# ----------------------------------------------------------------------------------------------------
# Naive float64 references (the CPU kernels' semantics: conv window and SSM state reset at doc starts)
# ----------------------------------------------------------------------------------------------------


def naive_causal_conv1d(x_BDL, weight_DW, bias_D=None, seq_idx_BL=None, activation=None):
    b, D, L = x_BDL.shape
    W = weight_DW.shape[-1]
    x_pad = F.pad(x_BDL, (W - 1, 0))
    if seq_idx_BL is None:
        seq_idx_BL = torch.zeros(b, L, dtype=torch.int32)
    seq_pad = F.pad(seq_idx_BL, (W - 1, 0), value=-1)
    out = torch.zeros_like(x_BDL) if bias_D is None else bias_D[None, :, None].expand(b, D, L).clone()
    for k in range(W):
        same_doc = (seq_pad[:, k : k + L] == seq_idx_BL).unsqueeze(1)
        out = out + weight_DW[None, :, k, None] * x_pad[:, :, k : k + L] * same_doc
    return F.silu(out) if activation in ("silu", "swish") else out


def naive_ssd(
    x_BLHP,
    dt_BLH,
    A_H,
    B_BLGN,
    C_BLGN,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    seq_idx=None,
    **_,
):
    b, L, H, P = x_BLHP.shape
    G = B_BLGN.shape[2]
    dt = dt_BLH + dt_bias if dt_bias is not None else dt_BLH
    dt = F.softplus(dt) if dt_softplus else dt
    B_h = B_BLGN.repeat_interleave(H // G, dim=2)
    C_h = C_BLGN.repeat_interleave(H // G, dim=2)
    h = torch.zeros(b, H, P, B_BLGN.shape[-1], dtype=x_BLHP.dtype)
    ys = []
    for t in range(L):
        if t > 0 and seq_idx is not None:
            keep = (seq_idx[:, t] == seq_idx[:, t - 1]).to(h.dtype)
            h = h * keep[:, None, None, None]
        dA = torch.exp(dt[:, t] * A_H)  # [b, H]
        h = h * dA[:, :, None, None] + (dt[:, t, :, None] * x_BLHP[:, t])[..., None] * B_h[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C_h[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + x_BLHP * (D[:, None] if D.dim() == 1 else D)
    return y


def _ops():
    try:
        from models.kernels.ops import causal_conv1d, ssd_chunk_scan

        return causal_conv1d, ssd_chunk_scan
    except ImportError:
        return naive_causal_conv1d, naive_ssd


def test_naive_references_reset_at_document_starts():
    # a document's output must not depend on the previous document's tokens
    torch.manual_seed(0)
    b, L, H, P, G, N, W = 1, 12, 2, 2, 1, 3, 4
    x, dt = torch.randn(b, L, H, P, dtype=torch.float64), torch.randn(b, L, H, dtype=torch.float64)
    Bm, Cm = torch.randn(b, L, G, N, dtype=torch.float64), torch.randn(b, L, G, N, dtype=torch.float64)
    A = -torch.rand(H, dtype=torch.float64)
    seq = torch.tensor([[0] * 5 + [1] * 7], dtype=torch.int32)
    y = naive_ssd(x, dt, A, Bm, Cm, 4, seq_idx=seq)
    y2 = naive_ssd(x[:, 5:], dt[:, 5:], A, Bm[:, 5:], Cm[:, 5:], 4)
    torch.testing.assert_close(y[:, 5:], y2)
    xc, w = torch.randn(b, 3, L, dtype=torch.float64), torch.randn(3, W, dtype=torch.float64)
    c = naive_causal_conv1d(xc, w, None, seq)
    torch.testing.assert_close(c[..., 5:], naive_causal_conv1d(xc[..., 5:], w))


def test_kernels_api_matches_naive_references():
    # the mixer-core checks below use models.kernels.ops when it exists: tie it to the naive semantics
    ops = pytest.importorskip("models.kernels.ops")
    torch.manual_seed(1)
    b, L, H, P, G, N, W = 2, 20, 4, 2, 2, 3, 4
    f64 = dict(dtype=torch.float64)
    x, dt = torch.randn(b, L, H, P, **f64), torch.randn(b, L, H, **f64)
    Bm, Cm = torch.randn(b, L, G, N, **f64), torch.randn(b, L, G, N, **f64)
    A, dt_bias = -torch.rand(H, **f64) - 0.5, torch.randn(H, **f64)
    seq = _seq_idx(b, L, seed=2)
    for D in (torch.randn(H, **f64), torch.randn(H, P, **f64)):
        kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, seq_idx=seq)
        torch.testing.assert_close(ops.ssd_chunk_scan(x, dt, A, Bm, Cm, 8, **kw), naive_ssd(x, dt, A, Bm, Cm, 8, **kw))
    xc, w, bias = torch.randn(b, 5, L, **f64), torch.randn(5, W, **f64), torch.randn(5, **f64)
    torch.testing.assert_close(
        ops.causal_conv1d(xc, w, bias, seq, activation="silu"), naive_causal_conv1d(xc, w, bias, seq, "silu")
    )


# ----------------------------------------------------------------------------------------------------
# Pure functions: load balance, sharding, validation
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", range(1, 9))
def test_undo_redo_load_balance_match_definition(cp):
    L = 3
    natural = torch.arange(2 * cp * L)
    chunks = natural.chunk(2 * cp)
    balanced = torch.cat([c for r in range(cp) for c in (chunks[r], chunks[2 * cp - 1 - r])])
    torch.testing.assert_close(undo_load_balance(balanced, cp, seq_dim=0), natural)
    torch.testing.assert_close(redo_load_balance(natural, cp, seq_dim=0), balanced)
    # other dims and batch-first layouts
    x = torch.randn(2, 2 * cp * L, 5)
    torch.testing.assert_close(undo_load_balance(redo_load_balance(x, cp), cp), x)
    xt = x.transpose(1, 2)  # [b, d, s]
    torch.testing.assert_close(redo_load_balance(xt, cp, seq_dim=-1), redo_load_balance(x, cp).transpose(1, 2))
    # shards of every rank, concatenated in rank order (what the all-to-all delivers), undo to natural
    t = torch.randn(2, 2 * cp * L, 3)
    for lb in (False, True):
        arrived = torch.cat([shard_sequence(t, r, cp, lb) for r in range(cp)], dim=1)
        torch.testing.assert_close(undo_load_balance(arrived, cp) if lb else arrived, t)


def test_load_balance_cp3_order():
    assert [c + 1 for c in load_balance_order(3)] == [1, 6, 2, 5, 3, 4]
    x = torch.arange(6)
    assert undo_load_balance(torch.tensor([0, 5, 1, 4, 2, 3]), 3, seq_dim=0).tolist() == x.tolist()


def test_shard_sequence_definition():
    t = torch.arange(24).reshape(1, 24)
    assert shard_sequence(t, 1, 3, False).tolist() == [list(range(8, 16))]
    assert shard_sequence(t, 1, 3, True).tolist() == [list(range(4, 8)) + list(range(16, 20))]
    assert shard_sequence(t, 0, 1, True) is t
    t3 = torch.arange(48).reshape(2, 24).unsqueeze(-1).expand(2, 24, 2)
    torch.testing.assert_close(shard_sequence(t3, 2, 4, True)[..., 0], shard_sequence(t3[..., 0], 2, 4, True))


def test_validate_cp_shapes_messages():
    validate_cp_shapes(48, 4, True)
    validate_cp_shapes(12, 4, False)
    with pytest.raises(ValueError, match=r"training.seq_len=12 must divide by 2\*cp=8.*training.seq_len=16"):
        validate_cp_shapes(12, 4, True)
    with pytest.raises(ValueError, match=r"training.seq_len=10 must divide by cp=4"):
        validate_cp_shapes(10, 4, False)
    with pytest.raises(ValueError, match="2\\*cp=6"):
        shard_sequence(torch.zeros(1, 8), 0, 3, True)


def test_validate_cp_mamba():
    assert validate_cp_mamba(8, 1, 4) == 4
    assert validate_cp_mamba(8, 2, 4) == 2
    assert validate_cp_mamba(8, 4, 2) == 1
    assert validate_cp_mamba(8, 8, 8) == 1
    with pytest.raises(ValueError, match="nheads=6, ngroups=2, cp=4"):
        validate_cp_mamba(6, 2, 4)
    with pytest.raises(ValueError, match="nheads=12, ngroups=3, cp=2"):
        validate_cp_mamba(12, 3, 2)


class _Mixer(nn.Module):
    """The attributes MambaContextParallel.from_mixer reads (mamba_ssm Mamba2 names)."""

    def __init__(self, nheads=8, headdim=2, ngroups=1, d_state=3, d_conv=4, D_has_hdim=False):
        super().__init__()
        self.nheads, self.ngroups, self.d_state, self.D_has_hdim = nheads, ngroups, d_state, D_has_hdim
        self.d_ssm = nheads * headdim
        conv_dim = self.d_ssm + 2 * ngroups * d_state
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1)
        self.dt_bias = nn.Parameter(torch.randn(nheads) * 0.5)
        self.A_log = nn.Parameter(torch.log(torch.rand(nheads) + 0.5))
        self.D = nn.Parameter(torch.randn(self.d_ssm if D_has_hdim else nheads))


@pytest.mark.parametrize("with_bias", [False, True])
def test_row_blocks_mm_writes_the_selected_rows_contiguously(with_bias):
    """in_proj's x B C dt rows straight into the send buffer: [K, T, d] contiguous (a transposed view would be copied
    by the all-to-all: GPU session 27 measured it), the same values as F.linear on the selected rows (the gradients:
    test_cp_mamba_autograd's in_proj node tests)."""
    from parallelisms.cp_mamba_autograd import row_blocks_mm

    g = torch.Generator().manual_seed(5)
    T, D, K, d = 12, 8, 3, 5
    u = torch.randn(T, D, dtype=torch.float64, generator=g)
    W = torch.randn(K * d + 2, D, dtype=torch.float64, generator=g)
    bias = torch.randn(K * d + 2, dtype=torch.float64, generator=g) if with_bias else None
    rows = torch.tensor([4, 0, 1, 9, 2, 3, 3, 5, 6, 7, 8, 10, 11, 12, 16])  # a repeat, as replicated B / C rows
    b_Kd = None if bias is None else bias.index_select(0, rows).view(K, d)
    out = row_blocks_mm(u, W.index_select(0, rows).view(K, d, D), b_Kd)
    assert out.shape == (K, T, d) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(u, W, bias)[:, rows].view(T, K, d).transpose(0, 1))


def test_construction_errors_name_sizes():
    m = _Mixer(nheads=12, headdim=2, ngroups=3)
    with pytest.raises(ValueError, match="nheads=12, ngroups=3, cp=2"):
        MambaContextParallel.from_mixer(m, FakeGroup(2, 0))
    with pytest.raises(ValueError, match="nheads=12, ngroups=3, cp=8"):
        MambaContextParallel.from_mixer(m, FakeGroup(8, 0))


def test_parameter_slices_match_definition():
    torch.manual_seed(0)
    m = _Mixer(nheads=8, headdim=2, ngroups=2, d_state=3, D_has_hdim=True)
    d_inner, N = 16, 3
    w = m.conv1d.weight[:, 0]
    xw, Bw, Cw = w[:d_inner], w[d_inner : d_inner + 6], w[d_inner + 6 :]
    for cp, rank in [(4, 3), (2, 1), (8, 5)]:
        cpm = MambaContextParallel.from_mixer(m, FakeGroup(cp, rank))
        g = rank * 2 // cp  # owning group: one replica per rank (cp >= ngroups)
        want = torch.cat([xw.chunk(cp)[rank], Bw[g * N : (g + 1) * N], Cw[g * N : (g + 1) * N]])
        torch.testing.assert_close(cpm.get_conv1d_weight(), want[:, None])
        assert cpm.conv1d_channels == d_inner // cp + 2 * N
        torch.testing.assert_close(cpm.get_dt_bias(), m.dt_bias.chunk(cp)[rank])
        torch.testing.assert_close(cpm.get_D(), m.D.chunk(cp)[rank])


def test_cp1_is_identity_and_follows_swapped_parameters():
    m = _Mixer()
    cpm = MambaContextParallel.from_mixer(m, None)
    x = torch.randn(2, 6, 16 + 6 + 8)
    assert cpm.pre_conv_ssm(x) is x and cpm.post_conv_ssm(x) is x
    assert cpm.get_A_log() is m.A_log
    # FSDP2 / to_empty replace the Parameter object on its module: the slices must follow
    m.A_log = nn.Parameter(torch.zeros(8))
    assert cpm.get_A_log() is m.A_log
    # a deep-copied model's CP reads the copy's parameters; the group is shared, not copied
    m.cp = MambaContextParallel.from_mixer(m, FakeGroup(2, 1))
    m2 = copy.deepcopy(m)
    assert m2.cp.conv1d_cp1 is m2.conv1d and m2.cp.cp_group is m.cp.cp_group
    torch.testing.assert_close(m2.cp.get_A_log(), m2.A_log[4:])
    m2.A_log.data.fill_(3.0)
    assert m2.cp.get_A_log().eq(3.0).all() and m.cp.get_A_log().eq(0.0).all()


def test_apply_context_parallel_wires_hooks_by_class_and_checks_heads():
    from models.args import ModelArgs
    from models.hybrid.attention import Attention
    from models.mamba2.mixer import Mamba2Mixer
    from parallelisms.context_parallel import AttentionContextParallel, apply_context_parallel

    class _LooksLikeAMixer(nn.Module):
        """Has every attribute the hooks read, but is not one of the model's layer classes: no hook."""

        def __init__(self, like: nn.Module):
            super().__init__()
            self.conv1d, self.A_log, self.n_heads, self.n_kv_heads, self.cp = like.conv1d, like.A_log, 8, 2, None

    def layers(n_heads, n_kv_heads):
        args = ModelArgs(
            d_model=32,
            n_layers=3,
            d_state=4,
            headdim=4,
            ngroups=2,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            attn_head_dim=4,
        )
        with torch.device("meta"):
            mixer = Mamba2Mixer(args, 0, 3)
            return nn.ModuleDict(
                {"0": mixer, "1": Attention(args, 1, 3), "2": nn.Linear(2, 2), "3": _LooksLikeAMixer(mixer)}
            )

    model = layers(8, 2)
    assert apply_context_parallel(model, None) == 0 and model["0"].cp is None  # cp = 1: hooks stay off
    assert apply_context_parallel(model, FakeGroup(4, 1), load_balance=True) == 2
    assert isinstance(model["0"].cp, MambaContextParallel) and model["0"].cp.load_balance
    assert model["0"].cp.ngroups_local == 1 and model["0"].cp.nheads_local == 4
    assert isinstance(model["1"].cp, AttentionContextParallel) and model["1"].cp.degree == 4
    assert model["3"].cp is None  # found by class, not by its attributes
    bad = layers(6, 3)
    with pytest.raises(ValueError, match="n_heads=6, n_kv_heads=3, cp=2"):
        apply_context_parallel(bad, FakeGroup(2, 0))
    assert bad["0"].cp is None  # checked before anything is set


# ----------------------------------------------------------------------------------------------------
# Multi-process: all-to-alls
# ----------------------------------------------------------------------------------------------------


def _all_to_all_body(rank, cp):
    group = dist.group.WORLD
    torch.manual_seed(0)
    b, s_local, d = 3, 5, 4
    s, D = cp * s_local, cp * d
    X = torch.randn(b, s, D, dtype=torch.float64)
    G1 = torch.randn(b, s, d, dtype=torch.float64)  # grad for the channel-sharded output
    G2 = torch.randn(b, s_local, D, dtype=torch.float64)  # grad for the sequence-sharded output
    seq_blk, ch_blk = slice(rank * s_local, (rank + 1) * s_local), slice(rank * d, (rank + 1) * d)

    # seq -> heads: values = a direct slicing of the gathered full tensor; backward = the identity's
    x_local = X[:, seq_blk].clone().requires_grad_()
    out = all_to_all_seq_to_heads(x_local, group)
    torch.testing.assert_close(out, X[:, :, ch_blk], rtol=0, atol=0)
    (out * G1[:, :]).sum().backward()
    # full-tensor view: loss = sum(X[:, :, ch_blk_j] * G1_j) over ranks j, so dL/dX[:, seq_blk] = gathered G1s
    G1_all = [torch.empty_like(G1) for _ in range(cp)]
    dist.all_gather(G1_all, G1)
    torch.testing.assert_close(x_local.grad, torch.cat(G1_all, dim=-1)[:, seq_blk], rtol=0, atol=0)

    # heads -> seq on the channel slice of a full tensor, and the two are inverse (non-contiguous input)
    y = X.transpose(0, 1).contiguous().transpose(0, 1)[:, :, ch_blk].requires_grad_()
    back = all_to_all_heads_to_seq(y, group)
    torch.testing.assert_close(back, X[:, seq_blk], rtol=0, atol=0)
    (back * G2).sum().backward()
    G2_all = [torch.empty_like(G2) for _ in range(cp)]
    dist.all_gather(G2_all, G2)
    torch.testing.assert_close(y.grad, torch.cat(G2_all, dim=1)[:, :, ch_blk], rtol=0, atol=0)
    torch.testing.assert_close(all_to_all_heads_to_seq(out, group), x_local, rtol=0, atol=0)

    # heads -> seq as column blocks [cp, b * s/cp, d]: the same values, block j = rank j's channels; the same gradient
    y_blk = y.detach().clone().requires_grad_()
    blocks = all_to_all_heads_to_seq_blocks(y_blk, group)
    assert blocks.shape == (cp, b * s_local, d)
    torch.testing.assert_close(blocks.permute(1, 0, 2).reshape(b, s_local, D), X[:, seq_blk], rtol=0, atol=0)
    (blocks * G2.reshape(b * s_local, cp, d).permute(1, 0, 2)).sum().backward()
    torch.testing.assert_close(y_blk.grad, y.grad, rtol=0, atol=0)

    # round trip's backward is the identity
    z = X[:, seq_blk].clone().requires_grad_()
    all_to_all_heads_to_seq(all_to_all_seq_to_heads(z, group), group).backward(G2)
    torch.testing.assert_close(z.grad, G2, rtol=0, atol=0)

    # data path: shard (balanced) -> all-to-all -> undo = natural-order full sequence, our channels
    S = torch.randn(b, 2 * cp * 3, D, dtype=torch.float64)
    for lb in (False, True):
        arrived = all_to_all_seq_to_heads(shard_sequence(S, rank, cp, lb), group)
        if lb:
            arrived = undo_load_balance(arrived, cp)
        torch.testing.assert_close(arrived, S[:, :, ch_blk], rtol=0, atol=0)
    return True


# ----------------------------------------------------------------------------------------------------
# Multi-process: the mixer core under cp vs cp = 1 on the full sequence
# ----------------------------------------------------------------------------------------------------


def _mixer_core(cpm, xBCdt, seq_idx, chunk_size=8):
    causal_conv1d, ssd_chunk_scan = _ops()
    xBCdt = cpm.pre_conv_ssm(xBCdt)
    b, s, _ = xBCdt.shape
    xBC, dt = torch.split(xBCdt, [cpm.conv1d_channels, cpm.nheads_local], dim=-1)
    xBC = causal_conv1d(
        xBC.transpose(1, 2), cpm.get_conv1d_weight().squeeze(1), cpm.get_conv1d_bias(), seq_idx, activation="silu"
    ).transpose(1, 2)
    GN = cpm.ngroups_local * cpm.d_state
    x, B, C = torch.split(xBC, [cpm.d_inner_local, GN, GN], dim=-1)
    H, P, G = cpm.nheads_local, cpm.headdim, cpm.ngroups_local
    D = cpm.get_D()
    D = D.reshape(H, P) if cpm.D_has_hdim else D
    y = ssd_chunk_scan(
        x.reshape(b, s, H, P),
        dt,
        -torch.exp(cpm.get_A_log()),
        B.reshape(b, s, G, -1),
        C.reshape(b, s, G, -1),
        chunk_size,
        D=D,
        dt_bias=cpm.get_dt_bias(),
        dt_softplus=True,
        seq_idx=seq_idx,
    )
    return cpm.post_conv_ssm(y.reshape(b, s, -1))


def _seq_idx(b, s, seed):
    g = torch.Generator().manual_seed(seed)
    starts = (torch.rand(b, s, generator=g) < 0.12).int()
    starts[:, 0] = 0
    return starts.cumsum(1).int()  # several documents per row, crossing the shard boundaries


def _mixer_checks(rank, cp, nheads, configs):
    group = dist.group.WORLD
    b, s, P, N = 2, 48, 2, 3
    for ngroups, load_balance, D_has_hdim in configs:
        torch.manual_seed(1234)
        ref = _Mixer(nheads, P, ngroups, N, D_has_hdim=D_has_hdim).double()
        mixer = copy.deepcopy(ref)
        D_in = nheads * P + 2 * ngroups * N + nheads
        X = torch.randn(b, s, D_in, dtype=torch.float64)
        G_out = torch.randn(b, s, nheads * P, dtype=torch.float64)
        seq_idx = _seq_idx(b, s, seed=7)
        tag = f"cp={cp} nheads={nheads} ngroups={ngroups} load_balance={load_balance} D_has_hdim={D_has_hdim}"

        X_ref = X.clone().requires_grad_()
        out_ref = _mixer_core(MambaContextParallel.from_mixer(ref, None), X_ref, seq_idx)
        (out_ref * G_out).sum().backward()

        cpm = MambaContextParallel.from_mixer(mixer, group, load_balance=load_balance)
        x_local = shard_sequence(X, rank, cp, load_balance).clone().requires_grad_()
        out = _mixer_core(cpm, x_local, seq_idx)
        shard = lambda t: shard_sequence(t, rank, cp, load_balance)  # noqa: E731
        torch.testing.assert_close(out, shard(out_ref), msg=lambda m: f"{tag}: output\n{m}")
        (out * shard(G_out)).sum().backward()
        torch.testing.assert_close(x_local.grad, shard(X_ref.grad), msg=lambda m: f"{tag}: input grad\n{m}")
        for (name, p), (_, p_ref) in zip(mixer.named_parameters(), ref.named_parameters()):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=group)  # what FSDP's reduce-scatter over the cp ranks does
            torch.testing.assert_close(grad, p_ref.grad, msg=lambda m: f"{tag}: grad of {name}\n{m}")
    return True


# ----------------------------------------------------------------------------------------------------
# Multi-process: the repo's Mamba2Mixer and Attention wired by apply_context_parallel
# ----------------------------------------------------------------------------------------------------


def _layers_checks(rank, cp, load_balance):
    from models.args import ModelArgs
    from models.hybrid.attention import Attention
    from models.mamba2.mixer import Mamba2Mixer
    from parallelisms.context_parallel import apply_context_parallel

    group = dist.group.WORLD
    args = ModelArgs(
        d_model=16, n_layers=2, d_state=4, headdim=4, ngroups=1, chunk_size=8, D_has_hdim=True, n_heads=4, n_kv_heads=1
    )
    torch.manual_seed(3)
    ref = nn.ModuleDict({"0": Mamba2Mixer(args, 0, 2), "1": Attention(args, 1, 2)}).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    model = copy.deepcopy(ref)
    assert apply_context_parallel(model, group, load_balance) == 2
    b, s = 2, 32
    X = torch.randn(b, s, 16, dtype=torch.float64)
    seq_idx = _seq_idx(b, s, seed=11)
    X_ref = X.clone().requires_grad_()
    y_ref = ref["1"](ref["0"](X_ref, seq_idx), seq_idx)
    (y_ref**2).sum().backward()
    shard = lambda t: shard_sequence(t, rank, cp, load_balance)  # noqa: E731
    x = shard(X).clone().requires_grad_()
    y = model["1"](model["0"](x, seq_idx), seq_idx)
    torch.testing.assert_close(y, shard(y_ref))
    (y**2).sum().backward()
    torch.testing.assert_close(x.grad, shard(X_ref.grad))
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
        dist.all_reduce(p.grad, group=group)
        torch.testing.assert_close(p.grad, p_ref.grad, msg=lambda m: f"grad of {name}\n{m}")
    _overlapped_all_to_all_is_waited_for(model["0"], rank, cp)
    return True


def _overlapped_all_to_all_is_waited_for(mixer, rank, cp):
    """One row per rank (long-context runs): the overlapped in_proj + all-to-all must hand the kernels a plain,
    waited-for tensor (a view of the async result fails in a Triton kernel: its data pointer is not there yet),
    equal to the synchronous path's, with gradients."""
    cpm = MambaContextParallel.from_mixer(mixer, dist.group.WORLD, load_balance=False)  # no reordering copy after it
    u = torch.randn(1, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    z, xBCdt = cpm.in_proj_pre_conv_ssm(u, mixer.in_proj)
    assert type(xBCdt) is torch.Tensor and xBCdt.data_ptr() != 0, type(xBCdt)
    zxbcdt = mixer.in_proj(u)
    torch.testing.assert_close(z, zxbcdt[..., : cpm.d_inner])
    torch.testing.assert_close(xBCdt, cpm.pre_conv_ssm(zxbcdt[..., cpm.d_inner :]))
    (xBCdt.sum() + z.sum()).backward()
    assert u.grad is not None and torch.isfinite(u.grad).all()


# ----------------------------------------------------------------------------------------------------
# One process group per cp size runs all the checks above (process start-up dominates the cost)
# ----------------------------------------------------------------------------------------------------


def _cp_body(rank, cp, nheads, configs, layers_load_balance):
    _all_to_all_body(rank, cp)
    _mixer_checks(rank, cp, nheads, configs)
    if layers_load_balance is not None:
        _layers_checks(rank, cp, layers_load_balance)
    return True


def _repo_layers_importable() -> bool:
    try:
        import models.hybrid.attention  # noqa: F401
        import models.mamba2.mixer  # noqa: F401
    except ImportError:
        return False
    return True


_ALL_CONFIGS = [(g, lb, dh) for g in (1, 2, 4) for lb in (False, True) for dh in (False, True)]
# cp -> (nheads, [(ngroups, load_balance, D_has_hdim)], load_balance of the repo-layers check or None)
_CASES = {
    2: (8, _ALL_CONFIGS, True),  # G=1: replication x2; G=2: one group per rank; G=4: two
    4: (8, [c for c in _ALL_CONFIGS if c[0] in (1, 2)] + [(4, True, False)], False),  # replication x4, x2
    3: (6, [(1, True, True), (3, False, False)], None),
}


@pytest.mark.parametrize("cp", list(_CASES))
def test_context_parallel_matches_cp1(cp):
    """All-to-all values / inverse / backward; the mixer core's outputs and grads vs cp=1 (every config);
    the repo's Mamba2Mixer + Attention wired by apply_context_parallel vs cp=1."""
    nheads, configs, layers_lb = _CASES[cp]
    if layers_lb is not None and not _repo_layers_importable():
        layers_lb = None
    assert all(run_distributed(_cp_body, cp, nheads, configs, layers_lb))
