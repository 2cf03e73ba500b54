"""Model hyper-parameters and the named flavors (the released state-spaces Mamba-2 sizes)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any


def doc(default: Any, text: str, choices: tuple | None = None):
    """A ModelArgs field with its default, a help text and optional allowed values.

    The metadata keys ("doc", "choices") are the ones configs/parser.py reads for --help and for checking
    --model.* overrides; the helper lives here so that models/ imports nothing from configs/.
    """
    meta = {"doc": text} if choices is None else {"doc": text, "choices": choices}
    return field(default=default, metadata=meta)


@dataclass
class ModelArgs:
    d_model: int = doc(768, "Hidden size.")
    n_layers: int = doc(24, "Number of residual blocks (= len(layer_pattern) without '|' when a pattern is set).")
    vocab_size: int = doc(50277, "Tokenizer vocabulary; the embedding is padded up to pad_vocab_size_multiple.")
    pad_vocab_size_multiple: int = doc(16, "Round the embedding / head rows up to a multiple of this.")
    # Mamba-2 mixer (names as in mamba_ssm.modules.mamba2.Mamba2)
    d_state: int = doc(128, "SSM state size N.")
    d_conv: int = doc(4, "Causal depthwise conv width.")
    expand: int = doc(2, "d_inner = expand * d_model.")
    headdim: int = doc(64, "SSM head dimension P; nheads = d_inner / headdim.")
    ngroups: int = doc(1, "Groups of B / C shared by nheads / ngroups heads.")
    chunk_size: int = doc(256, "SSD chunk length.")
    D_has_hdim: bool = doc(False, "D is [nheads, headdim] instead of [nheads].")
    conv_bias: bool = doc(True, "conv1d has a bias.")
    bias: bool = doc(False, "in_proj / out_proj have biases.")
    norm_before_gate: bool = doc(False, "Gated RMSNorm: norm(x) * silu(z) instead of norm(x * silu(z)).")
    dt_min: float = doc(0.001, "dt initialisation range (log-uniform) ...")
    dt_max: float = doc(0.1, "... upper end.")
    dt_init_floor: float = doc(1e-4, "Lower clamp of the initial dt.")
    dt_limit_min: float = doc(0.0, "Clamp dt (after softplus) from below in the forward.")
    dt_limit_max: float = doc(float("inf"), "Clamp dt from above in the forward.")
    A_init_min: float = doc(1.0, "A = -exp(A_log) initialised uniform in [A_init_min, A_init_max].")
    A_init_max: float = doc(16.0, "See A_init_min.")
    norm_eps: float = doc(1e-5, "RMSNorm epsilon (block norms, gated norm, norm_f).")
    residual_in_fp32: bool = doc(True, "Keep the residual stream in float32 under bf16 compute.")
    tie_embeddings: bool = doc(True, "lm_head shares tok_embeddings' weight (PP: the last stage keeps a synced copy).")
    initializer_range: float = doc(0.02, "Std of the embedding initialisation.")
    rescale_prenorm_residual: bool = doc(True, "Scale out_proj init by 1/sqrt(n_layers) as mamba-ssm does.")
    use_fused_path: bool = doc(True, "On CUDA without CP: mamba_split_conv1d_scan_combined (conv+SSD+norm fused).")
    ssd_keep_states: bool = doc(
        False,
        "Our SSD kernels keep each chunk's entering state from the forward for the backward instead of recomputing "
        "it: faster backward, batch * seqlen / chunk_size * nheads * headdim * d_state * 4 bytes more per Mamba layer "
        "held (128 MiB at the 1.3B's 4 x 4096); ignored by the mamba_ssm and reference kernels.",
    )
    ssd_keep_conv_layers: int = doc(
        0,
        "The Mamba layers among the last this many layers (-1: every layer) keep their conv output (x, B, C) from the "
        "forward for the backward instead of recomputing it, on our fused CUDA path: one conv pass fewer per such "
        "layer and step, batch * seqlen * (d_inner + 2 * ngroups * d_state) * 2 bytes more held per layer (136 MiB "
        "at the 1.3B's 4 x 4096); ignored elsewhere.",
    )
    recompute_in_proj_input: bool = doc(
        False,
        "Mamba blocks: the block norm's output, in_proj's input, is not kept for in_proj's weight gradient; the "
        "norm's backward, which reads the residual anyway, writes it again (models/kernels/norm_linear.py): "
        "batch * seqlen * d_model * 2 bytes less held per layer (64 MiB at the 1.3B's 4 x 4096) for one such write "
        "per layer and step. On CUDA with our kernels, bf16 autocast with float32 weights (one GPU, DDP) and a float32 "
        "residual stream, without context parallel; elsewhere ignored.",
    )
    fuse_gate_into_scan: bool = doc(
        False,
        "With our SSD kernels on the fused path: the chunk scan also writes out_proj's input before the gated "
        "norm's division by the rows' rms, and the next block's add + RMSNorm applies that row scale as it reads "
        "the block's output (models/kernels/row_scale.py): one pass over y and z fewer per Mamba layer. Norm after "
        "the gate with one group (ngroups 1) and out_proj without bias only; elsewhere ignored.",
    )
    # Hybrid models (Megatron's pattern letters): M Mamba-2, * attention, - MLP, E MoE, | stage boundary.
    layer_pattern: str = doc("", "Empty = n_layers Mamba-2 blocks. E.g. 'MM*-|MME-'.")
    n_heads: int = doc(8, "Attention query heads.")
    n_kv_heads: int = doc(0, "Attention key/value heads (grouped-query); 0 = n_heads.")
    attn_head_dim: int = doc(0, "Attention head dim; 0 = d_model / n_heads.")
    rope_theta: float = doc(10000.0, "Rotary base; 0 disables rotary (no positional encoding).")
    mlp_hidden_dim: int = doc(0, "SwiGLU hidden size for '-' layers; 0 = 4 * d_model * 2/3 rounded to 64.")
    moe_num_experts: int = doc(8, "Routed experts per 'E' layer.")
    moe_top_k: int = doc(2, "Experts per token.")
    moe_hidden_dim: int = doc(0, "Expert SwiGLU hidden size; 0 = mlp_hidden_dim / moe_top_k.")
    moe_shared_experts: int = doc(0, "Always-on shared experts (their hidden = moe_hidden_dim * count).")
    moe_score_func: str = doc("softmax", "Router scores: softmax or sigmoid.", choices=("softmax", "sigmoid"))
    moe_route_norm: bool = doc(False, "Renormalise the top-k scores to sum to 1.")
    moe_load_balance_coeff: float = doc(
        1e-3, "Auxiliary-loss-free balancing: expert-bias update rate per step (0 = off)."
    )
    moe_aux_loss_coeff: float = doc(0.0, "Switch-style auxiliary load-balancing loss weight (0 = off).")
    moe_z_loss_coeff: float = doc(0.0, "Router z-loss weight (0 = off).")

    def __post_init__(self):
        if self.layer_pattern:
            self.n_layers = len(self.layer_pattern.replace("|", ""))

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return ((self.vocab_size + m - 1) // m) * m

    @property
    def layer_types(self) -> str:
        """One letter per layer ('M', '*', '-', 'E'), '|' removed."""
        return self.layer_pattern.replace("|", "") if self.layer_pattern else "M" * self.n_layers

    def validate(self) -> list[str]:
        """Problems with these sizes, each naming the key and the fix (empty when fine)."""
        errs = []
        if self.d_inner % self.headdim:
            errs.append(f"model.headdim={self.headdim} must divide d_inner = expand*d_model = {self.d_inner}")
        elif self.nheads % self.ngroups:
            errs.append(f"model.ngroups={self.ngroups} must divide nheads = {self.nheads}")
        bad = set(self.layer_types) - set("M*-E")
        if bad:
            errs.append(f"model.layer_pattern has unknown letters {sorted(bad)}; use M, *, -, E and |")
        if self.n_layers < 1:
            errs.append("model.n_layers must be >= 1")
        if self.ssd_keep_conv_layers < -1:
            errs.append(
                f"model.ssd_keep_conv_layers={self.ssd_keep_conv_layers}: give a number of layers >= 0, or -1 for all"
            )
        if "*" in self.layer_types:
            kv = self.n_kv_heads or self.n_heads
            if self.n_heads % kv:
                errs.append(f"model.n_kv_heads={kv} must divide model.n_heads={self.n_heads}")
            if not self.attn_head_dim and self.d_model % self.n_heads:
                errs.append(f"model.n_heads={self.n_heads} must divide d_model={self.d_model} (or set attn_head_dim)")
        if "E" in self.layer_types and not 1 <= self.moe_top_k <= self.moe_num_experts:
            errs.append(f"model.moe_top_k={self.moe_top_k} must be in [1, moe_num_experts={self.moe_num_experts}]")
        return errs


def _mamba2(d_model: int, n_layers: int) -> dict[str, Any]:
    return dict(d_model=d_model, n_layers=n_layers)


# The released state-spaces/mamba2-* sizes: d_state 128, headdim 64, expand 2, ngroups 1, GPT-NeoX vocab.
FLAVORS: dict[str, dict[str, Any]] = {
    "debug": dict(d_model=128, n_layers=4, vocab_size=258, d_state=16, headdim=16, chunk_size=32),
    "130M": _mamba2(768, 24),
    "370M": _mamba2(1024, 48),
    "780M": _mamba2(1536, 48),
    "1.3B": _mamba2(2048, 48),
    "2.7B": _mamba2(2560, 64),
    # A small hybrid for CPU tests: Mamba, attention, MLP and MoE layers.
    "hybrid_moe_debug": dict(
        d_model=128,
        vocab_size=258,
        d_state=16,
        headdim=16,
        chunk_size=32,
        layer_pattern="M*ME|M-ME",
        n_heads=4,
        n_kv_heads=2,
        moe_num_experts=4,
        moe_top_k=2,
        moe_hidden_dim=128,
        mlp_hidden_dim=256,
        moe_shared_experts=1,
        tie_embeddings=False,
    ),
    # Nemotron-H-like proportions (~8% attention, MLP after every mixer), ~1.1B parameters.
    "hybrid_1B": dict(
        d_model=2048,
        layer_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-",
        n_heads=16,
        n_kv_heads=8,
        mlp_hidden_dim=5504,
        tie_embeddings=False,
    ),
    # The same proportions with MoE feed-forwards (8 experts, top-2, one shared).
    "hybrid_moe_1B": dict(
        d_model=1024,
        layer_pattern="MEMEME*EMEMEME*EMEMEME*EMEME*E",
        n_heads=16,
        n_kv_heads=4,
        moe_num_experts=8,
        moe_top_k=2,
        moe_hidden_dim=1408,
        moe_shared_experts=1,
        tie_embeddings=False,
    ),
}


MODEL_ARG_NAMES = tuple(f.name for f in fields(ModelArgs))


def build_model_args(flavor: str, overrides: dict[str, Any] | None = None) -> ModelArgs:
    if flavor not in FLAVORS:
        raise ValueError(f"model.flavor={flavor!r} is unknown; choose one of {sorted(FLAVORS)}")
    return replace(ModelArgs(**FLAVORS[flavor]), **(overrides or {}))
