"""Grouped-query attention layer ('*' in a hybrid layer pattern), document-masked, with rotary positions.

A "mixer": Attention(args, layer_id, n_layers), forward(x_BSD, seq_idx_BS=None) -> y_BSD. Recurrent decoding
(models.inference): `prefill` is the forward that also writes the rotated keys and values into a KV cache;
`step` attends one new token to the cached columns of its row (SDPA, the left padding masked out).

Masking: causal AND block-diagonal by seq_idx (int32 [b, s], non-decreasing document ids per row): token t
attends to token u iff u <= t and seq_idx[t] == seq_idx[u]. Rotary positions are 0..s-1 of the whole row
(they do not restart per document: relative positions inside a document are what matters, and they are the same).

Attention cores (``self.backend``):
    "auto"   CPU -> "sdpa"; CUDA -> "flash" when flash-attn imports and q is fp16/bf16, else "flex";
             without seq_idx: SDPA with is_causal (no mask to build).
    "sdpa"   torch SDPA with an explicit boolean mask [b, 1, s, s] built from seq_idx. This is the CPU path:
             exact, no compiler, the same on torch 2.11-2.13. (FlexAttention also runs on CPU, but eager it
             materialises the scores anyway and compiled it needs a C++ toolchain; nothing to gain.)
    "flex"   FlexAttention with a document-causal BlockMask (compiled flex_attention; the block mask is
             shared by all layers of one forward: it is cached on the seq_idx tensor object).
    "flash"  flash_attn_varlen_func on the flattened rows, cu_seqlens from seq_idx (documents never cross
             rows: a row start is always a sequence start).

Context parallel hook (``self.cp``, None = off and costs nothing): an object with
    degree: int                                   the CP size
    seq_to_heads(x_BSHD) -> x_BS'H'D              [b, s/cp, h, d] -> [b, s, h/cp, d]  (all-to-all)
    heads_to_seq(x_BSHD) -> x_BSHD                [b, s, h/cp, d] -> [b, s/cp, h, d]  (inverse)
seq_to_heads must return the whole sequence in natural token order (undo any load-balancing permutation) and
heads_to_seq redo it: rotary (applied AFTER seq_to_heads, positions 0..s-1) and the document mask (the
full-length seq_idx [b, s], which every CP rank receives) then see global positions. Head slicing rule:
rank r gets query heads [r*h/cp, (r+1)*h/cp). n_heads must divide by cp. Key/value heads: if cp divides
n_kv_heads, rank r gets kv heads [r*kv/cp, (r+1)*kv/cp), exactly the ones its query heads use; if
n_kv_heads divides cp (cp > n_kv_heads), each kv head is repeated cp/n_kv_heads times (adjacent copies)
before the all-to-all, so every rank gets one kv head: the one its query heads use. Other ratios raise.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from models.args import ModelArgs
from models.inference import InferenceCache, KVCache

BACKENDS = ("auto", "sdpa", "flex", "flash")


def head_dims(args: ModelArgs) -> tuple[int, int, int]:
    """(n_heads, n_kv_heads, head_dim) for the attention layers of `args`, checked."""
    n_heads = args.n_heads
    n_kv = args.n_kv_heads or n_heads
    if n_heads % n_kv:
        raise ValueError(f"model.n_kv_heads={n_kv} must divide model.n_heads={n_heads}")
    if args.attn_head_dim:
        head_dim = args.attn_head_dim
    elif args.d_model % n_heads:
        raise ValueError(f"model.n_heads={n_heads} must divide d_model={args.d_model} (or set attn_head_dim)")
    else:
        head_dim = args.d_model // n_heads
    if args.rope_theta and head_dim % 2:
        raise ValueError(f"rotary needs an even head dim, got {head_dim}: change attn_head_dim or set rope_theta=0")
    return n_heads, n_kv, head_dim


# ---------------------------------------------------------------------------------------------- rotary


def rotary_cos_sin(
    seqlen: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [s, head_dim/2] for positions offset..offset+s-1 (frequency j: theta^(-2j/head_dim)), fp32 or fp64.

    A position gets the same angles whatever the offset (decoding one token at a time = the whole row at once).
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim)
    angle_SJ = torch.arange(offset, offset + seqlen, device=device, dtype=dtype)[:, None] * inv_freq[None, :]
    return angle_SJ.cos(), angle_SJ.sin()


def apply_rotary(x_BSHD: torch.Tensor, cos_SJ: torch.Tensor, sin_SJ: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[j], x[j + d/2]) by position * freq_j ("rotate-half" layout), in cos/sin's precision."""
    half = x_BSHD.shape[-1] // 2
    x = x_BSHD.to(cos_SJ.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos_SJ[None, :, None, :], sin_SJ[None, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x_BSHD.dtype)


# ---------------------------------------------------------------------------------------------- cores


def document_causal_mask(seq_idx_BS: torch.Tensor) -> torch.Tensor:
    """Boolean [b, 1, s, s]: True where query t may attend key u (u <= t, same document)."""
    s = seq_idx_BS.shape[1]
    causal_SS = torch.ones(s, s, dtype=torch.bool, device=seq_idx_BS.device).tril()
    same_doc_BSS = seq_idx_BS[:, :, None] == seq_idx_BS[:, None, :]
    return (same_doc_BSS & causal_SS)[:, None]


def sdpa_attention(q_BSHD, k_BSHD, v_BSHD, seq_idx_BS, scale: float) -> torch.Tensor:
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BSHD, v_BSHD))
    gqa = q.shape[1] != k.shape[1]
    if seq_idx_BS is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = document_causal_mask(seq_idx_BS)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2)


