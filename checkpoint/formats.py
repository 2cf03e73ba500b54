"""Name and config mappings between this repo's Mamba-2 LM and the two foreign formats.

Our parameter names follow mamba_ssm's Mamba2, so the mixers map one to one; only the prefixes differ:

    ours                          mamba_ssm (MambaLMHeadModel)        HF transformers (Mamba2ForCausalLM)
    tok_embeddings.weight         backbone.embedding.weight           backbone.embeddings.weight
    layers.{i}.<rest>             backbone.layers.{i}.<rest>          backbone.layers.{i}.<rest>
    norm_f.weight                 backbone.norm_f.weight              backbone.norm_f.weight
    lm_head.weight                lm_head.weight                      lm_head.weight

Configs: mamba_ssm's MambaConfig (d_model, n_layer, vocab_size, ssm_cfg, rms_norm, residual_in_fp32,
pad_vocab_size_multiple, tie_embeddings, ...) and HF's Mamba2Config (hidden_size, num_hidden_layers,
state_size, head_dim, num_heads, n_groups, ...). Differences that matter for numerics:
- mamba_ssm pads the vocabulary itself (config holds the tokenizer size); HF's vocab_size is the row count.
- HF's mixer always gates before the norm (norm(x * silu(z)), our norm_before_gate=False) and its D is
  per head only (no D_has_hdim); models outside that cannot be exported to HF.
- mamba_ssm hard-codes eps 1e-5 in every norm; HF has layer_norm_epsilon.
- transformers applies its init rules to a loaded model, and rescale_prenorm_residual=true scales the loaded
  out_proj weights: exports always say false.
Mamba-1 checkpoints (x_proj / dt_proj, ssm_cfg layer "Mamba1" or none) and hybrids are rejected by name.
"""

from __future__ import annotations

import math
import re
from typing import Any

from models.args import FLAVORS, ModelArgs

FORMATS = ("mamba_ssm", "hf")
_EMBED = {"mamba_ssm": "backbone.embedding.weight", "hf": "backbone.embeddings.weight"}
_MAMBA1_LEAVES = ("mixer.x_proj.weight", "mixer.dt_proj.weight", "mixer.dt_proj.bias")
_MAMBA_SSM_EPS = 1e-5  # mamba_ssm builds every RMSNorm with this eps (not configurable in MambaConfig)


class UnsupportedCheckpoint(ValueError):
    """A foreign checkpoint this repo cannot represent; the message says what and why."""


# ------------------------------------------------------------------------------------------ names
def foreign_to_ours(sd: dict, fmt: str) -> dict:
    """A mamba_ssm / HF state dict -> our FQNs. Accepts either embedding spelling and a missing 'backbone.'."""
    _check_fmt(fmt)
    check_not_mamba1(sd)
    out: dict = {}
    for k, v in sd.items():
        name = k.removeprefix("backbone.")
        if name in ("embedding.weight", "embeddings.weight"):
            out["tok_embeddings.weight"] = v
        elif name.startswith("layers.") or name in ("norm_f.weight", "lm_head.weight"):
            out[name] = v
        else:
            raise UnsupportedCheckpoint(
                f"tensor {k!r} has no counterpart in this repo's Mamba-2 LM (expected embedding, layers.*, "
                f"norm_f, lm_head). Is it a Mamba-2 {fmt} checkpoint of a pure Mamba-2 model?"
            )
    return out


def ours_to_foreign(sd: dict, fmt: str) -> dict:
    """Our FQNs -> mamba_ssm / HF names (values untouched)."""
    _check_fmt(fmt)
    out: dict = {}
    for k, v in sd.items():
        if k == "tok_embeddings.weight":
            out[_EMBED[fmt]] = v
        elif k.startswith("layers.") or k == "norm_f.weight":
            out["backbone." + k] = v
        elif k == "lm_head.weight":
            out[k] = v
        else:
            raise KeyError(f"unexpected key {k!r} in our state dict")
    return out


