"""Data pipeline: tokenizers, text sources, document packing and the step loader (CPU, single process)."""

from __future__ import annotations

import gzip
import json
import sys

import numpy as np
import pytest
import torch

from data.datasets import DEFAULT_CORPUS, ListSource, build_text_source
from data.loader import StepBatchLoader, build_loader
from data.packing import IGNORE_INDEX, DocumentPacker
from data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

DOCS = [
    "hello world",
    "",  # an empty document is just its EOS
    "a much longer document " * 7,
    "x",
    "the quick brown fox jumps over the lazy dog",
    "ünïcödé ✓ text",
    "short",
]


# --------------------------------------------------------------------------------------------- reference


def reference_stream(docs, tok, n_tokens):
    """The EOS-joined endless stream built directly: tokens, is-EOS flags and document-start flags."""
    toks, eos, start = [], [], []
    while len(toks) < n_tokens:
        for d in docs:
            ids = tok.encode(d) + [tok.eos_id]
            toks += ids
            eos += [False] * (len(ids) - 1) + [True]
            start += [True] + [False] * (len(ids) - 1)
    return np.array(toks), np.array(eos), np.array(start)


def reference_rows(docs, tok, seq_len, n_rows):
    toks, eos, start = reference_stream(docs, tok, (n_rows + 1) * seq_len + 1)
    rows = []
    for k in range(n_rows):
        a, b = k * seq_len, (k + 1) * seq_len
        seq_idx = np.concatenate([[0], np.cumsum(start[a + 1 : b])])
        rows.append(
            dict(input_ids=toks[a:b], labels=np.where(eos[a:b], IGNORE_INDEX, toks[a + 1 : b + 1]), seq_idx=seq_idx)
        )
    return rows


class CountingTokenizer(ByteTokenizer):
    def __init__(self):
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return super().encode(text)


