"""Offline preprocessing into token shards: the format, determinism and resumption, inputs, damaged files (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from data.datasets import ListSource
from data.loader import RowStepLoader, build_loader
from data.packing import DocumentPacker
from data.preprocess import preprocess, verify
from data.shards import PackedRows, ShardDataset
from data.tokenizer import ByteTokenizer
from tests.parity import REPO
from tests.test_data import DOCS, _train_bpe, assert_batches_equal
from tests.test_data_shards import PAD, _job, _plan, labelled_docs, make_shards, rows_of, write_jsonl

# ------------------------------------------------------------------------------------------- format, preprocess


@pytest.mark.parametrize("seq_len", [5, 16, 64])
def test_unshuffled_shard_rows_are_the_packers_rows(tmp_path, seq_len):
    """Same documents, file order: every row byte-identical to DocumentPacker's, over several epochs."""
    docs = DOCS * 3
    ds = ShardDataset(str(make_shards(tmp_path, docs, bytes_per_shard=100)))  # several shards, an empty document
    assert ds.num_documents == len(docs) and len(ds.manifest["shards"]) >= 5
    rows = PackedRows(ds, seq_len, shuffle=False, seed=0, pad_id=PAD)
    packer = DocumentPacker(ListSource(docs), ByteTokenizer(), seq_len)
    for k in range((3 * ds.num_tokens) // seq_len):
        expected, got = packer.next_row(), rows.row(k)
        for key in expected:
            assert got[key].dtype == expected[key].dtype and np.array_equal(got[key], expected[key]), (k, key)


def test_a_text_run_continues_on_shards_of_the_same_documents(tmp_path):
    from data.loader import StepBatchLoader

    ds = ShardDataset(str(make_shards(tmp_path, DOCS * 2)))
    text = StepBatchLoader(ByteTokenizer(), ListSource(DOCS * 2), 16, 4)
    rows_of(text, 3)
    shards = RowStepLoader(PackedRows(ds, 16, shuffle=False, seed=0, pad_id=PAD), 16, 4, pad_id=PAD)
    shards.load_state_dict(text.state_dict())
    assert_batches_equal(rows_of(shards, 4), rows_of(text, 4))


def test_preprocess_is_deterministic_parallel_and_resumable(tmp_path):
    docs = labelled_docs("d", 300)
    one = make_shards(tmp_path, docs, "one", bytes_per_shard=4000, workers=1)
    two = make_shards(tmp_path, docs, "two", bytes_per_shard=4000, workers=2)
    files = sorted(p.name for p in one.iterdir())
    assert files == sorted(p.name for p in two.iterdir()) and len([f for f in files if f.endswith(".tokens.npy")]) > 5
    for f in files:
        if f not in ("plan.json", "manifest.json"):  # these two name the inputs' paths, which differ
            assert (one / f).read_bytes() == (two / f).read_bytes(), f
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (one, two)]
    assert manifests[0]["shards"] == manifests[1]["shards"]
    # A killed run: shard 3 never published (no .json, a half-written temp file), no manifest yet.
    reference = (two / "shard_00003.tokens.npy").read_bytes()
    (two / "shard_00003.json").unlink()
    (two / "shard_00003.tokens.npy").write_bytes(reference[:100])
    (two / "manifest.json").unlink()
    (two / "shard_00004.tokens.npy.tmp12345").write_bytes(b"half")  # a killed worker's file
    cfg = _job(two)
    with pytest.raises(ValueError, match="preprocessing did not finish.*re-run the same"):
        build_loader(cfg, ByteTokenizer(), _plan(cfg))
    before = {p.name: p.stat().st_mtime_ns for p in two.iterdir()}
    preprocess([str(tmp_path / "two.jsonl")], "", str(two), bytes_per_shard=4000, workers=2, progress=False)
    assert (two / "shard_00003.tokens.npy").read_bytes() == reference
    assert not (two / "shard_00004.tokens.npy.tmp12345").exists()
    rewritten = {p.name for p in two.iterdir() if before.get(p.name) != p.stat().st_mtime_ns}
    assert rewritten == {"shard_00003.tokens.npy", "shard_00003.docs.npy", "shard_00003.json", "manifest.json"}
    with pytest.raises(ValueError, match="holds the shards of another preprocessing"):
        preprocess([str(tmp_path / "two.jsonl")], "", str(two), bytes_per_shard=2000, progress=False)


@pytest.mark.parametrize("bytes_per_range", [1, 7, 50, 10**6])
def test_jsonl_byte_ranges_read_the_documents_of_jsonlfile(tmp_path, bytes_per_range):
    from data.datasets import JsonlFile
    from data.preprocess import JsonlByteRanges

    path = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": d, "id": i}, ensure_ascii=i % 2 == 0) for i, d in enumerate(DOCS * 3)]
    path.write_bytes(b"\xef\xbb\xbf" + "\n\n".join(lines[:5]).encode() + b"\r\n  \n" + "\n".join(lines[5:]).encode())
    src = JsonlByteRanges(str(path), "text", bytes_per_range)
    assert src.ranges[0][0] == 0 and src.ranges[-1][1] == path.stat().st_size
    assert all(a < b and (a == 0 or path.read_bytes()[a - 1 : a] == b"\n") for a, b in src.ranges)
    assert [t for r in src.ranges for t in src.texts_in(*r)] == list(JsonlFile(str(path), "text", "k")) == DOCS * 3


