"""Hybrid layers (attention, SwiGLU MLP, MoE) against naive float64 references, on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.args import ModelArgs
from models.hybrid import MLP, Attention, MoE
from models.hybrid.attention import apply_rotary, cu_seqlens_from_seq_idx, rotary_cos_sin
from models.hybrid.moe import GroupedExperts
from tests.dist_utils import run_distributed

D = 32


def _args(**kw) -> ModelArgs:
    base = dict(
        d_model=D,
        n_heads=4,
        n_kv_heads=2,
        rope_theta=10000.0,
        mlp_hidden_dim=48,
        moe_num_experts=4,
        moe_top_k=2,
        moe_hidden_dim=24,
        moe_shared_experts=0,
    )
    base.update(kw)
    return ModelArgs(**base)


def _seq_idx(lengths_per_row: list[list[int]]) -> torch.Tensor:
    rows = [torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(ls)]) for ls in lengths_per_row]
    return torch.stack(rows)


def _init(module: torch.nn.Module, seed: int = 0) -> None:
    """Drive the init_param protocol the way the model's init does (names relative to the mixer)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        module.init_param(name, p.data, g)


# ---------------------------------------------------------------------------------------------- attention


def _naive_attention(m: Attention, x_BSD: torch.Tensor, seq_idx_BS: torch.Tensor) -> torch.Tensor:
    """Per row, per document: causal softmax attention in float64, rotary with the row's global positions."""
    b, s, _ = x_BSD.shape
    h, kv, hd = m.n_heads, m.n_kv_heads, m.head_dim
    q = (x_BSD @ m.wq.weight.T).view(b, s, h, hd)
    k = (x_BSD @ m.wk.weight.T).view(b, s, kv, hd).repeat_interleave(h // kv, dim=2)
    v = (x_BSD @ m.wv.weight.T).view(b, s, kv, hd).repeat_interleave(h // kv, dim=2)
    if m.rope_theta:
        q, k = _naive_rope(q, m.rope_theta), _naive_rope(k, m.rope_theta)
    o = torch.zeros_like(q)
    for r in range(b):
        for doc in seq_idx_BS[r].unique():
            pos = (seq_idx_BS[r] == doc).nonzero().flatten()
            qd, kd, vd = q[r, pos], k[r, pos], v[r, pos]  # [n, h, hd]
            scores = torch.einsum("thd,uhd->htu", qd, kd) / math.sqrt(hd)
            n = len(pos)
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            o[r, pos] = torch.einsum("htu,uhd->thd", scores.softmax(-1), vd)
    return o.reshape(b, s, h * hd) @ m.wo.weight.T


def _naive_rope(x_BSHD: torch.Tensor, theta: float) -> torch.Tensor:
    """Complex rotation of (x[j], x[j + d/2]) by exp(i * position * theta^(-2j/d))."""
    b, s, h, d = x_BSHD.shape
    half = d // 2
    z = torch.complex(x_BSHD[..., :half].double(), x_BSHD[..., half:].double())
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(s, half, dtype=torch.float64), torch.arange(s, dtype=torch.float64)[:, None] * freq)
    z = z * rot[None, :, None, :]
    return torch.cat((z.real, z.imag), dim=-1).to(x_BSHD.dtype)


def _attn(**kw) -> Attention:
    m = Attention(_args(**kw), 0, 4).double()
    _init(m)
    return m


def test_attention_equals_naive_per_document_float64():
    torch.manual_seed(0)
    m = _attn()
    seq_idx = _seq_idx([[5, 9, 2], [16], [1, 1, 14]])
    x = torch.randn(3, 16, D, dtype=torch.float64)
    torch.testing.assert_close(m(x, seq_idx), _naive_attention(m, x, seq_idx), rtol=1e-10, atol=1e-12)
    # seq_idx=None is one document per row.
    torch.testing.assert_close(m(x), _naive_attention(m, x, torch.zeros(3, 16, dtype=torch.int32)))


def test_attention_never_crosses_documents():
    torch.manual_seed(1)
    m = _attn()
    seq_idx = _seq_idx([[6, 5, 5], [3, 13]])
    x = torch.randn(2, 16, D, dtype=torch.float64)
    x2 = x.clone()
    x2[0, :6] = torch.randn(6, D, dtype=torch.float64)  # change row 0's first document
    x2[1, :3] += 1.0
    y, y2 = m(x, seq_idx), m(x2, seq_idx)
    torch.testing.assert_close(y2[0, 6:], y[0, 6:], rtol=0, atol=1e-12)
    torch.testing.assert_close(y2[1, 3:], y[1, 3:], rtol=0, atol=1e-12)
    assert (y2[0, :6] - y[0, :6]).abs().max() > 1e-3  # the changed document itself did change
    # Without seq_idx the same change leaks into later positions (the mask is what isolates documents).
    assert (m(x2)[0, 6:] - m(x)[0, 6:]).abs().max() > 1e-3


def test_gqa_equals_mha_with_repeated_kv_weights():
    torch.manual_seed(2)
    gqa = _attn(n_kv_heads=2)
    mha = _attn(n_kv_heads=4)
    g, hd = 2, gqa.head_dim
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):  # query head i uses kv head i // g
            w = getattr(gqa, name).weight.view(2, hd, D).repeat_interleave(g, dim=0).reshape(4 * hd, D)
            getattr(mha, name).weight.copy_(w)
    seq_idx = _seq_idx([[7, 9], [16]])
    x = torch.randn(2, 16, D, dtype=torch.float64)
    torch.testing.assert_close(gqa(x, seq_idx), mha(x, seq_idx), rtol=1e-12, atol=1e-12)