def check_not_mamba1(sd: dict) -> None:
    mamba1 = [k for k in sd if k.endswith(_MAMBA1_LEAVES)]
    if mamba1:
        raise UnsupportedCheckpoint(
            f"this is a Mamba-1 checkpoint ({mamba1[0]!r}: Mamba-1 has x_proj / dt_proj, Mamba-2 has dt_bias); "
            f"only Mamba-2 checkpoints are supported"
        )


def _check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {FORMATS}")


# ------------------------------------------------------------------------------------------ mamba_ssm
def args_from_mamba_ssm_config(cfg: dict) -> dict[str, Any]:
    """mamba_ssm config.json -> ModelArgs fields."""
    ssm = dict(cfg.get("ssm_cfg") or {})
    layer = ssm.get("layer", "Mamba1")  # mamba_ssm's own default when the key is absent
    if layer != "Mamba2":
        raise UnsupportedCheckpoint(
            f"config.json ssm_cfg.layer={layer!r}: this is a Mamba-1 model; only Mamba-2 (ssm_cfg.layer 'Mamba2') "
            f"checkpoints are supported"
        )
    if cfg.get("attn_layer_idx"):
        raise UnsupportedCheckpoint(
            f"config.json attn_layer_idx={cfg['attn_layer_idx']}: mamba_ssm hybrid (attention) models are not "
            f"supported by the converter; only pure Mamba-2 stacks"
        )
    if cfg.get("d_intermediate", 0):
        raise UnsupportedCheckpoint(
            f"config.json d_intermediate={cfg['d_intermediate']}: blocks with an MLP are not supported; only "
            f"d_intermediate 0 (pure Mamba-2)"
        )
    if not cfg.get("rms_norm", True):
        raise UnsupportedCheckpoint("config.json rms_norm=false (LayerNorm blocks) is not supported; only RMSNorm")
    if not ssm.get("rmsnorm", True):
        raise UnsupportedCheckpoint("ssm_cfg.rmsnorm=false (no gated norm) is not supported")
    d_model, expand = cfg["d_model"], ssm.get("expand", 2)
    d_ssm = ssm.get("d_ssm")
    if d_ssm is not None and d_ssm != expand * d_model:
        raise UnsupportedCheckpoint(f"ssm_cfg.d_ssm={d_ssm} != expand*d_model={expand * d_model} is not supported")
    dt_limit = ssm.get("dt_limit", (0.0, float("inf")))
    a_range = ssm.get("A_init_range", (1, 16))
    return {
        "d_model": d_model,
        "n_layers": cfg["n_layer"],
        "vocab_size": cfg["vocab_size"],
        "pad_vocab_size_multiple": cfg.get("pad_vocab_size_multiple", 8),
        "d_state": ssm.get("d_state", 128),
        "d_conv": ssm.get("d_conv", 4),
        "expand": expand,
        "headdim": ssm.get("headdim", 64),
        "ngroups": ssm.get("ngroups", 1),
        "chunk_size": ssm.get("chunk_size", 256),
        "D_has_hdim": ssm.get("D_has_hdim", False),
        "conv_bias": ssm.get("conv_bias", True),
        "bias": ssm.get("bias", False),
        "norm_before_gate": ssm.get("norm_before_gate", False),
        "dt_min": ssm.get("dt_min", 0.001),
        "dt_max": ssm.get("dt_max", 0.1),
        "dt_init_floor": ssm.get("dt_init_floor", 1e-4),
        "dt_limit_min": _float(dt_limit[0]),
        "dt_limit_max": _float(dt_limit[1]),
        "A_init_min": float(a_range[0]),
        "A_init_max": float(a_range[1]),
        "norm_eps": _MAMBA_SSM_EPS,
        "residual_in_fp32": cfg.get("residual_in_fp32", True),
        "tie_embeddings": cfg.get("tie_embeddings", True),
    }