_compiled_flex = None
# (weakref to the seq_idx tensor, its _version, BlockMask): every attention layer of one forward receives the
# same seq_idx object, so the mask is built once per forward, not once per layer.
_block_mask_cache: tuple | None = None


def _flex_block_mask(seq_idx_BS: torch.Tensor):
    global _block_mask_cache
    compiling = torch.compiler.is_compiling()
    hit = _block_mask_cache
    if not compiling and hit is not None and hit[0]() is seq_idx_BS and hit[1] == seq_idx_BS._version:
        return hit[2]
    ids_BS = seq_idx_BS.contiguous()
    b, s = ids_BS.shape

    def doc_causal(b_i, h_i, q_i, kv_i):
        return (q_i >= kv_i) & (ids_BS[b_i, q_i] == ids_BS[b_i, kv_i])

    block_mask = create_block_mask(doc_causal, B=b, H=None, Q_LEN=s, KV_LEN=s, device=ids_BS.device)
    if not compiling:
        _block_mask_cache = (weakref.ref(seq_idx_BS), seq_idx_BS._version, block_mask)
    return block_mask


def flex_attention_core(q_BSHD, k_BSHD, v_BSHD, seq_idx_BS, scale: float) -> torch.Tensor:
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    b, s = q_BSHD.shape[:2]
    if seq_idx_BS is None:
        seq_idx_BS = torch.zeros(b, s, dtype=torch.int32, device=q_BSHD.device)
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BSHD, v_BSHD))
    # FORCE_USE_FLEX_ATTENTION: below 128 query rows (a short prompt's prefill) inductor would pick its flex-decoding
    # kernel, for which torch 2.11 finds no valid config on an H100 ("NoValidChoicesError", a 67-token prefill of
    # the hybrid model, tests/gpu/test_decode_gpu.py); the main kernel serves every length.
    o = _compiled_flex(
        q,
        k,
        v,
        block_mask=_flex_block_mask(seq_idx_BS),
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        kernel_options={"FORCE_USE_FLEX_ATTENTION": True},
    )
    return o.transpose(1, 2)


_flash_varlen = None


def flash_varlen_available() -> bool:
    """True when flash-attn imports (tried once, only when CUDA is present)."""
    global _flash_varlen
    if _flash_varlen is None:
        _flash_varlen = False
        if torch.cuda.is_available():
            try:
                from flash_attn import flash_attn_varlen_func  # lazy: optional, CUDA only

                _flash_varlen = flash_attn_varlen_func
            except Exception:  # noqa: BLE001 - any import failure means "not available"
                pass
    return _flash_varlen is not False


def cu_seqlens_from_seq_idx(seq_idx_BS: torch.Tensor) -> torch.Tensor:
    """int32 [n_docs + 1] offsets of the documents of the flattened [b*s] tokens (a row start is a doc start)."""
    b, s = seq_idx_BS.shape
    starts_BS = torch.ones_like(seq_idx_BS, dtype=torch.bool)
    starts_BS[:, 1:] = seq_idx_BS[:, 1:] != seq_idx_BS[:, :-1]
    starts = starts_BS.flatten().nonzero().flatten()
    end = torch.tensor([b * s], device=seq_idx_BS.device, dtype=starts.dtype)
    return torch.cat((starts, end)).to(torch.int32)


