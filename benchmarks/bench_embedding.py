"""GPU time of the tied embedding's weight gradient at a model's shape: torch's embedding backward plus autograd's add
into the head's gradient (before session 52) against ours added in place (models/kernels/embedding_triton.py, what
the model runs with tied weights and our fused loss: models/kernels/tied_embedding.py).

    bash .gpu/setup.sh && python3 benchmarks/bench_embedding.py [--tokens 16384] [--hot 0.05] [--calls 20]

Inputs: `--tokens` ids over the padded GPT-NeoX vocabulary (50,288 rows, 2,048 wide: the 1.3B; --width for others),
one token at a `--hot` fraction of the positions (real text's end-of-document and commonest tokens: long runs once
sorted), a float32 gradient [tokens, width] and a float32 [V, width] head gradient to add into. Times: CUDA events
around `--calls` calls after 3 warm-up calls, each path twice, alternating.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch

VOCAB = 50288


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="positions (the 1.3B's 4 x 4096)")
    ap.add_argument("--width", type=int, default=2048, help="d_model")
    ap.add_argument("--hot", type=float, default=0.05, help="fraction of the positions holding one token")
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.width < 1 or a.calls < 1 or not 0 <= a.hot <= 1:
        raise SystemExit("--tokens, --width and --calls must be >= 1 and --hot in [0, 1]")
    return a


def _time_us(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1000


def main(argv=None) -> dict:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_embedding.py times GPU kernels: run it on a CUDA machine (bash .gpu/setup.sh first)")
    from models.kernels.embedding_triton import embedding_grad_add_

    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, VOCAB, (a.tokens,), device="cuda", generator=g)
    ids[torch.rand(a.tokens, device="cuda", generator=g) < a.hot] = 11
    grad = torch.randn(a.tokens, a.width, device="cuda", generator=g)
    head_grad = torch.randn(VOCAB, a.width, device="cuda", generator=g)

    def torch_path():  # what autograd ran: a zero-filled dense gradient, the scatter, then the add of the two
        return head_grad + torch.ops.aten.embedding_dense_backward(grad, ids, VOCAB, -1, False)

    def ours():
        return embedding_grad_add_(head_grad, ids, grad)

    times = {"torch": [], "ours": []}
    for _ in range(2):
        for name, fn in (("torch", torch_path), ("ours", ours)):
            times[name].append(_time_us(fn, a.calls))
    print(f"{torch.cuda.get_device_name()}, {a.tokens} tokens x {a.width}, vocabulary {VOCAB}, hot token {a.hot:.0%}")
    for name, us in times.items():
        print(f"{name}: {' / '.join(f'{t:.1f}' for t in us)} us per call")
    return times


if __name__ == "__main__":
    main()