def global_batches(source, seq_len, gbs, dp, steps, state=None, tok=None):
    """`steps` global batches assembled from the dp ranks' local batches (rank order)."""
    loaders = [StepBatchLoader(tok or ByteTokenizer(), source, seq_len, gbs // dp, r, dp) for r in range(dp)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    out = []
    for _ in range(steps):
        parts = [ld.next_batch() for ld in loaders]
        out.append({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
    return out, loaders


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in ("input_ids", "labels", "seq_idx"):
            assert x[k].dtype == y[k].dtype
            assert torch.equal(x[k], y[k]), k


# --------------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = build_tokenizer("")
    assert isinstance(tok, ByteTokenizer) and (tok.vocab_size, tok.eos_id, tok.pad_id) == (258, 256, 257)
    text = "Mamba-2 ✓ ünïcödé\n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == text  # special ids have no bytes


def _train_bpe(folder, specials=("<|endoftext|>", "<pad>")):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(DOCS * 3, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    return tk


def test_hf_tokenizer(tmp_path):
    ref = _train_bpe(tmp_path / "tok")
    for path in (tmp_path / "tok", tmp_path / "tok" / "tokenizer.json"):
        tok = build_tokenizer(str(path))
        assert isinstance(tok, HFTokenizer)
        assert tok.eos_id == ref.token_to_id("<|endoftext|>") and tok.pad_id == ref.token_to_id("<pad>")
        assert tok.vocab_size == ref.get_vocab_size(with_added_tokens=True)
        for text in DOCS:
            ids = tok.encode(text)
            assert ids == ref.encode(text, add_special_tokens=False).ids
            assert tok.decode(ids) == text
    # tokenizer_config.json's eos_token (dict form) wins over the built-in candidates
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    assert HFTokenizer(str(tmp_path / "tok")).eos_id == ref.token_to_id("<pad>")


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        build_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        build_tokenizer(str(tmp_path / "empty"))
    _train_bpe(tmp_path / "noeos", specials=("<unk>",))
    with pytest.raises(ValueError, match="end-of-document token.*eos_token"):
        build_tokenizer(str(tmp_path / "noeos"))


# --------------------------------------------------------------------------------------------- packing


@pytest.mark.parametrize("seq_len", [1, 5, 16, 64, 400])
def test_packing_matches_direct_construction(seq_len):
    tok = ByteTokenizer()
    n_rows = max(3, 700 // seq_len)  # several epochs of DOCS (~260 tokens each)
    packer = DocumentPacker(ListSource(DOCS), tok, seq_len)
    rows = [packer.next_row() for _ in range(n_rows)]
    for got, want in zip(rows, reference_rows(DOCS, tok, seq_len, n_rows)):
        assert got["input_ids"].dtype == np.int64 and got["labels"].dtype == np.int64
        assert got["seq_idx"].dtype == np.int32
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)

    # The invariants, stated on their own:
    toks, eos, start = reference_stream(DOCS, tok, n_rows * seq_len + 1)
    flat = np.concatenate([r["input_ids"] for r in rows])
    np.testing.assert_array_equal(flat, toks[: len(flat)])  # rows concatenate to the EOS-joined stream
    labels = np.concatenate([r["labels"] for r in rows])
    np.testing.assert_array_equal(labels == IGNORE_INDEX, eos[: len(flat)])  # -100 exactly at EOS
    np.testing.assert_array_equal(labels[~eos[: len(flat)]], toks[1 : len(flat) + 1][~eos[: len(flat)]])
    for k, r in enumerate(rows):
        steps = np.diff(r["seq_idx"])
        assert r["seq_idx"][0] == 0 and set(steps.tolist()) <= {0, 1}
        np.testing.assert_array_equal(steps == 1, start[k * seq_len + 1 : (k + 1) * seq_len])


def test_packer_epochs_and_resume_without_retokenizing():
    tok = CountingTokenizer()
    src = ListSource(DOCS)
    seq_len, n = 24, 40  # ~4 epochs
    full = DocumentPacker(src, tok, seq_len)
    want = [full.next_row() for _ in range(n)]
    assert full.state_dict()["epoch"] >= 3
    for k in (0, 1, 7, 11, 23):
        p = DocumentPacker(src, tok, seq_len)
        p.skip_rows(k)
        state = json.loads(json.dumps(p.state_dict()))
        q = DocumentPacker(src, tok, seq_len)
        tok.calls = 0
        q.load_state_dict(state)
        got = q.next_row()
        # the documents one row spans (<= 4 here), not the stream from the start (k=23 is ~30 documents in)
        assert tok.calls <= 4
        for key in got:
            np.testing.assert_array_equal(got[key], want[k][key])


def test_packer_empty_source_errors():
    with pytest.raises(ValueError, match="yields no documents"):
        DocumentPacker(ListSource([], name="nothing"), ByteTokenizer(), 8).next_row()


# --------------------------------------------------------------------------------------------- loader


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_loader_dp_ranks_partition_the_global_batch(dp):
    src = build_text_source("default", "train", "text")
    one, _ = global_batches(src, 64, 8, 1, 5)
    many, loaders = global_batches(src, 64, 8, dp, 5)
    assert_batches_equal(one, many)
    assert all(ld.next_batch()["input_ids"].shape == (8 // dp, 64) for ld in loaders)
    assert len({json.dumps(ld.state_dict()) for ld in loaders}) == 1  # the state is global


def test_loader_resume_across_dp_degrees():
    src = ListSource(DOCS * 5)
    k, seq_len, gbs = 7, 32, 8
    reference, _ = global_batches(src, seq_len, gbs, 1, k + 3)
    _, loaders4 = global_batches(src, seq_len, gbs, 4, k)
    state = json.loads(json.dumps(loaders4[2].state_dict()))
    assert state["steps"] == k and state["rows_consumed"] == k * gbs
    for dp in (4, 2, 1):
        resumed, _ = global_batches(src, seq_len, gbs, dp, 3, state=state)
        assert_batches_equal(resumed, reference[k:])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_loader_state_through_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = ListSource(DOCS * 3)
    a = StepBatchLoader(ByteTokenizer(), src, 16, 4)
    from torch.distributed.checkpoint.stateful import Stateful

    assert isinstance(a, Stateful)
    for _ in range(5):
        a.next_batch()
    dcp.save({"dataloader": a}, checkpoint_id=str(tmp_path / "ckpt"))
    b = StepBatchLoader(ByteTokenizer(), src, 16, 4)
    dcp.load({"dataloader": b}, checkpoint_id=str(tmp_path / "ckpt"))
    assert b.state_dict() == a.state_dict()
    assert_batches_equal([b.next_batch()], [a.next_batch()])


def test_loader_refuses_a_rank_outside_the_layout():
    # The batch sizes are the BatchPlan's (checked once by configs/checks.py); the loader only checks its arguments.
    for rows_per_rank, rank, dp in ((2, 4, 4), (0, 0, 1), (2, -1, 2)):
        with pytest.raises(ValueError, match="rows_per_rank >= 1 and 0 <= dp_rank < dp_degree"):
            StepBatchLoader(ByteTokenizer(), ListSource(DOCS), 8, rows_per_rank, rank, dp)


def test_finite_loader_covers_one_epoch_then_stops():
    tok = ByteTokenizer()
    src = ListSource(DOCS)
    seq_len, dp = 16, 2
    loaders = [StepBatchLoader(tok, src, seq_len, 4 // dp, r, dp, infinite=False) for r in range(dp)]
    batches = []
    while True:
        parts = []
        for ld in loaders:
            try:
                parts.append(ld.next_batch())
            except StopIteration:
                pass
        assert len(parts) in (0, dp)  # every rank stops at the same step
        if not parts:
            break
        batches.append(torch.cat([p["input_ids"] for p in parts]))
    flat = torch.cat(batches).flatten()
    epoch, _, _ = reference_stream(DOCS, tok, 1)
    n = len(epoch)
    assert torch.equal(flat[:n], torch.from_numpy(epoch)) and bool((flat[n:] == tok.pad_id).all())
    assert len(batches) == -(-n // (4 * seq_len))
    loaders[0].reset()
    assert torch.equal(loaders[0].next_batch()["input_ids"], batches[0][:2])


def test_build_loader_from_job_config():
    from configs.checks import resolve_job
    from configs.job_config import JobConfig

    cfg = JobConfig()
    cfg.training.seq_len, cfg.training.global_batch_size, cfg.training.local_batch_size = 32, -1, 3
    plan = resolve_job(cfg, 2).batch  # global -1 = local 3 x dp 2
    ld = build_loader(cfg, ByteTokenizer(), plan, dp_rank=1)
    assert (ld.global_rows, ld.rows_per_rank, ld.dp_rank, ld.dp_degree) == (6, 3, 1, 2)
    assert ld.next_batch()["input_ids"].shape == (3, 32)
    cfg.validation.local_batch_size, cfg.validation.steps = 2, -1
    val = build_loader(cfg, ByteTokenizer(), plan, dp_rank=0, split="validation")
    assert (val.global_rows, val.rows_per_rank) == (4, 2) and not val.infinite
    want = build_text_source("default", "validation", "text")
    assert val.source.docs == want.docs


# --------------------------------------------------------------------------------------------- sources


def test_default_corpus_splits():
    train = build_text_source("default", "train", "text")
    val = build_text_source("default", "validation", "text")
    from pydoc_data.topics import topics

    with gzip.open(DEFAULT_CORPUS, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    titles = [r["title"] for r in rows]
    assert len(rows) == 79 and titles == sorted(titles)
    # every 20th document (from index 10) is held out; the rest is train, in title order
    assert val.docs == [rows[i]["text"] for i in (10, 30, 50, 70)]
    assert train.docs == [r["text"] for i, r in enumerate(rows) if i not in (10, 30, 50, 70)]
    if sys.version_info[:2] == (3, 11):  # the committed corpus is CPython 3.11's topics, unchanged
        assert {r["title"]: r["text"] for r in rows} == topics
    assert DEFAULT_CORPUS.stat().st_size < 400_000
    with pytest.raises(ValueError, match="splits 'train' and 'validation'"):
        build_text_source("default", "test", "text")


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the committed corpus was generated with CPython 3.11")
def test_default_corpus_is_reproducible():
    from data.default_corpus.make_corpus import build_corpus_bytes

    built = build_corpus_bytes()
    assert gzip.decompress(built) == gzip.decompress(DEFAULT_CORPUS.read_bytes())


def test_local_files(tmp_path):
    docs = ["first doc", "second ✓", "third", "fourth one"]
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs[:2])]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n\n")  # blank lines are skipped
    (tmp_path / "b.json").write_text(json.dumps([{"text": d} for d in docs[2:]]))
    assert list(build_text_source(str(tmp_path / "a.jsonl"), "train", "text")) == docs[:2]
    src = build_text_source(str(tmp_path / "*.json*"), "train", "text")
    assert list(src) == docs and src[3] == docs[3] and list(src.iter_from(1)) == docs[1:]

    txt = tmp_path / "txt"
    (txt / "sub").mkdir(parents=True)
    for i, d in enumerate(docs):
        (txt / ("sub" if i % 2 else ".") / f"{i}.txt").write_text(d)
    (txt / "README.md").write_text("ignored")
    assert list(build_text_source(str(txt), "train", "text")) == [docs[0], docs[2], docs[1], docs[3]]  # sorted by path

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": docs * 3, "n": list(range(12))}), tmp_path / "p.parquet", row_group_size=5)
    src = build_text_source(str(tmp_path / "p.parquet"), "train", "body")
    assert len(src) == 12 and list(src) == docs * 3 and src[6] == docs[2]

    # and through the loader, equal to the in-memory source
    a, _ = global_batches(src, 8, 4, 2, 6)
    b, _ = global_batches(ListSource(docs * 3), 8, 4, 1, 6)
    assert_batches_equal(a, b)


def test_local_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"training.dataset='.*x.jsonl': no such file"):
        build_text_source(str(tmp_path / "x.jsonl"), "train", "text")
    with pytest.raises(FileNotFoundError, match="glob matches no file"):
        build_text_source(str(tmp_path / "*.parquet"), "train", "text")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="contains no documents"):
        build_text_source(str(tmp_path / "empty.jsonl"), "train", "text", config_key="validation.dataset")
    (tmp_path / "f.jsonl").write_text(json.dumps({"content": "hi"}) + "\n")
    with pytest.raises(KeyError, match="has no field 'text'.*set training.dataset_text_field"):
        build_text_source(str(tmp_path / "f.jsonl"), "train", "text")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a"]}), tmp_path / "f.parquet")
    with pytest.raises(KeyError, match="has no field 'text'.*set training.dataset_text_field"):
        build_text_source(str(tmp_path / "f.parquet"), "train", "text")
    (tmp_path / "d").mkdir()
    with pytest.raises(FileNotFoundError, match="folder holds no"):
        build_text_source(str(tmp_path / "d"), "train", "text")


def test_hf_streaming_source_offline(tmp_path):
    """The HF path, exercised offline with the packaged 'json' builder over a local data_dir."""
    pytest.importorskip("datasets")
    docs = [f"document number {i} " * (i % 5 + 1) for i in range(30)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    src = build_text_source("json", "train", "text", dataset_path=str(tmp_path))
    assert src.num_documents is None and list(src) == docs and list(src.iter_from(25)) == docs[25:]
    ref, _ = global_batches(ListSource(docs), 16, 4, 1, 12)
    _, l2 = global_batches(src, 16, 4, 2, 9)
    resumed, _ = global_batches(src, 16, 4, 1, 3, state=l2[0].state_dict())
    assert_batches_equal(resumed, ref[9:])
    bad = build_text_source("json", "train", "body", dataset_path=str(tmp_path))
    with pytest.raises(KeyError, match="has no field 'body'"):
        next(iter(bad))


def _save_loader_state_dp2(rank, world_size, folder, steps):
    import torch.distributed.checkpoint as dcp

    ld = StepBatchLoader(ByteTokenizer(), ListSource(DOCS * 3), 16, 4 // world_size, rank, world_size)
    for _ in range(steps):
        ld.next_batch()
    dcp.save({"dataloader": ld}, checkpoint_id=folder)
    return ld.state_dict()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_loader_dcp_saved_by_two_ranks_loads_in_one(tmp_path):
    """Two gloo ranks save the (identical, global) state through DCP; one process resumes from it."""
    import torch.distributed.checkpoint as dcp

    from tests.dist_utils import run_distributed

    states = run_distributed(_save_loader_state_dp2, 2, str(tmp_path / "ckpt"), 5)
    assert states[0] == states[1]
    resumed = StepBatchLoader(ByteTokenizer(), ListSource(DOCS * 3), 16, 4)
    dcp.load({"dataloader": resumed}, checkpoint_id=str(tmp_path / "ckpt"))
    assert resumed.state_dict() == states[0]
    reference, _ = global_batches(ListSource(DOCS * 3), 16, 4, 1, 7)
    assert_batches_equal([resumed.next_batch(), resumed.next_batch()], reference[5:])