def mamba_ssm_config_from_args(a: ModelArgs) -> dict[str, Any]:
    """ModelArgs -> mamba_ssm config.json (MambaConfig fields)."""
    _check_pure_mamba2(a, "mamba_ssm")
    if not math.isclose(a.norm_eps, _MAMBA_SSM_EPS):
        raise UnsupportedCheckpoint(f"model.norm_eps={a.norm_eps}: mamba_ssm hard-codes eps {_MAMBA_SSM_EPS}")
    return {
        "d_model": a.d_model,
        "d_intermediate": 0,
        "n_layer": a.n_layers,
        "vocab_size": a.vocab_size,
        "ssm_cfg": {
            "layer": "Mamba2",
            "d_state": a.d_state,
            "d_conv": a.d_conv,
            "expand": a.expand,
            "headdim": a.headdim,
            "ngroups": a.ngroups,
            "chunk_size": a.chunk_size,
            "D_has_hdim": a.D_has_hdim,
            "conv_bias": a.conv_bias,
            "bias": a.bias,
            "norm_before_gate": a.norm_before_gate,
            "rmsnorm": True,
            "dt_min": a.dt_min,
            "dt_max": a.dt_max,
            "dt_init_floor": a.dt_init_floor,
            "dt_limit": [a.dt_limit_min, a.dt_limit_max],
            "A_init_range": [a.A_init_min, a.A_init_max],
        },
        "attn_layer_idx": [],
        "attn_cfg": {},
        "rms_norm": True,
        "residual_in_fp32": a.residual_in_fp32,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": a.pad_vocab_size_multiple,
        "tie_embeddings": a.tie_embeddings,
    }