def flash_varlen_core(q_BSHD, k_BSHD, v_BSHD, seq_idx_BS, scale: float) -> torch.Tensor:
    if not flash_varlen_available():
        raise RuntimeError("attention backend 'flash' needs flash-attn on CUDA: pip install flash-attn, or use 'flex'")
    b, s, h, d = q_BSHD.shape
    if seq_idx_BS is None:
        seq_idx_BS = torch.zeros(b, s, dtype=torch.int32, device=q_BSHD.device)
    cu = cu_seqlens_from_seq_idx(seq_idx_BS)
    # max_seqlen only sizes the launch grid: s is a valid upper bound and needs no host sync.
    o = _flash_varlen(
        q_BSHD.reshape(b * s, h, d),
        k_BSHD.reshape(b * s, -1, d),
        v_BSHD.reshape(b * s, -1, d),
        cu,
        cu,
        s,
        s,
        softmax_scale=scale,
        causal=True,
    )
    return o.view(b, s, h, d)


# ---------------------------------------------------------------------------------------------- module


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, n_layers: int):
        super().__init__()
        self.layer_id, self.n_layers = layer_id, n_layers
        self.n_heads, self.n_kv_heads, self.head_dim = head_dims(args)
        self.rope_theta = float(args.rope_theta)
        d = args.d_model
        self.wq = nn.Linear(d, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, d, bias=False)
        self.backend = "auto"
        self.cp = None  # context-parallel hook, see the module docstring

    @torch.no_grad()
    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full (unsharded) tensor of parameter `name` (relative to this module) in place."""
        std = 0.02
        if name == "wo.weight":  # GPT-2: residual-branch outputs scaled so the stream's variance is depth-independent
            std = 0.02 / math.sqrt(2 * self.n_layers)
        elif name not in ("wq.weight", "wk.weight", "wv.weight"):
            raise KeyError(f"Attention.init_param: unknown parameter {name!r}")
        nn.init.normal_(full, mean=0.0, std=std, generator=generator)

    def _core(self, q, k, v, seq_idx_BS):
        backend = self.backend
        if backend not in BACKENDS:
            raise ValueError(f"Attention.backend={backend!r} is unknown; choose one of {BACKENDS}")
        scale = 1.0 / math.sqrt(self.head_dim)
        if backend == "auto":
            if not q.is_cuda or seq_idx_BS is None:
                backend = "sdpa"
            elif q.dtype in (torch.float16, torch.bfloat16) and flash_varlen_available():
                backend = "flash"
            else:
                backend = "flex"
        if backend == "flash":
            return flash_varlen_core(q, k, v, seq_idx_BS, scale)
        if backend == "flex":
            return flex_attention_core(q, k, v, seq_idx_BS, scale)
        return sdpa_attention(q, k, v, seq_idx_BS, scale)

    def _project_qkv(self, x_BSD: torch.Tensor):
        b, s, _ = x_BSD.shape
        q_BSHD = self.wq(x_BSD).view(b, s, self.n_heads, self.head_dim)
        k_BSHD = self.wk(x_BSD).view(b, s, self.n_kv_heads, self.head_dim)
        v_BSHD = self.wv(x_BSD).view(b, s, self.n_kv_heads, self.head_dim)
        return q_BSHD, k_BSHD, v_BSHD

    def _rotate(self, q_BSHD: torch.Tensor, k_BSHD: torch.Tensor, offset: int = 0):
        """Rotary at positions offset..offset+s-1 (a no-op with rope_theta=0)."""
        if not self.rope_theta:
            return q_BSHD, k_BSHD
        # fp32 angles (fp64 only for fp64 tests): bf16 angles would be wrong by whole radians at long positions.
        dtype = torch.float64 if q_BSHD.dtype == torch.float64 else torch.float32
        cos, sin = rotary_cos_sin(q_BSHD.shape[1], self.head_dim, self.rope_theta, q_BSHD.device, dtype, offset)
        return apply_rotary(q_BSHD, cos, sin), apply_rotary(k_BSHD, cos, sin)

    def forward(self, x_BSD: torch.Tensor, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        b, s_local, _ = x_BSD.shape
        q_BSHD, k_BSHD, v_BSHD = self._project_qkv(x_BSD)

        cp = self.cp
        if cp is not None:
            q_BSHD, k_BSHD, v_BSHD = self._cp_seq_to_heads(cp, q_BSHD, k_BSHD, v_BSHD)
        s = q_BSHD.shape[1]
        if seq_idx is not None and seq_idx.shape != (b, s):
            raise ValueError(
                f"seq_idx has shape {tuple(seq_idx.shape)}, expected [b, s] = {(b, s)} (under context parallel "
                "pass the full-length seq_idx)"
            )
        q_BSHD, k_BSHD = self._rotate(q_BSHD, k_BSHD)

        o_BSHD = self._core(q_BSHD, k_BSHD, v_BSHD, seq_idx)
        if cp is not None:
            o_BSHD = cp.heads_to_seq(o_BSHD)
        return self.wo(o_BSHD.reshape(b, s_local, self.n_heads * self.head_dim))

    # ---- recurrent decoding (models.inference) -------------------------------------------------------
    def allocate_inference_cache(
        self, batch_size: int, max_seqlen: int, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        shape = (batch_size, max_seqlen, self.n_kv_heads, self.head_dim)
        return KVCache(
            k_BLHD=torch.zeros(shape, dtype=dtype, device=device), v_BLHD=torch.zeros(shape, dtype=dtype, device=device)
        )

    def prefill(self, x_BSD: torch.Tensor, cache: InferenceCache, seq_idx: torch.Tensor | None = None):
        """forward(x_BSD, seq_idx), writing the rotated keys and the values of columns 0..s-1 into the cache."""
        if self.cp is not None:
            raise ValueError("Attention.prefill: recurrent decoding does not run under context parallel")
        b, s, _ = x_BSD.shape
        if seq_idx is not None and seq_idx.shape != (b, s):
            raise ValueError(f"seq_idx has shape {tuple(seq_idx.shape)}, expected [b, s] = {(b, s)}")
        q_BSHD, k_BSHD, v_BSHD = self._project_qkv(x_BSD)
        q_BSHD, k_BSHD = self._rotate(q_BSHD, k_BSHD)
        kv = cache.layers[str(self.layer_id)]
        kv.k_BLHD[:, :s] = k_BSHD
        kv.v_BLHD[:, :s] = v_BSHD
        o_BSHD = self._core(q_BSHD, k_BSHD, v_BSHD, seq_idx)
        return self.wo(o_BSHD.reshape(b, s, self.n_heads * self.head_dim))

    def step(self, x_B1D: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """One token at column cache.seqlen: attends to the cached columns [first_real, seqlen] of its row."""
        if self.cp is not None:
            raise ValueError("Attention.step: recurrent decoding does not run under context parallel")
        b, pos = x_B1D.shape[0], cache.seqlen
        q_B1HD, k_B1HD, v_B1HD = self._project_qkv(x_B1D)
        q_B1HD, k_B1HD = self._rotate(q_B1HD, k_B1HD, offset=pos)
        kv = cache.layers[str(self.layer_id)]
        kv.k_BLHD[:, pos] = k_B1HD[:, 0]
        kv.v_BLHD[:, pos] = v_B1HD[:, 0]
        mask_B11L = None
        if cache.first_real_B is not None:  # left padding is never attended to
            cols_L = torch.arange(pos + 1, device=x_B1D.device)
            mask_B11L = (cols_L[None, :] >= cache.first_real_B[:, None])[:, None, None, :]
        q, k, v = (t.transpose(1, 2) for t in (q_B1HD, kv.k_BLHD[:, : pos + 1], kv.v_BLHD[:, : pos + 1]))
        o_BH1D = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask_B11L,
            scale=1.0 / math.sqrt(self.head_dim),
            enable_gqa=self.n_heads != self.n_kv_heads,
        )
        return self.wo(o_BH1D.transpose(1, 2).reshape(b, 1, self.n_heads * self.head_dim))

    def _cp_seq_to_heads(self, cp, q_BSHD, k_BSHD, v_BSHD):
        """q [b, s/cp, h, d] -> [b, s, h/cp, d]; k, v [b, s/cp, kv, d] -> [b, s, max(kv, cp)/cp, d]."""
        degree = cp.degree
        if self.n_heads % degree:
            raise ValueError(f"context parallel degree {degree} must divide model.n_heads={self.n_heads}")
        if self.n_kv_heads % degree:
            if degree % self.n_kv_heads:
                raise ValueError(
                    f"context parallel degree {degree} and model.n_kv_heads={self.n_kv_heads}: one must divide "
                    "the other (change n_kv_heads or the CP degree)"
                )
            # Adjacent copies: repeated head j is original head j // rep, the one rank j's query heads use.
            rep = degree // self.n_kv_heads
            k_BSHD = k_BSHD.repeat_interleave(rep, dim=2)
            v_BSHD = v_BSHD.repeat_interleave(rep, dim=2)
        return cp.seq_to_heads(q_BSHD), cp.seq_to_heads(k_BSHD), cp.seq_to_heads(v_BSHD)
