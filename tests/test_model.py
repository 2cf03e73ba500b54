"""The model's pipeline-ready structure, numerically: stage splits reproduce the whole model."""

import copy

import pytest
import torch

from models import build_model_args, build_model_on_meta
from models.init import init_weights
from models.mamba2.model import Mamba2LM, pack_hidden_residual, unpack_hidden_residual


def make_model(seed=0, **overrides) -> Mamba2LM:
    # residual_in_fp32 would round the float64 residual down to float32: keep the whole test in float64.
    base = dict(d_model=32, n_layers=4, d_state=8, headdim=8, chunk_size=16, residual_in_fp32=False)
    args = build_model_args("debug", dict(base, **overrides))
    model = build_model_on_meta(args)
    model.to_empty(device="cpu")
    init_weights(model, seed=seed)
    return model.double()


def batch(b=2, s=40, vocab=258, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    starts = torch.zeros(b, s, dtype=torch.int32)
    starts[:, [7, 19, 30]] = 1  # three document starts per row
    return tokens, starts.cumsum(1).to(torch.int32)


def split_stages(model: Mamba2LM, boundary: int, fmt: str):
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    for name in list(first.layers):
        del (first.layers if int(name) >= boundary else second.layers)[name]
    first.norm_f = first.lm_head = None
    second.tok_embeddings = None
    if second.args.tie_embeddings:  # the deepcopy untied nothing: lm_head still holds the shared weight
        assert second.lm_head.weight is not None
    first.pack_format = second.pack_format = fmt
    return first, second


def test_modeldict_names_survive_deletion():
    model = make_model()
    full_names = dict(model.named_parameters())
    del model.layers["1"], model.layers["2"]
    assert list(model.layers) == ["0", "3"]
    for name, p in model.named_parameters():
        assert torch.equal(p, full_names[name]), name
    assert any(n.startswith("layers.3.") for n in dict(model.named_parameters()))


@pytest.mark.parametrize("fmt", ["stack", "sum"])
@pytest.mark.parametrize("tie", [True, False])
def test_two_stages_reproduce_whole_model(fmt, tie):
    model = make_model(tie_embeddings=tie)
    tokens, seq_idx = batch()
    want = model(tokens, seq_idx=seq_idx)
    first, second = split_stages(model, 2, fmt)
    packed = first(tokens, seq_idx=seq_idx)
    assert packed.shape == ((2,) if fmt == "stack" else ()) + (2, 40, 32)
    got = second(packed, seq_idx=seq_idx)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_stage_without_layers_passes_through():
    model = make_model()
    tokens, seq_idx = batch()
    first, second = split_stages(model, 0, "stack")  # the first stage only embeds
    torch.testing.assert_close(second(first(tokens, seq_idx=seq_idx), seq_idx=seq_idx), model(tokens, seq_idx=seq_idx))


def test_pack_roundtrip_formats():
    h, r = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    for fmt in ("stack", "sum"):
        hh, rr = unpack_hidden_residual(pack_hidden_residual(h, r, fmt), fmt)
        torch.testing.assert_close(hh + (rr if rr is not None else 0), h + r)
    with pytest.raises(ValueError, match="pipeline_parallel_pack"):
        pack_hidden_residual(h, r, "concat")


def test_init_is_layout_independent():
    """A stage that owns only some layers initialises them exactly as the whole model does."""
    args = build_model_args("debug", dict(n_layers=4))
    whole = build_model_on_meta(args)
    whole.to_empty(device="cpu")
    init_weights(whole, seed=7)
    stage = build_model_on_meta(args)
    del stage.layers["0"], stage.layers["1"]
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    init_weights(stage, seed=7)
    ref = dict(whole.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, ref[name]), name
    other = build_model_on_meta(args)
    other.to_empty(device="cpu")
    init_weights(other, seed=8)
    assert not torch.equal(
        dict(other.named_parameters())["layers.2.mixer.in_proj.weight"], ref["layers.2.mixer.in_proj.weight"]
    )


def test_init_matches_mamba_ssm_scheme():
    model = make_model(seed=3)
    a = model.args
    mixer = model.layers["0"].mixer
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert dt.min() >= a.dt_init_floor * 0.999 and dt.max() <= a.dt_max * 1.001
    A = torch.exp(mixer.A_log)
    assert A.min() >= a.A_init_min and A.max() <= a.A_init_max
    assert torch.all(mixer.D == 1) and torch.all(mixer.norm.weight == 1)
    bound = 1 / (a.d_inner**0.5) / (a.n_layers**0.5)  # out_proj rescaled by 1/sqrt(n_layers)
    assert mixer.out_proj.weight.abs().max() <= bound
    assert abs(model.tok_embeddings.weight.std().item() - a.initializer_range) < 0.005


def test_document_isolation_through_the_model():
    """Changing an earlier document never changes a later document's logits."""
    model = make_model()
    tokens, seq_idx = batch()
    out = model(tokens, seq_idx=seq_idx)
    changed = tokens.clone()
    changed[:, :19] = (changed[:, :19] + 5) % 258  # documents 0 and 1
    out2 = model(changed, seq_idx=seq_idx)
    torch.testing.assert_close(out2[:, 19:], out[:, 19:], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out2[:, :19], out[:, :19])


@pytest.mark.parametrize("wrap", ["activation_checkpoint", "compile"])
def test_init_ignores_wrapper_names(wrap):
    """Activation checkpointing and torch.compile wrap blocks; initial weights must not change."""
    from configs.job_config import ActivationCheckpoint
    from models.init import canonical_name
    from parallelisms.activation_checkpoint import apply_activation_checkpoint
    from parallelisms.compile import apply_compile

    args = build_model_args("debug", dict(n_layers=2))
    plain = build_model_on_meta(args)
    plain.to_empty(device="cpu")
    init_weights(plain, seed=5)
    wrapped = build_model_on_meta(args)
    if wrap == "compile":
        apply_compile(wrapped)
    else:
        apply_activation_checkpoint(wrapped, ActivationCheckpoint(mode="full"))
    wrapped.to_empty(device="cpu")
    init_weights(wrapped, seed=5)
    ref = dict(plain.named_parameters())
    names = dict(wrapped.named_parameters())
    assert any(n != canonical_name(n) for n in names)
    for name, p in names.items():
        assert torch.equal(p, ref[canonical_name(name)]), name


@pytest.mark.parametrize("keep, expected", [(0, [False] * 4), (2, [False, False, True, True]), (-1, [True] * 4)])
def test_keep_conv_layers_are_the_last_ones(keep, expected):
    """model.ssd_keep_conv_layers K: the Mamba mixers of the last K layers keep their conv output (-1: all)."""
    from models.args import build_model_args

    model = Mamba2LM(build_model_args("debug", {"ssd_keep_conv_layers": keep}))
    assert [block.mixer.keep_conv for block in model.layers.values()] == expected
