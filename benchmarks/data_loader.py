"""Data pipeline timings: offline tokenization throughput, per-rank loader time vs dp degree, data stall in training.

    python3 benchmarks/data_loader.py preprocess --corpus_mb 1024 --workers 1,2        # tokens/s of data.preprocess
    python3 benchmarks/data_loader.py preprocess --corpus_mb 256 --corpus_text python_docs --bpe_vocab 16000
    python3 benchmarks/data_loader.py loader --dp 1,8,512 --seq_len 2048 --local_batch_size 8
    python3 benchmarks/data_loader.py stall --config configs/mamba2_370m.toml --steps 30   # GPU: data time / step
    python3 benchmarks/data_loader.py stall --config configs/debug.toml --steps 4 --cpu    # CPU smoke run

preprocess: writes a jsonl corpus of --corpus_mb MB (synthetic words, or the embedded corpus repeated; or uses
--input) and times `data.preprocess.preprocess` for each worker count (fresh output folder each), printing MB/s
and tokens/s; the byte tokenizer by default, a real BPE with --bpe_vocab (trained here) or --tokenizer.

loader: the rank-0 loader of a shard folder (generated if --shards is not given) at each dp degree, with
--local_batch_size rows per rank (so the global batch grows with dp, as in a real run), timed over --steps
next_batch() calls after --warmup untimed ones, synchronously (no prefetch thread: the work itself). The
on-the-fly text loader is timed next to it at the dp degrees listed in --text_dp (it packs the whole global batch).

stall: train.py in-process on a shard folder (generated from the synthetic corpus with the run's tokenizer if
--shards is not given), metrics every step; the trainer's loader is wrapped to time each next_batch() call
(the time the step waits for data, prefetch thread included). Prints the mean data wait and the mean step time
over the steps after --warmup, and their ratio (the issue asks < 1% for the 370M on a GPU).
Output: one JSON object per measurement on stdout (and --json FILE, appended).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train
from configs.checks import resolve_job
from configs.parser import load_config
from data.datasets import build_text_source, load_default_corpus
from data.loader import RowStepLoader, StepBatchLoader
from data.preprocess import preprocess
from data.shards import PackedRows, ShardDataset, is_shard_folder
from data.tokenizer import ByteTokenizer

WORDS = [
    "state",
    "space",
    "model",
    "token",
    "shard",
    "mamba",
    "layer",
    "the",
    "of",
    "and",
    "a",
    "scan",
    "chunk",
    "gradient",
    "memory",
    "kernel",
    "parallel",
    "sequence",
    "document",
    "batch",
]


def write_corpus(path: Path, n_bytes: int, seed: int = 0) -> int:
    """A jsonl corpus of synthetic documents (10..700 words), about n_bytes; returns the document count."""
    rng = np.random.default_rng(seed)
    written = docs = 0
    with open(path, "w") as f:
        while written < n_bytes:
            line = json.dumps({"text": " ".join(rng.choice(WORDS, size=int(rng.integers(10, 700))))}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def write_python_docs_corpus(path: Path, n_bytes: int) -> int:
    """A jsonl corpus of real prose and code: the embedded corpus' documents, repeated to about n_bytes."""
    docs = load_default_corpus("train").docs
    written = count = 0
    with open(path, "w") as f:
        while written < n_bytes:
            line = json.dumps({"text": docs[count % len(docs)]}) + "\n"
            f.write(line)
            written += len(line)
            count += 1
    return count