def test_rotary_matches_naive_rotation_and_is_relative():
    torch.manual_seed(3)
    x = torch.randn(2, 10, 3, 8, dtype=torch.float64)
    cos, sin = rotary_cos_sin(10, 8, 500.0, x.device, torch.float64)
    torch.testing.assert_close(apply_rotary(x, cos, sin), _naive_rope(x, 500.0), rtol=1e-6, atol=1e-6)
    # <R(p) q, R(u) k> depends only on p - u: shifting both positions by 3 keeps the score.
    q = torch.randn(8, dtype=torch.float64).expand(1, 10, 1, 8)
    k = torch.randn(8, dtype=torch.float64).expand(1, 10, 1, 8)
    rq, rk = apply_rotary(q, cos, sin)[0, :, 0], apply_rotary(k, cos, sin)[0, :, 0]
    torch.testing.assert_close(rq[5] @ rk[2], rq[8] @ rk[5], rtol=1e-5, atol=1e-6)
    # theta = 0 (no positional encoding) gives a different layer output than rotary.
    m_rope, m_none = _attn(), _attn(rope_theta=0.0)
    xs = torch.randn(1, 12, D, dtype=torch.float64)
    assert (m_rope(xs) - m_none(xs)).abs().max() > 1e-4
    torch.testing.assert_close(m_none(xs), _naive_attention(m_none, xs, torch.zeros(1, 12, dtype=torch.int32)))


def test_cu_seqlens_from_seq_idx():
    seq_idx = _seq_idx([[2, 3, 1], [6], [1, 5]])
    assert cu_seqlens_from_seq_idx(seq_idx).tolist() == [0, 2, 5, 6, 12, 13, 18]


