"""Offline tokenization: text files (or a HF dataset saved to disk) + a tokenizer -> a token-shard folder.

    python -m data.preprocess --input 'corpus/*.jsonl' --tokenizer path/to/tokenizer.json --out shards/corpus
    python train.py ... --training.dataset shards/corpus          # trains from it by memory map
    python -m data.preprocess --verify shards/corpus              # re-reads every shard against its CRC-32

The documents (files sorted by path within each --input, inputs in the order given) are cut into units:
--mb-per-shard of a line-delimited .jsonl file, cut at line ends (planned with a seek per cut: nothing is read
before the workers start), or --docs-per-shard documents of the other inputs (.json arrays, .txt, .parquet, HF
datasets); unit k becomes shard k (data/shards.py has the format). Shards are written by a pool of --workers
processes, each unit a pure function of its input bytes, so the output is byte-identical whatever the worker
count or the order units finish in.

Resumable: a shard is published by renaming its files into place and then writing shard_NNNNN.json (its
counts and CRC-32); a killed run re-started with the same arguments skips the published shards. plan.json
records the arguments and the inputs' sizes: a re-start with other inputs, tokenizer or shard size is refused.
manifest.json, written last, makes the folder usable for training; it carries the tokenizer fingerprint of
checkpoint/run_record.py, so that training refuses shards made with another tokenizer.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from data.datasets import IndexedSource, _field, _file_source, _local_files, _utf8_error
from data.shards import FORMAT, MANIFEST, PLAN, ShardDataset, docs_file, token_dtype, tokens_file
from data.tokenizer import ByteTokenizer, build_tokenizer, tokenizer_fingerprint

_INPUT_KEY = "--input"

# Set in the parent before the pool forks, so that workers inherit the opened sources and the tokenizer.
_SOURCES: list = []  # IndexedSource or JsonlByteRanges
_TOKENIZER = None


class HFDiskSource(IndexedSource):
    """A HF `datasets` dataset saved with save_to_disk (Arrow files, memory-mapped by `datasets`)."""

    def __init__(self, path: str, split: str, text_field: str):
        import datasets  # lazy: optional (the `data` extra), and slow to import

        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(
                    f"{_INPUT_KEY} {path}: a DatasetDict without split '{split}' (it has {sorted(ds)}); pass --split"
                )
            ds = ds[split]
        if text_field not in ds.column_names:
            raise KeyError(
                f"{_INPUT_KEY} {path} has no column '{text_field}' (columns: {ds.column_names}); pass --text-field"
            )
        self.ds, self.text_field, self.name, self.path = ds, text_field, path, path

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> str:
        return _field(self.ds[i], self.text_field, f"{self.path} row {i}", _INPUT_KEY)

    def texts(self, start: int, stop: int) -> list[str]:
        return ["" if t is None else t for t in self.ds[start:stop][self.text_field]]


def _is_hf_disk_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json", "state.json")
    )


class JsonlByteRanges:
    """A line-delimited .jsonl file cut into byte ranges at line ends, planned without reading the file (one
    seek + readline per cut), so that a corpus of any size is planned in moments and holds no per-line index.
    Each range is read, decoded (strict UTF-8) and parsed by a worker; errors name the file and line, with the
    data.datasets.JsonlFile rules (blank lines skipped, a byte-order mark dropped)."""

    def __init__(self, path: str, text_field: str, bytes_per_range: int):
        self.path, self.text_field = path, text_field
        size = os.path.getsize(path)
        cuts = [0]
        with open(path, "rb") as f:
            while cuts[-1] + bytes_per_range < size:
                f.seek(cuts[-1] + bytes_per_range - 1)  # a line starts at the target if this byte is a newline
                f.readline()
                if f.tell() >= size:
                    break
                cuts.append(f.tell())
        self.ranges = list(zip(cuts, cuts[1:] + [size])) if size else []

    def _line_number(self, offset: int) -> int:
        """1-based line at byte `offset` (reads the file up to it: for error messages only)."""
        with open(self.path, "rb") as f:
            return f.read(offset).count(b"\n") + 1

    def texts_in(self, start: int, end: int) -> list[str]:
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        texts = []
        for i, line in enumerate(data.split(b"\n")):
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8").removeprefix("\ufeff")
            except UnicodeDecodeError as e:
                raise _utf8_error(_INPUT_KEY, self.path, line, e, self._line_number(start) + i) from None
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{_INPUT_KEY}: {self.path} line {self._line_number(start) + i}: not a JSON object "
                    f"per line ({e}); fix the line or remove it"
                ) from e
            texts.append(
                _field(row, self.text_field, lambda i=i: f"{self.path} line {self._line_number(start) + i}", _INPUT_KEY)
            )
        return texts


def _is_json_array(path: str) -> bool:
    """A .json / .jsonl file whose first character is '[' (data.datasets.JsonlFile reads it whole)."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"[")


def open_inputs(inputs: list[str], text_field: str, split: str, bytes_per_range: int) -> list:
    """One source per file (or per HF dataset folder), in order. Line-delimited jsonl is planned in byte ranges
    (JsonlByteRanges); other files are opened as for training (.txt decoded, parquet schema checked)."""
    sources: list = []
    for item in inputs:
        path = os.path.expanduser(item)
        if not os.path.exists(path) and not any(c in path for c in "*?["):
            raise FileNotFoundError(
                f"{_INPUT_KEY} {item}: no such file or folder (relative paths start at "
                f"{os.getcwd()}); give files, folders or globs of .txt / .jsonl / .json / "
                ".parquet, or a HF dataset saved with save_to_disk"
            )
        if _is_hf_disk_dataset(path):
            sources.append(HFDiskSource(path, split, text_field))
            continue
        for file in _local_files(item, _INPUT_KEY):
            if file.lower().endswith((".jsonl", ".json")) and not _is_json_array(file):
                sources.append(JsonlByteRanges(file, text_field, bytes_per_range))
                continue
            src = _file_source(file, text_field, _INPUT_KEY)
            src.path = file
            sources.append(src)
    return sources


def encode_documents(tokenizer, texts: list[str]) -> list:
    """The token ids of each text (no EOS): numpy bytes for the byte tokenizer, one batched call for HF."""
    if isinstance(tokenizer, ByteTokenizer):
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    inner = getattr(tokenizer, "_tok", None)
    if inner is not None:
        return [e.ids for e in inner.encode_batch(texts, add_special_tokens=False)]
    return [tokenizer.encode(t) for t in texts]


def _write_atomic(path: str, write) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(out: str, unit: dict) -> dict:
    """Tokenize the unit's documents and publish shard unit["shard"]; returns its manifest entry."""
    src = _SOURCES[unit["source"]]
    if "bytes" in unit:
        texts = src.texts_in(*unit["bytes"])
    else:
        start, stop = unit["first_doc"], unit["first_doc"] + unit["n_docs"]
        texts = src.texts(start, stop) if hasattr(src, "texts") else [src[i] for i in range(start, stop)]
    ids = encode_documents(_TOKENIZER, texts)
    dtype = token_dtype(_TOKENIZER.vocab_size)
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([len(x) + 1 for x in ids], out=offsets[1:])
    eos = np.array([_TOKENIZER.eos_id], dtype=dtype)
    pieces = [np.asarray(x, dtype=dtype) if len(x) else eos[:0] for x in ids]
    tokens = np.concatenate([p for x in pieces for p in (x, eos)]) if pieces else np.empty(0, dtype=dtype)
    index = unit["shard"]
    _write_atomic(os.path.join(out, tokens_file(index)), lambda f: np.save(f, tokens))
    _write_atomic(os.path.join(out, docs_file(index)), lambda f: np.save(f, offsets))
    entry = {
        "tokens": tokens_file(index),
        "docs": docs_file(index),
        "n_docs": len(ids),
        "n_tokens": int(len(tokens)),
        "crc32": zlib.crc32(tokens.tobytes()),
        "unit": unit,
    }
    _write_atomic(os.path.join(out, f"shard_{index:05d}.json"), lambda f: f.write(json.dumps(entry).encode()))
    return entry


def _worker_write(args):
    return write_shard(*args)


def _published(out: str, unit: dict) -> dict | None:
    """The entry of a shard published by an earlier run for this same unit, else None."""
    path = os.path.join(out, f"shard_{unit['shard']:05d}.json")
    try:
        with open(path) as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return None
    files_ok = all(os.path.isfile(os.path.join(out, entry.get(k, ""))) for k in ("tokens", "docs"))
    return entry if entry.get("unit") == unit and files_ok else None


def preprocess(
    inputs: list[str],
    tokenizer_path: str,
    out: str,
    *,
    text_field: str = "text",
    split: str = "train",
    workers: int = 1,
    docs_per_shard: int = 50_000,
    bytes_per_shard: int = 64 << 20,
    progress: bool = True,
) -> dict:
    """Tokenize `inputs` into shards under `out` (resuming an interrupted run); returns the manifest.

    A shard is `bytes_per_shard` of a line-delimited jsonl file (cut at line ends) or `docs_per_shard`
    documents of any other input; shards never span two files."""
    global _SOURCES, _TOKENIZER
    if docs_per_shard < 1 or bytes_per_shard < 1 or workers < 1:
        raise ValueError("--docs-per-shard, --mb-per-shard and --workers must be > 0")
    tokenizer = build_tokenizer(tokenizer_path)
    sources = open_inputs(inputs, text_field, split, bytes_per_shard)
    units = []
    for s, src in enumerate(sources):
        if isinstance(src, JsonlByteRanges):
            units += [{"shard": len(units) + i, "source": s, "bytes": list(r)} for i, r in enumerate(src.ranges)]
            continue
        for first in range(0, len(src), docs_per_shard):
            units.append(
                {"shard": len(units), "source": s, "first_doc": first, "n_docs": min(docs_per_shard, len(src) - first)}
            )
    if not units:
        raise ValueError(f"{_INPUT_KEY} {inputs}: no documents; give non-empty files")
    plan = {
        "format": FORMAT,
        "inputs": list(inputs),
        "text_field": text_field,
        "split": split,
        "docs_per_shard": docs_per_shard,
        "bytes_per_shard": bytes_per_shard,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "files": [
            {
                "path": getattr(src, "path", ""),
                "bytes": os.path.getsize(src.path) if os.path.isfile(getattr(src, "path", "")) else None,
            }
            for src in sources
        ],
    }
    os.makedirs(out, exist_ok=True)
    plan_path = os.path.join(out, PLAN)
    if os.path.isfile(plan_path):
        with open(plan_path) as f:
            earlier = json.load(f)
        if earlier != json.loads(json.dumps(plan)):
            raise ValueError(
                f"--out {out} holds the shards of another preprocessing ({plan_path} differs: inputs, "
                "tokenizer, text field or shard size); use a new --out folder or delete this one"
            )
    else:
        _write_atomic(plan_path, lambda f: f.write(json.dumps(plan, indent=1).encode()))

    for leftover in Path(out).glob("*.tmp[0-9]*"):  # half-written files of a killed run
        leftover.unlink()
    entries = {u["shard"]: e for u in units if (e := _published(out, u)) is not None}
    todo = [u for u in units if u["shard"] not in entries]
    _SOURCES, _TOKENIZER = sources, tokenizer
    from tqdm import tqdm  # lazy: not a core dependency (datasets / transformers bring it)

    bar = tqdm(
        total=len(units),
        initial=len(entries),
        unit="shard",
        disable=not progress,
        desc=f"tokenizing into {out}",
        file=sys.stderr,
    )
    started = time.perf_counter()
    if workers == 1 or len(todo) <= 1:
        results = (write_shard(out, u) for u in todo)
        pool = None
    else:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core already
        pool = multiprocessing.get_context("fork").Pool(workers)
        results = pool.imap_unordered(_worker_write, [(out, u) for u in todo])
    docs_done = sum(e["n_docs"] for e in entries.values())
    try:
        for entry in results:
            entries[entry["unit"]["shard"]] = entry
            docs_done += entry["n_docs"]
            bar.set_postfix(docs=docs_done, refresh=False)
            bar.update(1)
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
    shards = [entries[u["shard"]] for u in units]
    if not any(e["n_docs"] for e in shards):
        raise ValueError(f"{_INPUT_KEY} {inputs}: no documents (only blank lines); give non-empty files")
    for s, file in enumerate(plan["files"]):
        file["n_docs"] = sum(e["n_docs"] for e in shards if e["unit"]["source"] == s)
    manifest = {
        "format": FORMAT,
        "complete": True,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "eos_id": int(tokenizer.eos_id),
        "tokenizer": plan["tokenizer"],
        "n_docs": sum(e["n_docs"] for e in shards),
        "n_tokens": sum(e["n_tokens"] for e in shards),
        "source": {k: plan[k] for k in ("inputs", "text_field", "split", "files")},
        "shards": [{k: e[k] for k in ("tokens", "docs", "n_docs", "n_tokens", "crc32")} for e in shards],
    }
    _write_atomic(os.path.join(out, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    seconds = time.perf_counter() - started
    if progress:
        print(
            f"{out}: {manifest['n_docs']} documents, {manifest['n_tokens']} tokens in {len(shards)} shards "
            f"({len(todo)} written in {seconds:.1f} s with {workers} worker(s))",
            file=sys.stderr,
        )
    return manifest


def verify(folder: str) -> list[str]:
    """Problems found re-reading every shard of `folder` against the manifest's CRC-32 (empty: all good)."""
    ds = ShardDataset(folder, config_key="--verify")  # headers, sizes and offsets
    problems = []
    for shard in ds.manifest["shards"]:
        tokens = np.load(os.path.join(ds.folder, shard["tokens"]), mmap_mode="r")
        if zlib.crc32(np.ascontiguousarray(tokens).tobytes()) != shard["crc32"]:
            problems.append(
                f"{os.path.join(ds.folder, shard['tokens'])}: CRC-32 differs from the manifest's "
                "(the file changed since it was written)"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m data.preprocess", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--input",
        nargs="+",
        help="files, folders, globs (.txt, .jsonl, .json, .parquet) or HF datasets saved with save_to_disk",
    )
    p.add_argument("--tokenizer", default="", help="tokenizer.json or its folder; '' = the built-in byte tokenizer")
    p.add_argument("--out", help="output folder (resumed if it holds an interrupted run of the same arguments)")
    p.add_argument("--text-field", default="text", help="field / column holding the text (jsonl, parquet, HF)")
    p.add_argument("--split", default="train", help="split of a saved HF DatasetDict")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: every core)")
    p.add_argument(
        "--mb-per-shard",
        type=float,
        default=64,
        help="MiB of a line-delimited jsonl file per shard (the unit of work; cut at line ends)",
    )
    p.add_argument("--docs-per-shard", type=int, default=50_000, help="documents per shard for the other inputs")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verify", metavar="DIR", help="check every shard of DIR against its CRC-32, then exit")
    args = p.parse_args(argv)
    try:
        if args.verify:
            problems = verify(args.verify)
            print("\n".join(problems) if problems else f"{args.verify}: every shard matches its CRC-32")
            return 1 if problems else 0
        if not args.input or not args.out:
            p.error("--input and --out are required (or --verify DIR)")
        preprocess(
            args.input,
            args.tokenizer,
            args.out,
            text_field=args.text_field,
            split=args.split,
            workers=args.workers,
            docs_per_shard=args.docs_per_shard,
            bytes_per_shard=int(args.mb_per_shard * 2**20),
            progress=not args.quiet,
        )
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