def test_jsonl_errors_name_the_line(tmp_path):
    from data.preprocess import JsonlByteRanges

    good = [json.dumps({"text": f"doc {i}"}).encode() for i in range(8)]
    for bad, match in (
        (b'{"text": "caf\xe9"}', r"a.jsonl line 6, byte 14: not valid UTF-8"),
        (b'{"text": ', r"a.jsonl line 6: not a JSON object per line"),
        (b'{"body": "x"}', r"a.jsonl line 6 has no field 'text'"),
    ):
        (tmp_path / "a.jsonl").write_bytes(b"\n".join(good[:5] + [bad] + good[5:]))
        src = JsonlByteRanges(str(tmp_path / "a.jsonl"), "text", 60)
        with pytest.raises((ValueError, KeyError), match=match):
            [src.texts_in(*r) for r in src.ranges]


def test_preprocess_command_line_with_a_hf_tokenizer(tmp_path):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    _train_bpe(tok_dir)
    src = write_jsonl(tmp_path / "in" / "a.jsonl", DOCS * 4)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "data.preprocess",
            "--input",
            str(tmp_path / "in" / "*.jsonl"),
            "--tokenizer",
            str(tok_dir),
            "--out",
            str(tmp_path / "out"),
            "--workers",
            "2",
            "--mb-per-shard",
            "0.0002",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["n_docs"] == 28 and manifest["dtype"] == "uint16"
    assert manifest["tokenizer"]["kind"] == "HFTokenizer" and manifest["source"]["files"][0]["path"] == str(src)
    from data.tokenizer import HFTokenizer

    tok = HFTokenizer(str(tok_dir))
    ds = ShardDataset(str(tmp_path / "out"))
    for g, text in enumerate(DOCS * 4):
        assert ds.doc_tokens(g).tolist() == tok.encode(text) + [tok.eos_id]
    r = subprocess.run(
        [sys.executable, "-m", "data.preprocess", "--input", str(tmp_path / "missing"), "--out", str(tmp_path / "o")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "missing: no such file or folder" in r.stderr and "save_to_disk" in r.stderr
    # Training with the byte tokenizer refuses these shards before reading a token.
    cfg = _job(tmp_path / "out")
    with pytest.raises(ValueError, match="tokenized with another tokenizer.*Set model.tokenizer_path"):
        build_loader(cfg, ByteTokenizer(), _plan(cfg))


def test_preprocess_a_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = DOCS * 5
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"body": docs, "n": list(range(len(docs)))})}
    ).save_to_disk(str(tmp_path / "hf"))
    preprocess(
        [str(tmp_path / "hf")],
        "",
        str(tmp_path / "out"),
        text_field="body",
        docs_per_shard=8,
        workers=2,
        progress=False,
    )
    ds = ShardDataset(str(tmp_path / "out"))
    assert [ds.doc_tokens(g).tolist() for g in range(len(docs))] == [list(d.encode()) + [256] for d in docs]
    with pytest.raises(ValueError, match="without split 'test'.*pass --split"):
        preprocess([str(tmp_path / "hf")], "", str(tmp_path / "o2"), text_field="body", split="test", progress=False)


def test_preprocess_parquet_and_txt_inputs_in_order(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"text": ["first", None, "third"]}), tmp_path / "in" / "a.parquet", row_group_size=2)
    (tmp_path / "in" / "b.txt").write_text("a whole file")
    write_jsonl(tmp_path / "c.jsonl", ["from jsonl"])
    preprocess(
        [str(tmp_path / "in"), str(tmp_path / "c.jsonl")], "", str(tmp_path / "out"), docs_per_shard=2, progress=False
    )
    ds = ShardDataset(str(tmp_path / "out"))
    texts = [
        bytes(ds.doc_tokens(g)[:-1].tolist()).decode() if ds.doc_tokens(g)[-1] == 256 else None
        for g in range(ds.num_documents)
    ]
    assert texts == ["first", "", "third", "a whole file", "from jsonl"]  # a null row is an empty document
    assert [f["n_docs"] for f in ds.manifest["source"]["files"]] == [3, 1, 1]


def test_damaged_shards_name_the_file(tmp_path):
    folder = make_shards(tmp_path, labelled_docs("d", 40), bytes_per_shard=1000)
    tokens = folder / "shard_00002.tokens.npy"
    good = tokens.read_bytes()
    tokens.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(ValueError, match=r"shard file .*shard_00002\.tokens\.npy is corrupt or truncated"):
        ShardDataset(str(folder))
    tokens.write_bytes(b"garbage" + good[7:])  # header destroyed
    with pytest.raises(ValueError, match=r"shard_00002\.tokens\.npy is corrupt or truncated"):
        ShardDataset(str(folder))
    tokens.write_bytes(good)
    docs = folder / "shard_00001.docs.npy"
    offsets = np.load(docs)
    np.save(docs, offsets[::-1].copy())
    with pytest.raises(ValueError, match=r"shard_00001\.docs\.npy has inconsistent document offsets"):
        ShardDataset(str(folder))
    np.save(docs, offsets)
    (folder / "shard_00003.docs.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"shard file .*shard_00003\.docs\.npy is missing"):
        ShardDataset(str(folder))
    preprocess([str(tmp_path / "shards.jsonl")], "", str(folder), bytes_per_shard=1000, progress=False)  # repairs
    ShardDataset(str(folder))
    flipped = bytearray(good)
    flipped[-1] ^= 1  # same size, valid header: only the checksum sees it
    tokens.write_bytes(bytes(flipped))
    assert ShardDataset(str(folder)) and [p.split(":")[0] for p in verify(str(folder))] == [str(tokens)]