def test_attention_bad_backend_and_head_dims():
    m = _attn()
    m.backend = "nope"
    with pytest.raises(ValueError, match="backend"):
        m(torch.randn(1, 4, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="n_kv_heads"):
        Attention(_args(n_kv_heads=3), 0, 4)


class _AllGather(torch.autograd.Function):
    """[...] -> [cp, ...] stacked over the group; backward: sum the gradients over ranks, keep our slice."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group, ctx.rank = group, dist.get_rank(group)
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


class _GatherCP:
    """Test-only CP hook built from all_gather (gloo has no all_to_all), contiguous shards in rank order."""

    def __init__(self, group):
        import torch.distributed as dist

        self.group, self.degree, self.rank = group, dist.get_world_size(group), dist.get_rank(group)

    def _gather(self, x):
        return _AllGather.apply(x, self.group).unbind(0)

    def seq_to_heads(self, x_BSHD):  # [b, s/cp, h, d] -> [b, s, h/cp, d]
        full = torch.cat(self._gather(x_BSHD), dim=1)
        return full.chunk(self.degree, dim=2)[self.rank]

    def heads_to_seq(self, x_BSHD):  # [b, s, h/cp, d] -> [b, s/cp, h, d]
        full = torch.cat(self._gather(x_BSHD), dim=2)
        return full.chunk(self.degree, dim=1)[self.rank]


def _cp_case(group, n_kv_heads):
    import torch.distributed as dist

    torch.manual_seed(4)
    m = _attn(n_heads=4, n_kv_heads=n_kv_heads)
    seq_idx = _seq_idx([[5, 11, 8], [24]])
    x = torch.randn(2, 24, D, dtype=torch.float64, requires_grad=True)
    y_ref = m(x, seq_idx)
    (y_ref**2).sum().backward()
    gx_ref, gq_ref = x.grad.clone(), m.wq.weight.grad.clone()
    m.zero_grad()

    m.cp = _GatherCP(group)
    rank, s_loc = m.cp.rank, 24 // m.cp.degree
    mine = slice(rank * s_loc, (rank + 1) * s_loc)
    x_loc = x.detach()[:, mine].clone().requires_grad_()
    y_loc = m(x_loc, seq_idx)  # the full-length seq_idx
    (y_loc**2).sum().backward()
    gq = m.wq.weight.grad.clone()
    dist.all_reduce(gq, group=group)
    torch.testing.assert_close(y_loc, y_ref[:, mine], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x_loc.grad, gx_ref[:, mine], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gq, gq_ref, rtol=1e-10, atol=1e-12)


def _cp_body(rank, world_size):
    import torch.distributed as dist

    _cp_case(dist.group.WORLD, n_kv_heads=2)  # cp=4 > n_kv=2: kv heads repeated
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _cp_case(pairs[rank // 2], n_kv_heads=2)  # cp=2 divides n_kv=2: kv heads split
    dist.barrier()  # rank 0 hosts the store: nobody leaves while the other pair still uses it
    return True


def test_attention_context_parallel_hook_matches_single_process():
    """Forward, input gradients and (all-reduced) weight gradients under the CP hook equal one process."""
    assert all(run_distributed(_cp_body, 4))


# ---------------------------------------------------------------------------------------------- MLP


def test_mlp_equals_swiglu_formula_and_hidden_default():
    torch.manual_seed(5)
    m = MLP(_args(), 0, 4).double()
    _init(m)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    w1, w2, w3 = m.w1.weight, m.w2.weight, m.w3.weight
    ref = ((x @ w1.T) * torch.sigmoid(x @ w1.T) * (x @ w3.T)) @ w2.T
    torch.testing.assert_close(m(x), ref, rtol=1e-12, atol=1e-12)
    assert MLP(_args(mlp_hidden_dim=0, d_model=96), 0, 4).w1.out_features == 256  # int(8*96/3)=256, /64 ok
    assert MLP(_args(mlp_hidden_dim=0, d_model=100), 0, 4).w1.out_features == 320  # 266 -> 320


def test_init_param_std_and_determinism():
    m = MLP(_args(d_model=256, mlp_hidden_dim=512), 0, 8)
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.empty(512, 256), torch.empty(256, 512)
    m.init_param("w1.weight", w1, g)
    m.init_param("w2.weight", w2, g)
    assert abs(w1.std().item() - 0.02) < 1e-3 and abs(w2.std().item() - 0.02 / 4) < 3e-4
    w1b = torch.empty(512, 256)
    m.init_param("w1.weight", w1b, torch.Generator().manual_seed(0))
    assert torch.equal(w1, w1b)
    with pytest.raises(KeyError):
        m.init_param("w9.weight", w1, g)
    moe = MoE(_args(moe_shared_experts=1), 0, 8)
    for name, p in moe.named_parameters():  # every parameter name is accepted through the mixer
        moe.init_param(name, torch.empty_like(p), g)


# ---------------------------------------------------------------------------------------------- MoE


def _moe(seed=0, **kw) -> MoE:
    m = MoE(_args(**kw), 0, 4).double()
    _init(m, seed)
    return m


def _naive_moe(m: MoE, x_BSD: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dense per-token reference: sum_k w_k * expert_k(x) (+ shared), selection by scores + bias."""
    x = x_BSD.reshape(-1, x_BSD.shape[-1])
    logits = x @ m.router.weight.T
    scores = logits.softmax(-1) if m.score_func == "softmax" else logits.sigmoid()
    sel = scores + (bias if bias is not None else 0)
    out = torch.zeros_like(x)
    ex = m.experts
    for t in range(x.shape[0]):
        idx = sel[t].topk(m.top_k).indices
        w = scores[t, idx]
        if m.route_norm:
            w = w / w.sum()
        for wk, e in zip(w, idx):
            out[t] += wk * ((F.silu(x[t] @ ex.w1[e]) * (x[t] @ ex.w3[e])) @ ex.w2[e])
    if m.shared_experts is not None:
        out = out + m.shared_experts(x)
    return out.view_as(x_BSD)


@pytest.mark.parametrize(
    "score_func,route_norm,shared",
    [
        ("softmax", False, 0),
        ("softmax", True, 1),
        ("sigmoid", False, 2),
        ("sigmoid", True, 0),
    ],
)
def test_moe_equals_dense_naive_float64(score_func, route_norm, shared):
    torch.manual_seed(6)
    m = _moe(moe_score_func=score_func, moe_route_norm=route_norm, moe_shared_experts=shared, moe_top_k=2)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    torch.testing.assert_close(m(x), _naive_moe(m, x), rtol=1e-10, atol=1e-12)


def test_moe_top1_and_topall():
    torch.manual_seed(7)
    for k in (1, 4):
        m = _moe(moe_top_k=k, moe_num_experts=4)
        x = torch.randn(1, 11, D, dtype=torch.float64)
        torch.testing.assert_close(m(x), _naive_moe(m, x), rtol=1e-10, atol=1e-12)


def test_expert_bias_changes_selection_not_combine_weights():
    torch.manual_seed(8)
    m = _moe(moe_score_func="sigmoid")
    x = torch.randn(2, 8, D, dtype=torch.float64)
    y0 = m(x)
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 is selected for every token
    m.expert_bias.copy_(bias)
    _, _, idx, w, _ = m.route(x.reshape(-1, D))
    assert (idx == 3).any(-1).all()
    logits = x.reshape(-1, D) @ m.router.weight.T
    torch.testing.assert_close(w, logits.sigmoid().gather(1, idx))  # combine weights: raw scores
    y1 = m(x)
    torch.testing.assert_close(y1, _naive_moe(m, x, bias.double()), rtol=1e-10, atol=1e-12)
    assert (y1 - y0).abs().max() > 1e-4


def test_update_expert_bias_moves_load_toward_uniform():
    torch.manual_seed(9)
    m = _moe(moe_num_experts=8, moe_top_k=2, moe_load_balance_coeff=0.002)
    with torch.no_grad():  # spread-out scores, expert 0 popular
        m.router.weight.normal_(0, 0.3)
        m.router.weight[0] += 0.3
    m.train()
    x = torch.randn(4, 64, D, dtype=torch.float64)

    def load_after_step():
        with torch.no_grad():
            m(x)
        load = m.tokens_per_expert.clone().double()
        assert load.sum() == x.shape[0] * x.shape[1] * 2
        m.update_expert_bias()
        assert m.tokens_per_expert.sum() == 0
        return load

    first = load_after_step()
    assert m.expert_bias[first.argmax()] < 0 and abs(m.expert_bias.sum()) < 1e-6
    stds = [load_after_step().std() for _ in range(40)]
    assert sum(stds[-5:]) / 5 < 0.3 * first.std(), (first, stds)
    m.eval()  # no counting outside training
    m(x)
    assert m.tokens_per_expert.sum() == 0


def test_tokens_per_expert_not_double_counted_under_activation_checkpoint():
    from torch.utils.checkpoint import checkpoint

    m = _moe()
    m.train()
    x = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)
    checkpoint(m, x, use_reentrant=False).sum().backward()
    assert m.tokens_per_expert.sum().item() == 2 * 5 * 2


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_and_z_loss_gradients_equal_explicit_objective(score_func):
    torch.manual_seed(10)
    ca, cz, scale = 0.3, 0.05, 0.5
    m = _moe(moe_score_func=score_func, moe_aux_loss_coeff=ca, moe_z_loss_coeff=cz, moe_shared_experts=1)
    m.train()
    m.aux_loss_scale = scale
    x = torch.randn(2, 12, D, dtype=torch.float64)
    r = torch.randn(2, 12, D, dtype=torch.float64)
    (scale * (m(x) * r).sum()).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()

    # Explicit objective with the attached losses switched off.
    m.aux_loss_coeff = m.z_loss_coeff = 0.0
    y = m(x)
    xt = x.reshape(-1, D)
    logits = xt @ m.router.weight.T
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    probs = scores / scores.sum(-1, keepdim=True)
    idx = scores.topk(2, dim=-1).indices
    f = torch.bincount(idx.flatten(), minlength=4).double() / (xt.shape[0] * 2)
    balance = 4 * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    (scale * ((y * r).sum() + ca * balance + cz * z)).backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-12, msg=n)
    assert grads["router.weight"].abs().max() > 0