def train_bpe(folder: Path, vocab_size: int) -> str:
    """A byte-level BPE tokenizer.json of vocab_size ids trained on the embedded corpus (GPT-2 style)."""
    tk = Tokenizer(BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(load_default_corpus("train").docs, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    return str(folder / "tokenizer.json")


def emit(record: dict, json_path: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if json_path:
        with open(json_path, "a") as f:
            f.write(line + "\n")


def cmd_preprocess(args, work: Path) -> None:
    inputs = args.input or [str(work / f"corpus_{args.corpus_text}.jsonl")]
    if not args.input and not os.path.isfile(inputs[0]):
        writer = write_corpus if args.corpus_text == "synthetic" else write_python_docs_corpus
        writer(Path(inputs[0]), args.corpus_mb * 2**20)
    tokenizer = train_bpe(work / "bpe", args.bpe_vocab) if args.bpe_vocab else args.tokenizer
    n_bytes = sum(os.path.getsize(p) for p in inputs if os.path.isfile(p))
    for workers in [int(w) for w in args.workers.split(",")]:
        out = work / f"shards_w{workers}"
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        m = preprocess(
            inputs,
            tokenizer,
            str(out),
            workers=workers,
            docs_per_shard=args.docs_per_shard,
            bytes_per_shard=int(args.mb_per_shard * 2**20),
            progress=False,
        )
        seconds = time.perf_counter() - started
        emit(
            {
                "bench": "preprocess",
                "workers": workers,
                "cpus": os.cpu_count(),
                "corpus": args.corpus_text,
                "tokenizer": f"bpe{args.bpe_vocab}" if args.bpe_vocab else (tokenizer or "byte"),
                "input_mb": round(n_bytes / 2**20, 1),
                "docs": m["n_docs"],
                "tokens": m["n_tokens"],
                "shards": len(m["shards"]),
                "seconds": round(seconds, 2),
                "mb_per_s": round(n_bytes / 2**20 / seconds, 1),
                "tokens_per_s": round(m["n_tokens"] / seconds),
            },
            args.json,
        )


def _generated_shards(work: Path, corpus: Path, corpus_mb: int, tokenizer: str) -> str:
    """Shards of the synthetic corpus in `work` (reused when a kept --work folder already has them)."""
    if not corpus.is_file():
        write_corpus(corpus, corpus_mb * 2**20)
    shards = work / f"shards_{Path(tokenizer).parent.name if tokenizer else 'byte'}"
    if not is_shard_folder(str(shards)):
        preprocess([str(corpus)], tokenizer, str(shards), workers=os.cpu_count() or 1, progress=False)
    return str(shards)


def _time_calls(fn, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    started = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - started) / steps


def cmd_loader(args, work: Path) -> None:
    corpus = work / "corpus_synthetic.jsonl"
    shards = args.shards or _generated_shards(work, corpus, args.corpus_mb, "")
    opened = time.perf_counter()
    ds = ShardDataset(shards)
    open_s = time.perf_counter() - opened
    tok = ByteTokenizer()
    for dp in [int(d) for d in args.dp.split(",")] * args.repeat:
        rows = PackedRows(ds, args.seq_len, shuffle=True, seed=0, pad_id=tok.pad_id)
        loader = RowStepLoader(rows, args.seq_len, args.local_batch_size, 0, dp, pad_id=tok.pad_id)
        per_step = _time_calls(loader.next_batch, args.warmup, args.steps)
        emit(
            {
                "bench": "loader",
                "kind": "shards",
                "dp": dp,
                "rank": 0,
                "local_batch_size": args.local_batch_size,
                "seq_len": args.seq_len,
                "ms_per_step": round(per_step * 1e3, 3),
                "open_s": round(open_s, 3),
                "documents": ds.num_documents,
                "tokens": ds.num_tokens,
            },
            args.json,
        )
    if args.text_dp and not args.shards:
        source = build_text_source(str(corpus), "train", "text")
        for dp in [int(d) for d in args.text_dp.split(",")]:
            loader = StepBatchLoader(tok, source, args.seq_len, args.local_batch_size, 0, dp)
            per_step = _time_calls(loader.next_batch, min(args.warmup, 1), max(1, args.steps // 4))
            emit(
                {
                    "bench": "loader",
                    "kind": "text_on_the_fly",
                    "dp": dp,
                    "rank": 0,
                    "local_batch_size": args.local_batch_size,
                    "seq_len": args.seq_len,
                    "ms_per_step": round(per_step * 1e3, 3),
                },
                args.json,
            )


def cmd_stall(args, work: Path) -> None:
    base = ["--job.config_file", args.config]
    cfg = load_config(base + args.overrides)
    shards = args.shards or _generated_shards(
        work, work / "corpus_synthetic.jsonl", args.corpus_mb, cfg.model.tokenizer_path
    )
    waits: list[float] = []
    real_build = train.build_loader

    def timed_build(*a, **kw):
        loader = real_build(*a, **kw)
        inner_next = loader.next_batch

        def next_batch():
            started = time.perf_counter()
            batch = inner_next()
            waits.append(time.perf_counter() - started)
            return batch

        loader.next_batch = next_batch
        return loader

    train.build_loader = timed_build
    dump = work / "run"
    argv = base + [
        "--training.dataset",
        shards,
        "--training.steps",
        str(args.warmup + args.steps),
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "false",
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--job.dump_folder",
        str(dump),
        *args.overrides,
    ]
    try:
        train.main(argv)
    finally:
        train.build_loader = real_build
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    cfg = load_config(argv)
    # One process: the step's rows are the global batch; metrics' tokens_per_sec counts them.
    tokens_per_step = resolve_job(cfg, 1).batch.global_rows * cfg.training.seq_len
    step_s = [tokens_per_step / r["tokens_per_sec"] for r in records if r["step"] > args.warmup]
    wait_s = waits[args.warmup :]
    emit(
        {
            "bench": "stall",
            "config": args.config,
            "overrides": args.overrides,
            "steps": len(step_s),
            "data_wait_ms": round(statistics.mean(wait_s) * 1e3, 3),
            "max_data_wait_ms": round(max(wait_s) * 1e3, 3),
            "step_ms": round(statistics.mean(step_s) * 1e3, 2),
            "data_fraction": round(statistics.mean(wait_s) / statistics.mean(step_s), 5),
        },
        args.json,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("preprocess", "loader", "stall"):
        s = sub.add_parser(name)
        s.add_argument("--corpus_mb", type=int, default=256, help="size of the generated corpus")
        s.add_argument("--json", default=None, help="also append the records to this file")
        s.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed)")
        s.add_argument("--warmup", type=int, default=3)
        s.add_argument("--steps", type=int, default=20)
        s.add_argument("--shards", default="", help="an existing shard folder instead of a generated one")
    sp = sub.choices["preprocess"]
    sp.add_argument("--input", nargs="*", default=None, help="files / globs instead of the generated corpus")
    sp.add_argument("--tokenizer", default="", help="tokenizer.json (default: the byte tokenizer)")
    sp.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    sp.add_argument(
        "--corpus_text",
        default="synthetic",
        choices=("synthetic", "python_docs"),
        help="generated words, or the embedded corpus' prose and code repeated",
    )
    sp.add_argument(
        "--bpe_vocab",
        type=int,
        default=0,
        help="train a byte-level BPE of this many ids on the embedded corpus and tokenize with it (0: --tokenizer)",
    )
    sp.add_argument("--docs_per_shard", type=int, default=50_000)
    sp.add_argument("--mb_per_shard", type=float, default=64, help="jsonl MiB per shard (the unit of work)")
    sl = sub.choices["loader"]
    sl.add_argument("--dp", default="1,8,512")
    sl.add_argument("--text_dp", default="1,8", help="dp degrees for the on-the-fly loader ('' to skip)")
    sl.add_argument("--seq_len", type=int, default=2048)
    sl.add_argument("--local_batch_size", type=int, default=8)
    sl.add_argument("--repeat", type=int, default=1, help="cycle through --dp this many times (noise on a shared host)")
    ss = sub.choices["stall"]
    ss.add_argument("--config", default="configs/mamba2_370m.toml")
    ss.add_argument("--cpu", action="store_true", help="hide CUDA (smoke run)")
    ss.add_argument("overrides", nargs="*", help="train.py overrides, after --")
    args = p.parse_args()
    if getattr(args, "cpu", False):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="data_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        {"preprocess": cmd_preprocess, "loader": cmd_loader, "stall": cmd_stall}[args.cmd](args, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