# ------------------------------------------------------------------------------------------ HF transformers
def args_from_hf_config(cfg: dict) -> dict[str, Any]:
    """HF Mamba2Config (config.json) -> ModelArgs fields. vocab_size is HF's row count (already padded)."""
    model_type = cfg.get("model_type")
    if model_type == "mamba":
        raise UnsupportedCheckpoint("config.json model_type='mamba' is Mamba-1; only Mamba-2 checkpoints are supported")
    if model_type != "mamba2":
        raise UnsupportedCheckpoint(
            f"config.json model_type={model_type!r}: unknown architecture; expected 'mamba2' (Mamba2ForCausalLM)"
        )
    d_model, expand, head_dim = cfg["hidden_size"], cfg.get("expand", 2), cfg.get("head_dim", 64)
    if float(expand) != int(expand):
        raise UnsupportedCheckpoint(f"config.json expand={expand}: only integer expand factors are supported")
    expand = int(expand)
    nheads = cfg.get("num_heads", expand * d_model // head_dim)
    if nheads * head_dim != expand * d_model:
        raise UnsupportedCheckpoint(
            f"config.json num_heads={nheads} x head_dim={head_dim} != expand x hidden_size = {expand * d_model}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpoint(f"config.json hidden_act={cfg['hidden_act']!r}: only 'silu' is supported")
    vocab = cfg["vocab_size"]
    dt_limit = cfg.get("time_step_limit", (0.0, float("inf")))
    return {
        "d_model": d_model,
        "n_layers": cfg["num_hidden_layers"],
        "vocab_size": vocab,
        "pad_vocab_size_multiple": next(m for m in (16, 8, 4, 2, 1) if vocab % m == 0),
        "d_state": cfg.get("state_size", 128),
        "d_conv": cfg.get("conv_kernel", 4),
        "expand": expand,
        "headdim": head_dim,
        "ngroups": cfg.get("n_groups", 8),
        "chunk_size": cfg.get("chunk_size", 256),
        "D_has_hdim": False,
        "conv_bias": cfg.get("use_conv_bias", True),
        "bias": cfg.get("use_bias", False),
        "norm_before_gate": False,  # HF's mixer gates before the norm whatever an old config's key says
        "dt_min": cfg.get("time_step_min", 0.001),
        "dt_max": cfg.get("time_step_max", 0.1),
        "dt_init_floor": cfg.get("time_step_floor", 1e-4),
        "dt_limit_min": _float(dt_limit[0]),
        "dt_limit_max": _float(dt_limit[1]),
        "norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
        "residual_in_fp32": cfg.get("residual_in_fp32", True),
        "tie_embeddings": cfg.get("tie_word_embeddings", False),
        "initializer_range": cfg.get("initializer_range", 0.02),
        "rescale_prenorm_residual": cfg.get("rescale_prenorm_residual", False),
    }


def hf_config_from_args(a: ModelArgs) -> dict[str, Any]:
    """ModelArgs -> HF Mamba2Config dict (config.json). vocab_size = our padded row count."""
    _check_pure_mamba2(a, "HF transformers")
    if a.norm_before_gate:
        raise UnsupportedCheckpoint(
            "model.norm_before_gate=true cannot be exported to HF: its Mamba2 always "
            "gates before the norm (norm_before_gate=false)"
        )
    if a.D_has_hdim:
        raise UnsupportedCheckpoint("model.D_has_hdim=true cannot be exported to HF: its Mamba2 has D per head")
    return {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "hidden_size": a.d_model,
        "num_hidden_layers": a.n_layers,
        "vocab_size": a.padded_vocab_size,
        "state_size": a.d_state,
        "head_dim": a.headdim,
        "num_heads": a.nheads,
        "n_groups": a.ngroups,
        "expand": a.expand,
        "conv_kernel": a.d_conv,
        "chunk_size": a.chunk_size,
        "use_bias": a.bias,
        "use_conv_bias": a.conv_bias,
        "hidden_act": "silu",
        "residual_in_fp32": a.residual_in_fp32,
        "tie_word_embeddings": a.tie_embeddings,
        "layer_norm_epsilon": a.norm_eps,
        "time_step_min": a.dt_min,
        "time_step_max": a.dt_max,
        "time_step_floor": a.dt_init_floor,
        "time_step_limit": [a.dt_limit_min, a.dt_limit_max],
        # false whatever our init used: transformers (5.x) runs _init_weights over the loaded model, and with true
        # it divides every loaded (trained) out_proj by sqrt(num_hidden_layers). It is an init rule, not a weight fact.
        "rescale_prenorm_residual": False,
        "initializer_range": a.initializer_range,
        "use_cache": True,
    }


def _float(v: Any) -> float:
    """A JSON number, also transformers 5's {"__float__": "Infinity"} encoding of non-finite floats."""
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


def _check_pure_mamba2(a: ModelArgs, target: str) -> None:
    if set(a.layer_types) != {"M"}:
        raise UnsupportedCheckpoint(
            f"model.layer_pattern={a.layer_pattern!r} is a hybrid; only pure Mamba-2 models export to {target}"
        )


# ------------------------------------------------------------------------------------------ model.toml
def flavor_and_overrides(fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The flavor needing the fewest overrides to reproduce `fields` (ModelArgs values), and those overrides."""
    target = ModelArgs(**fields)
    best = None
    for name, preset in FLAVORS.items():
        base = ModelArgs(**preset)
        if base.layer_pattern:
            continue
        diff = {k: getattr(target, k) for k in fields if getattr(base, k) != getattr(target, k)}
        if best is None or len(diff) < len(best[1]):
            best = (name, diff)
    return best


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "inf" if v == float("inf") else repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(v)


def model_toml(fields: dict[str, Any], source: str, tokenizer_path: str = "") -> str:
    """A [model] TOML section (flavor + overrides) that rebuilds these ModelArgs in the trainer, and the source's
    tokenizer.json when it had one (training and the HF export need the tokenizer the weights were trained with)."""
    flavor, overrides = flavor_and_overrides(fields)
    source = re.sub(r"[\r\n]", " ", source)
    lines = [
        f"# Converted from {source}.",
        "# Put this [model] section in your job TOML (or pass --job.config_file this file for evaluate.py).",
        "[model]",
        f'flavor = "{flavor}"',
    ]
    if tokenizer_path:
        lines.append(f"tokenizer_path = {_toml_value(tokenizer_path)}")
    lines += [f"{k} = {_toml_value(v)}" for k, v in overrides.items()]
    if not overrides:
        lines.insert(2, f"# exactly the '{flavor}' flavor")
    return "\n".join(lines) + "\n"