def test_grouped_mm_path_equals_loop_on_cpu_when_available():
    """The padded grouped-GEMM path (used on CUDA) checked on the CPU kernel of torch>=2.9, bf16."""
    torch.manual_seed(11)
    ex = GroupedExperts(32, 48, 5, 4)
    counts = torch.tensor([7, 0, 19, 1, 13])
    x = torch.randn(int(counts.sum()), 32, dtype=torch.bfloat16)
    try:
        y = ex._forward_grouped_mm(x, counts)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm has no usable CPU kernel here: {e}")
    ref = ex._forward_loop(x.double(), counts)
    torch.testing.assert_close(y.double(), ref, rtol=3e-2, atol=3e-3)


@pytest.mark.parametrize("apply", [0.0, 1.0])
def test_expert_bias_update_masked_on_the_device(apply):
    """A step the optimizer skipped on the device (apply 0.0): the counts are dropped, the bias stays; 1.0: the
    update of the unmasked call."""
    torch.manual_seed(9)
    m = _moe(moe_num_experts=8, moe_top_k=2, moe_load_balance_coeff=0.002)
    m.train()
    x = torch.randn(2, 32, D, dtype=torch.float64)
    with torch.no_grad():
        m(x)
    counts, bias = m.tokens_per_expert.clone(), m.expert_bias.clone()
    m.update_expert_bias(apply=torch.tensor(apply))
    assert m.tokens_per_expert.sum() == 0
    if apply == 0.0:
        assert torch.equal(m.expert_bias, bias)
    else:
        masked = m.expert_bias.clone()
        m.expert_bias.copy_(bias)
        m.tokens_per_expert.copy_(counts)
        m.update_expert_bias()
        assert torch.equal(m.expert_bias, masked) and not torch.equal(masked, bias)


