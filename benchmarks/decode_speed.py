"""Decoding throughput of the recurrent generation path (generation.generate) on one device.

    bash .gpu/setup.sh && python3 benchmarks/decode_speed.py --flavors 370M,1.3B --batches 1,32
    python3 benchmarks/decode_speed.py --flavors debug --batches 1,4 --prompt_len 16 --new_tokens 16   # CPU smoke

For each flavor and batch: random-initialised weights (the speed does not depend on the values), bf16 on CUDA
(fp32 on the CPU), prompts of --prompt_len random tokens, greedy, no EOS (every row decodes --new_tokens). One
warm-up generation, then --repeats timed ones. Reports the prefill time (one parallel forward over the prompts)
and the decode rate: new tokens of all rows per second and milliseconds per decode step, excluding the prefill.
Prints a table and, with --out, writes the records as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from generation import SamplingParams, generate  # noqa: E402
from models import build_model_args  # noqa: E402
from models.init import init_weights  # noqa: E402
from models.mamba2.model import Mamba2LM  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(flavor: str, batch: int, prompt_len: int, new_tokens: int, repeats: int, device: torch.device) -> dict:
    args = build_model_args(flavor, {})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = Mamba2LM(args)
    init_weights(model, seed=0, init_std=args.initializer_range)
    model = model.to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab_size, (batch, prompt_len), generator=g).tolist()
    greedy = SamplingParams(temperature=0.0)
    with torch.no_grad():
        generate(model, prompts, new_tokens, greedy)  # warm-up (allocations, kernel autotuning)
        cache = model.allocate_inference_cache(batch, prompt_len + new_tokens)
        ids = torch.tensor(prompts, device=device)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            cache.reset()
            model.prefill(ids, cache)
        sync(device)
        prefill_s = (time.perf_counter() - t0) / repeats
        t0 = time.perf_counter()
        for _ in range(repeats):
            generate(model, prompts, new_tokens, greedy)
        sync(device)
        total_s = (time.perf_counter() - t0) / repeats
    decode_s = max(total_s - prefill_s, 1e-9)
    steps = new_tokens - 1  # the first new token comes from the prefill's logits
    return {
        "flavor": flavor,
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "prefill_ms": prefill_s * 1e3,
        "decode_ms_per_step": decode_s / steps * 1e3,
        "decode_tokens_per_s": batch * steps / decode_s,
        "memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavors", default="370M,1.3B")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records = []
    print(f"{'flavor':>14} {'batch':>5} {'prefill ms':>10} {'ms/step':>8} {'tokens/s':>10} {'GiB':>6}", flush=True)
    for flavor in a.flavors.split(","):
        for batch in (int(b) for b in a.batches.split(",")):
            r = measure(flavor, batch, a.prompt_len, a.new_tokens, a.repeats, device)
            records.append(r)
            print(
                f"{flavor:>14} {batch:>5} {r['prefill_ms']:>10.1f} {r['decode_ms_per_step']:>8.2f} "
                f"{r['decode_tokens_per_s']:>10.0f} {r['memory_gib']:>6.2f}",
                flush=True,
            )
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
