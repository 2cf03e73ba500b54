"""Bad data is refused when the dataset / tokenizer is built, naming the file (line, column) and the fix.

Each case here used to reach training: an empty corpus as a NaN loss at step 1, a non-UTF-8 byte as a bare
UnicodeDecodeError (jsonl) or silent U+FFFD characters (.txt), a parquet int column as an AttributeError in
the tokenizer, a tokenizer with gaps in its ids as an IndexError in the embedding.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from configs.checks import resolve_job
from configs.job_config import JobConfig
from data.datasets import ListSource, build_text_source
from data.loader import StepBatchLoader, build_loader
from data.tokenizer import ByteTokenizer, build_tokenizer
from tests.parity import REPO

# ------------------------------------------------------------------------------------- empty corpora


def _write_parquet(path, **columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


def test_empty_documents_are_refused_when_the_loader_is_built(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_text("\n".join(json.dumps({"text": ""}) for _ in range(3)) + "\n")
    _write_parquet(tmp_path / "nulls.parquet", text=[None, None], other=["not", "this"])
    for name, documents in (
        ("empty.txt", "its one document is"),
        ("blank.jsonl", "all 3 documents are"),
        ("nulls.parquet", "all 2 documents are"),
    ):
        source = build_text_source(str(tmp_path / name), "train", "text")
        with pytest.raises(
            ValueError,
            match=rf"training.dataset='.*{name}': {documents} empty "
            r".*check that training.dataset_text_field",
        ):
            StepBatchLoader(ByteTokenizer(), source, seq_len=8, rows_per_rank=2)
    # The check stops at the first document with a token: empty documents before it stay legal.
    batch = StepBatchLoader(ByteTokenizer(), ListSource(["", "", "ok"]), seq_len=4, rows_per_rank=1).next_batch()
    assert batch["input_ids"][0].tolist() == [256, 256, ord("o"), ord("k")]


def test_empty_validation_split_is_refused_too(tmp_path):
    (tmp_path / "val").mkdir()
    for i in range(2):
        (tmp_path / "val" / f"{i}.txt").write_bytes(b"")
    cfg = JobConfig()
    cfg.validation.dataset = str(tmp_path / "val")
    with pytest.raises(ValueError, match=r"validation.dataset='.*val': all 2 documents are empty"):
        build_loader(cfg, ByteTokenizer(), resolve_job(cfg, 1).batch, split="validation")


def test_train_py_stops_on_an_empty_corpus_before_step_1(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--job.config_file",
            "configs/debug.toml",
            "--training.steps",
            "2",
            "--training.dataset",
            str(tmp_path / "empty.txt"),
            "--job.dump_folder",
            str(tmp_path / "out"),
            "--metrics.enable_tensorboard",
            "false",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0
    assert "its one document is empty" in r.stderr and "loss is nan" not in r.stderr, r.stderr[-2000:]
    assert "data error:" in r.stderr and "Traceback" not in r.stderr  # a message, not a crash


# ------------------------------------------------------------------------------------- encodings


def test_non_utf8_jsonl_names_file_line_and_byte(tmp_path):
    lines = [json.dumps({"text": "one"}).encode(), b"", b'{"text": "caf\xe9"}']  # latin-1 e-acute on line 3
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(
        ValueError,
        match=r"training.dataset: .*bad.jsonl line 3, byte 14: not valid UTF-8 "
        r"\(bytes e9.*re-encode the file",
    ):
        build_text_source(str(tmp_path / "bad.jsonl"), "train", "text")


def test_non_utf8_json_array_and_txt_follow_the_same_strict_policy(tmp_path):
    (tmp_path / "bad.json").write_bytes(b'[\n  {"text": "ok"},\n  {"text": "\xff"}\n]\n')
    with pytest.raises(ValueError, match=r"bad.json line 3, byte 13: not valid UTF-8"):
        build_text_source(str(tmp_path / "bad.json"), "train", "text")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("fine ✓")
    (tmp_path / "docs" / "b.txt").write_bytes(b"first line\nsecond \x80 line\n")
    with pytest.raises(ValueError, match=r"validation.dataset: .*b.txt line 2, byte 8: not valid UTF-8"):
        build_text_source(str(tmp_path / "docs"), "validation", "text", config_key="validation.dataset")


def test_utf8_byte_order_mark_is_dropped(tmp_path):
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfhello")
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "a"}\n{"text": "b"}\n')
    assert list(build_text_source(str(tmp_path / "bom.txt"), "train", "text")) == ["hello"]
    assert list(build_text_source(str(tmp_path / "bom.jsonl"), "train", "text")) == ["a", "b"]


def test_malformed_jsonl_line_is_named_by_its_line_number(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n\n{"text": oops}\n')
    source = build_text_source(str(tmp_path / "x.jsonl"), "train", "text")
    with pytest.raises(ValueError, match=r"x.jsonl line 3: not a JSON object per line"):
        list(source)


# ------------------------------------------------------------------------------------- column types


def test_parquet_non_string_column_is_refused_naming_the_string_columns(tmp_path):
    _write_parquet(tmp_path / "ints.parquet", text=[1, 2, 3], body=["a", "b", "c"])
    with pytest.raises(
        ValueError,
        match=r"training.dataset: .*ints.parquet: column 'text' holds int64 values, "
        r"not text; set training.dataset_text_field to a string column .*'body'",
    ):
        build_text_source(str(tmp_path / "ints.parquet"), "train", "text")
    _write_parquet(tmp_path / "large.parquet", text=__import__("pyarrow").array(["x", "y"], "large_string"))
    assert list(build_text_source(str(tmp_path / "large.parquet"), "train", "text")) == ["x", "y"]


# ------------------------------------------------------------------------------------- tokenizer ids


def test_tokenizer_with_sparse_ids_reports_largest_id_plus_one(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"a": 0, "b": 700, "[UNK]": 3, "<|endoftext|>": 20}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(["<pad>"])  # an added token: id 4, the first free one
    tk.save(str(tmp_path / "tokenizer.json"))
    assert tk.get_vocab_size(with_added_tokens=True) == 5  # a count: the embedding needs 701 rows

    tok = build_tokenizer(str(tmp_path))
    assert tok.vocab_size == 701 and tok.eos_id == 20 and tok.pad_id == 4
    assert max(tok.encode("a b a")) < tok.vocab_size

    from configs.checks import job_errors
    from models.args import build_model_args
    from parallelisms.batch_plan import BatchPlan
    from parallelisms.mesh import ParallelDims

    cfg = JobConfig()
    pdims = ParallelDims.from_config(cfg.parallelism, 1)
    errs = job_errors(
        cfg, pdims, build_model_args("debug", {}), tok, BatchPlan.from_config(cfg.training, cfg.parallelism, pdims)
    )
    assert any("set --model.vocab_size 701" in e for e in errs), errs  # the debug flavor has 258 ids
