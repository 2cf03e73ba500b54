"""`checkpoint.convert to-hf` of our own trained weights, loaded the way users load them (transformers, CPU, fp32).

- A model trained a few steps by train.py gives our logits (1e-5 relative) after
  `Mamba2ForCausalLM.from_pretrained`, and HF's greedy `generate` (its recurrent decoding) emits the tokens of a
  greedy loop over our full forward (tests/test_decode.py also checks generation.generate against it). Our own
  weights, not an HF import: test_convert's round trips start from HF models whose config says
  rescale_prenorm_residual=false, so transformers' init pass over the loaded model (which divides every out_proj by
  sqrt(n_layers) when it is true) never showed. config.json / generation_config.json carry the byte tokenizer's ids.
- Non-default config fields (ngroups, chunk_size, eps, biases, untied, padded vocabulary) survive the export and
  the import back; a tokenizer.json run's tokenizer files come along and load with AutoTokenizer.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from checkpoint.convert import export_checkpoint, import_checkpoint, main, read_dcp_weights, write_dcp_weights
from checkpoint.formats import UnsupportedCheckpoint
from models import Mamba2LM
from models.args import ModelArgs, build_model_args
from tests.parity import run_training

transformers = pytest.importorskip("transformers")

MODEL_ARGS = ["--model.d_model", "64", "--model.n_layers", "4", "--model.chunk_size", "16", "--model.ngroups", "2"]
TRAIN_ARGS = [
    "--job.config_file",
    "configs/debug.toml",
    *MODEL_ARGS,
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "4",
    "--training.global_batch_size",
    "4",
    "--training.steps",
    "8",
    "--lr_scheduler.warmup_steps",
    "1",
    "--training.deterministic",
    "true",
    "--metrics.enable_tensorboard",
    "false",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "8",
]
BYTE_EOS, BYTE_PAD = 256, 257


def assert_close(got, want, rtol=1e-5):
    err = (got - want).abs().max().item()
    assert err <= rtol * want.abs().max().item(), f"max abs diff {err} vs scale {want.abs().max().item()}"


def load_hf(folder):
    from transformers import Mamba2ForCausalLM

    return Mamba2ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


def assert_our_greedy_choices(model: Mamba2LM, seq: list[int], prompt_len: int, new_tokens: int, eos: int) -> None:
    """seq (a prompt and what HF generated) is what a greedy loop over our full forward produces: every new token
    is our argmax after the tokens before it, EOS only last, and 16 new tokens unless it stopped at EOS.

    One forward over seq instead of one per token: the model is causal, so position t's logits are those of
    the forward over seq[:t + 1] that a step-by-step loop would run (2 cores are shared in CI).
    """
    new = seq[prompt_len:]
    assert len(new) == new_tokens or (0 < len(new) < new_tokens and new[-1] == eos), new
    assert eos not in new[:-1], new
    with torch.no_grad():
        choices = model(torch.tensor([seq]))[0, prompt_len - 1 : -1].argmax(-1).tolist()
    assert choices == new, (seq[:prompt_len], new, choices)


@pytest.fixture(scope="module")
def trained_step(tmp_path_factory):
    """A step-8 training checkpoint of a small debug Mamba-2 (byte tokenizer, tied embeddings, ngroups 2)."""
    dump = tmp_path_factory.mktemp("trained")
    records = run_training(1, TRAIN_ARGS, dump)
    assert records[-1]["loss"] < records[0]["loss"]  # trained, not an init
    return dump / "checkpoint" / "step-8"


def test_trained_export_loads_in_transformers_with_our_logits_and_greedy_tokens(trained_step, tmp_path):
    main(["to-hf", str(trained_step), str(tmp_path / "hf"), "--config", "configs/debug.toml", *MODEL_ARGS])
    ours = Mamba2LM(build_model_args("debug", {"d_model": 64, "n_layers": 4, "chunk_size": 16, "ngroups": 2})).eval()
    ours.load_state_dict(read_dcp_weights(str(trained_step)))
    hf = load_hf(tmp_path / "hf")

    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rescale_prenorm_residual"] is False and cfg["n_groups"] == 2 and cfg["tie_word_embeddings"] is True
    ids = {"bos_token_id": BYTE_EOS, "eos_token_id": BYTE_EOS, "pad_token_id": BYTE_PAD}
    assert {k: cfg[k] for k in ids} == ids
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation == {**ids, "suppress_tokens": list(range(258, 272))}  # the padding rows are never emitted
    assert (hf.generation_config.eos_token_id, hf.generation_config.pad_token_id) == (BYTE_EOS, BYTE_PAD)
    assert not (tmp_path / "hf" / "tokenizer.json").exists()  # the byte tokenizer has no HF file

    x = torch.randint(0, 256, (2, 45), generator=torch.Generator().manual_seed(0))  # 45: a partial last chunk
    with torch.no_grad():
        assert_close(hf(x, use_cache=False).logits, ours(x))

    for text in ("The ", "Once upon a time, there", "q"):
        prompt = list(text.encode())
        got = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=16,
        )
        assert got[0, : len(prompt)].tolist() == prompt
        assert_our_greedy_choices(ours, got[0].tolist(), len(prompt), 16, BYTE_EOS)


def test_a_step_folder_exports_without_config_from_its_run_record(trained_step, tmp_path):
    main(["to-hf", str(trained_step), str(tmp_path / "with"), "--config", "configs/debug.toml", *MODEL_ARGS])
    main(["to-hf", str(trained_step), str(tmp_path / "without")])  # the model comes from run_record.json
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "with" / name).read_text()) == json.loads(
            (tmp_path / "without" / name).read_text()
        )
    assert (tmp_path / "with" / "model.safetensors").read_bytes() == (
        tmp_path / "without" / "model.safetensors"
    ).read_bytes()


def _perturbed_weights(args: ModelArgs, folder) -> Mamba2LM:
    """Every tensor moved off any init (deterministically), written as a weights-only DCP folder."""
    from models.init import init_weights

    model = Mamba2LM(args).eval()
    init_weights(model, seed=0)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    write_dcp_weights(model.state_dict(), str(folder))
    return model


def tiny_tokenizer(folder, with_config: bool) -> str:
    """A word-level tokenizer.json (12 tokens) with an end-of-text token and, optionally, tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "the a cat dog sat on mat and ran".split()
    vocab = {"<|endoftext|>": 0, "<pad>": 1, "<s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>", "<pad>", "<s>"])
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if with_config:
        (folder / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": "<s>",
                    "eos_token": "<|endoftext|>",
                    "pad_token": "<pad>",
                }
            )
        )
        (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>"}))
    return str(folder / "tokenizer.json")


@pytest.mark.parametrize("with_config", [False, True])
def test_config_fields_and_tokenizer_files_round_trip(tmp_path, with_config):
    from transformers import AutoTokenizer

    from data.tokenizer import HFTokenizer

    args = ModelArgs(
        d_model=32,
        n_layers=2,
        vocab_size=50,
        pad_vocab_size_multiple=16,
        d_state=8,
        headdim=8,
        ngroups=2,
        chunk_size=8,
        norm_eps=1e-6,
        residual_in_fp32=False,
        conv_bias=False,
        bias=True,
        tie_embeddings=False,
    )
    ours = _perturbed_weights(args, tmp_path / "dcp")
    tokenizer_json = tiny_tokenizer(tmp_path / "tok", with_config)
    files = export_checkpoint(str(tmp_path / "dcp"), str(tmp_path / "hf"), "hf", args, tokenizer_path=tokenizer_json)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(files)
    assert ("special_tokens_map.json" in files) == with_config

    hf = load_hf(tmp_path / "hf")
    c = hf.config
    assert (
        c.vocab_size,
        c.n_groups,
        c.chunk_size,
        c.layer_norm_epsilon,
        c.residual_in_fp32,
        c.use_conv_bias,
        c.use_bias,
        c.tie_word_embeddings,
        c.rescale_prenorm_residual,
    ) == (64, 2, 8, 1e-6, False, False, True, False, False)
    bos = 2 if with_config else 0  # tokenizer_config.json's bos_token, else eos
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (bos, 0, 1)
    assert hf.generation_config.bos_token_id == bos and hf.generation_config.eos_token_id == 0
    x = torch.randint(0, 50, (2, 21))
    with torch.no_grad():
        assert_close(hf(x, use_cache=False).logits, ours(x))

    hf_tok, our_tok = AutoTokenizer.from_pretrained(tmp_path / "hf"), HFTokenizer(tokenizer_json)
    text = "the cat sat on the mat and the dog ran"
    assert hf_tok(text, add_special_tokens=False).input_ids == our_tok.encode(text)
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id, hf_tok.bos_token_id) == (0, 1, bos)

    back = import_checkpoint(str(tmp_path / "hf"), str(tmp_path / "back"), "hf")
    for k in (
        "d_model",
        "n_layers",
        "padded_vocab_size",
        "ngroups",
        "chunk_size",
        "norm_eps",
        "residual_in_fp32",
        "conv_bias",
        "bias",
        "tie_embeddings",
        "D_has_hdim",
        "norm_before_gate",
        "d_state",
        "headdim",
    ):
        assert getattr(back, k) == getattr(args, k), k


def test_what_hf_cannot_hold_is_refused_before_writing(tmp_path):
    args = ModelArgs(d_model=32, n_layers=2, vocab_size=50, d_state=8, headdim=8, chunk_size=8)
    _perturbed_weights(args, tmp_path / "dcp")
    too_big = tiny_tokenizer(tmp_path / "tok", with_config=False)
    with pytest.raises(ValueError, match="has 12 tokens but the model only 10.*--model.tokenizer_path"):
        export_checkpoint(
            str(tmp_path / "dcp"), str(tmp_path / "o"), "hf", replace(args, vocab_size=10), tokenizer_path=too_big
        )
    with pytest.raises(UnsupportedCheckpoint, match="hybrid"):
        export_checkpoint(str(tmp_path / "dcp"), str(tmp_path / "o"), "hf", replace(args, layer_pattern="M*"))
    with pytest.raises(UnsupportedCheckpoint, match="D_has_hdim"):
        export_checkpoint(str(tmp_path / "dcp"), str(tmp_path / "o"), "hf", replace(args, D_has_hdim=True))
    assert not (tmp_path / "o").exists()
