"""Sample from a trained model with recurrent decoding (one step per token after a parallel prefill).

    python generate.py --checkpoint outputs/debug/checkpoint/step-40 --prompt "The " --max_new_tokens 64 --temperature 0
    python generate.py --checkpoint weights/130m --prompt "Mamba is" --prompt "Once" --temperature 0.8 --top_p 0.9 \\
        --seed 0

--checkpoint: a training checkpoint step-N (its run_record.json names the model and the tokenizer), a weights-only
export or an import with its model.toml; --config: the run's job TOML where the folder holds neither. Each prompt's
continuation is printed after a header line; --temperature 0 is greedy. Prompts of different lengths run as one
batch; a row stops at the tokenizer's EOS.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from components.log import setup_logging
from generation import SamplingParams, generate, load_checkpoint

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python generate.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    p.add_argument("--checkpoint", required=True, help="step-N folder, weights-only export or import folder")
    p.add_argument(
        "--config",
        default=None,
        help="job TOML / model.toml with the [model] section (default: the folder's run_record.json or model.toml)",
    )
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompts_file", default=None, help="a file with one prompt per line (added to --prompt)")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=0, help="0 = no top-k filter")
    p.add_argument("--top_p", type=float, default=1.0, help="1 = no nucleus filter")
    p.add_argument("--seed", type=int, default=None, help="seeds the sampler (the same seed, the same samples)")
    p.add_argument("--tokenizer_path", default=None, help="override the recorded tokenizer ('' = byte tokenizer)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    setup_logging("stderr")  # stdout holds the generated text only; log lines (checkpoint warnings) go to stderr
    prompts = list(a.prompt)
    if a.prompts_file:
        with open(a.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    try:
        if not prompts:
            raise ValueError("no prompt: pass --prompt TEXT (repeatable) or --prompts_file FILE")
        sampling = SamplingParams(a.temperature, a.top_k, a.top_p)
        sampling.validate()
        model, tokenizer = load_checkpoint(a.checkpoint, a.config, a.device, DTYPES.get(a.dtype), a.tokenizer_path)
        encoded = [tokenizer.encode(p) for p in prompts]
        if any(not ids for ids in encoded):
            raise ValueError("a prompt encodes to no tokens; give at least one character")
        with torch.no_grad():
            outputs = generate(
                model,
                encoded,
                a.max_new_tokens,
                sampling,
                eos_id=tokenizer.eos_id,
                seed=a.seed,
                pad_id=tokenizer.pad_id,
            )
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"generate error: {e}")
    for prompt, new in zip(prompts, outputs):
        text = tokenizer.decode([t for t in new if t != tokenizer.eos_id])
        if a.json:
            print(json.dumps({"prompt": prompt, "completion": text, "tokens": new}), flush=True)
        else:
            print(f"=== {prompt!r}\n{prompt}{text}", flush=True)


if __name__ == "__main__":
    main()
