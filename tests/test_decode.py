"""Recurrent decoding (CPU, fp32): the step ops against the parallel references, prefill + decode_step against the
parallel forward, left-padded batches against single prompts, the sampler / generate loop, and greedy generation
against HF transformers' own recurrent decoding of the exported weights."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from generation import SamplingParams, generate, left_pad, sample_next_tokens
from generation.sampling import allowed_tokens
from models import build_model_args, build_model_on_meta
from models.init import init_weights
from models.kernels.conv_reference import causal_conv1d_ref
from models.kernels.ssd_reference import ssd_chunk_scan_ref
from models.kernels.step_reference import causal_conv1d_update_ref, selective_state_update_ref

RTOL = 1e-5
VOCAB = 258
DEBUG_TOML = Path(__file__).resolve().parents[1] / "configs" / "debug.toml"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model, one token at a time: more threads only contend on a busy CPU (5x here)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def perturbed_model(flavor: str, overrides: tuple = ()):
    """The debug model with initialised weights moved off their init values (D != 1, norms != 1, a non-zero
    MoE selection bias, ...), so that no term of the step can be silently wrong because its weight is trivial.
    overrides: (name, value) pairs of ModelArgs fields."""
    model = build_model_on_meta(build_model_args(flavor, dict(overrides)))
    model.to_empty(device="cpu")
    model.tie_weights()
    init_weights(model, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * p.abs().mean().clamp_min(0.02) * torch.randn(p.shape, generator=g))
        for b in model.buffers():
            if b.is_floating_point():
                b.add_(0.05 * torch.randn(b.shape, generator=g))
    return model.eval()


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # 1e-5 relative to the logits' scale (elementwise rtol is meaningless for logits that cross zero).
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < RTOL, f"{what}: max |step - parallel| / max |parallel| = {err:.2e}"


def tokens(b: int, s: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- step ops


def test_selective_state_update_ref_steps_equal_the_chunked_scan():
    b, L, H, P, G, N = 2, 11, 4, 3, 2, 5
    g = torch.Generator().manual_seed(0)
    x, z = torch.randn(b, L, H, P, generator=g), torch.randn(b, L, H, P, generator=g)
    dt = torch.randn(b, L, H, generator=g)
    Bm, Cm = torch.randn(b, L, G, N, generator=g), torch.randn(b, L, G, N, generator=g)
    A, D, dt_bias = -torch.rand(H, generator=g) - 0.5, torch.randn(H, P, generator=g), torch.randn(H, generator=g)
    init = torch.randn(b, H, P, N, generator=g)
    dt_limit = (0.05, 1.5)  # a real clamp, so both ends of dt_limit matter
    want_y, want_state = ssd_chunk_scan_ref(
        x,
        dt,
        A,
        Bm,
        Cm,
        4,
        D=D,
        z=z,
        dt_bias=dt_bias,
        dt_softplus=True,
        dt_limit=dt_limit,
        initial_states=init,
        return_final_states=True,
    )
    state = init.clone()
    for t in range(L):
        y = selective_state_update_ref(
            state,
            x[:, t],
            dt[:, t, :, None].expand(b, H, P),
            A[:, None, None].expand(H, P, N),
            Bm[:, t],
            Cm[:, t],
            D,
            z[:, t],
            dt_bias[:, None].expand(H, P),
            dt_softplus=True,
            dt_limit=dt_limit,
        )
        torch.testing.assert_close(y, want_y[:, t], rtol=RTOL, atol=1e-6)
    torch.testing.assert_close(state, want_state, rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("state_len", [3, 4, 6])  # width - 1 (causal_conv1d >= 1.4), width (mamba_ssm), longer
def test_causal_conv1d_update_ref_steps_equal_the_parallel_conv(state_len):
    b, d, L, W = 2, 6, 9, 4
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(b, d, L, generator=g), torch.randn(d, W, generator=g), torch.randn(d, generator=g)
    want = causal_conv1d_ref(x, w, bias, activation="silu")
    state = torch.zeros(b, d, state_len)
    for t in range(L):
        torch.testing.assert_close(
            causal_conv1d_update_ref(x[:, :, t], state, w, bias, "silu"), want[:, :, t], rtol=RTOL, atol=1e-6
        )
    torch.testing.assert_close(state, F.pad(x, (state_len, 0))[:, :, -state_len:])  # the last inputs, oldest first


def test_step_refs_reject_bad_shapes():
    with pytest.raises(ValueError, match=r"conv_state must be \[batch, dim, state_len >= width - 1\]"):
        causal_conv1d_update_ref(torch.zeros(2, 6), torch.zeros(2, 6, 2), torch.zeros(6, 4))
    with pytest.raises(ValueError, match=r"A must be \[nheads, headdim, dstate\]"):
        selective_state_update_ref(
            torch.zeros(1, 2, 3, 4),
            torch.zeros(1, 2, 3),
            torch.zeros(1, 2, 3),
            torch.zeros(2),
            torch.zeros(1, 1, 4),
            torch.zeros(1, 1, 4),
        )


# ---------------------------------------------------------------------------------------------- the model


def prefill_then_decode(model, ids_BS: torch.Tensor, k: int, prompt_lengths_B=None):
    """Prefill columns [0, k), then feed columns k.. one at a time: the logits of columns k-1 .. s-1 [B, s-k+1, V]."""
    cache = model.allocate_inference_cache(ids_BS.shape[0], ids_BS.shape[1])
    logits = [model.prefill(ids_BS[:, :k], cache, prompt_lengths_B)]
    for t in range(k, ids_BS.shape[1]):
        logits.append(model.decode_step(ids_BS[:, t], cache))
    return torch.stack(logits, dim=1)


# k = 37 crosses the chunk boundary (chunk_size 32); k = 2 is shorter than d_conv - 1; k = 1 a single token.
@pytest.mark.parametrize("flavor", ["debug", "hybrid_moe_debug"])
@pytest.mark.parametrize("k", [37, 2, 1])
def test_decode_steps_equal_the_parallel_forward(flavor, k):
    model = perturbed_model(flavor)
    ids_BS = tokens(2, k + 6, seed=k)
    with torch.no_grad():
        want_BSV = model(ids_BS)
    got = prefill_then_decode(model, ids_BS, k)
    for i in range(got.shape[1]):
        assert_logits_close(got[:, i], want_BSV[:, k - 1 + i], f"{flavor}, prefill {k}, column {k - 1 + i}")


# The branches the default flavors leave out: groups of B / C, D per channel, norm before gate, a dt clamp, a
# conv of width 3, in/out projection biases; attention without rotary or GQA, sigmoid routing with renormalisation.
VARIANTS = {
    "debug": dict(
        ngroups=2,
        D_has_hdim=True,
        norm_before_gate=True,
        dt_limit_min=0.01,
        dt_limit_max=0.2,
        d_conv=3,
        bias=True,
        conv_bias=False,
    ),
    "hybrid_moe_debug": dict(rope_theta=0.0, n_kv_heads=4, moe_score_func="sigmoid", moe_route_norm=True),
}


@pytest.mark.parametrize("flavor", ["debug", "hybrid_moe_debug"])
def test_decode_steps_equal_the_parallel_forward_in_model_variants(flavor):
    model = perturbed_model(flavor, tuple(VARIANTS[flavor].items()))
    k = 35
    ids_BS = tokens(2, k + 4, seed=3)
    with torch.no_grad():
        want_BSV = model(ids_BS)
    got = prefill_then_decode(model, ids_BS, k)
    for i in range(got.shape[1]):
        assert_logits_close(got[:, i], want_BSV[:, k - 1 + i], f"{flavor} {VARIANTS[flavor]}, column {k - 1 + i}")


@pytest.mark.parametrize("flavor", ["debug", "hybrid_moe_debug"])
def test_left_padded_batch_gives_each_prompts_own_logits(flavor):
    model = perturbed_model(flavor)
    prompt_lengths, n_new = [35, 2, 9], 5
    rows = [tokens(1, n + n_new, seed=10 + n)[0] for n in prompt_lengths]
    # A pad id that is a real, non-zero token: the padding must not leak whatever its embedding.
    ids_BS, lengths_B = left_pad([r[:n].tolist() for r, n in zip(rows, prompt_lengths)], pad_id=7)
    ids_BS = torch.cat([ids_BS, torch.stack([r[n:] for r, n in zip(rows, prompt_lengths)])], dim=1)
    batch = prefill_then_decode(model, ids_BS, max(prompt_lengths), lengths_B)
    for row, (r, n) in enumerate(zip(rows, prompt_lengths)):
        alone = prefill_then_decode(model, r[None], n)
        assert_logits_close(batch[row], alone[0], f"{flavor}, prompt of {n} tokens in a padded batch")


def test_a_reset_cache_serves_a_new_batch_like_a_fresh_one():
    model = perturbed_model("hybrid_moe_debug")
    first, second = tokens(2, 12, seed=5), tokens(2, 6, seed=6)
    cache = model.allocate_inference_cache(2, 12)
    model.prefill(first[:, :3], cache, torch.tensor([3, 1]))  # padded, then 9 steps: every KV column is written
    for t in range(3, 12):
        model.decode_step(first[:, t], cache)
    cache.reset()
    reused = [model.prefill(second[:, :4], cache)] + [model.decode_step(second[:, t], cache) for t in range(4, 6)]
    fresh = prefill_then_decode(model, second, 4)
    torch.testing.assert_close(torch.stack(reused, dim=1), fresh, rtol=0, atol=0)


def test_decode_api_errors_name_the_fix():
    model = perturbed_model("debug")
    cache = model.allocate_inference_cache(2, 4)
    with pytest.raises(ValueError, match="call prefill"):
        model.decode_step(torch.zeros(2, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="allocate a longer cache"):
        model.prefill(tokens(2, 5, seed=0), cache)
    with pytest.raises(ValueError, match=r"prompt_lengths must be \[batch\]"):
        model.prefill(tokens(2, 3, seed=0), cache, torch.tensor([3, 0]))
    model.prefill(tokens(2, 4, seed=0), cache)
    with pytest.raises(ValueError, match="cache is full"):
        model.decode_step(torch.zeros(2, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"cache\.reset\(\)"):
        model.prefill(tokens(2, 3, seed=0), cache)
    model.train()
    try:
        with pytest.raises(ValueError, match=r"model\.eval\(\)"):
            model.allocate_inference_cache(2, 4)
    finally:
        model.eval()


# ---------------------------------------------------------------------------------------------- sampling


def test_greedy_is_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(sample_next_tokens(logits, SamplingParams(temperature=0)), logits.argmax(-1))


def test_a_seed_reproduces_the_samples():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.5)

    def draws(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.stack([sample_next_tokens(logits, params, g) for _ in range(20)])

    assert torch.equal(draws(3), draws(3))
    assert not torch.equal(draws(3), draws(4))


def test_top_k_and_top_p_never_sample_outside_their_set():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g) * 3
    probs = logits.softmax(-1)
    top4 = logits.topk(4, dim=-1).indices
    for _ in range(200):
        tok = sample_next_tokens(logits, SamplingParams(top_k=4), g)
        assert bool((top4 == tok[:, None]).any(-1).all())
    # The nucleus, computed independently: the most likely tokens until their total reaches 0.6.
    for row in range(3):
        ranked = probs[row].argsort(descending=True).tolist()
        nucleus, total = set(), 0.0
        for t in ranked:
            nucleus.add(t)
            total += probs[row, t].item()
            if total >= 0.6:
                break
        assert set(allowed_tokens(logits, SamplingParams(top_p=0.6))[row].nonzero().flatten().tolist()) == nucleus
    for _ in range(200):
        tok = sample_next_tokens(logits, SamplingParams(top_p=0.6), g)
        assert all(allowed_tokens(logits, SamplingParams(top_p=0.6))[range(3), tok])


def test_sampling_params_are_checked():
    for bad, field in ((dict(temperature=-1), "temperature"), (dict(top_k=-2), "top_k"), (dict(top_p=0), "top_p")):
        with pytest.raises(ValueError, match=field):
            sample_next_tokens(torch.zeros(1, 5), SamplingParams(**bad))


def test_generate_batch_equals_single_prompts_and_eos_stops_only_its_row():
    model = perturbed_model("hybrid_moe_debug")
    prompts = [tokens(1, 9, seed=1)[0].tolist(), tokens(1, 3, seed=2)[0].tolist()]
    greedy = SamplingParams(temperature=0)
    free = generate(model, prompts, 8, greedy)
    assert [len(o) for o in free] == [8, 8]
    for prompt, out in zip(prompts, free):
        assert generate(model, [prompt], 8, greedy) == [out]
    eos = free[0][2]  # row 0 stops after its third token; row 1 runs on until it produces eos, if ever
    stopped = generate(model, prompts, 8, greedy, eos_id=eos)
    for out, full in zip(stopped, free):
        assert out == (full[: full.index(eos) + 1] if eos in full else full)
    assert len(stopped[0]) == 3 and len(stopped[1]) > 3


def test_generate_samples_only_real_vocabulary_ids_and_checks_prompts():
    model = perturbed_model("debug")
    assert model.args.padded_vocab_size > model.args.vocab_size  # 258 -> 272: 14 ids no tokenizer produces
    outs = generate(model, [[1, 2, 3]] * 4, 12, SamplingParams(temperature=5.0), seed=0)
    assert all(0 <= t < model.args.vocab_size for o in outs for t in o)
    assert outs == generate(model, [[1, 2, 3]] * 4, 12, SamplingParams(temperature=5.0), seed=0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []], 2)
    with pytest.raises(ValueError, match=r"outside \[0, 258\)"):
        generate(model, [[1, 300]], 2)


def test_greedy_generation_equals_transformers_recurrent_decoding(tmp_path):
    """An independent implementation: our weights exported to HF Mamba2ForCausalLM (checkpoint.convert), its
    cached greedy generate (restricted to the real vocabulary, as ours) gives our batched tokens, and its scores
    are our decode-step logits."""
    transformers = pytest.importorskip("transformers")
    from checkpoint.convert import main as convert_main
    from checkpoint.convert import write_dcp_weights

    overrides = {"d_model": 64, "n_layers": 4, "chunk_size": 16, "ngroups": 2}
    model = perturbed_model("debug", tuple(overrides.items()))
    write_dcp_weights(model.state_dict(), str(tmp_path / "weights"))
    convert_main(
        [
            "to-hf",
            str(tmp_path / "weights"),
            str(tmp_path / "hf"),
            "--config",
            str(DEBUG_TOML),
            *[a for k, v in overrides.items() for a in (f"--model.{k}", str(v))],
        ]
    )
    hf = transformers.Mamba2ForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    prompts, n_new, V = [list(b"Once upon a time, there"), list(b"q")], 24, model.args.vocab_size
    ours = generate(model, prompts, n_new, SamplingParams(temperature=0))
    for prompt, out in zip(prompts, ours):
        got = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            eos_token_id=None,
            suppress_tokens=list(range(V, model.args.padded_vocab_size)),
            output_scores=True,
            return_dict_in_generate=True,
        )
        assert got.sequences[0, len(prompt) :].tolist() == out
        cache = model.allocate_inference_cache(1, len(prompt) + n_new)
        logits = [model.prefill(torch.tensor([prompt]), cache)]
        logits += [model.decode_step(torch.tensor([t]), cache) for t in out[:-1]]
        assert_logits_close(
            torch.stack(logits, 1)[0, :, :V],
            torch.stack(got.scores, 1)[0, :, :V],
            f"transformers' scores, prompt of {len(prompt)}",
        )
