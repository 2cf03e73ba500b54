"""generate.py and generation.load_checkpoint on a model trained by train.py (CPU, fp32): greedy tokens equal a
greedy loop over the full forward and transformers' generate on the HF export; weights-only exports load too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from checkpoint.export import main as export_main
from generation import SamplingParams, generate, load_checkpoint
from tests.parity import REPO, run_training

TRAIN_ARGS = [
    "--job.config_file",
    "configs/debug.toml",
    "--model.d_model",
    "64",
    "--model.n_layers",
    "2",
    "--model.chunk_size",
    "16",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "4",
    "--training.global_batch_size",
    "4",
    "--training.steps",
    "6",
    "--lr_scheduler.warmup_steps",
    "1",
    "--training.deterministic",
    "true",
    "--metrics.enable_tensorboard",
    "false",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "6",
]
PROMPTS = ["The ", "def f(x):", "q"]


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory):
    dump = tmp_path_factory.mktemp("gen")
    run_training(1, TRAIN_ARGS, dump)
    return dump / "checkpoint" / "step-6"


def cli(*args: str) -> list[dict]:
    r = subprocess.run(
        [sys.executable, "generate.py", *args, "--json"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines()]


def greedy_by_full_forward(model, prompt: list[int], n: int, eos: int) -> list[int]:
    seq, new = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(torch.tensor([seq]))[0, -1, : model.args.vocab_size].argmax())
            new.append(token)
            if token == eos:
                break
            seq.append(token)
    return new


def test_greedy_cli_equals_the_full_forward_loop_and_transformers(step_dir, tmp_path):
    out = cli(
        "--checkpoint",
        str(step_dir),
        *sum((["--prompt", p] for p in PROMPTS), []),
        "--max_new_tokens",
        "12",
        "--temperature",
        "0",
    )
    model, tokenizer = load_checkpoint(str(step_dir))
    assert [o["prompt"] for o in out] == PROMPTS
    for o, prompt in zip(out, PROMPTS):
        want = greedy_by_full_forward(model, tokenizer.encode(prompt), 12, tokenizer.eos_id)
        assert o["tokens"] == want
        assert o["completion"] == tokenizer.decode([t for t in want if t != tokenizer.eos_id])

    from transformers import Mamba2ForCausalLM

    from checkpoint.convert import main as convert_main

    convert_main(["to-hf", str(step_dir), str(tmp_path / "hf")])  # the model from the step's run_record.json
    hf = Mamba2ForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    for o, prompt in zip(out, PROMPTS):
        ids = tokenizer.encode(prompt)
        got = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
        )[0, len(ids) :].tolist()
        assert got == o["tokens"], (prompt, got, o["tokens"])


def test_weights_only_export_and_sampling_seed(step_dir, tmp_path):
    export_main(["--checkpoint", str(step_dir), "--out", str(tmp_path / "weights"), "--dtype", "float32"])
    args = [
        "--prompt",
        "The ",
        "--prompt",
        "x",
        "--max_new_tokens",
        "10",
        "--temperature",
        "0.9",
        "--top_k",
        "20",
        "--seed",
        "3",
    ]
    a = cli("--checkpoint", str(tmp_path / "weights"), *args)
    b = cli("--checkpoint", str(step_dir), *args)
    assert a == b  # same weights, same seed: the same samples
    model, tokenizer = load_checkpoint(str(step_dir))
    with torch.no_grad():
        api = generate(
            model,
            [tokenizer.encode("The "), tokenizer.encode("x")],
            10,
            SamplingParams(0.9, 20, 1.0),
            eos_id=tokenizer.eos_id,
            seed=3,
            pad_id=tokenizer.pad_id,
        )
    assert [o["tokens"] for o in a] == api


def test_cli_errors_name_the_fix(tmp_path):
    r = subprocess.run(
        [sys.executable, "generate.py", "--checkpoint", str(tmp_path), "--prompt", "x"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "generate error:" in r.stderr and "--config" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_decode_speed_benchmark_runs_and_counts_the_decode_steps(tmp_path):
    from benchmarks import decode_speed

    out = tmp_path / "decode.json"
    decode_speed.main(
        [
            "--flavors",
            "debug",
            "--batches",
            "2",
            "--prompt_len",
            "5",
            "--new_tokens",
            "4",
            "--repeats",
            "2",
            "--out",
            str(out),
        ]
    )
    (r,) = json.loads(out.read_text())
    assert r["batch"] == 2 and r["new_tokens"] == 4 and r["prefill_ms"] > 0
    # 3 decode steps of 2 rows: tokens/s and ms/step describe the same time
    assert abs(r["decode_tokens_per_s"] * r["decode_ms_per_step"] / 1e3 - 2) < 1e-6