def test_moe_forward_reads_nothing_on_the_host_and_sorts_like_indexing():
    """No aten op of a MoE forward + backward (single process, loop or grouped-GEMM experts) reads a device value
    on the host on CUDA (torch.bincount reads its input's min / max: two stream syncs per layer before), and the
    counts equal bincount's; the dispatch / combine gathers equal indexing, gradients included (K = 3: three
    copies of each token summed in the backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from models.hybrid.moe import count_experts, gather_rows

    class Ops(TorchDispatchMode):
        names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(12)
    idx = torch.randint(0, 5, (13, 3))
    assert torch.equal(count_experts(idx, 5), torch.bincount(idx.flatten(), minlength=5))
    for grouped in (False, True):
        m = _moe(moe_top_k=3, moe_num_experts=5, moe_shared_experts=1)
        dtype = torch.float64
        if grouped:  # the CUDA path through torch's CPU fallback, in bf16 as on CUDA
            m, dtype = m.to(torch.bfloat16), torch.bfloat16
            m.experts._use_grouped_mm = lambda x_TD: True
        x = torch.randn(2, 7, D, dtype=dtype, requires_grad=True)
        ops = Ops()
        ops.names = []
        with ops:
            m(x).sum().backward()
        syncing = {"bincount", "_local_scalar_dense", "nonzero", "masked_select", "_unique2"}
        assert not syncing & set(ops.names), sorted(syncing & set(ops.names))
        assert "index_put_" not in ops.names and "index_put" not in ops.names  # no scatter-add in the backward

    perm = idx.flatten().argsort(stable=True)
    inv_perm = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel()))
    x = torch.randn(13, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(39, 4, dtype=torch.float64)
    y, y_ref = gather_rows(x, perm // 3, inv_perm, 3), x[perm // 3]
    assert torch.equal(y, y_ref)
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(y_ref, x, g)[0])
    z, z_ref = gather_rows(y, inv_perm, perm, 1), y[inv_perm]
    assert torch.equal(z, z_ref)
    assert torch.equal(torch.autograd.grad(z, y, g)[0], torch.autograd.grad(z_ref, y, g)[0])


def test_moe_queues_the_shared_expert_between_the_counts_prefetch_and_the_experts():
    """The order that lets the device run work while the host waits for the counts (expert parallel's one host
    read per layer): prefetch_counts right after routing, then the shared expert, then the experts, which get
    the prefetch's handle; the output is unchanged (float64 against the naive dense reference)."""
    torch.manual_seed(13)
    m = _moe(moe_shared_experts=1)
    calls, handle = [], object()
    experts_forward = m.experts.forward
    m.experts.prefetch_counts = lambda counts_E: calls.append("prefetch") or handle
    m.shared_experts.register_forward_hook(lambda *_: calls.append("shared"))

    def forward(x_TD, counts_E, prefetched=None):
        calls.append(("experts", prefetched is handle))
        return experts_forward(x_TD, counts_E)

    m.experts.forward = forward
    x = torch.randn(2, 9, D, dtype=torch.float64)
    y = m(x)
    assert calls == ["prefetch", "shared", ("experts", True)]
    torch.testing.assert_close(y, _naive_moe(m, x), rtol=1e-10, atol=1e-12)
